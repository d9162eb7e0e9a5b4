"""Layer benchmark: MegaMoE-Train's mega_moe vs the torch-native EP MoE vs the hardware floor.

LAUNCH (self-spawn; one process per GPU, NCCL; no torchrun needed):

    python benchmarks/bench_layer.py                      # all GPUs, S1-S3, uniform+skewed, bf16+fp8
    python benchmarks/bench_layer.py --nproc 1            # one GPU
    python benchmarks/bench_layer.py --tiny               # CPU smoke run: gloo, 2 processes, tiny shape

The script spawns --nproc processes itself (default: every visible GPU, or 2 on CPU). It also
works under `torchrun --nproc-per-node=N benchmarks/bench_layer.py ...` (detected by the RANK
environment variable); the self-spawn form is the documented one.

Per (shape, routing, recipe) case it times, on the same inputs, each rank with the same seed:
  ours      mega_moe(x, topk_idx, topk_weights, w1, w2, buffer, backend=--backend)
  native    the torch-native EP MoE of benchmarks/native_moe.py (all_to_all_single with the
            split sizes exchanged first, argsort permute, torch._grouped_mm / _scaled_grouped_mm,
            weighted unpermute, all_to_all_single back); fp8 backward uses bf16 grouped GEMMs
  megatron  Megatron-core MoELayer: only reported as skipped (megatron.core is not installed
            on the GPU machines)
  floor     max(GEMM FLOPs / dense GEMM rate, NVLink bytes / NVLink rate), per rank, max over
            ranks, with the rates measured at the start of the same run; NVLink bytes count one
            row per unique (token, destination GPU), the physical minimum; with --main-grad
            (and --graphed) forward+backward is at least the fp32 main_grads' read and write
            (8 bytes per local expert parameter) at the HBM rate
each for the forward (training forward, autograd enabled) and forward+backward; with --graphed,
ours replayed from CUDA graphs as the trainer runs it (forward+backward only). Timing: CUDA
events around every iteration, warmup, median, reported as the max over ranks; barriers between
phases. Once per case, y (and dx, d topk_weights for fwd+bwd) of ours and native are compared.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import statistics
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
for _p in (_ROOT, _HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import native_moe  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

SHAPES = {
    # name: (E, K, H, I, T tokens per GPU)
    "S1": (256, 6, 4096, 2048, 8192),
    "S2": (128, 8, 2048, 768, 16384),
    "S3": (8, 2, 4096, 14336, 8192),
    "S4": (256, 8, 7168, 2048, 4096),  # DeepSeek-V3's expert width
    "P": (256, 8, 2048, 512, 8192),  # recipes/deepseek_v3_proxy_*: the MoE layer of the training benchmark
    "tiny": (8, 2, 256, 128, 64),
}

# The torch-native baseline of each recipe: torch has no e2m1 grouped GEMM on Hopper, so the
# 4-bit-weight recipe and the fp8-wgrad recipe are measured against the fp8 torch-native path.
NATIVE_RECIPE = {"bf16": "bf16", "fp8": "fp8", "fp8_e4m3_wgrad": "fp8", "mxfp8_mxfp4": "fp8"}

# relative error of y, dx or d(topk weights) above which a case is flagged MISMATCH: ours vs native
# (fp8: the two paths quantize differently, 1x128/128x128 blocks vs rows, ~6% each from bf16;
# mxfp8_mxfp4: e2m1 weights with 1x32 power-of-two scales, one mantissa bit; on 2026-12-03 its y,
# dx and d(topk weights) were 0.21-0.22 from native fp8's and y 0.21 from bf16's, --tiny on CPU),
# and for quantized recipes also ours' y vs the bf16 torch-native path
TOL = {"bf16": 2e-2, "fp8": 1.5e-1, "fp8_e4m3_wgrad": 1.5e-1, "mxfp8_mxfp4": 3e-1}
TOL_VS_BF16 = {"fp8": 1e-1, "fp8_e4m3_wgrad": 1e-1, "mxfp8_mxfp4": 3e-1}


# ----------------------------------------------------------------------------- helpers


def log(rank, *a):
    if rank == 0:
        print(*a, flush=True)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def allreduce_max(v: float, device) -> float:
    t = torch.tensor([float(v)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def rel_err(a: torch.Tensor, b: torch.Tensor, device) -> float:
    """||a - b|| / ||b|| over all ranks."""
    t = torch.stack([(a.float() - b.float()).pow(2).sum(), b.float().pow(2).sum()]).double().to(device)
    dist.all_reduce(t)
    return math.sqrt(t[0].item() / max(t[1].item(), 1e-300))


def free_memory(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench(fn, device, warmup: int, iters: int, budget_s: float, min_iters: int = 3) -> dict:
    """Median ms of fn over ranks (max over ranks). The iteration count is agreed by all ranks
    (fn is collective): iters, cut down so that it takes about budget_s."""
    for _ in range(warmup):
        fn()
    sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    sync(device)
    est = allreduce_max(time.perf_counter() - t0, device)
    n = max(min_iters, min(iters, int(budget_s / max(est, 1e-6))))
    times = []
    if device.type == "cuda":
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for s, e in ev:
            s.record()
            fn()
            e.record()
        sync(device)
        times = [s.elapsed_time(e) for s, e in ev]
    else:
        for _ in range(n):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    med = statistics.median(times)
    out = {"ms": allreduce_max(med, device), "iters": n, "min_ms": allreduce_max(min(times), device)}
    dist.barrier()
    return out


def case_agrees(check: dict, recipe: str) -> bool:
    """Ours and torch-native agree: y, dx and d(topk weights) each within the recipe's tolerance
    (every case runs a backward in its check, so a wrong backward is flagged too, not only a wrong
    forward), and for quantized recipes ours' y within TOL_VS_BF16 of the bf16 torch-native path."""
    errs = [check[k] for k in ("err_y", "err_dx", "err_dtw")]
    return all(e <= TOL[recipe] for e in errs) and check.get("err_y_ours_vs_bf16", 0) <= TOL_VS_BF16.get(recipe, 0)


