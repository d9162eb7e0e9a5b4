"""Training recipes for `megamoe-train`: a YAML schema as dataclasses, loaded and checked before
any rank starts.

A recipe has six sections (every key optional, defaults below): `run`, `parallel`, `model`,
`moe`, `train`, `data`. Unknown keys, wrong types and impossible combinations raise
`RecipeError` whose message starts with the dotted key at fault (e.g. `moe.num_experts: ...`).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

import yaml
from megamoe_train.precision import RECIPES as _RECIPES

from .flops import H200_BF16_PEAK_TFLOPS

MEGAMOE_RECIPES = tuple(_RECIPES)


class RecipeError(ValueError):
    """A recipe that cannot run; the message names the key."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}" if key else message)


@dataclass
class RunSection:
    dir: str = "runs/default"  # run directory: metrics, plots, checkpoints (relative to the CWD)
    seed: int = 1234
    log_every: int = 1  # print a progress line every N steps (rank 0)
    plot_every: int = 50  # redraw progress.png every N steps (and at the end); 0 = only at the end
    save_every: int = 0  # checkpoint every N steps (and at the end); 0 = only at the end
    checkpoint: bool = True  # false: never write checkpoints (benchmarks, smoke runs)
    resume: Union[bool, Literal["auto"]] = "auto"  # auto: continue if the run dir has a checkpoint
    peak_tflops: float = H200_BF16_PEAK_TFLOPS  # per-GPU peak the MFU is relative to (default: measured dense bf16 GEMM rate of an H200)
    profile_at: Optional[int] = None  # torch-profile steps profile_at .. profile_at+profile_steps-1: RUN/profile/, RUN/summary.json
    profile_steps: int = 3


@dataclass
class ParallelSection:
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda when a GPU is present
    world_size: int = 1  # processes; on cuda one per GPU
    expert_parallel: int = 1  # EP size: must divide world_size / tensor_parallel and moe.num_experts
    tensor_parallel: int = 1  # TP size for attention / dense layers (experts use expert TP 1)
    # CUDA: each rank's process on its own share of the CPUs near its GPU (megamoe_train/launch.py),
    # so ranks' hosts do not compete for cores or get moved across NUMA nodes (off by default: no
    # measured gain on a one-NUMA-node 2x H200 host)
    pin_cpus: bool = False


@dataclass
class ModelSection:
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
    attention: Literal["sdpa", "megatron"] = "sdpa"  # core attention: torch SDPA (fused) or Megatron's local DotProductAttention
    # CUDA only (torch.compile'd; compiled on the first step): megatron's RoPE and its native fused
    # vocab-parallel cross entropy, where its fused kernels would need Transformer Engine
    fused_rope: bool = True
    fused_cross_entropy: bool = True


@dataclass
class MoESection:
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
    # CUDA only: the router's top-k expert selections (group-limited and aux-loss) in one Triton
    # kernel per call instead of torch.topk's (megatron_patch.routing); same experts chosen. On: with
    # the MoE layers graphed it measured +3.1% tokens/s (means of two alternating pairs) (NOTES.md, session 24)
    fused_router_topk: bool = True
    load_balancing: Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "none"] = "aux_loss"
    aux_loss_coeff: float = 1e-2
    z_loss_coeff: Optional[float] = None
    megamoe_recipe: Optional[str] = "bf16"  # None = stock Megatron MoE; else one of MEGAMOE_RECIPES
    megamoe_backend: str = "auto"
    # replay each MoE layer's call from CUDA graphs (megamoe_train.graphs); None: wherever the layers
    # run the GPU executor (megatron_patch.cuda_graphs_enabled: CUDA, sm90, backend auto/triton, a
    # recipe it runs): a host that falls behind then no longer starves its GPU and its peer
    # (BENCHMARKS.md, session 24)
    megamoe_cuda_graph: Optional[bool] = None
    # expert wgrads added into DDP's main_grad by the wgrad GEMM (no separate main_grad += grad pass)
    megamoe_fuse_wgrad_accumulation: bool = True
    # with the fusion: DDP's per-step zeroing skips the expert weights' main_grad and the step's
    # first backward writes the expert wgrads over it (megatron_patch.grad_buffers): no zeroing
    # pass and no read of main_grad in that GEMM
    megamoe_overwrite_main_grad: bool = True
    max_tokens_per_rank: Optional[int] = None  # MegaMoE buffer size; None = micro_batch * seq_length


