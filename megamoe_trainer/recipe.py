"""Training recipes for `megamoe-train`: a YAML schema as dataclasses, loaded and checked before
any rank starts.

A recipe has seven sections (every key optional, defaults below): `run`, `parallel`, `model`,
`moe`, `train`, `perf`, `data`. Each section checks its own keys (`check`, with the other
sections at hand where a rule spans two). Unknown keys, wrong types and impossible combinations
raise `RecipeError` whose message starts with the dotted key at fault (e.g. `moe.num_experts: ...`).
Keys of earlier recipes that moved to `perf` (`MOVED_KEYS`) are still read where they were.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

import yaml

from megamoe_train.precision import RECIPES as _RECIPES

from .schema import RecipeError, from_mapping

__all__ = [
    "MEGAMOE_RECIPES",
    "MOVED_KEYS",
    "Recipe",
    "RecipeError",
    "apply_overrides",
    "check_environment",
    "load_recipe",
    "parse_override",
    "read_recipe_file",
    "runs_on_cuda",
    "validate",
    "validate_with_megatron",
]

MEGAMOE_RECIPES = tuple(_RECIPES)


class _Section:
    """What every section has besides its keys: the keys that must be > 0 (None allowed) or >= 0,
    checked by `check_ranges()` before any section's `check(recipe)` runs its rules."""

    prefix = ""  # the section's name in the recipe
    _positive_keys: tuple[str, ...] = ()
    _non_negative_keys: tuple[str, ...] = ()

    def check_ranges(self) -> None:
        for name in self._positive_keys:
            value = getattr(self, name)
            if value is not None and value <= 0:
                self._fail(name, f"must be > 0, got {value!r}")
        for name in self._non_negative_keys:
            value = getattr(self, name)
            if value < 0:
                self._fail(name, f"must be >= 0, got {value!r}")

    def check(self, recipe: Recipe) -> None:
        """Raise RecipeError for a key of this section that cannot run in `recipe` (every
        section's ranges already checked)."""

    def _fail(self, name: str, message: str):
        raise RecipeError(f"{self.prefix}.{name}", message)


@dataclass
class RunSection(_Section):
    prefix = "run"
    _positive_keys = ("log_every", "peak_tflops", "profile_at", "profile_steps")
    _non_negative_keys = ("plot_every", "save_every")
    dir: str = "runs/default"  # run directory: metrics, plots, checkpoints (relative to the CWD)
    seed: int = 1234
    log_every: int = 1  # print a progress line every N steps (rank 0)
    plot_every: int = 50  # redraw progress.png every N steps (and at the end); 0 = only at the end
    save_every: int = 0  # checkpoint every N steps (and at the end); 0 = only at the end
    checkpoint: bool = True  # false: never write checkpoints (benchmarks, smoke runs)
    resume: Union[bool, Literal["auto"]] = "auto"  # auto: continue if the run dir has a checkpoint
    # per-GPU peak the MFU is relative to; None: the GPU's entry in flops.PEAK_TFLOPS_BY_GPU (an H200:
    # its measured dense bf16 GEMM rate), no MFU where there is none (CPUs, other GPUs)
    peak_tflops: Optional[float] = None
    profile_at: Optional[int] = (
        None  # torch-profile steps profile_at .. profile_at+profile_steps-1: RUN/profile/, RUN/summary.json
    )
    profile_steps: int = 3

    def check(self, recipe: Recipe) -> None:
        t = recipe.train
        if not self.dir:
            self._fail("dir", "must not be empty")
        if self.profile_at is not None:
            last = self.profile_at + self.profile_steps - 1
            if last > t.steps:
                self._fail("profile_at", f"steps {self.profile_at}..{last} do not fit in train.steps={t.steps}")
            if t.stop_at is not None and self.profile_at <= t.stop_at < last:
                # the invocation would end with the profiler open: no trace, no profile summary, silently
                self._fail("profile_at", f"steps {self.profile_at}..{last} do not fit before train.stop_at={t.stop_at}")