def agreed_ok(ok: bool, device) -> bool:
    """Every rank learns whether all ranks succeeded (so no rank runs a collective alone)."""
    return allreduce_max(0.0 if ok else 1.0, device) == 0.0


# ----------------------------------------------------------------------------- floor rates


def measure_floor_rates(rank, world, device, args) -> dict:
    rates = {"gemm_bf16_tflops": None, "gemm_fp8_tflops": None, "nvlink_gbps": None, "hbm_gbps": None}
    if device.type != "cuda":
        log(rank, "floor: skipped on CPU (needs CUDA)")
        return rates
    n = 8192
    flops = 2.0 * n * n * n
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    r = bench(lambda: torch.mm(a, b), device, 3, 20, 1.0)
    rates["gemm_bf16_tflops"] = flops / (r["ms"] * 1e-3) / 1e12
    try:
        aq = a.to(native_moe.FP8)
        bq = b.to(native_moe.FP8).t()  # column-major B
        sa = torch.rand(n, 1, device=device) + 0.5
        sb = torch.rand(1, n, device=device) + 0.5
        r = bench(
            lambda: torch._scaled_mm(aq, bq, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16), device, 3, 20, 1.0
        )
        rates["gemm_fp8_tflops"] = flops / (r["ms"] * 1e-3) / 1e12
        del aq, bq, sa, sb
    except Exception as e:  # noqa: BLE001
        log(rank, f"floor: fp8 _scaled_mm failed: {type(e).__name__}: {e}")
    del a, b
    # HBM: local copy, read + write
    nbytes = 1 << 30
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    r = bench(lambda: dst.copy_(src), device, 3, 20, 1.0)
    rates["hbm_gbps"] = 2 * nbytes / (r["ms"] * 1e-3) / 1e9
    del src, dst
    # NVLink: every rank pulls a 1 GiB buffer from the next rank at the same time
    if world > 1:
        from torch.distributed import _symmetric_memory as symm_mem

        group_name = dist.group.WORLD.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(group_name)
        nbytes = 1 << 30
        local = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        local.fill_(rank % 251)
        handle = symm_mem.rendezvous(local, group_name)
        peer = (rank + 1) % world
        remote = handle.get_buffer(peer, (nbytes,), torch.uint8, 0)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        sync(device)
        dist.barrier()

        times = []
        for i in range(3 + 10):
            handle.barrier(channel=0)  # both GPUs start their pulls together; not timed
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            dst.copy_(remote)
            e.record()
            if i >= 3:
                times.append((s, e))
        sync(device)
        ms = allreduce_max(statistics.median(s.elapsed_time(e) for s, e in times), device)
        assert int(dst[0].item()) == peer % 251 and int(dst[-1].item()) == peer % 251, "peer copy read wrong data"
        rates["nvlink_gbps"] = nbytes / (ms * 1e-3) / 1e9
        handle.barrier(channel=0)
        sync(device)
        dist.barrier()
        del remote, dst, handle, local
    free_memory(device)
    return rates