@dataclass
class TrainSection:
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
    fused_optimizer: bool = True  # foreach grad norm / clip and fused AdamW where megatron has no TE / Apex kernels
    # with fused_optimizer, on CUDA: the AdamW kernel also writes the bf16 model params, so megatron's
    # separate main -> model params copy is skipped (megamoe_trainer/adam_kernel.py)
    adam_writes_model_params: bool = True
    # AdamW's exp_avg and exp_avg_sq kept in bf16 by that kernel (DeepSeek-V3's recipe): 22 bytes of
    # optimizer traffic per parameter instead of 30, 4 bytes less memory. Needs the kernel (CUDA,
    # bf16 model, no distributed optimizer) and adam_beta2 <= 0.99 (adam_kernel.py says why)
    adam_moments_dtype: Literal["fp32", "bf16"] = "fp32"
    # fp32 matmuls on TF32 tensor cores (CUDA): in a bf16 model only the router's (moe_router_dtype
    # fp32), whose operands are bf16 values, exact in TF32; fp32 accumulation either way
    tf32_matmul: bool = True
    overlap_grad_reduce: bool = False  # DDP all-reduces gradient buckets during the backward (Megatron's overlap_grad_reduce)
    # the dense linear layers' wgrads added into DDP's main_grad by their GEMM (Megatron's
    # gradient_accumulation_fusion, megatron_patch.dense_wgrad): no bf16 wgrad and no separate add.
    # Off: 1% slower at the DeepSeek-V3 proxy on 2 H200s (BENCHMARKS.md, session 25)
    dense_wgrad_fusion: bool = False
    # Python's garbage collector (megamoe_trainer/host_gc.py): true = freeze the heap after the
    # model is built, no automatic collections, collect every gc_every steps on every rank at once
    # (0 = never during the run). Off by default: the automatic collector measured 0.0-0.3 ms/step
    manual_gc: bool = False
    gc_every: int = 50


@dataclass
class DataSection:
    path: Optional[str] = None  # Megatron indexed dataset prefix (PREFIX.bin + PREFIX.idx); None = synthetic
    eod_token: int = 0
    seed: Optional[int] = None  # synthetic corpus / sample shuffling seed; None = run.seed


