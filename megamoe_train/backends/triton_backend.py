"""The GPU executor of the protocol (protocol.py): Triton row movement and grouped GEMMs.

- plan and input storage: the plan's tables in three Triton launches (triton_plan.py, plan.py's
  bits); the fp8 recipe's input rows quantized straight into the buffer (quantize_rows);
- pull: one Triton kernel reads each received (source, token) row once over NVLink (x, its
  fp8 scales, its topk weights; dY in backward, with an fp8 dgrad also quantized in that pass)
  and writes it into every pool row of its slots;
- expert MLP: L1 grouped GEMM -> fused clamp/SwiGLU/topk weight (/e4m3 requantization) -> L2
  grouped GEMM; bf16 GEMMs our CUTLASS kernel, fp8 GEMMs our block-scaled CUTLASS kernel
  (cutlass_gemm.py; where the CUDA extension was not built, torch._grouped_mm and our Triton
  kernel); backward: with the fp8 recipe the two dgrad GEMMs are fp8 too (dY quantized by the
  pull, dH by the SwiGLU backward, both e4m3 with 1x128 scales, against the transposed quantized
  weights ExpertWeights.w2_t / w1_t); the wgrads bf16 (fp32 accumulation) on the dequantized
  stored activations and the unquantized gradients, torch's K-grouped GEMM (with
  fuse_wgrad_accumulation: our CUTLASS K-grouped GEMM on the pool operands as stored, adding into
  the fp32 accumulators in its epilogue, or writing over those flagged overwrite_main_grad:
  main_grad.py), except with recipe fp8_e4m3_wgrad: dY, dH and the stored activations each quantized
  along the pool rows in 128-row blocks by quantize_tokens_t, transposed, into the CUTLASS
  K-grouped fp8 GEMM (each expert padded to 128 pool rows so no block spans two; slower than bf16
  as measured 2026-11-30: S1 forward+backward 17.73 against 14.61 ms, the tile's fixed costs and
  per-step promotion dominate at 2-4 K steps); with bf16 every backward GEMM is bf16;
- mxfp8_mxfp4 (recipe.mx) runs on the fp8 GEMMs with its operands folded (quant.py's MX
  section): the input rows are stored as the recipe's MXFP8 (1x32 ue8m0 scales, quantize_rows_mx),
  pulled as stored, then folded in the pool to 1x128 power-of-two scales (fold_mx_rows); the
  SwiGLU kernel quantizes the L2 input the same way (MXFP8, folded); the weights are folded to e4m3
  with 128x128 scales once per weight version (ExpertWeights.mma_operands), or, with
  MEGAMOE_MX_GEMM=expanded, read as stored (4 bits a weight) and expanded in shared memory by our
  expert GEMM (fp8_expert_gemm_mx, the same bits; 1.3-1.6x slower, docs/decisions.md). Its dgrads
  are quantized like fp8's, on the same GEMMs: dY quantized to MXFP8 and folded in its pull, dH by
  the SwiGLU backward, against the E2M1 copies of the transposed master weights
  (ExpertWeights.w2_t / w1_t, blocked along the dgrad's K), folded or read as stored like the
  forward's; its wgrads are bf16 on the dequantized activations;
- push: one kernel sums the output rows of each received (source, token) in fp32 in slot
  order and stores one partial row into the home rank's buffer (and d(topk weight) per slot);
- reduce: one kernel sums the home's partials in owner-rank order, then the shared row.

Nothing reads the device from the host, so forward and backward are capturable in a CUDA graph
(bad ids are handled by the protocol's deferred verdicts).

Numerics match the reference executor up to rounding: pre-activations, grad_act and the wgrads'
operands are kept in bf16 instead of fp32 (dH is quantized from fp32, as in the reference),
GEMMs accumulate in fp32, and the shared experts use bf16 GEMMs (fp32 accumulation, SwiGLU in
fp32, by the routed experts' SwiGLU kernels) where the reference uses fp32.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..expert_math import shared_backward, shared_forward
from ..faults import STATUS_BAD, STATUS_OK
from ..plan import Plan
from ..precision import GPU_EXECUTOR_RECIPES
from ..quant import dequantize_tokens_t
from ..symm_buffer import SymmBuffer
from ..weights import ExpertWeights
from . import cutlass_gemm, triton_plan
from . import triton_kernels as K_

GROUP_ALIGN = 16  # rows per expert group in the pool where the GEMMs take any group ends
WGRAD_BLOCK = 128  # quantized wgrads: 1x128 blocks along the pool rows, which must not span two experts
_FP8_GEMM = os.environ.get("MEGAMOE_FP8_GEMM", "auto")  # "auto" (CUTLASS where built) or "triton"
# Non-fused bf16 wgrads: "torch" (K-grouped torch._grouped_mm) or "cutlass" (our store kernel,
# cutlass_gemm.bf16_wgrad_grouped_gemm); torch by default: ours was within noise of it in the
# layer (S1 fp8 forward+backward 13.688 against 13.652 ms).
_BF16_WGRAD = os.environ.get("MEGAMOE_BF16_WGRAD", "torch")
# The fp8 forward's expert GEMMs: "fused" (our persistent kernels, csrc/cuda/expert_gemm.h: L1 with
# SwiGLU and the requantization in its epilogue, then L2) or "split" (the CUTLASS grouped GEMMs
# around the Triton SwiGLU kernel); docs/kernels.md has the measurements behind the default.
_FP8_FORWARD = os.environ.get("MEGAMOE_FP8_FORWARD", "split")
# The MX recipe's expert GEMMs: "folded" (the CUTLASS fp8 GEMMs on the weights folded to e4m3 in HBM
# once per weight version, ExpertWeights.mma_operands) or "expanded" (our expert GEMM reading the
# E2M1 weights as stored, expanded in shared memory, where built: half the weight bytes, but its
# expansion bounds it, 1.6-1.7x slower at S1 and P on 2026-12-07; docs/decisions.md).
_MX_GEMM = os.environ.get("MEGAMOE_MX_GEMM", "folded")


def unsupported_reason(cfg, device: torch.device) -> str | None:
    """Why this executor does not run calls of this MegaMoEConfig on this device; None where it does."""
    if device.type != "cuda":
        return f"it runs on CUDA devices only, not {device.type}"
    if cfg.recipe not in GPU_EXECUTOR_RECIPES:
        return f"recipe {cfg.recipe!r} has no GPU kernels yet (they exist for {', '.join(GPU_EXECUTOR_RECIPES)})"
    if cfg.dtype != torch.bfloat16:
        return f"dtype {cfg.dtype} (its kernels take bf16)"
    if cfg.intermediate % 128 or cfg.hidden % 128:
        return f"hidden {cfg.hidden} and intermediate {cfg.intermediate} must be multiples of 128"
    if cfg.block_m not in (64, 128):
        return f"block_m {cfg.block_m} (its kernels take 64 or 128)"
    capability = torch.cuda.get_device_capability(device)
    if capability < (9, 0):
        return f"compute capability {capability[0]}.{capability[1]} (its kernels need 9.0, Hopper, or newer)"
    return None


@dataclass
class TritonExpertState:
    pool_x: torch.Tensor  # L1 input rows as stored
    pool_x_scales: torch.Tensor | None
    row_weights: torch.Tensor  # fp32 [P]
    pre_act: torch.Tensor  # bf16 [P, 2I] interleaved
    act: torch.Tensor  # L2 input as stored
    act_scales: torch.Tensor | None


@dataclass
class TritonPoolInputs:
    x: torch.Tensor
    x_scales: torch.Tensor | None
    row_weights: torch.Tensor


@dataclass
class TritonPoolGrad:
    """dY's pool rows: as pulled (compute dtype; the W2 wgrad reads them), and with a quantized
    dgrad also quantized in the same pass (e4m3 + fp32 1x128 scales, the MX recipe's folded from
    its 1x32 ones; the L2 dgrad reads them)."""

    rows: torch.Tensor
    q: torch.Tensor | None = None
    q_scales: torch.Tensor | None = None


def _grouped_mm(a, b, offs):
    """torch's grouped GEMM over expert row groups (a [P, K] x b [E, K, N], or K-grouped
    a [M, P] x b [P, N] -> [E, M, N] when both are 2-D); the output has the inputs' dtype."""
    return torch._grouped_mm(a, b, offs=offs)


