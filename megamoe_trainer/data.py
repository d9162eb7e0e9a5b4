"""Training data for `megamoe-train`.

Two sources, both addressed by a global sample index (so a run's data position is one number,
the samples consumed so far, and resuming continues exactly where the checkpoint stopped):

- `SyntheticCorpus`: generated on the fly, deterministic by seed. Documents follow four
  low-entropy generators a small model learns within a few hundred steps, so the loss falls
  visibly from ln(vocab): a sparse Markov chain, copies of a random segment, arithmetic
  progressions, and phrases from a fixed phrase bank. Each document starts with its
  generator's marker token and ends with the EOD token.
- `IndexedCorpus`: a Megatron indexed dataset (PREFIX.bin / PREFIX.idx) read through
  megatron-core's `GPTDataset` (its document / sample / shuffle indices, cached in the run dir).

`write_synthetic_indexed` writes the synthetic corpus as an indexed dataset, for trying the
indexed path without real data.
"""

from __future__ import annotations

import os

import numpy as np
import torch

NUM_MARKERS = 4  # marker tokens follow the EOD token: eod+1 .. eod+4


class SyntheticCorpus:
    """Sample i is `seq_length + 1` tokens, a function of (seed, i) only."""

    def __init__(self, vocab_size: int, seq_length: int, seed: int, eod: int = 0):
        if vocab_size < NUM_MARKERS + 16:
            raise ValueError(f"vocab_size: the synthetic corpus needs at least {NUM_MARKERS + 16} tokens")
        self.vocab_size, self.seq_length, self.seed, self.eod = vocab_size, seq_length, seed, eod
        # content tokens: everything except EOD and the markers
        special = {eod, *((eod + 1 + j) % vocab_size for j in range(NUM_MARKERS))}
        self.markers = [(eod + 1 + j) % vocab_size for j in range(NUM_MARKERS)]
        self.content = np.array([t for t in range(vocab_size) if t not in special], dtype=np.int64)
        C = len(self.content)
        rng = np.random.default_rng([seed, 0xC0DE])
        self.successors = rng.integers(0, C, size=(C, 2))  # Markov chain: two successors per state
        self.phrases = rng.integers(0, C, size=(16, 8))  # phrase bank

    def _document(self, rng: np.random.Generator) -> np.ndarray:
        C = len(self.content)
        kind = int(rng.integers(0, NUM_MARKERS))
        n = int(rng.integers(16, 49))
        if kind == 0:  # Markov chain: the likely successor 90% of the time
            out = np.empty(n, dtype=np.int64)
            s = int(rng.integers(0, C))
            pick = rng.random(n) < 0.9
            for j in range(n):
                out[j] = s
                s = self.successors[s, 0 if pick[j] else 1]
        elif kind == 1:  # a random segment, copied until the document ends
            seg = rng.integers(0, C, size=int(rng.integers(3, 9)))
            out = np.resize(seg, n)
        elif kind == 2:  # arithmetic progression modulo the content size
            a, d = int(rng.integers(0, C)), int(rng.integers(1, 8))
            out = (a + d * np.arange(n)) % C
        else:  # phrases from a fixed bank
            out = self.phrases[rng.integers(0, len(self.phrases), size=n // 8 + 1)].reshape(-1)[:n]
        return np.concatenate([[self.markers[kind]], self.content[out], [self.eod]])

    def sample(self, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, 1, index])
        need = self.seq_length + 1
        parts, have = [], 0
        while have < need:
            doc = self._document(rng)
            parts.append(doc)
            have += len(doc)
        return np.concatenate(parts)[:need]

    def batch(self, indices) -> dict:
        text = torch.from_numpy(np.stack([self.sample(int(i)) for i in indices]))
        tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
        return {
            "tokens": tokens,
            "labels": labels,
            "loss_mask": torch.ones_like(tokens, dtype=torch.float32),
            "position_ids": torch.arange(self.seq_length).unsqueeze(0).expand_as(tokens).contiguous(),
        }

    def documents(self, count: int):
        """`count` documents for writing an indexed dataset."""
        rng = np.random.default_rng([self.seed, 2])
        for _ in range(count):
            yield self._document(rng)


class _Tokenizer:
    """What GPTDataset asks of a tokenizer: the vocabulary size and the EOD id."""

    def __init__(self, vocab_size: int, eod: int):
        self.vocab_size = vocab_size
        self.eod = eod
        self.pad = -1  # no pad token: every label counts
        # GPTDataset hashes this into its index cache names
        self.unique_identifiers = {"class": "megamoe_train.token_ids", "vocab_size": vocab_size, "eod": eod}


class IndexedCorpus:
    """A Megatron indexed dataset through megatron-core's GPTDataset (100% train split)."""

    def __init__(
        self, path: str, vocab_size: int, seq_length: int, seed: int, num_samples: int, cache_dir: str, eod: int = 0
    ):
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

        config = GPTDatasetConfig(
            random_seed=seed,
            sequence_length=seq_length,
            blend=([path], None),
            split="100,0,0",
            path_to_cache=cache_dir,
            tokenizer=_Tokenizer(vocab_size, eod),
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
            create_attention_mask=False,
            mid_level_dataset_surplus=0.005,
        )
        train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [num_samples, None, None], lambda: True, config).build()
        self.dataset = train
        self.vocab_size, self.seq_length = vocab_size, seq_length

    def batch(self, indices) -> dict:
        samples = [self.dataset[int(i) % len(self.dataset)] for i in indices]
        out = {
            k: torch.stack([torch.as_tensor(s[k]) for s in samples])
            for k in ("tokens", "labels", "loss_mask", "position_ids")
        }
        top = max(int(out["tokens"].max()), int(out["labels"].max()))  # labels hold one token past the inputs
        if top >= self.vocab_size:
            raise ValueError(f"data.path: token id {top} is not below model.vocab_size={self.vocab_size}")
        return out