@dataclass
class Recipe:
    run: RunSection = field(default_factory=RunSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    model: ModelSection = field(default_factory=ModelSection)
    moe: MoESection = field(default_factory=MoESection)
    train: TrainSection = field(default_factory=TrainSection)
    data: DataSection = field(default_factory=DataSection)

    # ---- derived -------------------------------------------------------------------------
    @property
    def data_parallel_size(self) -> int:
        return self.parallel.world_size // self.parallel.tensor_parallel

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step, over every data-parallel rank and micro-batch."""
        return self.train.micro_batch_size * self.data_parallel_size * self.train.grad_accum_steps

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.model.seq_length

    @property
    def max_tokens_per_rank(self) -> int:
        return self.moe.max_tokens_per_rank or self.train.micro_batch_size * self.model.seq_length

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---- loading ---------------------------------------------------------------------------------


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin is Union:
        return " or ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp):
    """value checked (and int -> float widened) against the annotation tp, or RecipeError."""
    origin = typing.get_origin(tp)
    if origin is Union:
        for arg in typing.get_args(tp):
            if arg is type(None):
                if value is None:
                    return None
                continue
            try:
                return _coerce(key, value, arg)
            except RecipeError:
                pass
        raise RecipeError(key, f"expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value in typing.get_args(tp) and type(value) in {type(a) for a in typing.get_args(tp)}:
            return value
        raise RecipeError(key, f"expected one of {_type_name(tp)}, got {value!r}")
    if origin is list:
        (inner,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise RecipeError(key, f"expected {_type_name(tp)}, got {value!r}")
        return [_coerce(f"{key}[{i}]", v, inner) for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    raise RecipeError(key, f"expected {_type_name(tp)}, got {type(value).__name__} {value!r}")


def _build(cls, data: Any, prefix: str):
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(prefix or "recipe", f"expected a mapping, got {type(data).__name__} {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(names)})"
            raise RecipeError(dotted, f"unknown key{hint}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value, dotted)
        else:
            kwargs[key] = _coerce(dotted, value, tp)
    return cls(**kwargs)


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


def load_recipe(path: str | os.PathLike | None = None, overrides: list[str] | None = None, data: dict | None = None,
                deep: bool = True) -> Recipe:
    """Read a recipe file (or a dict), apply `section.key=value` overrides, validate it
    (deep: also build the Megatron TransformerConfig, which runs Megatron's and the MegaMoE
    adapter's own checks)."""
    if data is None:
        if path is None:
            raise RecipeError("recipe", "no recipe file given")
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise RecipeError("recipe", f"file not found: {path}")
        try:
            with open(path) as f:
                data = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise RecipeError("recipe", f"{path} is not valid YAML: {e}") from None
        if data is None:
            data = {}
    data = apply_overrides(data, [parse_override(o) for o in overrides or []])
    recipe = _build(Recipe, data, "")
    validate(recipe)
    if deep:
        validate_with_megatron(recipe)
    return recipe


# ---- validation -----------------------------------------------------------------------------


def _positive(recipe: Recipe, *keys: str):
    for dotted in keys:
        section, name = dotted.split(".")
        value = getattr(getattr(recipe, section), name)
        if value is not None and value <= 0:
            raise RecipeError(dotted, f"must be > 0, got {value!r}")


def validate(recipe: Recipe) -> Recipe:
    """Checks that need no hardware: sizes, divisibility, names, files. Raises RecipeError."""
    r, p, m, moe, t, d = recipe.run, recipe.parallel, recipe.model, recipe.moe, recipe.train, recipe.data
    _positive(
        recipe,
        "parallel.world_size", "parallel.expert_parallel", "parallel.tensor_parallel",
        "model.num_layers", "model.hidden_size", "model.num_attention_heads", "model.num_query_groups",
        "model.kv_channels", "model.ffn_hidden_size", "model.vocab_size", "model.seq_length",
        "model.rotary_base", "model.init_std",
        "moe.num_experts", "moe.topk", "moe.ffn_hidden_size", "moe.shared_expert_ffn_hidden_size",
        "moe.max_tokens_per_rank", "moe.router_num_groups", "moe.router_group_topk",
        "train.steps", "train.stop_at", "train.micro_batch_size", "train.grad_accum_steps", "train.lr", "run.log_every",
        "run.peak_tflops", "run.profile_at", "run.profile_steps",
    )
    for dotted, value in (("run.plot_every", r.plot_every), ("run.save_every", r.save_every),
                          ("train.warmup_steps", t.warmup_steps), ("train.min_lr", t.min_lr),
                          ("train.weight_decay", t.weight_decay), ("train.clip_grad", t.clip_grad),
                          ("moe.aux_loss_coeff", moe.aux_loss_coeff), ("data.eod_token", d.eod_token),
                          ("train.gc_every", t.gc_every)):
        if value < 0:
            raise RecipeError(dotted, f"must be >= 0, got {value!r}")
    if not r.dir:
        raise RecipeError("run.dir", "must not be empty")
    if r.profile_at is not None and r.profile_at + r.profile_steps - 1 > t.steps:
        raise RecipeError("run.profile_at", f"steps {r.profile_at}..{r.profile_at + r.profile_steps - 1} do not fit in train.steps={t.steps}")
    if r.profile_at is not None and t.stop_at is not None and r.profile_at <= t.stop_at < r.profile_at + r.profile_steps - 1:
        # the invocation would end with the profiler open: no trace, no profile summary, silently
        raise RecipeError("run.profile_at", f"steps {r.profile_at}..{r.profile_at + r.profile_steps - 1} do not fit before train.stop_at={t.stop_at}")
    if t.min_lr > t.lr:
        raise RecipeError("train.min_lr", f"{t.min_lr} exceeds train.lr={t.lr}")
    for dotted, value in (("train.adam_beta1", t.adam_beta1), ("train.adam_beta2", t.adam_beta2)):
        if not 0 <= value < 1:
            raise RecipeError(dotted, f"must be in [0, 1), got {value}")
    if t.adam_moments_dtype == "bf16":
        needs = {"parallel.device": (p.device == "cuda", "cuda"), "model.dtype": (m.dtype == "bf16", "bf16"),
                 "train.fused_optimizer": (t.fused_optimizer, "true"),
                 "train.adam_writes_model_params": (t.adam_writes_model_params, "true"),
                 "train.use_distributed_optimizer": (not t.use_distributed_optimizer, "false")}
        for dotted, (ok, want) in needs.items():
            if not ok:
                raise RecipeError("train.adam_moments_dtype", f"bf16 moments are kept by the AdamW kernel, which needs {dotted}: {want}")
        if t.adam_beta2 > 0.99:
            raise RecipeError("train.adam_moments_dtype", f"bf16 exp_avg_sq with adam_beta2={t.adam_beta2}: its per-step decay "
                              f"{1 - t.adam_beta2:.2g} is too small for bf16's rounding step, it would stall; keep fp32 "
                              "moments or use adam_beta2 <= 0.99")

    # parallel sizes
    if p.world_size % p.tensor_parallel:
        raise RecipeError("parallel.tensor_parallel", f"{p.tensor_parallel} does not divide parallel.world_size={p.world_size}")
    if p.world_size % p.expert_parallel:
        raise RecipeError("parallel.expert_parallel", f"{p.expert_parallel} does not divide parallel.world_size={p.world_size}")
    if moe.num_experts % p.expert_parallel:
        raise RecipeError("parallel.expert_parallel", f"{p.expert_parallel} does not divide moe.num_experts={moe.num_experts}")
    if m.num_attention_heads % p.tensor_parallel:
        raise RecipeError("parallel.tensor_parallel", f"{p.tensor_parallel} does not divide model.num_attention_heads={m.num_attention_heads}")
    if p.tensor_parallel > 1 and moe.megamoe_recipe is not None:
        raise RecipeError("parallel.tensor_parallel", "MegaMoE layers support tensor_parallel 1 only (use expert_parallel)")
    if p.tensor_parallel > 1:  # the stock MoELayer's forward raises in training under TP without sequence parallelism
        raise RecipeError("parallel.tensor_parallel", "Megatron's MoE layers train with tensor_parallel > 1 only under sequence "
                          "parallelism, which this trainer does not enable: use tensor_parallel 1 (and expert_parallel)")

    # model shapes
    if m.kv_channels is None and m.hidden_size % m.num_attention_heads:
        raise RecipeError("model.num_attention_heads", f"{m.num_attention_heads} does not divide model.hidden_size={m.hidden_size} (or set model.kv_channels)")
    if m.num_query_groups is not None:
        if m.num_attention_heads % m.num_query_groups:
            raise RecipeError("model.num_query_groups", f"{m.num_query_groups} does not divide model.num_attention_heads={m.num_attention_heads}")
        if m.num_query_groups % p.tensor_parallel:
            raise RecipeError("parallel.tensor_parallel", f"{p.tensor_parallel} does not divide model.num_query_groups={m.num_query_groups}")
    if m.position_embedding == "rope":
        head_dim = m.kv_channels or m.hidden_size // m.num_attention_heads
        if head_dim % 2:
            raise RecipeError("model.position_embedding", f"rope needs an even head dim, got {head_dim}")
    if m.vocab_size % p.tensor_parallel:
        raise RecipeError("model.vocab_size", f"{m.vocab_size} is not divisible by parallel.tensor_parallel={p.tensor_parallel}")
    if isinstance(m.moe_layer_freq, list):
        if len(m.moe_layer_freq) != m.num_layers or any(v not in (0, 1) for v in m.moe_layer_freq):
            raise RecipeError("model.moe_layer_freq", f"a list must hold {m.num_layers} entries of 0/1 (one per layer), got {m.moe_layer_freq}")
        if not any(m.moe_layer_freq):
            raise RecipeError("model.moe_layer_freq", "no MoE layer")
    elif m.moe_layer_freq <= 0 or m.moe_layer_freq > m.num_layers:
        raise RecipeError("model.moe_layer_freq", f"must be in 1..model.num_layers={m.num_layers}, got {m.moe_layer_freq}")
    if d.eod_token >= m.vocab_size:
        raise RecipeError("data.eod_token", f"{d.eod_token} is not below model.vocab_size={m.vocab_size}")

    # MoE
    if moe.topk > moe.num_experts:
        raise RecipeError("moe.topk", f"{moe.topk} exceeds moe.num_experts={moe.num_experts}")
    if (moe.router_num_groups is None) != (moe.router_group_topk is None):
        raise RecipeError("moe.router_group_topk", "set both moe.router_num_groups and moe.router_group_topk, or neither")
    if moe.router_num_groups is not None:
        if moe.num_experts % moe.router_num_groups:
            raise RecipeError("moe.router_num_groups", f"{moe.router_num_groups} does not divide moe.num_experts={moe.num_experts}")
        if moe.router_group_topk > moe.router_num_groups:
            raise RecipeError("moe.router_group_topk", f"{moe.router_group_topk} exceeds moe.router_num_groups={moe.router_num_groups}")
        if moe.topk > moe.router_group_topk * (moe.num_experts // moe.router_num_groups):
            raise RecipeError("moe.topk", f"{moe.topk} exceeds the experts of the selected groups")
    if moe.router_expert_bias and moe.router_score_function != "sigmoid":
        raise RecipeError("moe.router_expert_bias", "needs moe.router_score_function: sigmoid (Megatron ignores the bias with softmax)")
    if moe.router_pre_softmax and moe.router_score_function != "softmax":
        raise RecipeError("moe.router_pre_softmax", "only applies to moe.router_score_function: softmax")
    if moe.megamoe_recipe is not None:
        if moe.megamoe_recipe not in MEGAMOE_RECIPES:
            raise RecipeError("moe.megamoe_recipe", f"unknown recipe {moe.megamoe_recipe!r}; choose one of {', '.join(MEGAMOE_RECIPES)} or null (stock Megatron MoE)")
        if recipe.max_tokens_per_rank < t.micro_batch_size * m.seq_length:
            raise RecipeError("moe.max_tokens_per_rank", f"{moe.max_tokens_per_rank} is below the tokens one rank routes per step "
                              f"(train.micro_batch_size * model.seq_length = {t.micro_batch_size * m.seq_length})")
        if moe.megamoe_cuda_graph and recipe.parallel.device != "cuda":
            raise RecipeError("moe.megamoe_cuda_graph", f"CUDA graphs need parallel.device: cuda, got {recipe.parallel.device!r}")
        _check_megamoe_shapes(recipe)

    # data
    if d.path is not None:
        for ext in (".bin", ".idx"):
            if not os.path.isfile(d.path + ext):
                raise RecipeError("data.path", f"{d.path + ext} not found (data.path is an indexed dataset prefix: PREFIX.bin + PREFIX.idx)")
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
        raise RecipeError(_MEGATRON_KEYS.get(setting, "moe.megamoe_recipe"), f"MegaMoE recipe {recipe.moe.megamoe_recipe!r}: {e}") from None
    except (ValueError, AssertionError, TypeError):
        return


# TransformerConfig field -> recipe key (for naming the key in Megatron's own error messages)
_MEGATRON_KEYS = {
    "num_layers": "model.num_layers", "hidden_size": "model.hidden_size", "num_attention_heads": "model.num_attention_heads",
    "num_query_groups": "model.num_query_groups", "kv_channels": "model.kv_channels", "qk_layernorm": "model.qk_layernorm",
    "ffn_hidden_size": "model.ffn_hidden_size", "moe_layer_freq": "model.moe_layer_freq", "normalization": "model.normalization",
    "tensor_model_parallel_size": "parallel.tensor_parallel", "expert_model_parallel_size": "parallel.expert_parallel",
    "num_moe_experts": "moe.num_experts", "moe_router_topk": "moe.topk", "moe_ffn_hidden_size": "moe.ffn_hidden_size",
    "moe_shared_expert_intermediate_size": "moe.shared_expert_ffn_hidden_size",
    "moe_router_score_function": "moe.router_score_function", "moe_router_pre_softmax": "moe.router_pre_softmax",
    "moe_router_topk_scaling_factor": "moe.router_topk_scaling_factor", "moe_router_num_groups": "moe.router_num_groups",
    "moe_router_group_topk": "moe.router_group_topk", "moe_router_enable_expert_bias": "moe.router_expert_bias",
    "moe_router_bias_update_rate": "moe.router_bias_update_rate", "moe_router_load_balancing_type": "moe.load_balancing",
    "moe_aux_loss_coeff": "moe.aux_loss_coeff", "moe_z_loss_coeff": "moe.z_loss_coeff", "moe_megamoe_recipe": "moe.megamoe_recipe",
    "moe_megamoe_backend": "moe.megamoe_backend", "moe_megamoe_max_tokens_per_rank": "moe.max_tokens_per_rank",
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
            raise RecipeError("parallel.world_size", f"{p.world_size} ranks need {p.world_size} GPUs (one per rank), this machine has {n}")
    return device