# ----------------------------------------------------------------------------- inputs


def make_routing(T, E, K, kind, seed, rank, device, zipf_s):
    g_tok = torch.Generator(device=device).manual_seed(seed * 7919 + rank)
    if kind == "uniform":
        scores = torch.rand(T, E, generator=g_tok, device=device)
    elif kind == "skewed":
        # Zipf-like popularity p_e ~ 1/(1+r_e)^s, the hot experts the same on every rank (common
        # seed), sampled without replacement by Gumbel top-k
        g_common = torch.Generator(device="cpu").manual_seed(seed * 104729 + 17)
        popularity_rank = torch.randperm(E, generator=g_common).to(device)
        logp = -zipf_s * torch.log1p(popularity_rank.float())
        u = torch.rand(T, E, generator=g_tok, device=device).clamp_(1e-9, 1 - 1e-9)
        scores = logp - torch.log(-torch.log(u))
    else:
        raise ValueError(f"routing: unknown {kind!r}")
    idx = scores.topk(K, dim=-1).indices.to(torch.int64)
    weights = torch.softmax(torch.randn(T, K, generator=g_tok, device=device), dim=-1).float()
    return idx, weights


def make_case_tensors(E, K, H, I, T, world, rank, routing, seed, device, zipf_s):
    El = E // world
    g = torch.Generator(device=device).manual_seed(seed * 31 + 1000 * rank + 5)
    dt = torch.bfloat16
    x = torch.randn(T, H, generator=g, device=device, dtype=dt)
    w1 = (torch.randn(El, 2 * I, H, generator=g, device=device, dtype=dt) / math.sqrt(H)).requires_grad_()
    w2 = (torch.randn(El, H, I, generator=g, device=device, dtype=dt) / math.sqrt(I)).requires_grad_()
    grad_y = torch.randn(T, H, generator=g, device=device, dtype=dt)
    idx, tw = make_routing(T, E, K, routing, seed, rank, device, zipf_s)
    return x, idx, tw, w1, w2, grad_y