def _bf16_grouped_gemm(a, w, plan: Plan, transposed: bool):
    """out[rows of expert e] = a[rows] @ w[e]^T (transposed=False: w [E, N, K], the forward) or
    a[rows] @ w[e] (transposed=True: w [E, K, N], the dgrad), bf16 with fp32 accumulation: our
    CUTLASS kernel where built (it reads w in either layout by TMA, and beats torch's grouped GEMM
    where torch's 2x1 clusters pair an expert's M tiles and an odd tile count leaves a CTA idle),
    else torch's."""
    if a.is_contiguous() and w.is_contiguous() and cutlass_gemm.takes(a, w):
        out = torch.empty(a.shape[0], w.shape[2] if transposed else w.shape[1], dtype=a.dtype, device=a.device)
        return cutlass_gemm.bf16_grouped_gemm(a, w, plan.expert_ends, out, "kn" if transposed else "nk")
    return _grouped_mm(a, w if transposed else w.transpose(1, 2), plan.expert_ends)


def _cutlass_fp8(device: torch.device) -> bool:
    """The one place that picks the fp8 GEMM: CUTLASS where built; MEGAMOE_FP8_GEMM=triton forces
    the Triton kernel (whose tiles need block_m-aligned experts: row_align)."""
    return _FP8_GEMM != "triton" and cutlass_gemm.available(device)


