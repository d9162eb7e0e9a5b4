"""Megatron's router top-k selections on the GPU in one Triton kernel per call, where Transformer
Engine's fused router (`moe_router_fusion`) is not installed.

Without Transformer Engine, megatron's router (`moe_utils.topk_routing_with_score_function`)
selects experts with torch.topk: group-limited routing runs three of them per call (top-2 per
group, top groups, top-k of the kept experts) plus a scatter, an expand and a masked fill, and the
sequence-wise aux loss (`compute_routing_scores_for_aux_loss`) a fourth. Each is a radix select
per row; together ~7.4 ms of a DeepSeek-V3 proxy step on an H200. `use_fused_router_topk()` makes
the selection one kernel per call and hands it to megatron, which still computes the
probabilities, their normalization, scaling, aux losses and gradients itself: only *which*
experts are chosen comes from here. For distinct scores that is the set torch.topk picks; on
exact ties the lower expert id wins (torch.topk leaves ties unspecified).

The kernel runs on CUDA tensors (and on CPU ones under TRITON_INTERPRET=1, for the tests);
elsewhere, for shapes it does not cover, or where megatron does not rank fp32 scores (softmax
without pre-softmax ranks the logits in moe_router_dtype: fp64 logits, and the bf16 / fp16 group
sums of group-limited routing), megatron's torch code runs unchanged. The MegaMoE layer's own
routing-map kernel stays in the adapter (`megatron_patch/routing.py`).
"""

from __future__ import annotations

import inspect

import torch

from megatron_patch.routing import MAX_EXPERTS, ROWS, kernels_run_on

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without triton: megatron's torch code runs
    triton = None

__all__ = [
    "select_topk",
    "use_fused_router_topk",
    "fused_router_topk_installed",
    "fused_topk_routing",
    "fused_aux_loss_scores",
]


if triton is not None:

    @triton.jit
    def _select_topk_kernel(
        scores,
        out,
        T,
        E,
        stride,
        K: tl.constexpr,
        EP: tl.constexpr,
        G: tl.constexpr,
        GK: tl.constexpr,
        M: tl.constexpr,
        ROWS: tl.constexpr,
    ):
        """out[t, :K] = the K largest of scores[t] (fp32 [T, E]), largest first; with G groups
        (G > 1, E = EP) only experts of the GK groups with the largest sum of their top M scores."""
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, EP)
        live = rows < T
        s = tl.load(
            scores + rows[:, None].to(tl.int64) * stride + cols[None, :],
            mask=live[:, None] & (cols[None, :] < E),
            other=float("-inf"),
        )
        if G > 1:
            EG: tl.constexpr = EP // G
            x = tl.reshape(s, [ROWS, G, EG])
            within = tl.arange(0, EG)
            group_score = tl.zeros([ROWS, G], dtype=tl.float32)
            for _ in tl.static_range(M):  # the group's top M, largest first (megatron sums them so)
                best = tl.argmax(x, axis=2)
                group_score += tl.max(x, axis=2)
                x = tl.where(within[None, None, :] == best[:, :, None], float("-inf"), x)
            groups = tl.arange(0, G)
            chosen = tl.zeros([ROWS, G], dtype=tl.int32)
            for _ in tl.static_range(GK):
                hit = groups[None, :] == tl.argmax(group_score, axis=1)[:, None]
                chosen = tl.where(hit, 1, chosen)
                group_score = tl.where(hit, float("-inf"), group_score)
            keep = tl.reshape(tl.broadcast_to(chosen[:, :, None], [ROWS, G, EG]), [ROWS, EP])
            s = tl.where(keep != 0, s, float("-inf"))
        for j in tl.static_range(K):
            best = tl.argmax(s, axis=1)  # ties: the lowest index
            tl.store(out + rows.to(tl.int64) * K + j, best.to(tl.int64), mask=live)
            s = tl.where(cols[None, :] == best[:, None], float("-inf"), s)


