"""mega_moe: the differentiable fused MoE call, and its autograd function."""

from __future__ import annotations

import torch

from . import protocol
from .backends import resolve_backend
from .main_grad import overwrite_done, placeholder_grad, wgrad_targets
from .symm_buffer import SymmBuffer
from .validation import check_inputs
from .weights import ExpertWeights, transform_weights


def _leave(buffer: SymmBuffer, where: str, err: BaseException):
    """This rank raised before joining its next protocol call: mark the buffer failed so peers
    waiting in that call stop at once (protocol._guarded's rule) instead of timing out or
    pairing that call with this rank's next one."""
    call = buffer.call_state.call_count + 1
    buffer.fail(f"rank {buffer.rank} failed before call {call} ({where}): {type(err).__name__}: {err}", call * 4)


class MegaMoEFunction(torch.autograd.Function):
    """Forward and backward each run one pass of the protocol (protocol.py) over the buffer, with
    the executor that mega_moe picked."""

    @staticmethod
    def forward(
        ctx,
        x,
        topk_idx,
        topk_weights,
        w1,
        w2,
        shared_w1,
        shared_w2,
        buffer,
        executor,
        recv_stats,
        layer_id,
        fuse_wgrad_accumulation,
        prepared_weights,
    ):
        try:
            weights = prepared_weights if prepared_weights is not None else transform_weights(w1, w2, buffer.config)
        except BaseException as err:
            _leave(buffer, "the weight transform", err)
            raise
        shared = (shared_w1.detach(), shared_w2.detach()) if shared_w1 is not None else None
        y, saved = protocol.forward(
            executor, buffer, x.detach(), topk_idx, topk_weights.detach(), weights, shared, recv_stats, None, layer_id
        )
        ctx.buffer, ctx.executor, ctx.saved, ctx.weights, ctx.shared = buffer, executor, saved, weights, shared
        ctx.param_dtypes = (
            w1.dtype,
            w2.dtype,
            None if shared is None else shared_w1.dtype,
            None if shared is None else shared_w2.dtype,
        )
        ctx.fused_weights = (w1, w2) if fuse_wgrad_accumulation else None
        ctx.mark_non_differentiable(topk_idx)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        buffer = ctx.buffer
        fused = ctx.fused_weights
        try:
            grad_y = grad_y.to(buffer.config.dtype).contiguous()
            targets = None if fused is None else wgrad_targets(*fused)
        except BaseException as err:
            _leave(buffer, "the backward's preparation", err)
            raise
        grad_x, grad_tw, grad_w1, grad_w2, grad_sw1, grad_sw2 = protocol.backward(
            ctx.executor,
            buffer,
            ctx.saved,
            grad_y,
            ctx.weights,
            ctx.shared,
            wgrad_targets=targets,
        )
        dt_w1, dt_w2, dt_sw1, dt_sw2 = ctx.param_dtypes
        ctx.saved = ctx.fused_weights = None
        if fused is not None:  # in main_grad already: Megatron's convention for that
            overwrite_done(*fused)
            grad_w1, grad_w2 = (placeholder_grad(w) for w in fused)
        return (
            grad_x,
            None,
            grad_tw,
            grad_w1.to(dt_w1),
            grad_w2.to(dt_w2),
            None if grad_sw1 is None else grad_sw1.to(dt_sw1),
            None if grad_sw2 is None else grad_sw2.to(dt_sw2),
            None,
            None,
            None,
            None,
            None,
            None,
        )


def mega_moe(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    buffer: SymmBuffer,
    *,
    shared_w1: torch.Tensor | None = None,
    shared_w2: torch.Tensor | None = None,
    recv_stats: torch.Tensor | None = None,
    backend: str = "auto",
    layer_id: int = 0,
    fuse_wgrad_accumulation: bool = False,
    prepared_weights: ExpertWeights | None = None,
) -> torch.Tensor:
    """Expert-parallel MoE over the group of `buffer`: dispatch by pull, two expert GEMMs with
    SwiGLU, combine by push.

    x [T, H] (config.dtype), topk_idx [T, K] int64 global expert ids (-1 = masked slot),
    topk_weights [T, K] float32, w1 [E_local, 2I, H] (gate rows, then up rows), w2 [E_local, H, I]:
    this rank's experts [rank*E_local, (rank+1)*E_local). Returns
    y[t] = sum_k topk_weights[t,k] * expert_{topk_idx[t,k]}(x[t]) (+ shared experts(x[t])).
    Differentiable in x, topk_weights, w1, w2 and the shared weights. recv_stats (int64 [E_local])
    is increased by the rows each local expert received. Collective: every rank of the group calls
    it; bad input on any rank raises MegaMoEInputError on every rank.

    fuse_wgrad_accumulation (Megatron's and Transformer Engine's gradient-accumulation fusion):
    w1 and w2 carry a `main_grad` accumulator of their shape (Megatron DDP's, usually fp32); the
    backward adds the expert weight gradients into it (in the wgrad GEMM's epilogue on the GPU
    backend) and sets `grad_added_to_main_grad = True` on the weight, whose .grad is then a
    placeholder that Megatron's gradient hook discards. A weight flagged `overwrite_main_grad`
    gets its gradient written over main_grad instead (main_grad.py).

    prepared_weights: w1 and w2 already in the kernel layout of the buffer's recipe
    (`transform_weights` or `quantize_expert_weights` of them as they are now), for callers that
    manage the preparation themselves (graphs.py keeps one static copy per layer). Without it the
    call transforms w1 and w2 through the cache of `transform_weights`.
    """
    buffer.check_usable()  # first: after a device barrier's trap this names the rank and call, not a CUDA error
    executor = resolve_backend(backend, buffer)
    problem = check_inputs(
        buffer,
        x,
        topk_idx,
        topk_weights,
        w1,
        w2,
        shared_w1,
        shared_w2,
        recv_stats,
        check_ids=not executor.checks_ids_on_device,
        fuse_wgrad_accumulation=fuse_wgrad_accumulation,
        prepared_weights=prepared_weights,
    )
    if problem is not None:  # still take part in the status exchange so peers fail too
        protocol.forward(executor, buffer, None, None, None, None, None, None, problem, layer_id)
    return MegaMoEFunction.apply(
        x,
        topk_idx,
        topk_weights,
        w1,
        w2,
        shared_w1,
        shared_w2,
        buffer,
        executor,
        recv_stats,
        layer_id,
        fuse_wgrad_accumulation,
        prepared_weights,
    )