def _fused_fp8_forward(cfg, weights: ExpertWeights, device: torch.device) -> bool:
    """Whether the fp8 forward runs on our fused expert kernels (1x128 activation blocks and
    128x128 weight blocks, whole 128-row gate/up chunks: what their epilogue quantizes)."""
    recipe = cfg.precision
    return (
        _FP8_FORWARD == "fused"
        and cutlass_gemm.has_expert_gemm(device)
        and recipe.act_block == 128
        and tuple(recipe.weight_block) == (128, 128)
        and weights.chunk % 128 == 0
        and weights.w1.shape[0] <= 1024
    )


def _fp8_grouped_gemm(a, a_scales, b, b_scales, plan: Plan, out, block_m: int):
    """out[rows of expert e] = (a * a_scales)[rows] @ (b[e] * b_scales[e])^T."""
    if _cutlass_fp8(a.device):
        return cutlass_gemm.fp8_grouped_gemm(a, a_scales, b, b_scales, plan.expert_ends, out)
    return K_.grouped_gemm(a, b, plan.block_expert, out, a_scales, b_scales, block_m=block_m)


# The expanded path's variant of fp8_expert_gemm_mx: + 32, the math warpgroups sharing the expansion
# (1.1-1.2x faster than the converter warps alone at S1, same bits; docs/decisions.md).
_MX_EXPANDED_VARIANT = 32


def _mx_expanded(cfg, device: torch.device) -> bool:
    """The one place that picks the MX recipe's GEMMs: whether this call's read the E2M1 weights as
    stored (our expert GEMM, with MEGAMOE_MX_GEMM=expanded, where built); else CUTLASS fp8 on the
    weights folded to e4m3 (the default)."""
    return cfg.precision.mx and _MX_GEMM == "expanded" and cutlass_gemm.has_expert_gemm_mx(device)


# The weights as the expert GEMMs read them, by path: the one place that picks which of
# ExpertWeights' derived operands a call reads (its paths and prepare_weights ask here).


def _forward_weight_operands(cfg, weights: ExpertWeights, device: torch.device) -> tuple:
    """experts_forward's: mx_gemm_operands (MX, expanded), else mma_operands (the stored weights,
    or the MX weights folded to e4m3)."""
    return weights.mx_gemm_operands() if _mx_expanded(cfg, device) else weights.mma_operands()


def _backward_weight_operands(cfg, weights: ExpertWeights, device: torch.device) -> tuple:
    """experts_backward's dgrads': mx_dgrad_gemm_operands (MX, expanded), mma_dgrad_operands (a
    quantized dgrad: fp8's stored, MX's folded), else compute_copies (bf16: the parameters)."""
    if not cfg.precision.quantized_dgrad:
        return weights.compute_copies(cfg.dtype)
    return weights.mx_dgrad_gemm_operands() if _mx_expanded(cfg, device) else weights.mma_dgrad_operands()


