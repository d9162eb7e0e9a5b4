"""The torch-native expert-parallel MoE a user would write today (the baseline of bench_layer.py).

    exchange per-expert counts (all_to_all_single) -> host sync for the split sizes
    -> permute (argsort by expert) -> all_to_all_single of token rows -> regroup by local expert
    -> grouped GEMM (torch._grouped_mm, int32 offs) -> SwiGLU -> grouped GEMM
    -> un-regroup -> all_to_all_single back -> weighted unpermute (index_add by token)

bf16: every step is an ordinary autograd op (the all_to_all through a small autograd Function),
so backward is whatever autograd makes of that composition.

fp8: rows are quantized to E4M3 with one fp32 scale per row *before* dispatch and travel in fp8
with their scales; both GEMMs are torch._scaled_grouped_mm with rowwise scales (weights quantized
once per output channel, outside the timed region); the L2 input is re-quantized per row.
Backward of the fp8 path runs bf16 grouped GEMMs on the dequantized forward operands
(straight-through for every quantization), inside one autograd Function.

On CPU (smoke mode only) torch._scaled_grouped_mm does not exist: it is emulated by dequantize +
bf16 grouped GEMM, and if torch._grouped_mm itself fails on CPU a per-expert loop replaces it.
Both are labeled in the benchmark output; neither is ever used on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0

# ----------------------------------------------------------------------------- grouped GEMMs

_CPU_GMM_OK: bool | None = None


def _cpu_grouped_mm_works() -> bool:
    global _CPU_GMM_OK
    if _CPU_GMM_OK is None:
        try:
            a = torch.randn(6, 16, dtype=torch.bfloat16, requires_grad=True)
            b = torch.randn(2, 16, 16, dtype=torch.bfloat16, requires_grad=True)
            y = torch._grouped_mm(a, b, offs=torch.tensor([2, 6], dtype=torch.int32))
            y.backward(torch.randn_like(y))
            _CPU_GMM_OK = True
        except Exception:
            _CPU_GMM_OK = False
    return _CPU_GMM_OK


def _loop_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """CPU-only fallback with torch._grouped_mm's meaning (2d x 3d and 2d x 2d with offs)."""
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    if b.dim() == 3:  # out[s:e] = a[s:e] @ b[g]
        return torch.cat([a[s:e] @ b[g] for g, (s, e) in enumerate(zip(starts, ends))], dim=0)
    return torch.stack([a[:, s:e] @ b[s:e] for s, e in zip(starts, ends)])  # offs along K


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if a.is_cuda or _cpu_grouped_mm_works():
        return torch._grouped_mm(a, b, offs=offs)
    return _loop_grouped_mm(a, b, offs)


def scaled_grouped_mm(a_q, b_q, scale_a, scale_b, offs) -> torch.Tensor:
    """a_q fp8 [M, K] row-major, scale_a fp32 [M]; b_q fp8 [G, K, N] column-major, scale_b fp32
    [G, N]; bf16 out [M, N]. CUDA: torch._scaled_grouped_mm; CPU: dequantize + grouped_mm."""
    if a_q.is_cuda:
        return torch._scaled_grouped_mm(a_q, b_q, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16)
    a = (a_q.float() * scale_a[:, None]).to(torch.bfloat16)
    b = (b_q.float() * scale_b[:, None, :]).to(torch.bfloat16)
    return grouped_mm(a, b, offs)


def gemm_impl_label(device: torch.device) -> str:
    if device.type == "cuda":
        return "torch._grouped_mm / torch._scaled_grouped_mm"
    gmm = "torch._grouped_mm (cpu)" if _cpu_grouped_mm_works() else "CPU per-expert loop (fallback)"
    return f"{gmm}; fp8 emulated on CPU (dequantize + bf16)"


