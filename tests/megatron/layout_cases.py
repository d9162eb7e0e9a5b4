"""What the parallel-layout tests run on every rank: a tiny GPT trained under Megatron's own
pipeline schedules (1F1B, interleaved virtual stages), tensor + sequence parallelism and expert
parallelism, once with stock MoE layers and once with MegaMoE layers from the same weights.
Losses, every gradient (keyed by checkpoint key and global offset: global layer numbers, global
expert ids), two Adam steps and model checkpoints (both ways) must agree.

Each case sets up Megatron's parallel state for its layout and tears it down again, so the
processes of mcore_pool serve the other Megatron tests afterwards (mcore_cases.init re-inits)."""

from __future__ import annotations

import contextlib
import os

import mcore_cases as cases
import torch
import torch.distributed as dist
from test_mega_moe_dist import rel_err

VOCAB, SEQ, BATCH = 128, 16, 2


@contextlib.contextmanager
def parallel_layout(tp=1, pp=1, vp=None, cp=1, ep=2):
    """Megatron's model-parallel groups of one layout for the body, torn down afterwards."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_patch import cpu_compat

    cpu_compat.apply()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    cases._READY = False  # the next mcore_cases.init sets its own layout up again
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
    )
    model_parallel_cuda_manual_seed(1234)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()


def layout_config(recipe, tp=1, pp=1, vp=None, cp=1, ep=2, **overrides):
    kw = dict(
        num_layers=4,
        moe_shared_expert_intermediate_size=64,
        tensor_model_parallel_size=tp,
        sequence_parallel=tp > 1,
        expert_tensor_parallel_size=1,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
        pipeline_dtype=torch.float32,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
    )
    kw.update(overrides)
    return cases.config(recipe, **kw)


def model_chunks(cfg, seed):
    """This rank's model chunks (one per virtual stage), as Megatron-LM builds them."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_patch import get_megamoe_gpt_decoder_block_spec, sequence_parallel_norms

    torch.manual_seed(seed)
    vp = cfg.virtual_pipeline_model_parallel_size
    chunks = []
    for stage in range(vp or 1):
        vp_stage = stage if vp else None
        chunks.append(
            GPTModel(
                cfg,
                sequence_parallel_norms(
                    get_megamoe_gpt_decoder_block_spec(cfg, use_transformer_engine=False, vp_stage=vp_stage)
                ),
                vocab_size=VOCAB,
                max_sequence_length=SEQ,
                pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                share_embeddings_and_output_weights=False,
                vp_stage=vp_stage,
            ).to(cases.device())
        )
    return chunks