def _dgrad_gemm(cfg, weights: ExpertWeights, fc: int, a, a_scales, plan: Plan, out, align: int):
    """The quantized dgrad of fc `fc` (2: grad_act = dY_q W2, out [P, I]; 1: grad_x = dH_q W1, out
    [P, H]): out[rows of e] = (a * a_scales)[rows] @ W_t[e]^T with W_t = weights.w2_t [E, I, H] or
    w1_t [E, H, 2I], a e4m3 with fp32 1x128 scales. fp8: the fp8 grouped GEMM on the stored e4m3
    copies. MX: our expert GEMM on the E2M1 copies as stored (fp8_expert_gemm_mx, N = I or H and
    K = H or 2I), or the fp8 grouped GEMM on them folded to e4m3 (ExpertWeights.mma_dgrad_operands)."""
    operands = _backward_weight_operands(cfg, weights, a.device)
    if _mx_expanded(cfg, a.device):  # w1_t's three, then w2_t's
        b = operands[:3] if fc == 1 else operands[3:]
        return cutlass_gemm.fp8_expert_gemm_mx(a, a_scales, *b, plan.expert_ends, out, _MX_EXPANDED_VARIANT)
    b = operands[:2] if fc == 1 else operands[2:]  # w1_t, its scales, w2_t, its scales
    return _fp8_grouped_gemm(a, a_scales, *b, plan, out, align)