# ----------------------------------------------------------------------------- quantization


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 with one fp32 scale per row (amax / 448) along the last dim."""
    t32 = t.float()
    scale = (t32.abs().amax(dim=-1) / FP8_MAX).clamp(min=1e-12)
    q = (t32 / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


@dataclass
class Fp8Weights:
    """Per-output-channel E4M3 weights, done once outside the timed region (ours caches its
    weight transform the same way)."""

    w1_q: torch.Tensor  # [E_local, 2I, H] fp8 (row-major; .transpose(-2,-1) is the column-major B)
    w1_s: torch.Tensor  # [E_local, 2I] fp32
    w2_q: torch.Tensor  # [E_local, H, I] fp8
    w2_s: torch.Tensor  # [E_local, H] fp32


def quantize_weights(w1: torch.Tensor, w2: torch.Tensor) -> Fp8Weights:
    with torch.no_grad():
        w1_q, w1_s = quantize_rows(w1)
        w2_q, w2_s = quantize_rows(w2)
    return Fp8Weights(w1_q, w1_s, w2_q, w2_s)


# ----------------------------------------------------------------------------- all-to-all


def _a2a(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """all_to_all_single of rows; any dtype travels as bytes (no reduction happens)."""
    assert x.dim() == 2, "rows of a 2-D tensor"
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), x.shape[1]))
    xb, ob = x.view(torch.uint8), out.view(torch.uint8)  # [rows, bytes per row]; fine with 0 rows
    dist.all_to_all_single(ob, xb, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group)
    return out


class AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.meta = (out_splits, in_splits, group)
        return _a2a(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits, group = ctx.meta
        return _a2a(grad, in_splits, out_splits, group), None, None, None


# ----------------------------------------------------------------------------- routing plan


@dataclass
class Plan:
    slot: torch.Tensor  # [n_send] flat (token*K + k) of each sent row, in send order (owner rank, expert)
    tok: torch.Tensor  # [n_send] its token
    send_splits: list[int]  # rows to each rank
    recv_splits: list[int]  # rows from each rank
    perm: torch.Tensor  # expert-major row i <- received row perm[i]
    inv: torch.Tensor  # received row j <- expert-major row inv[j]
    offs: torch.Tensor  # int32 [E_local] cumulative rows per local expert


def make_plan(topk_idx: torch.Tensor, num_experts: int, group) -> Plan:
    R = dist.get_world_size(group)
    E, K = num_experts, topk_idx.shape[1]
    El = E // R
    flat = topk_idx.reshape(-1)
    key = torch.where(flat >= 0, flat, E)  # masked slots sort last and are never sent
    order = torch.argsort(key, stable=True)
    # scatter_add, not bincount: bincount on CUDA syncs with the host to size its output
    counts = torch.zeros(E + 1, dtype=torch.int64, device=flat.device).scatter_add_(0, key, torch.ones_like(key))[:E]
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)  # [src rank, local expert]
    # the host sync every torch-native EP layer pays: split sizes must be Python ints
    splits = torch.cat([counts.view(R, El).sum(1), recv_counts.view(R, El).sum(1)]).tolist()
    send_splits, recv_splits = splits[:R], splits[R:]
    n_send, n_recv = sum(send_splits), sum(recv_splits)
    slot = order[:n_send]
    rc = recv_counts.view(R, El)
    expert_of_row = torch.repeat_interleave(
        torch.arange(El, device=flat.device).repeat(R), rc.reshape(-1), output_size=n_recv
    )
    perm = torch.argsort(expert_of_row, stable=True)
    inv = torch.empty_like(perm).scatter_(0, perm, torch.arange(n_recv, device=perm.device))
    offs = rc.sum(0).cumsum(0).to(torch.int32)
    return Plan(slot, torch.div(slot, K, rounding_mode="floor"), send_splits, recv_splits, perm, inv, offs)


def _weighted_unpermute(ys, topk_weights, plan: Plan, num_tokens: int) -> torch.Tensor:
    w = topk_weights.reshape(-1).index_select(0, plan.slot).to(ys.dtype)
    out = ys.new_zeros((num_tokens, ys.shape[1]))
    return out.index_add(0, plan.tok, ys * w.unsqueeze(-1))


# ----------------------------------------------------------------------------- bf16


def native_moe_bf16(x, topk_idx, topk_weights, w1, w2, num_experts: int, group) -> torch.Tensor:
    """x [T,H] bf16, w1 [E_local, 2I, H] ([gate; up]), w2 [E_local, H, I]; plain autograd."""
    plan = make_plan(topk_idx, num_experts, group)
    xs = x.index_select(0, plan.tok)
    xr = AllToAll.apply(xs, plan.recv_splits, plan.send_splits, group)
    xg = xr.index_select(0, plan.perm)
    h = grouped_mm(xg, w1.transpose(-2, -1), plan.offs)
    g, u = h.chunk(2, dim=-1)
    o = grouped_mm(F.silu(g) * u, w2.transpose(-2, -1), plan.offs)
    ys = AllToAll.apply(o.index_select(0, plan.inv), plan.send_splits, plan.recv_splits, group)
    return _weighted_unpermute(ys, topk_weights, plan, x.shape[0])


# ----------------------------------------------------------------------------- fp8


class _Fp8DispatchExpertsCombine(torch.autograd.Function):
    """fp8 forward (rows dispatched in E4M3 + per-row scales, _scaled_grouped_mm), bf16 backward."""

    @staticmethod
    def forward(ctx, x, w1, w2, plan: Plan, wq: Fp8Weights, group):
        xq, sx = quantize_rows(x)
        xs = xq.view(torch.uint8).index_select(0, plan.tok)
        ss = sx.index_select(0, plan.tok)
        xr = _a2a(xs, plan.recv_splits, plan.send_splits, group)
        sr = _a2a(ss.unsqueeze(-1), plan.recv_splits, plan.send_splits, group).squeeze(-1)
        xg = xr.index_select(0, plan.perm).view(FP8)
        sg = sr.index_select(0, plan.perm)
        h = scaled_grouped_mm(xg, wq.w1_q.transpose(-2, -1), sg, wq.w1_s, plan.offs)
        g, u = h.chunk(2, dim=-1)
        aq, sa = quantize_rows(F.silu(g) * u)
        o = scaled_grouped_mm(aq, wq.w2_q.transpose(-2, -1), sa, wq.w2_s, plan.offs)
        ys = _a2a(o.index_select(0, plan.inv), plan.send_splits, plan.recv_splits, group)
        ctx.save_for_backward(xg, sg, h, w1, w2)
        ctx.plan, ctx.group, ctx.num_tokens = plan, group, x.shape[0]
        return ys

    @staticmethod
    def backward(ctx, grad_ys):
        xg, sg, h, w1, w2 = ctx.saved_tensors
        plan, group = ctx.plan, ctx.group
        dr = _a2a(grad_ys.to(torch.bfloat16), plan.recv_splits, plan.send_splits, group)
        do = dr.index_select(0, plan.perm)
        g, u = (t.float() for t in h.chunk(2, dim=-1))
        sig = torch.sigmoid(g)
        a = (g * sig * u).to(torch.bfloat16)
        da = grouped_mm(do, w2, plan.offs).float()  # [N,H] x [E,H,I] -> [N,I]
        dw2 = grouped_mm(do.t(), a, plan.offs)  # [E,H,I]
        dg = da * u * sig * (1 + g * (1 - sig))
        du = da * g * sig
        dh = torch.cat([dg, du], dim=-1).to(torch.bfloat16)
        xd = (xg.float() * sg.unsqueeze(-1)).to(torch.bfloat16)
        dxg = grouped_mm(dh, w1, plan.offs)  # [N,2I] x [E,2I,H] -> [N,H]
        dw1 = grouped_mm(dh.t(), xd, plan.offs)  # [E,2I,H]
        dxs = _a2a(dxg.index_select(0, plan.inv), plan.send_splits, plan.recv_splits, group)
        dx = dxs.new_zeros((ctx.num_tokens, dxs.shape[1])).index_add_(0, plan.tok, dxs)
        return dx, dw1.to(w1.dtype), dw2.to(w2.dtype), None, None, None


def native_moe_fp8(x, topk_idx, topk_weights, w1, w2, wq: Fp8Weights, num_experts: int, group) -> torch.Tensor:
    plan = make_plan(topk_idx, num_experts, group)
    ys = _Fp8DispatchExpertsCombine.apply(x, w1, w2, plan, wq, group)
    return _weighted_unpermute(ys, topk_weights, plan, x.shape[0])