def select_topk(
    scores: torch.Tensor, topk: int, num_groups: int | None = None, group_topk: int | None = None
) -> torch.Tensor | None:
    """int64 [T, topk]: each row's topk largest scores' expert ids, largest first, with megatron's
    group-limited rule when group_topk is set (num_groups groups of E / num_groups experts; keep
    the group_topk groups whose top topk / group_topk scores sum highest). None where the kernel
    does not apply (not on the GPU, a shape it does not cover): then use torch."""
    if scores.dim() != 2 or not kernels_run_on(scores):
        return None
    T, E = scores.shape
    if E > MAX_EXPERTS or topk > E or scores.dtype != torch.float32 or scores.stride(1) != 1:
        return None
    EP = triton.next_power_of_2(E)
    G, GK, M = 1, 1, 1
    if group_topk:
        G, GK = int(num_groups), int(group_topk)
        # the kernel views a row as [G, E / G]: both powers of two; megatron's own requirements too
        if E != EP or E % G or G & (G - 1) or topk % GK or GK * (E // G) < topk:
            return None
        M = topk // GK
    out = torch.empty(T, topk, dtype=torch.int64, device=scores.device)
    if T:
        _select_topk_kernel[(triton.cdiv(T, ROWS),)](
            scores, out, T, E, scores.stride(0), K=topk, EP=EP, G=G, GK=GK, M=M, ROWS=ROWS, num_warps=4
        )
    return out


def _routing_scores(
    logits: torch.Tensor, score_function: str, use_pre_softmax: bool, expert_bias, grouped: bool = False
) -> torch.Tensor | None:
    """The fp32 scores megatron's top-k ranks the experts by (None: a score function not known
    here, or scores megatron does not rank in fp32)."""
    if score_function == "softmax":
        if use_pre_softmax:
            return torch.softmax(logits, dim=-1, dtype=torch.float32)
        # megatron ranks the logits themselves, in their own dtype: fp64 ones do not survive a cast
        # to fp32 (distinct logits can become equal), and with group-limited routing it sums each
        # group's top scores in that dtype (bf16 sums tie where fp32 ones do not)
        if logits.dtype == torch.float64 or (grouped and logits.dtype != torch.float32):
            return None
        return logits.float()
    if score_function == "sigmoid":
        scores = torch.sigmoid(logits.float())
    elif score_function == "sqrtsoftplus":
        scores = torch.nn.functional.softplus(logits.float()).sqrt()
    else:
        return None
    return scores + expert_bias.float() if expert_bias is not None else scores


def fused_topk_routing(original):
    """megatron's topk_routing_with_score_function with the selection from select_topk, passed
    in as its `precomputed_indices`."""
    signature = inspect.signature(original)

    def topk_routing_with_score_function(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        if not a["fused"] and a["precomputed_indices"] is None and a.get("router_replay") is None:
            with torch.no_grad():
                scores = _routing_scores(
                    a["logits"],
                    a["score_function"],
                    a["use_pre_softmax"],
                    a["expert_bias"],
                    grouped=bool(a["group_topk"]),
                )
                if scores is not None:
                    a["precomputed_indices"] = select_topk(scores, a["topk"], a["num_groups"], a["group_topk"])
        return original(*bound.args, **bound.kwargs)

    topk_routing_with_score_function.__doc__ = original.__doc__
    topk_routing_with_score_function.__wrapped_original__ = original
    return topk_routing_with_score_function


def fused_aux_loss_scores(original):
    """megatron's compute_routing_scores_for_aux_loss with the routing map from select_topk:
    megatron's own function is asked for its scores with topk = 0 (its top-k then selects
    nothing), and the map is scattered from the kernel's selection over those scores. Padding
    rows keep megatron's handling: their scores and map entries are zeroed after selection."""
    signature = inspect.signature(original)

    def compute_routing_scores_for_aux_loss(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        if a["fused"] or not kernels_run_on(a["logits"]):
            return original(*bound.args, **bound.kwargs)
        topk = a["topk"]
        a["topk"] = 0
        routing_map, scores = original(*bound.args, **bound.kwargs)
        idx = select_topk(scores.detach(), topk)
        if idx is None:
            a["topk"] = topk
            return original(*bound.args, **bound.kwargs)
        routing_map = torch.zeros_like(routing_map).scatter_(1, idx, True)
        if a.get("padding_mask") is not None:
            routing_map &= (~a["padding_mask"]).unsqueeze(-1)
        return routing_map, scores

    compute_routing_scores_for_aux_loss.__doc__ = original.__doc__
    compute_routing_scores_for_aux_loss.__wrapped_original__ = original
    return compute_routing_scores_for_aux_loss


_originals: dict = {}


def use_fused_router_topk() -> bool:
    """Route megatron's router top-k selections through select_topk (process-global, idempotent;
    CUDA tensors only, everything else runs megatron's code). False if this megatron's router
    functions lack the arguments relied on (`precomputed_indices`, aux-loss `topk`)."""
    from megatron.core.transformer.moe import router

    if _originals:
        return True
    routing, aux = router.topk_routing_with_score_function, router.compute_routing_scores_for_aux_loss
    if "precomputed_indices" not in inspect.signature(routing).parameters or not {"logits", "topk", "fused"} <= set(
        inspect.signature(aux).parameters
    ):
        return False
    _originals.update(routing=routing, aux=aux)
    router.topk_routing_with_score_function = fused_topk_routing(routing)
    router.compute_routing_scores_for_aux_loss = fused_aux_loss_scores(aux)
    return True


def fused_router_topk_installed() -> bool:
    return bool(_originals)
