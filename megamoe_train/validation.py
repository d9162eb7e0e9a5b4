"""Input checks of one mega_moe call.

They return a message instead of raising: a rank with bad input must still tell its peers
(through the status exchange of the protocol) so that every rank raises together and no rank
waits forever for rows that will never come.
"""

from __future__ import annotations

import torch

from .errors import MegaMoEInputError
from .symm_buffer import SymmBuffer
from .weights import ExpertWeights

__all__ = ["MegaMoEInputError", "check_inputs"]


def _check_tensor(name, t, shape, dtypes, device) -> str | None:
    if not isinstance(t, torch.Tensor):
        return f"{name}: expected a torch.Tensor, got {type(t).__name__}"
    if t.layout != torch.strided:  # sparse, CSR, mkldnn: the protocol reads dense rows
        return f"{name}: expected a dense (strided) tensor, got layout {t.layout}"
    if tuple(t.shape) != tuple(shape):
        return f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}"
    if t.dtype not in dtypes:
        return f"{name}: expected dtype {' or '.join(map(str, dtypes))}, got {t.dtype}"
    if t.device != device:
        return f"{name}: expected device {device}, got {t.device}"
    return None


def check_inputs(
    buffer: SymmBuffer,
    x,
    topk_idx,
    topk_weights,
    w1,
    w2,
    shared_w1,
    shared_w2,
    recv_stats,
    check_ids: bool = True,
    fuse_wgrad_accumulation: bool = False,
    prepared_weights=None,
) -> str | None:
    """First problem with this rank's inputs, or None. check_ids reads topk_idx on the host."""
    cfg = buffer.config
    dev = buffer.device
    floats = (torch.float32, torch.bfloat16, torch.float16)
    if isinstance(x, torch.Tensor) and x.layout != torch.strided:
        return f"x: expected a dense (strided) tensor, got layout {x.layout}"
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        return f"x: expected a 2-D tensor [tokens, {cfg.hidden}], got {getattr(x, 'shape', type(x).__name__)}"
    T = x.shape[0]
    if T > cfg.num_max_tokens_per_rank:
        return f"x: {T} tokens exceed num_max_tokens_per_rank={cfg.num_max_tokens_per_rank} of the buffer"
    E_l, H, I, K = buffer.num_local_experts, cfg.hidden, cfg.intermediate, cfg.topk
    checks = [
        ("x", x, (T, H), (cfg.dtype,)),
        ("topk_idx", topk_idx, (T, K), (torch.int64,)),
        ("topk_weights", topk_weights, (T, K), (torch.float32,)),
        ("w1", w1, (E_l, 2 * I, H), floats),
        ("w2", w2, (E_l, H, I), floats),
    ]
    if cfg.num_shared_experts:
        W = cfg.shared_width
        checks += [("shared_w1", shared_w1, (2 * W, H), floats), ("shared_w2", shared_w2, (H, W), floats)]
    elif shared_w1 is not None or shared_w2 is not None:
        return "shared_w1/shared_w2: given, but the config has num_shared_experts=0"
    if recv_stats is not None:
        checks.append(("recv_stats", recv_stats, (E_l,), (torch.int64,)))
    if fuse_wgrad_accumulation:  # the gradient accumulators the backward adds into
        for name, w, shape in (("w1", w1, (E_l, 2 * I, H)), ("w2", w2, (E_l, H, I))):
            grad_acc = getattr(w, "main_grad", None)
            if grad_acc is None:
                return (
                    f"{name}: fuse_wgrad_accumulation needs a main_grad attribute "
                    "(the gradient accumulator) on the weight"
                )
            checks.append((f"{name}.main_grad", grad_acc, shape, floats))
    for name, t, shape, dtypes in checks:
        problem = _check_tensor(name, t, shape, dtypes, dev)
        if problem:
            return problem
    if prepared_weights is not None:
        problem = _check_prepared(prepared_weights, cfg, E_l, dev)
        if problem:
            return problem
    if check_ids and T:
        lo, hi = int(topk_idx.min()), int(topk_idx.max())
        if lo < -1 or hi >= cfg.num_experts:
            bad = lo if lo < -1 else hi
            return f"topk_idx: expert id {bad} is outside [0, {cfg.num_experts}) (use -1 to mask a slot)"
    return None


def _check_prepared(prepared, cfg, num_local_experts: int, device) -> str | None:
    """mega_moe(prepared_weights=): kernel-layout weights for this buffer's recipe, experts and
    device, of the shapes, dtype and gate/up chunk transform_weights makes for its config."""
    recipe = cfg.precision
    if not isinstance(prepared, ExpertWeights):
        return f"prepared_weights: expected ExpertWeights, got {type(prepared).__name__}"
    if prepared.recipe != recipe.name:
        return f"prepared_weights: prepared for recipe {prepared.recipe!r}, the buffer runs {recipe.name!r}"
    n = prepared.w1.shape[0]
    if (
        n != num_local_experts
        or prepared.w2.shape[0] != n
        or prepared.w1.device != device
        or prepared.w2.device != device
    ):
        return (
            f"prepared_weights: {n} experts on {prepared.w1.device}, expected {num_local_experts} on {device} "
            "(the buffer's local experts)"
        )
    H, I = cfg.hidden, cfg.intermediate
    pack = 2 if recipe.weight_format == "e2m1" else 1  # FP4 packs two values a byte
    dtype = {"native": cfg.dtype, "e4m3": torch.float8_e4m3fn}.get(recipe.weight_format, torch.uint8)
    chunk = I if recipe.weight_format == "native" else recipe.gate_up_chunk
    expected = [("w1", prepared.w1, (n, 2 * I, H // pack)), ("w2", prepared.w2, (n, H, I // pack))]
    if recipe.quantized_dgrad:  # the dgrads' weights, quant.quantize_weight_t's
        expected += [("w1_t", prepared.w1_t, (n, H, 2 * I // pack)), ("w2_t", prepared.w2_t, (n, I, H // pack))]
    for name, w, shape in expected:
        if w is None:
            return f"prepared_weights: no {name}, which recipe {recipe.name!r} reads in backward (transform_weights)"
        if tuple(w.shape) != shape or w.dtype != dtype:
            return (
                f"prepared_weights: {name} is {w.dtype} {list(w.shape)}, expected {dtype} {list(shape)} "
                "(transform_weights of this buffer's config)"
            )
    if prepared.chunk != chunk:
        return f"prepared_weights: gate/up chunk {prepared.chunk}, expected {chunk} for this buffer's config"
    return None