@dataclass
class ParallelSection(_Section):
    prefix = "parallel"
    _positive_keys = (
        "world_size",
        "expert_parallel",
        "tensor_parallel",
        "pipeline_parallel",
        "virtual_pipeline_stages",
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda when a GPU is present
    world_size: int = 1  # processes; on cuda one per GPU
    # EP size: must divide the ranks of one pipeline stage (world_size / pipeline_parallel) and
    # moe.num_experts; the EP group is ranks of one stage (with TP > 1 it spans the TP ranks)
    expert_parallel: int = 1
    # TP size for attention / dense layers, with sequence parallelism (each TP rank's sequence
    # shard goes through the MoE layers on its own; experts use expert TP 1)
    tensor_parallel: int = 1
    pipeline_parallel: int = 1  # PP stages (Megatron's 1F1B schedule over train.grad_accum_steps micro-batches)
    # model chunks per pipeline stage (Megatron's interleaved schedule); None: one
    virtual_pipeline_stages: Optional[int] = None
    # CUDA: each rank's process on its own share of the CPUs near its GPU (megamoe_train/launch.py),
    # so ranks' hosts do not compete for cores or get moved across NUMA nodes (off by default: no
    # measured gain on a one-NUMA-node 2x H200 host)
    pin_cpus: bool = False

    def check(self, recipe: Recipe) -> None:
        m, moe, t = recipe.model, recipe.moe, recipe.train
        tp, pp, vp = self.tensor_parallel, self.pipeline_parallel, self.virtual_pipeline_stages or 1
        if self.world_size % (tp * pp):
            self._fail(
                "pipeline_parallel" if pp > 1 and self.world_size % tp == 0 else "tensor_parallel",
                f"tensor_parallel x pipeline_parallel = {tp} x {pp} does not divide "
                f"parallel.world_size={self.world_size}",
            )
        stage_ranks = self.world_size // pp
        if stage_ranks % self.expert_parallel:
            where = f"parallel.world_size={self.world_size}"
            if pp > 1:
                where = f"the {stage_ranks} ranks of a pipeline stage ({where} / pipeline_parallel={pp})"
            self._fail("expert_parallel", f"{self.expert_parallel} does not divide {where}")
        if moe.num_experts % self.expert_parallel:
            self._fail("expert_parallel", f"{self.expert_parallel} does not divide moe.num_experts={moe.num_experts}")
        if m.num_attention_heads % tp:
            self._fail("tensor_parallel", f"{tp} does not divide model.num_attention_heads={m.num_attention_heads}")
        if m.seq_length % tp:  # sequence parallelism splits each sequence over the TP ranks
            self._fail(
                "tensor_parallel", f"{tp} does not divide model.seq_length={m.seq_length} (sequence parallelism)"
            )
        if self.virtual_pipeline_stages is not None and pp == 1:
            self._fail("virtual_pipeline_stages", "needs parallel.pipeline_parallel > 1")
        if m.num_layers % (pp * vp):
            self._fail(
                "pipeline_parallel",
                f"pipeline_parallel x virtual_pipeline_stages = {pp} x {vp} does not divide "
                f"model.num_layers={m.num_layers}",
            )
        if vp > 1 and t.grad_accum_steps % pp:
            self._fail(
                "virtual_pipeline_stages",
                f"the interleaved schedule needs train.grad_accum_steps (micro-batches, {t.grad_accum_steps}) "
                f"to be a multiple of parallel.pipeline_parallel={pp}",
            )
        if pp > 1 and moe.megamoe_recipe is not None and moe.megamoe_cuda_graph:
            raise RecipeError(
                "moe.megamoe_cuda_graph",
                "CUDA-graphed MegaMoE layers need parallel.pipeline_parallel 1: a pipeline schedule runs "
                "several forwards of a layer before their backwards, a graphed layer holds one",
            )


@dataclass
class ModelSection(_Section):
    prefix = "model"
    _positive_keys = (
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "num_query_groups",
        "kv_channels",
        "ffn_hidden_size",
        "vocab_size",
        "seq_length",
        "rotary_base",
        "init_std",
    )
    num_layers: int = 2
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None  # GQA groups; None = multi-head attention
    kv_channels: Optional[int] = None  # head dim; None = hidden_size / num_attention_heads
    qk_layernorm: bool = False
    ffn_hidden_size: int = 512  # dense (non-MoE) MLP width
    vocab_size: int = 256
    seq_length: int = 64
    moe_layer_freq: Union[int, list[int]] = 1  # 1 = every layer MoE, k = every k-th, or a 0/1 list
    normalization: Literal["RMSNorm", "LayerNorm"] = "RMSNorm"
    position_embedding: Literal["rope", "learned_absolute"] = "rope"
    rotary_base: int = 10000
    dtype: Literal["fp32", "bf16"] = "bf16"  # parameter / activation dtype (master weights fp32 in bf16)
    init_std: float = 0.02

    def check(self, recipe: Recipe) -> None:
        tp = recipe.parallel.tensor_parallel
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            self._fail(
                "num_attention_heads",
                f"{self.num_attention_heads} does not divide model.hidden_size={self.hidden_size} "
                "(or set model.kv_channels)",
            )
        if self.num_query_groups is not None:
            if self.num_attention_heads % self.num_query_groups:
                self._fail(
                    "num_query_groups",
                    f"{self.num_query_groups} does not divide model.num_attention_heads={self.num_attention_heads}",
                )
            if self.num_query_groups % tp:
                raise RecipeError(
                    "parallel.tensor_parallel", f"{tp} does not divide model.num_query_groups={self.num_query_groups}"
                )
        if self.position_embedding == "rope":
            head_dim = self.kv_channels or self.hidden_size // self.num_attention_heads
            if head_dim % 2:
                self._fail("position_embedding", f"rope needs an even head dim, got {head_dim}")
        if self.vocab_size % tp:
            self._fail("vocab_size", f"{self.vocab_size} is not divisible by parallel.tensor_parallel={tp}")
        freq = self.moe_layer_freq
        if isinstance(freq, list):
            if len(freq) != self.num_layers or any(v not in (0, 1) for v in freq):
                self._fail(
                    "moe_layer_freq", f"a list must hold {self.num_layers} entries of 0/1 (one per layer), got {freq}"
                )
            if not any(freq):
                self._fail("moe_layer_freq", "no MoE layer")
        elif freq <= 0 or freq > self.num_layers:
            self._fail("moe_layer_freq", f"must be in 1..model.num_layers={self.num_layers}, got {freq}")


@dataclass
class MoESection(_Section):
    prefix = "moe"
    _positive_keys = (
        "num_experts",
        "topk",
        "ffn_hidden_size",
        "shared_expert_ffn_hidden_size",
        "max_tokens_per_rank",
        "router_num_groups",
        "router_group_topk",
    )
    _non_negative_keys = ("aux_loss_coeff",)
    num_experts: int = 8
    topk: int = 2
    ffn_hidden_size: int = 128  # per-expert intermediate size I
    shared_expert_ffn_hidden_size: Optional[int] = None  # None = no shared expert
    router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    router_pre_softmax: bool = False
    router_topk_scaling_factor: Optional[float] = None
    router_num_groups: Optional[int] = None  # group-limited routing (DeepSeek-V3: 8 groups)
    router_group_topk: Optional[int] = None
    router_expert_bias: bool = False  # aux-loss-free balancing (needs sigmoid scores)
    router_bias_update_rate: float = 1e-3
    load_balancing: Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "none"] = "aux_loss"
    aux_loss_coeff: float = 1e-2
    z_loss_coeff: Optional[float] = None
    megamoe_recipe: Optional[str] = "bf16"  # None = stock Megatron MoE; else one of MEGAMOE_RECIPES
    megamoe_backend: str = "auto"
    # replay each MoE layer's call from CUDA graphs (megamoe_train.graphs); None: wherever the layers
    # run the GPU executor (megatron_patch.cuda_graphs_enabled: CUDA, sm90, backend auto/triton, a
    # recipe it runs): a host that falls behind then no longer starves its GPU and its peer (eager
    # layers measured 7.5-27 ms per step waiting at the forward's first barrier, replayed ones
    # 0.1-3.8 ms, on the DeepSeek-V3 proxy over 2 H200s)
    megamoe_cuda_graph: Optional[bool] = None
    # expert wgrads added into DDP's main_grad by the wgrad GEMM (no separate main_grad += grad pass)
    megamoe_fuse_wgrad_accumulation: bool = True
    # with the fusion: DDP's per-step zeroing skips the expert weights' main_grad and the step's
    # first backward writes the expert wgrads over it (megatron_patch.grad_buffers): no zeroing
    # pass and no read of main_grad in that GEMM
    megamoe_overwrite_main_grad: bool = True
    max_tokens_per_rank: Optional[int] = None  # MegaMoE buffer size; None = micro_batch * seq_length / TP

    def check(self, recipe: Recipe) -> None:
        t, m = recipe.train, recipe.model
        if self.topk > self.num_experts:
            self._fail("topk", f"{self.topk} exceeds moe.num_experts={self.num_experts}")
        if (self.router_num_groups is None) != (self.router_group_topk is None):
            self._fail("router_group_topk", "set both moe.router_num_groups and moe.router_group_topk, or neither")
        if self.router_num_groups is not None:
            if self.num_experts % self.router_num_groups:
                self._fail(
                    "router_num_groups", f"{self.router_num_groups} does not divide moe.num_experts={self.num_experts}"
                )
            if self.router_group_topk > self.router_num_groups:
                self._fail(
                    "router_group_topk",
                    f"{self.router_group_topk} exceeds moe.router_num_groups={self.router_num_groups}",
                )
            if self.topk > self.router_group_topk * (self.num_experts // self.router_num_groups):
                self._fail("topk", f"{self.topk} exceeds the experts of the selected groups")
        if self.router_expert_bias and self.router_score_function != "sigmoid":
            self._fail(
                "router_expert_bias",
                "needs moe.router_score_function: sigmoid (Megatron ignores the bias with softmax)",
            )
        if self.router_pre_softmax and self.router_score_function != "softmax":
            self._fail("router_pre_softmax", "only applies to moe.router_score_function: softmax")
        if self.megamoe_recipe is None:
            return
        if self.megamoe_recipe not in MEGAMOE_RECIPES:
            self._fail(
                "megamoe_recipe",
                f"unknown recipe {self.megamoe_recipe!r}; choose one of {', '.join(MEGAMOE_RECIPES)} "
                "or null (stock Megatron MoE)",
            )
        tp = recipe.parallel.tensor_parallel
        routed = t.micro_batch_size * m.seq_length // tp  # sequence parallelism: 1/TP of each sequence
        if recipe.max_tokens_per_rank < routed:
            self._fail(
                "max_tokens_per_rank",
                f"{self.max_tokens_per_rank} is below the tokens one rank routes per step "
                f"(train.micro_batch_size * model.seq_length / parallel.tensor_parallel = {routed})",
            )
        if self.megamoe_cuda_graph and recipe.parallel.device != "cuda":
            self._fail("megamoe_cuda_graph", f"CUDA graphs need parallel.device: cuda, got {recipe.parallel.device!r}")
        _check_megamoe_shapes(recipe)


@dataclass
class TrainSection(_Section):
    prefix = "train"
    _positive_keys = ("steps", "stop_at", "micro_batch_size", "grad_accum_steps", "lr")
    _non_negative_keys = ("warmup_steps", "min_lr", "weight_decay", "clip_grad")
    steps: int = 100  # length of the run (the LR schedule ends here)
    stop_at: Optional[int] = None  # end this invocation after this step (checkpointed); resume continues
    micro_batch_size: int = 8  # sequences per rank per forward; global batch = micro_batch * DP size * grad_accum_steps
    grad_accum_steps: int = 1  # micro-batches per optimizer step (forward + backward each; one optimizer step)
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 10  # linear warmup, then cosine decay to min_lr at `steps`
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    clip_grad: float = 1.0
    use_distributed_optimizer: bool = False
    # AdamW's exp_avg and exp_avg_sq kept in bf16 by the AdamW kernel of perf.adam_writes_model_params
    # (DeepSeek-V3's recipe): 22 bytes of optimizer traffic per parameter instead of 30, 4 bytes less
    # memory. Needs the kernel (CUDA, bf16 model, no distributed optimizer) and adam_beta2 <= 0.99
    # (perf/adam_kernel.py says why)
    adam_moments_dtype: Literal["fp32", "bf16"] = "fp32"
    # fp32 matmuls on TF32 tensor cores (CUDA): in a bf16 model only the router's (moe_router_dtype
    # fp32), whose operands are bf16 values, exact in TF32; fp32 accumulation either way
    tf32_matmul: bool = True
    overlap_grad_reduce: bool = (
        False  # DDP all-reduces gradient buckets during the backward (Megatron's overlap_grad_reduce)
    )

    @property
    def last_step(self) -> int:
        """This invocation's final step."""
        return min(self.steps, self.stop_at or self.steps)

    def check(self, recipe: Recipe) -> None:
        p, m, perf = recipe.parallel, recipe.model, recipe.perf
        if self.min_lr > self.lr:
            self._fail("min_lr", f"{self.min_lr} exceeds train.lr={self.lr}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                self._fail(name, f"must be in [0, 1), got {getattr(self, name)}")
        if self.adam_moments_dtype == "bf16":
            needs = {
                "parallel.device": (p.device == "cuda", "cuda"),
                "model.dtype": (m.dtype == "bf16", "bf16"),
                "perf.fused_optimizer": (perf.fused_optimizer, "true"),
                "perf.adam_writes_model_params": (perf.adam_writes_model_params, "true"),
                "train.use_distributed_optimizer": (not self.use_distributed_optimizer, "false"),
            }
            for dotted, (ok, want) in needs.items():
                if not ok:
                    self._fail(
                        "adam_moments_dtype", f"bf16 moments are kept by the AdamW kernel, which needs {dotted}: {want}"
                    )
            if self.adam_beta2 > 0.99:
                self._fail(
                    "adam_moments_dtype",
                    f"bf16 exp_avg_sq with adam_beta2={self.adam_beta2}: its per-step decay "
                    f"{1 - self.adam_beta2:.2g} is too small for bf16's rounding step, it would stall; keep fp32 "
                    "moments or use adam_beta2 <= 0.99",
                )


@dataclass
class PerfSection(_Section):
    """The general speed-ups (megamoe_trainer/perf/): each stands in for a Transformer Engine or
    Apex feature (docs/perf.md); false restores megatron-core's own path."""

    prefix = "perf"
    _non_negative_keys = ("gc_every",)
    fused_optimizer: bool = True  # foreach grad norm / clip and fused AdamW where megatron has no TE / Apex kernels
    # with fused_optimizer, on CUDA: the AdamW kernel also writes the bf16 model params, so megatron's
    # separate main -> model params copy is skipped (perf/adam_kernel.py)
    adam_writes_model_params: bool = True
    attention: Literal["sdpa", "megatron"] = (
        "sdpa"  # core attention: torch SDPA (fused) or Megatron's local DotProductAttention
    )
    # CUDA only (torch.compile'd; compiled on the first step): megatron's RoPE and its native fused
    # vocab-parallel cross entropy, where its fused kernels would need Transformer Engine
    fused_rope: bool = True
    fused_cross_entropy: bool = True
    # CUDA only: the router's top-k expert selections (group-limited and aux-loss) in one Triton
    # kernel per call instead of torch.topk's (perf/router_topk.py); same experts chosen. On: with
    # the MoE layers graphed it measured +3.1% tokens/s on the DeepSeek-V3 proxy over 2 H200s
    # (means of two alternating pairs)
    fused_router_topk: bool = True
    # the dense linear layers' wgrads added into DDP's main_grad by their GEMM (Megatron's
    # gradient_accumulation_fusion, perf/dense_wgrad.py): no bf16 wgrad and no separate add.
    # Off: 1% slower at the DeepSeek-V3 proxy on 2 H200s, where cuBLAS's wgrad plus the adds cost
    # no more than the accumulating GEMM
    dense_wgrad_fusion: bool = False
    # Python's garbage collector (perf/host_gc.py): true = freeze the heap after the model is built,
    # no automatic collections, collect every gc_every steps on every rank at once (0 = never during
    # the run). Off by default: the automatic collector measured 0.0-0.3 ms/step
    manual_gc: bool = False
    gc_every: int = 50


@dataclass
class DataSection(_Section):
    prefix = "data"
    _non_negative_keys = ("eod_token",)
    path: Optional[str] = None  # Megatron indexed dataset prefix (PREFIX.bin + PREFIX.idx); None = synthetic
    eod_token: int = 0
    seed: Optional[int] = None  # synthetic corpus / sample shuffling seed; None = run.seed

    def check(self, recipe: Recipe) -> None:
        if self.eod_token >= recipe.model.vocab_size:
            self._fail("eod_token", f"{self.eod_token} is not below model.vocab_size={recipe.model.vocab_size}")
        if self.path is not None:
            for ext in (".bin", ".idx"):
                if not os.path.isfile(self.path + ext):
                    self._fail(
                        "path",
                        f"{self.path + ext} not found "
                        "(data.path is an indexed dataset prefix: PREFIX.bin + PREFIX.idx)",
                    )
            problem = _indexed_dataset_problem(self.path)
            if problem:
                self._fail("path", problem)


def _indexed_dataset_problem(prefix: str) -> str | None:
    """What makes PREFIX.bin / PREFIX.idx unreadable as a Megatron indexed dataset (empty, a bad
    index, a .bin shorter than its index says), or None."""
    import logging

    from megatron.core.datasets.indexed_dataset import DType, _IndexReader

    bin_path, idx_path = prefix + ".bin", prefix + ".idx"
    if os.path.getsize(idx_path) == 0:
        return f"{idx_path} is empty"
    quiet = logging.getLogger("megatron.core.datasets")
    level = quiet.level
    quiet.setLevel(logging.WARNING)  # the reader logs each array it maps
    try:
        index = _IndexReader(idx_path, multimodal=False)
        lengths, pointers, itemsize = index.sequence_lengths, index.sequence_pointers, DType.size(index.dtype)
        needed = int(pointers[-1]) + int(lengths[-1]) * itemsize if len(lengths) else 0
    except Exception as e:  # the reader asserts, or maps past the end of a truncated index
        return f"{idx_path} is not a readable Megatron index ({type(e).__name__}: {e})"
    finally:
        quiet.setLevel(level)
    if needed == 0:
        return f"{idx_path} indexes no tokens"
    size = os.path.getsize(bin_path)
    if size == 0:
        return f"{bin_path} is empty (its index {idx_path} describes {needed} bytes)"
    if size < needed:
        return f"{bin_path} holds {size} bytes, its index {idx_path} describes {needed}: it is truncated"
    return None


@dataclass
class Recipe:
    run: RunSection = field(default_factory=RunSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    model: ModelSection = field(default_factory=ModelSection)
    moe: MoESection = field(default_factory=MoESection)
    train: TrainSection = field(default_factory=TrainSection)
    perf: PerfSection = field(default_factory=PerfSection)
    data: DataSection = field(default_factory=DataSection)

    @classmethod
    def from_dict(cls, data: Any) -> Recipe:
        """The recipe of a mapping (what YAML reads, or `to_dict` wrote), types checked, not
        validated; keys of MOVED_KEYS read at their new place."""
        data, renamed = _move_old_keys(data)
        with _named_as_written(renamed):
            return from_mapping(cls, data)

    def sections(self) -> list[_Section]:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]

    # ---- derived -------------------------------------------------------------------------
    @property
    def data_parallel_size(self) -> int:
        p = self.parallel
        return p.world_size // (p.tensor_parallel * p.pipeline_parallel)

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step, over every data-parallel rank and micro-batch."""
        return self.train.micro_batch_size * self.data_parallel_size * self.train.grad_accum_steps

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.model.seq_length

    @property
    def max_tokens_per_rank(self) -> int:
        # sequence parallelism: a rank's MoE layers see its 1/TP of each sequence
        default = self.train.micro_batch_size * self.model.seq_length // self.parallel.tensor_parallel
        return self.moe.max_tokens_per_rank or default

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---- loading ---------------------------------------------------------------------------------

# Keys of earlier recipes -> where they live now. A recipe (or --set) may still use the old name;
# errors then name the key as written.
MOVED_KEYS = {
    "train.fused_optimizer": "perf.fused_optimizer",
    "train.adam_writes_model_params": "perf.adam_writes_model_params",
    "model.attention": "perf.attention",
    "model.fused_rope": "perf.fused_rope",
    "model.fused_cross_entropy": "perf.fused_cross_entropy",
    "moe.fused_router_topk": "perf.fused_router_topk",
    "train.dense_wgrad_fusion": "perf.dense_wgrad_fusion",
    "train.manual_gc": "perf.manual_gc",
    "train.gc_every": "perf.gc_every",
}


def _move_old_keys(data: Any) -> tuple[Any, dict[str, str]]:
    """data with the keys of MOVED_KEYS under their new names, and {new name: old name} of those
    moved. A key set under both names is refused."""
    if not isinstance(data, dict):
        return data, {}
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    renamed = {}
    for old, new in MOVED_KEYS.items():
        old_section, old_name = old.split(".")
        section = data.get(old_section)
        if not isinstance(section, dict) or old_name not in section:
            continue
        new_section, new_name = new.split(".")
        target = data.get(new_section)
        if target is None:
            target = data[new_section] = {}
        if not isinstance(target, dict):
            continue  # from_mapping names the section that is not a mapping
        if new_name in target:
            raise RecipeError(old, f"is the old name of {new}, which the recipe sets too: keep {new}")
        target[new_name] = section.pop(old_name)
        renamed[new] = old
    return data, renamed


@contextlib.contextmanager
def _named_as_written(renamed: dict[str, str]):
    """A RecipeError about a moved key names the key as the recipe wrote it."""
    try:
        yield
    except RecipeError as e:
        if e.key not in renamed:
            raise
        raise RecipeError(renamed[e.key], e.reason) from None


def parse_override(text: str) -> tuple[str, Any]:
    """'train.steps=4' -> ('train.steps', 4); the value is read as YAML."""
    if "=" not in text:
        raise RecipeError(text, "an override must look like section.key=value")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise RecipeError(key, f"cannot read value {raw!r}: {e}") from None
    return key.strip(), value


def apply_overrides(data: dict, overrides: list[tuple[str, Any]]) -> dict:
    data = dict(data or {})
    for key, value in overrides:
        parts = key.split(".")
        if len(parts) != 2 or not all(parts):
            raise RecipeError(key, "an override key must be section.key (e.g. train.steps)")
        section, name = parts
        current = data.get(section)
        if current is None:
            current = {}
        if not isinstance(current, dict):
            raise RecipeError(section, f"expected a mapping, got {current!r}")
        data[section] = {**current, name: value}
    return data


def _repeated_keys(node, prefix: str = ""):
    """RecipeError for the first key given twice in one mapping of the YAML node tree (YAML
    itself keeps the last silently)."""
    if isinstance(node, yaml.MappingNode):
        seen: dict = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            dotted = f"{prefix}.{key}" if prefix else str(key)
            if key is not None and key in seen:
                what = "section" if not prefix else "key"
                raise RecipeError(
                    dotted,
                    f"{what} given twice (lines {seen[key]} and {key_node.start_mark.line + 1}); "
                    "YAML would keep only the last: merge them",
                )
            seen[key] = key_node.start_mark.line + 1
            _repeated_keys(value_node, dotted)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _repeated_keys(item, prefix)


def read_recipe_file(path: str | os.PathLike | None) -> Any:
    """What the recipe file's YAML holds (None for an empty file), or RecipeError."""
    if path is None:
        raise RecipeError("recipe", "no recipe file given")
    path = os.fspath(path)
    if os.path.isdir(path):
        raise RecipeError("recipe", f"{path} is a directory, not a recipe file (e.g. recipes/tiny_moe_cpu.yaml)")
    if not os.path.isfile(path):
        raise RecipeError("recipe", f"file not found: {path}")
    try:
        with open(path) as f:
            text = f.read()
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise RecipeError("recipe", f"{path} is not valid YAML: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise RecipeError("recipe", f"cannot read {path}: {e}") from None
    try:
        _repeated_keys(root)
    except RecipeError as e:
        raise RecipeError(e.key, f"{e.reason} (in {path})") from None
    if data is not None and not isinstance(data, dict):
        raise RecipeError("recipe", f"{path} holds {_kind(data)}, not a mapping of sections (run:, parallel:, ...)")
    return data


def _kind(value: Any) -> str:
    if isinstance(value, list):
        return "a list"
    return f"a {type(value).__name__} ({value!r})" if len(repr(value)) <= 40 else f"a {type(value).__name__}"


def load_recipe(
    path: str | os.PathLike | None = None,
    overrides: list[str] | None = None,
    data: dict | None = None,
    deep: bool = True,
) -> Recipe:
    """Read a recipe file (or a dict), apply `section.key=value` overrides, validate it
    (deep: also build the Megatron TransformerConfig, which runs Megatron's and the MegaMoE
    adapter's own checks)."""
    if data is None:
        data = read_recipe_file(path)
        if data is None:
            data = {}
    if not isinstance(data, dict):
        raise RecipeError("recipe", f"holds {_kind(data)}, not a mapping of sections (run:, parallel:, ...)")
    data, renamed = _move_old_keys(data)
    pairs = []
    for key, value in (parse_override(o) for o in overrides or []):
        if key in MOVED_KEYS:
            renamed[MOVED_KEYS[key]] = key
            key = MOVED_KEYS[key]
        pairs.append((key, value))
    data = apply_overrides(data, pairs)
    with _named_as_written(renamed):
        recipe = from_mapping(Recipe, data)
        validate(recipe)
        if deep:
            validate_with_megatron(recipe)
    return recipe


# ---- validation -----------------------------------------------------------------------------


def validate(recipe: Recipe) -> Recipe:
    """Checks that need no hardware (sizes, divisibility, names, files), section by section.
    Raises RecipeError."""
    for section in recipe.sections():
        section.check_ranges()
    for section in recipe.sections():
        section.check(recipe)
    return recipe


def _check_megamoe_shapes(recipe: Recipe):
    """The MegaMoE layer's own rules (fp8 / fp4 block sizes, backend names, ...), reported per
    recipe key: the adapter's one Megatron -> MegaMoEConfig translation, on the run's config."""
    from megatron_patch.config import MegaMoEConfigError, megamoe_config

    from .model import transformer_config

    try:
        megamoe_config(transformer_config(recipe), num_max_tokens_per_rank=recipe.max_tokens_per_rank)
    except MegaMoEConfigError as e:  # "<Megatron setting>: why"; Megatron's own errors: validate_with_megatron
        setting = str(e).split(":", 1)[0]
        raise RecipeError(
            _MEGATRON_KEYS.get(setting, "moe.megamoe_recipe"), f"MegaMoE recipe {recipe.moe.megamoe_recipe!r}: {e}"
        ) from None
    except (ValueError, AssertionError, TypeError):
        return


# TransformerConfig field -> recipe key (for naming the key in Megatron's own error messages)
_MEGATRON_KEYS = {
    "num_layers": "model.num_layers",
    "hidden_size": "model.hidden_size",
    "num_attention_heads": "model.num_attention_heads",
    "num_query_groups": "model.num_query_groups",
    "kv_channels": "model.kv_channels",
    "qk_layernorm": "model.qk_layernorm",
    "ffn_hidden_size": "model.ffn_hidden_size",
    "moe_layer_freq": "model.moe_layer_freq",
    "normalization": "model.normalization",
    "tensor_model_parallel_size": "parallel.tensor_parallel",
    "expert_model_parallel_size": "parallel.expert_parallel",
    "pipeline_model_parallel_size": "parallel.pipeline_parallel",
    "virtual_pipeline_model_parallel_size": "parallel.virtual_pipeline_stages",
    "sequence_parallel": "parallel.tensor_parallel",
    "moe_megamoe_cuda_graph": "moe.megamoe_cuda_graph",
    "num_moe_experts": "moe.num_experts",
    "moe_router_topk": "moe.topk",
    "moe_ffn_hidden_size": "moe.ffn_hidden_size",
    "moe_shared_expert_intermediate_size": "moe.shared_expert_ffn_hidden_size",
    "moe_router_score_function": "moe.router_score_function",
    "moe_router_pre_softmax": "moe.router_pre_softmax",
    "moe_router_topk_scaling_factor": "moe.router_topk_scaling_factor",
    "moe_router_num_groups": "moe.router_num_groups",
    "moe_router_group_topk": "moe.router_group_topk",
    "moe_router_enable_expert_bias": "moe.router_expert_bias",
    "moe_router_bias_update_rate": "moe.router_bias_update_rate",
    "moe_router_load_balancing_type": "moe.load_balancing",
    "moe_aux_loss_coeff": "moe.aux_loss_coeff",
    "moe_z_loss_coeff": "moe.z_loss_coeff",
    "moe_megamoe_recipe": "moe.megamoe_recipe",
    "moe_megamoe_backend": "moe.megamoe_backend",
    "moe_megamoe_max_tokens_per_rank": "moe.max_tokens_per_rank",
}


def validate_with_megatron(recipe: Recipe):
    """Builds the run's MegaMoETransformerConfig (no process group needed), so Megatron's and the
    adapter's checks run before any rank starts; their errors are reported under the recipe key."""
    import re

    from .model import transformer_config

    try:
        transformer_config(recipe)
    except (ValueError, AssertionError, TypeError) as e:
        text = str(e) or type(e).__name__
        names = sorted(_MEGATRON_KEYS, key=len, reverse=True)
        found = next((n for n in names if re.search(rf"\b{n}\b", text)), None)
        raise RecipeError(_MEGATRON_KEYS.get(found, "model"), f"rejected by Megatron: {text}") from None


def runs_on_cuda(recipe: Recipe) -> bool:
    """Whether a rank of this recipe runs on a GPU here: parallel.device cuda or auto, and CUDA present."""
    import torch

    return recipe.parallel.device != "cpu" and torch.cuda.is_available()


def check_environment(recipe: Recipe) -> str:
    """Checks against this machine (GPU count); returns the device to run on ('cpu' or 'cuda')."""
    import torch

    p = recipe.parallel
    device = p.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n < p.world_size:
            raise RecipeError(
                "parallel.world_size",
                f"{p.world_size} ranks need {p.world_size} GPUs (one per rank), this machine has {n}",
            )
    return device