def by_checkpoint_key(chunks, grads=False):
    """{(checkpoint key, global offset): tensor} of every sharded tensor of the chunks (a stacked
    MegaMoE expert parameter yields one entry per expert, as stock's per-expert weights do).
    grads: the same entries of the parameters' main_grad (read through the parameters' own
    sharded_state_dict with main_grad swapped in for their data)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    swapped = []
    if grads:
        for chunk in chunks:
            for p in chunk.parameters():
                swapped.append((p, p.data))
                p.data = p.main_grad
    try:
        out = {}
        for chunk in chunks:
            for v in chunk.sharded_state_dict().values():
                for t in v.build() if isinstance(v, ShardedTensorFactory) else [v]:
                    if isinstance(t, ShardedTensor) and t.data is not None:
                        entry = (t.key, t.global_offset)
                        assert entry not in out, entry
                        out[entry] = t.data.detach().clone()
    finally:
        for p, data in swapped:
            p.data = data
    return out


def compare(got, ref, tol, what):
    assert set(got) == set(ref), (what, sorted(set(got) ^ set(ref))[:6])
    errs = {k: rel_err(got[k], ref[k]) if ref[k].abs().max() > 0 else got[k].abs().max().item() for k in ref}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= tol, (what, worst, errs[worst])
    return errs[worst]


def micro_batches(dp_rank, step, n):
    """n micro-batches of this data-parallel rank (the TP ranks of one pipeline read the same)."""
    out = []
    for micro in range(n):
        g = torch.Generator().manual_seed(10_000 * step + 100 * dp_rank + micro)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
        out.append(tuple(t.to(cases.device()) for t in (tokens, pos, labels)))
    return out


def forward_step(data_iterator, model):
    tokens, pos, labels = next(data_iterator)
    output = model(tokens, pos, None, labels=labels)

    def loss_func(per_token):
        loss = per_token.float().mean()
        return loss, {"loss": loss.detach()}

    return output, loss_func


class Trained:
    """Model chunks in DDP with Megatron's Adam, stepped through Megatron's pipeline schedule."""

    def __init__(self, cfg, chunks, lr=1e-4):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        cfg.finalize_model_grads_func = finalize_model_grads
        self.cfg = cfg
        self.chunks = chunks
        self.ddp = [
            DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), c) for c in chunks
        ]
        self.optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=lr), self.ddp)

    def forward_backward(self, batches):
        """Losses of the micro-batches on the last stage ([] elsewhere); gradients reduced."""
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        # process-global: a test run earlier in this pool process may have left a 0-dim scale,
        # which the schedule's [1]-shaped one cannot be copied into
        MoEAuxLossAutoScaler.main_loss_backward_scale = None
        for d in self.ddp:
            d.zero_grad_buffer()
        self.optimizer.zero_grad()
        iters = [iter(batches) for _ in self.ddp]
        schedule = get_forward_backward_func()
        self.schedule = schedule.__name__
        out = schedule(
            forward_step_func=forward_step,
            data_iterator=iters if len(iters) > 1 else iters[0],
            model=self.ddp if len(self.ddp) > 1 else self.ddp[0],
            num_microbatches=len(batches),
            seq_length=SEQ,
            micro_batch_size=BATCH,
            forward_only=False,
        )
        return [d["loss"].item() for d in out]

    def step(self):
        ok, _, _ = self.optimizer.step()
        assert ok


def layout_training(rank, world, layout, ckpt_dir, steps=2, num_micro_batches=4, tol=2e-5, param_tol=3e-5):
    """Stock vs MegaMoE under `layout` (parallel_layout's keywords): per step the losses, every
    gradient and the parameters after the optimizer step, keyed by checkpoint key; then model
    checkpoints saved by one kind and loaded by the other, both ways."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_patch import MegaMoEMoELayer

    with parallel_layout(**layout):
        stock = Trained(layout_config(None, **layout), model_chunks(layout_config(None, **layout), seed=1))
        mega_cfg = layout_config("bf16", **layout)
        mega = Trained(mega_cfg, model_chunks(mega_cfg, seed=2))
        for s, m in zip(stock.chunks, mega.chunks):
            m.load_state_dict(s.state_dict(), strict=True)
        kinds = {type(x) for c in mega.chunks for x in c.modules() if isinstance(x, MoELayer)}
        assert kinds == {MegaMoEMoELayer}, kinds
        assert [cases.sharded_layout(c) for c in stock.chunks] == [cases.sharded_layout(c) for c in mega.chunks]
        dp_rank = parallel_state.get_data_parallel_rank()
        report = {"loss": [], "grad_err": [], "param_err": []}
        for step in range(steps):
            batches = micro_batches(dp_rank, step, num_micro_batches)
            l_stock, l_mega = stock.forward_backward(batches), mega.forward_backward(batches)
            assert len(l_stock) == len(l_mega) == (num_micro_batches if parallel_state.is_pipeline_last_stage() else 0)
            for a, b in zip(l_stock, l_mega):
                assert abs(a - b) <= tol * abs(a), (step, l_stock, l_mega)
            report["loss"].append(l_mega)
            g_stock = by_checkpoint_key(stock.chunks, grads=True)
            report["grad_err"].append(compare(by_checkpoint_key(mega.chunks, grads=True), g_stock, tol, "grads"))
            experts = [k for k in g_stock if ".experts." in k[0]]
            assert experts and all(g_stock[k].abs().max() > 0 for k in experts), "expert grads missing"
            stock.step(), mega.step()
            # Adam divides each gradient element by its own magnitude: a rounding-level difference
            # of a near-zero gradient element moves its update by up to lr (measured: up to 7e-6
            # with lr 1e-4 on PP2 x TP2; the bounds leave room for other CPUs' summation orders)
            params = compare(by_checkpoint_key(mega.chunks), by_checkpoint_key(stock.chunks), param_tol, "params")
            report["param_err"].append(params)
        report["n_keys"] = len(g_stock)
        report["schedule"] = mega.schedule
        report["moe_layers"] = sum(isinstance(x, MegaMoEMoELayer) for c in mega.chunks for x in c.modules())
        report["checkpoint_keys"] = checkpoint_both_ways(layout, ckpt_dir)
        return report


def checkpoint_both_ways(layout, ckpt_dir):
    """A model checkpoint (megatron.core.dist_checkpointing, one entry per model chunk as
    Megatron-LM writes it) of a stock model loads into a MegaMoE one bit-exact, and back; the
    plain per-rank state_dict moves both ways too."""
    from megatron.core import dist_checkpointing

    def sharded(chunks):
        return {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}

    def save(chunks, path):
        if dist.get_rank() == 0:
            os.makedirs(path, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(sharded(chunks), path)
        dist.barrier()

    def load(chunks, path):
        state = dist_checkpointing.load(sharded(chunks), path)
        for i, c in enumerate(chunks):
            c.load_state_dict(state[f"model{i}"], strict=True)

    def exact(a, b):
        assert set(a) == set(b), sorted(set(a) ^ set(b))[:6]
        bad = [k for k in a if not torch.equal(a[k], b[k])]
        assert not bad, bad[:6]

    def chunks(recipe, seed):
        return model_chunks(layout_config(recipe, **layout), seed)

    stock, mega = chunks(None, 11), chunks("bf16", 12)
    ref_stock, ref_mega = by_checkpoint_key(stock), by_checkpoint_key(mega)
    assert any(not torch.equal(ref_stock[k], ref_mega[k]) for k in ref_stock)  # different inits
    save(stock, os.path.join(ckpt_dir, "stock"))
    save(mega, os.path.join(ckpt_dir, "mega"))
    load(mega, os.path.join(ckpt_dir, "stock"))
    load(stock, os.path.join(ckpt_dir, "mega"))
    exact(by_checkpoint_key(mega), ref_stock)
    exact(by_checkpoint_key(stock), ref_mega)
    # the plain state_dict of every chunk: the same keys and shapes per rank, strict both ways
    stock, mega = chunks(None, 21), chunks("bf16", 22)
    ref_stock, ref_mega = by_checkpoint_key(stock), by_checkpoint_key(mega)
    sd_stock = [{k: v.clone() if torch.is_tensor(v) else v for k, v in c.state_dict().items()} for c in stock]
    for s, m in zip(stock, mega):
        s.load_state_dict(m.state_dict(), strict=True)
    for m, sd in zip(mega, sd_stock):
        m.load_state_dict(sd, strict=True)
    exact(by_checkpoint_key(mega), ref_stock)
    exact(by_checkpoint_key(stock), ref_mega)
    return len(ref_stock)


def context_parallel_moe_layer(rank, world, tol=1e-5):
    """CP2 x EP2: Megatron's GPT attention needs Transformer Engine under context parallelism,
    so the MoE layer alone, as a CP rank runs it: its own seq / CP tokens dispatched over the EP
    group (which spans the CP ranks), the router's aux loss over the TP x CP group. Output, input
    gradient and every parameter gradient against the stock MoELayer's."""
    import functools

    from megatron.core import parallel_state
    from megatron.core.transformer.spec_utils import build_module

    from megatron_patch import MegaMoEMoELayer, get_megamoe_moe_module_spec

    with parallel_layout(cp=2, ep=2):
        assert parallel_state.get_context_parallel_world_size() == 2
        out = {}
        for recipe in (None, "bf16"):
            cfg = layout_config(recipe, cp=2, num_layers=1)
            spec = get_megamoe_moe_module_spec(cfg, use_te=False, num_experts=cfg.num_moe_experts)
            torch.manual_seed(5)
            layer = spec(config=cfg) if isinstance(spec, functools.partial) else build_module(spec, config=cfg)
            layer = layer.to(cases.device())
            if recipe is None:
                stock_state = layer.state_dict()
            else:
                assert isinstance(layer, MegaMoEMoELayer)
                layer.load_state_dict(stock_state, strict=True)
            g = torch.Generator().manual_seed(77 + rank)  # every rank its own tokens (CP chunk, DP rank)
            x = torch.randn(SEQ // 2, BATCH, cfg.hidden_size, generator=g).to(cases.device()).requires_grad_()
            w = torch.randn(SEQ // 2, BATCH, cfg.hidden_size, generator=g).to(cases.device())
            layer.train()
            y, _ = layer(x)
            (y * w).sum().backward()
            grads = cases.per_expert({n: p.grad.detach().clone() for n, p in layer.named_parameters()})
            out[recipe] = (y.detach(), x.grad.detach(), grads)
        (y1, dx1, g1), (y2, dx2, g2) = out[None], out["bf16"]
        errs = {"y": rel_err(y2, y1), "dx": rel_err(dx2, dx1)}
        errs["grads"] = compare(g2, g1, tol, "grads")
        assert errs["y"] <= tol and errs["dx"] <= tol, errs
        assert any("router" in n for n in g1) and len(g1) > 4
        return errs