def routing_stats(idx, E, world, device) -> dict:
    """What each rank computes and moves, gathered on every rank: GEMM rows per (source rank,
    expert), and link rows as unique (token, destination rank) pairs: a token crosses to an
    owner GPU once however many of its experts live there (the physical minimum of dispatch
    and combine traffic)."""
    flat = idx.reshape(-1)
    counts = torch.bincount(flat[flat >= 0], minlength=E).to(torch.int64)
    allc = [torch.empty_like(counts) for _ in range(world)]
    dist.all_gather(allc, counts)
    C = torch.stack(allc).cpu()  # [src, expert]
    El = E // world
    owner = torch.where(idx >= 0, idx // El, world)
    dest = torch.zeros(idx.shape[0], world + 1, dtype=torch.bool, device=idx.device).scatter_(1, owner, True)[:, :world]
    pairs = dest.sum(0).to(torch.int64)  # [owner]: this rank's tokens with a slot there
    allp = [torch.empty_like(pairs) for _ in range(world)]
    dist.all_gather(allp, pairs)
    U = torch.stack(allp).cpu()  # [src, owner] unique (token, owner) pairs
    per_rank = []
    for r in range(world):
        own = slice(r * El, (r + 1) * El)
        recv = int(C[:, own].sum())
        per_rank.append(
            dict(recv_rows=recv, dispatch_in=int(U[:, r].sum() - U[r, r]), combine_in=int(U[r].sum() - U[r, r]))
        )
    load = C.sum(0).float()
    return dict(
        per_rank=per_rank,
        rows_total=int(C.sum()),
        link_rows_total=int(U.sum() - U.diagonal().sum()),
        expert_max_over_mean=float(load.max() / load.mean().clamp(min=1e-9)),
        rank_max_over_mean=float(
            max(p["recv_rows"] for p in per_rank) / max(1e-9, sum(p["recv_rows"] for p in per_rank) / world)
        ),
    )


def floor_ms(stats, H, I, recipe, rates, main_grad_params: int = 0) -> tuple[float | None, float | None, dict]:
    """(fwd floor, fwd+bwd floor) in ms: over ranks, the max of max(GEMM time, NVLink time),
    i.e. perfect overlap of communication and compute on the busiest rank.
    GEMM: the FLOPs of the rows that rank's experts got, each GEMM pair at the dense 8192^3 rate
    of the format the recipe runs it in (precision.PrecisionRecipe): the forward's L1 and L2 at
    the fp8 rate where activations are quantized (Hopper runs e2m1 weights as e4m3 MMAs), the two
    dgrads at the fp8 rate where the recipe quantizes the gradient, the two wgrads where it
    quantizes their operands; bf16 otherwise.
    NVLink: the bytes of the busier direction of that GPU's link, at the peer-copy rate, counting
    one row per unique (token, destination rank), the physical minimum (a token's experts on one
    GPU share its row). Forward: dispatch rows in the activation format, combine rows in bf16;
    backward: dY rows (dispatch direction) and dX rows (combine direction), both bf16.
    main_grad_params (--main-grad, --graphed): a rank's expert parameters whose weight gradients the
    backward adds into fp32 main_grads, each read and written once (8 bytes) at the HBM rate: the
    forward+backward floor is at least that, overlapped with the GEMMs at best."""
    from megamoe_train.precision import get_recipe

    spec = get_recipe(recipe)
    bf16, fp8 = rates["gemm_bf16_tflops"], rates["gemm_fp8_tflops"]
    fwd_rate = fp8 if spec.quantized else bf16
    dgrad_rate = fp8 if spec.quantized_dgrad else bf16
    wgrad_rate = fp8 if spec.quantized_wgrad else bf16
    if None in (fwd_rate, dgrad_rate, wgrad_rate):
        return None, None, {}
    nvl = rates["nvlink_gbps"]
    act_bytes = 1 if spec.quantized else 2
    gemm_fwd = gemm_all = link_fwd = link_all = 0.0  # ms, max over ranks
    f_fwd = f_all = 0.0
    for p in stats["per_rank"]:
        flops = 2.0 * p["recv_rows"] * H * 2 * I + 2.0 * p["recv_rows"] * I * H  # one pass: L1 + L2
        g = flops / (fwd_rate * 1e12) * 1e3
        g_all = g + flops / (dgrad_rate * 1e12) * 1e3 + flops / (wgrad_rate * 1e12) * 1e3
        d_in, c_in = p["dispatch_in"], p["combine_in"]  # rows arriving at this GPU in each phase
        fwd_bytes = max(d_in * H * act_bytes + c_in * H * 2, c_in * H * act_bytes + d_in * H * 2)
        bwd_bytes = (d_in + c_in) * H * 2
        lf = fwd_bytes / (nvl * 1e9) * 1e3 if nvl else 0.0
        la = (fwd_bytes + bwd_bytes) / (nvl * 1e9) * 1e3 if nvl else 0.0
        gemm_fwd, gemm_all = max(gemm_fwd, g), max(gemm_all, g_all)
        link_fwd, link_all = max(link_fwd, lf), max(link_all, la)
        f_fwd, f_all = max(f_fwd, g, lf), max(f_all, g_all, la)
    detail = dict(gemm_fwd_ms=gemm_fwd, gemm_fwdbwd_ms=gemm_all, nvlink_fwd_ms=link_fwd, nvlink_fwdbwd_ms=link_all)
    if main_grad_params:
        if not rates.get("hbm_gbps"):
            return f_fwd, None, detail
        detail["main_grad_ms"] = 8.0 * main_grad_params / (rates["hbm_gbps"] * 1e9) * 1e3
        f_all = max(f_all, detail["main_grad_ms"])
    return f_fwd, f_all, detail


# ----------------------------------------------------------------------------- one case


def run_case(rank, world, device, args, shape_name, routing, recipe, rates) -> list[dict]:
    from megamoe_train import MegaMoEConfig, get_symm_buffer, mega_moe
    from megamoe_train.backends import resolve_backend
    from megamoe_train.weights import clear_weight_cache, transform_weights

    E, K, H, I, T = SHAPES[shape_name]
    group = dist.group.WORLD
    t_case = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    x, idx, tw, w1, w2, grad_y = make_case_tensors(E, K, H, I, T, world, rank, routing, args.seed, device, args.zipf)
    stats = routing_stats(idx, E, world, device)
    log(
        rank,
        f"  rows routed {stats['rows_total']}, rows crossing GPUs (unique token x destination) "
        f"{stats['link_rows_total']}, busiest expert {stats['expert_max_over_mean']:.2f}x mean, "
        f"busiest rank {stats['rank_max_over_mean']:.2f}x mean",
    )
    # --main-grad: every local expert's L1 [2I, H] and L2 [H, I] weight gradients added into fp32
    main_grad_params = (E // world) * 3 * H * I if args.main_grad else 0
    f_fwd, f_all, f_detail = floor_ms(stats, H, I, recipe, rates, main_grad_params)
    cfg = MegaMoEConfig(num_experts=E, hidden=H, intermediate=I, topk=K, num_max_tokens_per_rank=T, recipe=recipe)
    buf = get_symm_buffer(group, cfg, device=device)
    log(rank, f"  symmetric buffer per rank: {buf.nbytes / 1e6:.1f} MB")
    try:  # the name the backend resolves to, for the record
        backend_name = resolve_backend(args.backend, buf).name
    except Exception:  # noqa: BLE001
        backend_name = args.backend
    native_recipe = NATIVE_RECIPE[recipe]
    wq = native_moe.quantize_weights(w1.detach(), w2.detach()) if native_recipe == "fp8" else None

    if args.main_grad:  # as the trainer runs it: the expert wgrads added into fp32 main_grads by the GEMMs
        for w in (w1, w2):
            w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=device)
    graphed = None
    if args.graphed:  # as the trainer runs it: captured at the first call, replayed after
        from megamoe_train.graphs import GraphedMegaMoE

        graphed = GraphedMegaMoE(buf, w1, w2, backend=args.backend or "auto", fuse_wgrad_accumulation=True)

        def ours_fwd(xx, ww):
            return graphed(xx, idx, ww)

    else:

        def ours_fwd(xx, ww):
            return mega_moe(xx, idx, ww, w1, w2, buf, backend=args.backend, fuse_wgrad_accumulation=args.main_grad)

    def native_fwd(xx, ww):
        if native_recipe == "fp8":
            return native_moe.native_moe_fp8(xx, idx, ww, w1, w2, wq, E, group)
        return native_moe.native_moe_bf16(xx, idx, ww, w1, w2, E, group)

    x_leaf = x.detach().requires_grad_()
    tw_leaf = tw.detach().requires_grad_()
    leaves = (x_leaf, tw_leaf, w1, w2)

    def clear_grads():
        for t in leaves:
            t.grad = None

    def fwd_only(f):
        def step():
            f(x_leaf, tw_leaf)  # training forward (autograd on), output dropped

        return step

    def fwd_bwd(f):
        def step():
            clear_grads()
            y = f(x_leaf, tw_leaf)
            y.backward(grad_y)

        return step

    # ---- correctness, once per case; an implementation that fails here is not timed
    def run_once(f):
        clear_grads()
        y = f(x_leaf, tw_leaf)
        y.backward(grad_y)
        out = (y.detach(), x_leaf.grad, tw_leaf.grad)
        clear_grads()
        return out

    check, results, usable = {}, {}, {}
    for impl, f in (("ours", ours_fwd), ("native", native_fwd)):
        good = True
        try:
            results[impl] = run_once(f)
        except Exception as e:  # noqa: BLE001
            good = False
            check[f"error_{impl}"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"[rank {rank}] {impl} failed in the check: {check[f'error_{impl}']}", flush=True)
        usable[impl] = agreed_ok(good, device)
        free_memory(device)
    if usable["ours"] and usable["native"]:
        go, gn = results["ours"], results["native"]
        check.update(
            err_y=rel_err(go[0], gn[0], device),
            err_dx=rel_err(go[1], gn[1], device),
            err_dtw=rel_err(go[2], gn[2], device),
        )
        if recipe != "bf16":  # both quantized paths against the bf16 torch-native path
            with torch.no_grad():
                y_ref = native_moe.native_moe_bf16(x, idx, tw, w1, w2, E, group)
            check["err_y_ours_vs_bf16"] = rel_err(go[0], y_ref, device)
            check["err_y_native_vs_bf16"] = rel_err(gn[0], y_ref, device)
            del y_ref
        del go, gn
    results.clear()
    if usable["ours"] and usable["native"]:
        agree = case_agrees(check, recipe)
        verdict = "ok" if agree else "MISMATCH"
    else:
        verdict = "ERROR (" + ", ".join(k for k, v in usable.items() if not v) + ")"
    free_memory(device)

    rows = []
    # a graphed layer's forward must be followed by its backward before its next forward
    for phase in [ph for ph in args.phases if not (args.graphed and ph == "fwd")]:
        res = {}
        for impl, f in (("ours", ours_fwd), ("native", native_fwd)):
            if not usable[impl]:
                res[impl] = {"error": "failed in the correctness check; not timed"}
                continue
            step = fwd_only(f) if phase == "fwd" else fwd_bwd(f)
            good = True
            try:
                r = bench(step, device, args.warmup, args.iters, args.budget_s)
            except Exception as e:  # noqa: BLE001
                good = False
                r = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                print(f"[rank {rank}] {impl} {phase} failed: {r['error']}", flush=True)
            if not agreed_ok(good, device):
                usable[impl] = False  # do not run it again in this case
                if good:
                    r = {"error": "failed on another rank"}
            res[impl] = r
            clear_grads()
            free_memory(device)
        fl = f_fwd if phase == "fwd" else f_all
        o_ms, n_ms = res["ours"].get("ms"), res["native"].get("ms")
        rows.append(
            dict(
                shape=shape_name,
                E=E,
                K=K,
                H=H,
                I=I,
                T=T,
                routing=routing,
                recipe=recipe + (", graphed" if args.graphed else ", main_grad" if args.main_grad else ""),
                phase=phase,
                ours_ms=o_ms,
                native_ms=n_ms,
                floor_ms=fl,
                native_over_ours=(n_ms / o_ms) if o_ms and n_ms else None,
                ours_over_floor=(o_ms / fl) if o_ms and fl else None,
                native_over_floor=(n_ms / fl) if n_ms and fl else None,
                iters=dict(ours=res["ours"].get("iters"), native=res["native"].get("iters")),
                errors={k: v["error"] for k, v in res.items() if "error" in v},
                check=check,
                verdict=verdict,
                backend=backend_name,
                routing_stats={k: v for k, v in stats.items() if k != "per_rank"} | {"per_rank": stats["per_rank"]},
                floor_detail=f_detail,
            )
        )
        log(rank, "  " + fmt_row(rows[-1]))
    peak_gb = allreduce_max(torch.cuda.max_memory_allocated(device) / 1e9, device) if device.type == "cuda" else None
    wall_s = allreduce_max(time.perf_counter() - t_case, device)
    # the rank's expert weights as the kernels read them, every operand derived so far included
    prepared = graphed.prepared_weights if graphed is not None else None  # the graphs' own static copy
    prepared = prepared or transform_weights(w1, w2, cfg)
    weight_mb = allreduce_max(prepared.resident_bytes() / 1e6, device)
    for r in rows:
        r.update(peak_mem_gb=peak_gb, case_wall_s=wall_s, expert_weight_mb=weight_mb)
    log(
        rank,
        f"  case wall {wall_s:.1f} s, peak memory {fmt(peak_gb, '.1f')} GB, expert weights as the kernels "
        f"read them {weight_mb:.1f} MB (max over ranks)",
    )
    del x, idx, tw, w1, w2, grad_y, x_leaf, tw_leaf, wq, leaves, graphed, prepared
    buf.destroy()
    clear_weight_cache()
    free_memory(device)
    return rows


# ----------------------------------------------------------------------------- output


def fmt(v, spec=".3f"):
    return "n/a" if v is None else format(v, spec)


def fmt_row(r) -> str:
    c = r["check"]
    err = f"err y {fmt(c.get('err_y'), '.2e')}"
    if r["phase"] != "fwd":
        err += f" dx {fmt(c.get('err_dx'), '.2e')} dtw {fmt(c.get('err_dtw'), '.2e')}"
    if "err_y_ours_vs_bf16" in c:
        err += f" | vs bf16: ours {c['err_y_ours_vs_bf16']:.2e} native {c['err_y_native_vs_bf16']:.2e}"
    extra = f" errors={r['errors']}" if r["errors"] else ""
    return (
        f"{r['shape']:<5} {r['routing']:<8} {r['recipe']:<5} {r['phase']:<7} floor {fmt(r['floor_ms']):>8} ms | "
        f"ours {fmt(r['ours_ms']):>9} ms | native {fmt(r['native_ms']):>9} ms | "
        f"ours/floor {fmt(r['ours_over_floor'], '.2f'):>6} | "
        f"native/ours {fmt(r['native_over_ours'], '.2f'):>6} | {err} [{r['verdict']}]{extra}"
    )


MD_HEADER = (
    "| date | machine | shape | routing | recipe | phase | ours ms | torch-native ms | ratio (native/ours) | "
    "floor ms | ours/floor | expert weights MB |\n"
    "| --- | --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"
)


def md_rows(result) -> list[str]:
    lines = []
    for r in result["cases"]:
        lines.append(
            f"| {result['date'][:10]} | {result['machine']} | "
            f"{r['shape']} (E{r['E']} k{r['K']} H{r['H']} I{r['I']} T{r['T']}) | "
            f"{r['routing']} | {r['recipe']} | {'fwd' if r['phase'] == 'fwd' else 'fwd+bwd'} | {fmt(r['ours_ms'])} | "
            f"{fmt(r['native_ms'])} | {fmt(r['native_over_ours'], '.2f')} | {fmt(r['floor_ms'])} | "
            f"{fmt(r['ours_over_floor'], '.2f')} | {fmt(r.get('expert_weight_mb'), '.1f')} |"
        )
    return lines


def write_results(result, path):
    if path.endswith(".md"):
        with open(path, "w") as f:
            f.write(f"# bench_layer {result['date']} on {result['machine']}\n\n")
            f.write(f"floor rates: {json.dumps(result['floor_rates'])}\n\n")
            f.write(MD_HEADER + "\n" + "\n".join(md_rows(result)) + "\n")
    else:
        with open(path, "w") as f:
            json.dump(result, f, indent=1, default=str)


# ----------------------------------------------------------------------------- main


def worker(rank, world, args):
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        machine = f"{world}x {name}"
    else:
        machine = f"cpu x{world} (gloo)"
    shapes = ["tiny"] if args.tiny else args.shapes
    log(
        rank,
        f"bench_layer: {machine}, torch {torch.__version__}, backend={args.backend}, shapes={shapes}, "
        f"routing={args.routing}, recipes={args.recipes}, phases={args.phases}",
    )
    log(
        rank,
        f"native GEMMs: {native_moe.gemm_impl_label(device)}; native fp8 backward: bf16 grouped GEMMs "
        "(dequantized forward operands, straight-through)",
    )
    log(
        rank,
        "weights: ours caches its weight transform, native fp8 quantizes weights once; both outside the timed region",
    )
    try:
        import megatron.core  # noqa: F401

        log(
            rank,
            "megatron: megatron.core is importable but its MoELayer benchmark is not wired into this script; skipped",
        )
    except Exception:  # noqa: BLE001
        log(rank, "megatron: megatron.core not importable; Megatron-core MoELayer (alltoall dispatcher) skipped")

    rates = (
        measure_floor_rates(rank, world, device, args)
        if not args.no_floor
        else dict.fromkeys(("gemm_bf16_tflops", "gemm_fp8_tflops", "nvlink_gbps", "hbm_gbps"))
    )
    log(rank, "floor rates: " + ", ".join(f"{k}={fmt(v, '.1f')}" for k, v in rates.items()))

    cases = []
    for shape in shapes:
        E = SHAPES[shape][0]
        if E % world:
            log(rank, f"{shape}: E={E} not divisible by world {world}; skipped")
            continue
        for recipe in args.recipes:
            for routing in args.routing:
                log(rank, f"case {shape} {routing} {recipe}")
                cases += run_case(rank, world, device, args, shape, routing, recipe, rates)

    result = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        machine=machine,
        world=world,
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        device_count=torch.cuda.device_count() if device.type == "cuda" else 0,
        torch=torch.__version__,
        backend=args.backend,
        native_gemms=native_moe.gemm_impl_label(device),
        args=vars(args),
        floor_rates=rates,
        cases=cases,
        notes=[
            "times: median over iterations of CUDA-event time per call, max over ranks",
            "fwd = training forward (autograd on), output dropped; fwd+bwd = forward + backward with a fixed dY",
            "floor = max over ranks of max(GEMM FLOPs of the rows that rank's experts got / dense 8192^3 rate, "
            "NVLink bytes of that rank / peer-copy rate, one row per unique (token, destination GPU)); "
            "fwd+bwd: the forward's FLOPs again for the dgrads and for the wgrads, backward bytes dY + dX in bf16",
            "each GEMM pair of the floor at the rate of the format the recipe runs it in (fp8 or bf16); "
            "native fp8 backward runs bf16 grouped GEMMs",
            "torch-native baseline per recipe: " + ", ".join(f"{k} -> {v}" for k, v in NATIVE_RECIPE.items()),
        ],
    )
    if rank == 0:
        print("\n" + "=" * 30 + " summary " + "=" * 30)
        for r in cases:
            print(fmt_row(r))
        if args.markdown:
            print("\n" + MD_HEADER)
            print("\n".join(md_rows(result)))
        if args.out:
            write_results(result, args.out)
            print(f"\nwrote {args.out}")