def build_corpus(recipe, run_dir: str):
    """The recipe's data source (call on every rank: the indexed path builds its index caches collectively)."""
    seed = recipe.data.seed if recipe.data.seed is not None else recipe.run.seed
    m = recipe.model
    if recipe.data.path is None:
        return SyntheticCorpus(m.vocab_size, m.seq_length, seed, recipe.data.eod_token)
    return IndexedCorpus(
        recipe.data.path,
        m.vocab_size,
        m.seq_length,
        seed,
        num_samples=recipe.train.steps * recipe.global_batch_size,
        cache_dir=os.path.join(run_dir, "data_cache"),
        eod=recipe.data.eod_token,
    )


def write_synthetic_indexed(
    prefix: str, num_documents: int = 20000, vocab_size: int = 256, seed: int = 1234, eod: int = 0
) -> str:
    """Writes PREFIX.bin / PREFIX.idx with synthetic documents; returns the prefix."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    corpus = SyntheticCorpus(vocab_size, 1, seed, eod)
    dtype = np.uint16 if vocab_size <= 65536 else np.int32
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in corpus.documents(num_documents):
        builder.add_document(doc, [len(doc)])
    builder.finalize(prefix + ".idx")
    return prefix


def main(argv=None):
    """python -m megamoe_trainer.data PREFIX [--documents N] [--vocab-size V] [--seed S]"""
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m megamoe_trainer.data",
        description="Write the synthetic corpus as a Megatron indexed dataset (PREFIX.bin / PREFIX.idx).",
    )
    p.add_argument("prefix")
    p.add_argument("--documents", type=int, default=20000)
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--eod-token", type=int, default=0)
    args = p.parse_args(argv)
    prefix = write_synthetic_indexed(args.prefix, args.documents, args.vocab_size, args.seed, args.eod_token)
    print(
        f"wrote {prefix}.bin and {prefix}.idx ({args.documents} documents); train on it with --set data.path={prefix}"
    )


if __name__ == "__main__":
    main()