def _tokens_t(src, src_scales, plan: Plan):
    """A pool matrix [P, C] as the quantized wgrad reads it: e4m3 [C, P] + fp32 [C, P/128]."""
    P, C = src.shape
    data = torch.empty(C, P, dtype=torch.float8_e4m3fn, device=src.device)
    scales = torch.empty(C, P // WGRAD_BLOCK, dtype=torch.float32, device=src.device)
    K_.quantize_tokens_t(src, src_scales, plan.row_slot, plan.num_rows, data, scales)
    return data, scales


def _fp8_wgrad(recipe, grad, act, act_scales, plan: Plan):
    """grad_w[e] = Qt(grad)_e^T Qt(act)_e over expert e's pool rows (docs/precision.md): bf16
    [E, C_grad, C_act]. CUTLASS where built; otherwise the same quantized operands dequantized
    through torch's grouped GEMM (rounded to bf16 on the way: an e4m3 value times an fp32 scale
    is not always a bf16 value)."""
    a_t, a_s = _tokens_t(grad, None, plan)
    b_t, b_s = _tokens_t(act, act_scales, plan)
    E = plan.expert_ends.shape[0]
    if cutlass_gemm.available(grad.device):
        out = torch.empty(E, a_t.shape[0], b_t.shape[0], dtype=torch.bfloat16, device=grad.device)
        return cutlass_gemm.fp8_wgrad_grouped_gemm(a_t, a_s, b_t, b_s, plan.expert_ends, out)
    a, b = (dequantize_tokens_t(t, s, recipe).to(torch.bfloat16) for t, s in ((a_t, a_s), (b_t, b_s)))
    return _grouped_mm(a, b.t(), plan.expert_ends)


def _expert_wgrad(cfg, plan: Plan, grad, stored, stored_scales, target=None):
    """grad[rows of e]^T @ (stored activation rows of e) for every expert e, as the recipe computes
    it (fp8_e4m3_wgrad: _fp8_wgrad; else bf16 on the dequantized activations). Without a target
    it is returned (bf16 [E, ., .]); with one (main_grad.WgradTarget) it goes into the target's
    tensor, added or written over, and None is returned: in the CUTLASS GEMM's epilogue (fp32,
    unrounded) where built and the tensor is fp32, else by an add or copy of the bf16 product."""
    recipe = cfg.precision
    if recipe.quantized_wgrad:
        wgrad = _fp8_wgrad(recipe, grad, stored, stored_scales, plan)
    else:
        inputs = _as_compute(stored, stored_scales, plan.num_rows, cfg.dtype)
        out = None if target is None else target.tensor
        fusable = (
            out is not None
            and out.dtype == torch.float32
            and out.is_contiguous()
            and cutlass_gemm.takes(grad, inputs, out)
        )
        if fusable:
            depth = cfg.num_max_tokens_per_rank * cfg.topk / plan.expert_ends.shape[0]  # mean rows per expert
            if target.overwrite:  # the stale main_grad is neither read nor zeroed first
                config = cutlass_gemm.bf16_wgrad_store32_config(depth)
                cutlass_gemm.bf16_wgrad_grouped_gemm(grad, inputs, plan.expert_ends, out, *config)
            else:
                config = cutlass_gemm.bf16_wgrad_accumulate_config(depth)
                cutlass_gemm.bf16_wgrad_grouped_gemm_accumulate(grad, inputs, plan.expert_ends, out, *config)
            return None
        wgrad = _bf16_wgrad(grad, inputs, plan)
    if target is None:
        return wgrad
    target.put(wgrad)
    return None


def _bf16_wgrad(grad, inputs, plan: Plan):
    """wgrad[e] = grad[rows of e]^T @ inputs[rows of e], bf16 [E, ., .] (fp32 accumulation)."""
    if _BF16_WGRAD == "cutlass" and cutlass_gemm.takes(grad, inputs):
        E = plan.expert_ends.shape[0]
        out = torch.empty(E, grad.shape[1], inputs.shape[1], dtype=torch.bfloat16, device=grad.device)
        return cutlass_gemm.bf16_wgrad_grouped_gemm(grad, inputs, plan.expert_ends, out)
    return _grouped_mm(grad.t(), inputs, plan.expert_ends)


def _as_compute(data, scales, num_rows, dtype):
    """Stored activations as `dtype` values for the backward GEMMs (fp8: dequantized)."""
    if scales is None:
        return data
    out = torch.empty(data.shape, dtype=dtype, device=data.device)
    K_.dequantize_rows(data, scales, out, num_rows)
    return out


def _swiglu_kernel_takes(x, width: int) -> bool:
    return x.shape[0] > 0 and width % 128 == 0 and x.is_contiguous()


def _all_rows(T: int, device):
    """Row weights 1 and the live-row count T, as the SwiGLU kernels read them (no host sync)."""
    return torch.ones(T, dtype=torch.float32, device=device), torch.full((1,), T, dtype=torch.int32, device=device)


class TritonExecutor:
    name = "triton"
    reads_device_on_host = False  # no host sync: verdicts are deferred, the call is capturable
    checks_ids_on_device = True

    def row_align(self, cfg) -> int:
        # The quantized wgrads' scale blocks are 128 pool rows of one expert, and the Triton fp8
        # GEMM's tiles block_m rows of one expert. The CUTLASS GEMMs (fp8 and bf16) and torch's
        # take any group ends (per-group TMA bounds), so their experts are padded only to 16 rows
        # (16-byte aligned row starts at every width): at S1 the 128-row padding added ~14% rows
        # for the memory-bound kernels to move (and the K of the K-grouped wgrads).
        if cfg.precision.quantized_wgrad:
            return max(cfg.block_m, WGRAD_BLOCK)
        if cfg.precision.quantized and not _cutlass_fp8(torch.device("cuda")):
            return cfg.block_m
        return GROUP_ALIGN

    # --------------------------------------------------------------------- shared experts

    def shared_forward(self, x, w1, w2, clamp):
        """The shared experts' MLP: bf16 GEMMs (fp32 accumulation) around the routed experts'
        SwiGLU kernel (fp32 math, one pass). The plain torch SwiGLU (expert_math) makes about
        ten fp32 passes over [T, 2I]: ~4.5 ms of casts and multiplies per DeepSeek-V3-proxy
        step (profiled 2026-11-30). Returns (out, pre-activation), as expert_math.shared_forward."""
        width, dt = w2.shape[1], x.dtype
        if not _swiglu_kernel_takes(x, width):
            return shared_forward(x, w1, w2, clamp, dt)
        h = x @ w1.to(dt).t()
        return self._shared_act(h, width, clamp, _all_rows(x.shape[0], x.device)) @ w2.to(dt).t(), h

    def shared_backward(self, x, w1, w2, h, clamp, grad_out):
        """(dx, dw1, dw2) of shared_forward, the SwiGLU backward by the routed experts' kernel."""
        width, dt = w2.shape[1], x.dtype
        if not _swiglu_kernel_takes(x, width):
            return shared_backward(x, w1, w2, h, clamp, grad_out, dt)
        T = x.shape[0]
        grad_out = grad_out.to(dt)
        grad_act = grad_out @ w2.to(dt)
        grad_h = torch.empty(T, 2 * width, dtype=dt, device=x.device)
        unused_row_grad = torch.empty(T, dtype=torch.float32, device=x.device)
        rows = _all_rows(T, x.device)
        K_.swiglu_backward(h, rows[0], grad_act, grad_h, unused_row_grad, rows[1], width, clamp)
        return grad_h @ w1.to(dt), grad_h.t() @ x, grad_out.t() @ self._shared_act(h, width, clamp, rows)

    @staticmethod
    def _shared_act(h, width, clamp, rows):
        # [gate | up] is the interleave with one chunk of the whole width; row weight 1 is exact
        act = torch.empty(h.shape[0], width, dtype=h.dtype, device=h.device)
        ones, num_rows = rows
        K_.swiglu_forward(h, ones, act, None, num_rows, width, clamp)
        return act

    # --------------------------------------------------------------------- plan and row movement

    def build_plan(self, buf: SymmBuffer, all_ok: torch.Tensor, align: int) -> Plan:
        # plan.py's tables on the device, from the ids where every source published them
        return triton_plan.build_plan_from_buffers(
            buf.peer_base_ptrs, buf.layout.regions["topk_idx"], all_ok, buf.rank, buf.num_local_experts, align
        )

    def store_routing(self, cfg, topk_idx, topk_weights, ids_out, weights_out) -> torch.Tensor:
        """The reference's store_routing in one kernel (the verdict raised by an atomic max)."""
        verdict = torch.full((), STATUS_OK, dtype=torch.int32, device=ids_out.device)
        K_.store_routing(topk_idx, topk_weights, ids_out, weights_out, verdict, STATUS_BAD, cfg.num_experts)
        return verdict

    def routing_masks(self, ids: torch.Tensor, all_ok: torch.Tensor, num_ranks: int, experts_per_rank: int):
        """The reference's routing_masks in one kernel (about ten small torch kernels there)."""
        return K_.routing_masks(ids, all_ok, num_ranks, experts_per_rank)

    def store_inputs(self, cfg, x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor | None):
        """The recipe's storage of the input rows (quant.quantize_act bit for bit) in one kernel."""
        if scales is None:
            data.copy_(x)
            return
        if x.shape[0] == 0:
            return
        num_rows = torch.full((1,), x.shape[0], dtype=torch.int32, device=x.device)
        if cfg.precision.mx:  # MXFP8, 1x32 ue8m0 scales, as the buffer's protocol stores it
            K_.quantize_rows_mx(x.contiguous(), data, scales, num_rows)
        else:
            K_.quantize_rows(x.contiguous(), data, scales, num_rows)

    def _pull(self, buf: SymmBuffer, name: str, plan: Plan, dtype: torch.dtype) -> torch.Tensor:
        region = buf.layout.regions[name]
        pool = torch.empty(plan.pool_rows, region.shape[-1], dtype=dtype, device=buf.device)
        K_.pull_expand(buf.peer_base_ptrs, region, pool, plan)
        return pool

    def pull_inputs(self, buf: SymmBuffer, plan: Plan) -> TritonPoolInputs:
        # one pass per received row: x, its scales (fp8) and its slots' topk weights
        cfg, recipe, regions = buf.config, buf.config.precision, buf.layout.regions
        P, dev = plan.pool_rows, buf.device
        x = torch.empty(P, cfg.hidden, dtype=recipe.act_storage_dtype(cfg.dtype), device=dev)
        # the scales as stored (the MX recipe's: ue8m0, folded below)
        x_scales = (
            torch.empty(P, regions["x_scales"].shape[-1], dtype=recipe.scale_storage_dtype, device=dev)
            if recipe.quantized
            else None
        )
        row_weights = torch.empty(P, dtype=torch.float32, device=dev)
        K_.pull_expand(
            buf.peer_base_ptrs,
            regions["x"],
            x,
            plan,
            scales_region=regions["x_scales"] if recipe.quantized else None,
            scales_pool=x_scales,
            weights_region=regions["topk_weights"],
            row_weights=row_weights,
        )
        if recipe.mx:  # the fp8 GEMMs' operand: the rows folded in place to 1x128 power-of-two scales
            folded = torch.empty(P, recipe.mma_scale_cols(cfg.hidden), dtype=torch.float32, device=dev)
            K_.fold_mx_rows(x, x_scales, folded, plan.num_rows)
            x_scales = folded
        return TritonPoolInputs(x, x_scales, row_weights)

    def pull_grad(self, buf: SymmBuffer, plan: Plan) -> TritonPoolGrad:
        cfg = buf.config
        if not cfg.precision.quantized_dgrad:
            return TritonPoolGrad(self._pull(buf, "grad_y", plan, cfg.dtype))
        P, H, dev = plan.pool_rows, cfg.hidden, buf.device
        grad = TritonPoolGrad(
            torch.empty(P, H, dtype=cfg.dtype, device=dev),
            torch.empty(P, H, dtype=torch.float8_e4m3fn, device=dev),
            torch.empty(P, H // 128, dtype=torch.float32, device=dev),
        )
        K_.pull_expand(
            buf.peer_base_ptrs,
            buf.layout.regions["grad_y"],
            grad.rows,
            plan,
            quant_pool=grad.q,
            quant_scales=grad.q_scales,
            quant_mx=cfg.precision.mx,
        )
        return grad

    def push_partials(self, buf: SymmBuffer, plan: Plan, rows: torch.Tensor, row_scalars: torch.Tensor | None = None):
        regions = buf.layout.regions
        scalar_region = regions["topk_weight_grads"] if row_scalars is not None else None
        K_.push_partials(buf.peer_base_ptrs, regions["partials"], rows, plan, buf.rank, scalar_region, row_scalars)

    def reduce_partials(self, buf: SymmBuffer, mask: torch.Tensor, T: int, has_shared: bool) -> torch.Tensor:
        return K_.reduce_partials(buf.regions().partials, mask, T, has_shared, buf.config.dtype)

    # --------------------------------------------------------------------- expert MLP

    def prepare_weights(self, cfg, weights: ExpertWeights) -> None:
        """Makes what experts_forward and experts_backward derive from the weights, by the same
        choice of path: the MX recipe's folded copies (mma_operands, mma_dgrad_operands; 1 byte a
        weight each) or the expanded GEMM's shifts and scales; fp8 and bf16 read what they store."""
        device = weights.w1.device
        _forward_weight_operands(cfg, weights, device)
        _backward_weight_operands(cfg, weights, device)

    def experts_forward(self, cfg, weights: ExpertWeights, plan: Plan, pool: TritonPoolInputs):
        recipe, align = cfg.precision, self.row_align(cfg)
        P, H, I, dev = plan.pool_rows, cfg.hidden, cfg.intermediate, pool.x.device
        act = torch.empty(P, I, dtype=recipe.act_storage_dtype(cfg.dtype), device=dev)
        act_scales = (
            torch.empty(P, recipe.mma_scale_cols(I), dtype=torch.float32, device=dev) if recipe.quantized else None
        )
        if _mx_expanded(cfg, dev):
            return self._mx_experts_forward(cfg, weights, plan, pool, act, act_scales)
        w1, w1_scales, w2, w2_scales = _forward_weight_operands(cfg, weights, dev)
        if recipe.quantized and _fused_fp8_forward(cfg, weights, dev):
            h = torch.empty(P, 2 * I, dtype=cfg.dtype, device=dev)
            cutlass_gemm.fp8_expert_gemm_swiglu(
                pool.x,
                pool.x_scales,
                weights.w1,
                weights.w1_scales,
                plan.expert_ends,
                pool.row_weights,
                weights.chunk,
                cfg.activation_clamp,
                h,
                act,
                act_scales,
            )
            out = torch.empty(P, H, dtype=cfg.dtype, device=dev)
            cutlass_gemm.fp8_expert_gemm(act, act_scales, weights.w2, weights.w2_scales, plan.expert_ends, out)
            return out, TritonExpertState(pool.x, pool.x_scales, pool.row_weights, h, act, act_scales)
        if recipe.quantized:
            h = torch.empty(P, 2 * I, dtype=cfg.dtype, device=dev)
            _fp8_grouped_gemm(pool.x, pool.x_scales, w1, w1_scales, plan, h, align)
        else:
            h = _bf16_grouped_gemm(pool.x, w1, plan, transposed=False)
        K_.swiglu_forward(
            h, pool.row_weights, act, act_scales, plan.num_rows, weights.chunk, cfg.activation_clamp, mx=recipe.mx
        )
        if recipe.quantized:
            out = torch.empty(P, H, dtype=cfg.dtype, device=dev)
            _fp8_grouped_gemm(act, act_scales, w2, w2_scales, plan, out, align)
        else:
            out = _bf16_grouped_gemm(act, w2, plan, transposed=False)
        return out, TritonExpertState(pool.x, pool.x_scales, pool.row_weights, h, act, act_scales)

    def _mx_experts_forward(self, cfg, weights: ExpertWeights, plan: Plan, pool: TritonPoolInputs, act, act_scales):
        """The MX recipe's expert MLP on the expert GEMM that reads E2M1 weights as stored."""
        P, H, I, dev = plan.pool_rows, cfg.hidden, cfg.intermediate, pool.x.device
        w1, w1_shifts, w1_scales, w2, w2_shifts, w2_scales = _forward_weight_operands(cfg, weights, dev)
        h = torch.empty(P, 2 * I, dtype=cfg.dtype, device=dev)
        cutlass_gemm.fp8_expert_gemm_mx(
            pool.x, pool.x_scales, w1, w1_shifts, w1_scales, plan.expert_ends, h, _MX_EXPANDED_VARIANT
        )
        clamp = cfg.activation_clamp
        K_.swiglu_forward(h, pool.row_weights, act, act_scales, plan.num_rows, weights.chunk, clamp, mx=True)
        out = torch.empty(P, H, dtype=cfg.dtype, device=dev)
        cutlass_gemm.fp8_expert_gemm_mx(
            act, act_scales, w2, w2_shifts, w2_scales, plan.expert_ends, out, _MX_EXPANDED_VARIANT
        )
        return out, TritonExpertState(pool.x, pool.x_scales, pool.row_weights, h, act, act_scales)

    def experts_backward(
        self,
        cfg,
        weights: ExpertWeights,
        plan: Plan,
        state: TritonExpertState,
        pool_grad: TritonPoolGrad,
        wgrad_targets=None,
    ):
        """pool_grad: pull_grad's; without its quantized rows (q None) a quantized dgrad quantizes them here."""
        recipe, align = cfg.precision, self.row_align(cfg)
        grad_rows = pool_grad.rows
        P, H, I, dev = plan.pool_rows, cfg.hidden, cfg.intermediate, grad_rows.device
        grad_h = torch.empty(P, 2 * I, dtype=cfg.dtype, device=dev)
        grad_row_w = torch.empty(P, dtype=torch.float32, device=dev)
        if recipe.quantized_dgrad:  # fp8 dgrads against the transposed quantized weights
            e4m3 = torch.float8_e4m3fn
            grad_q, grad_q_scales = pool_grad.q, pool_grad.q_scales
            if grad_q is None:
                grad_q = torch.empty(P, H, dtype=e4m3, device=dev)
                grad_q_scales = torch.empty(P, H // 128, dtype=torch.float32, device=dev)
                if recipe.mx:  # MXFP8, then folded in place for the fp8 MMA
                    mx_scales = torch.empty(P, H // 32, dtype=torch.uint8, device=dev)
                    K_.quantize_rows_mx(grad_rows, grad_q, mx_scales, plan.num_rows)
                    K_.fold_mx_rows(grad_q, mx_scales, grad_q_scales, plan.num_rows)
                else:
                    K_.quantize_rows(grad_rows, grad_q, grad_q_scales, plan.num_rows)
            grad_act = torch.empty(P, I, dtype=cfg.dtype, device=dev)
            _dgrad_gemm(cfg, weights, 2, grad_q, grad_q_scales, plan, grad_act, align)
            grad_h_q = torch.empty(P, 2 * I, dtype=e4m3, device=dev)
            grad_h_scales = torch.empty(P, 2 * I // 128, dtype=torch.float32, device=dev)
            K_.swiglu_backward(
                state.pre_act,
                state.row_weights,
                grad_act,
                grad_h,
                grad_row_w,
                plan.num_rows,
                weights.chunk,
                cfg.activation_clamp,
                grad_h_q,
                grad_h_scales,
                mx=recipe.mx,
            )
            grad_x_rows = torch.empty(P, H, dtype=cfg.dtype, device=dev)
            _dgrad_gemm(cfg, weights, 1, grad_h_q, grad_h_scales, plan, grad_x_rows, align)
        else:
            w1, w2 = _backward_weight_operands(cfg, weights, dev)  # bf16: the parameters themselves
            grad_act = _bf16_grouped_gemm(grad_rows, w2, plan, transposed=True)
            K_.swiglu_backward(
                state.pre_act,
                state.row_weights,
                grad_act,
                grad_h,
                grad_row_w,
                plan.num_rows,
                weights.chunk,
                cfg.activation_clamp,
            )
            grad_x_rows = _bf16_grouped_gemm(grad_h, w1, plan, transposed=True)
        target_w1, target_w2 = wgrad_targets if wgrad_targets is not None else (None, None)
        grad_w2 = _expert_wgrad(cfg, plan, grad_rows, state.act, state.act_scales, target_w2)
        grad_w1 = _expert_wgrad(cfg, plan, grad_h, state.pool_x, state.pool_x_scales, target_w1)
        return grad_x_rows, grad_row_w, grad_w1, grad_w2