def _torchrun_main(args):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    else:
        dist.init_process_group("gloo")
    try:
        worker(rank, world, args)
    finally:
        from megamoe_train.launch import finish_rank

        finish_rank()


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    csv = lambda s: [t for t in s.split(",") if t]  # noqa: E731
    p.add_argument(
        "--shapes",
        type=csv,
        default=["S1", "S2", "S3"],
        help="comma list of S1,S2,S3,S4,P (P: the training proxy's MoE layer)",
    )
    p.add_argument(
        "--tiny", action="store_true", help="tiny smoke shape (E8 k2 H256 I128 T64); on CPU uses backend reference"
    )
    p.add_argument("--routing", type=csv, default=["uniform", "skewed"])
    p.add_argument("--recipes", type=csv, default=["bf16", "fp8"])
    p.add_argument("--phases", type=csv, default=["fwd", "fwdbwd"])
    p.add_argument("--backend", default=None, help="mega_moe backend (default auto; reference on CPU)")
    p.add_argument(
        "--graphed",
        action="store_true",
        help="time ours replayed from CUDA graphs (graphs.GraphedMegaMoE, as the trainer runs it), so the "
        "host's ~100 launches per call stay out of the GPU time; forward+backward only (a graphed layer's "
        "forward must be followed by its backward); CUDA only; implies --main-grad",
    )
    p.add_argument(
        "--main-grad",
        action="store_true",
        help="ours adds the expert weight gradients into fp32 main_grads (gradient-accumulation fusion, as the "
        "trainer runs the layer) instead of returning bf16 .grad tensors; without it a graphed backward's "
        "static weight gradients are copied into .grad (3 GB of traffic per call at P)",
    )
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--nproc", type=int, default=None, help="processes (default: GPU count, or 2 on CPU)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20, help="most timed iterations per measurement")
    p.add_argument(
        "--budget-s",
        type=float,
        default=1.5,
        help="about this many seconds of timed iterations per measurement (at least 3 iterations)",
    )
    p.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of the skewed routing")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-floor", action="store_true", help="skip the floor rate measurements")
    p.add_argument("--out", default=None, help="results file (.json, or .md for the markdown table)")
    p.add_argument("--markdown", action="store_true", help="print rows for BENCHMARKS.md")
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.backend is None:
        args.backend = "auto" if args.device == "cuda" else "reference"
    if args.graphed and args.device != "cuda":
        p.error("--graphed: CUDA graphs need --device cuda")
    args.main_grad = args.main_grad or args.graphed
    for s in args.shapes:
        if s not in SHAPES:
            p.error(f"--shapes: unknown {s!r}")
    for r in args.recipes:
        if r not in NATIVE_RECIPE:
            p.error(f"--recipes: unknown {r!r}; choose from {','.join(NATIVE_RECIPE)}")
    return args


def main(argv=None):
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        _torchrun_main(args)
        return
    from megamoe_train.launch import spawn

    nproc = args.nproc or (torch.cuda.device_count() if args.device == "cuda" else 2)
    spawn(worker, nproc, args=(args,), backend="nccl" if args.device == "cuda" else "gloo")


if __name__ == "__main__":
    main()
