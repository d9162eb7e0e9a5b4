"""Micro-benchmarks of the GPU backend's kernels against torch's built-ins, same shapes, one run.

  python benchmarks/bench_kernels.py [--shape S1] [--world 2]

- grouped GEMM, bf16: our Triton kernel vs torch._grouped_mm;
- grouped GEMM, fp8: our 1x128/128x128 block-scaled Triton kernel vs torch._scaled_grouped_mm
  (row-wise scales: cheaper scaling, the closest built-in) and vs torch._grouped_mm in bf16;
- row movement over NVLink: our pull kernel (rows gathered from the peer's buffer by a row
  list) vs a plain peer copy of the same bytes (copy engine), both GPUs at once, GB/s per GPU.
Shapes: the expert GEMMs of one rank at the layer shapes of bench_layer.py, uniform routing
(forward L1, L2 and the two backward dgrads, which the fp8 recipe runs in fp8).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from bench_layer import SHAPES  # (experts, topk, hidden, intermediate, tokens per GPU)
from timing import median_ms as bench

from megamoe_train import MegaMoEConfig, get_symm_buffer
from megamoe_train.backends import triton_kernels as K_
from megamoe_train.launch import spawn
from megamoe_train.plan import build_plan
from megamoe_train.precision import get_recipe
from megamoe_train.quant import quantize_act, quantize_weight

# Tile configurations of our fp8 grouped GEMM to compare (block_n, stages, warps, group_m);
# block_m is the pool's block (128).
FP8_CONFIGS = (
    (128, 4, 8, 8),
    (128, 3, 8, 8),
    (128, 5, 8, 8),
    (128, 4, 4, 8),
    (128, 4, 8, 16),
    (128, 4, 8, 1),
    (64, 4, 4, 8),
)


def gemm_case(E_l, rows_per_expert, N, Kd, block_m, dev):
    rows = E_l * rows_per_expert
    a = torch.randn(rows, Kd, device=dev, dtype=torch.bfloat16)
    b = torch.randn(E_l, N, Kd, device=dev, dtype=torch.bfloat16) * Kd**-0.5
    ends = torch.arange(1, E_l + 1, device=dev, dtype=torch.int32) * rows_per_expert
    block_expert = torch.arange(rows // block_m, device=dev, dtype=torch.int32) // (rows_per_expert // block_m)
    return a, b, ends, block_expert


def gemm_report(name, shape, rows, N, Kd, dev):
    E, topk, H, I, T = SHAPES[shape]
    E_l = E // dist.get_world_size()
    per_expert = (T * topk // E_l // 128) * 128 or 128
    a, b, ends, block_expert = gemm_case(E_l, per_expert, N, Kd, 128, dev)
    flops = 2 * a.shape[0] * N * Kd
    tf = lambda ms: flops / ms / 1e9
    out = torch.empty(a.shape[0], N, device=dev, dtype=torch.bfloat16)
    lines = []
    t_torch = bench(lambda: torch._grouped_mm(a, b.transpose(1, 2), offs=ends))
    t_ours = bench(lambda: K_.grouped_gemm(a, b, block_expert, out))
    ref = torch._grouped_mm(a, b.transpose(1, 2), offs=ends).float()
    err = float((out.float() - ref).norm() / ref.norm())
    lines.append(
        f"{name} bf16 rows={a.shape[0]} N={N} K={Kd}: torch._grouped_mm {t_torch:.3f} ms ({tf(t_torch):.0f} TF/s), "
        f"ours {t_ours:.3f} ms ({tf(t_ours):.0f} TF/s), ours/torch {t_ours / t_torch:.2f}, rel err {err:.1e}"
    )
    recipe = get_recipe("fp8")
    aq, a_s = quantize_act(a, recipe)
    bq, b_s = quantize_weight(b, recipe)
    best = None
    fp8_ref = None
    for block_n, stages, warps, group_m in FP8_CONFIGS:
        cfg = f"block_n={block_n} stages={stages} warps={warps} group_m={group_m}"
        try:
            t = bench(
                lambda: K_.grouped_gemm(
                    aq,
                    bq,
                    block_expert,
                    out,
                    a_s,
                    b_s,
                    block_n=block_n,
                    num_stages=stages,
                    num_warps=warps,
                    group_m=group_m,
                )
            )
        except Exception as exc:  # noqa: BLE001 - a config that does not fit is reported, not fatal
            lines.append(f"  fp8 {cfg}: failed {type(exc).__name__}: {str(exc)[:80]}")
            continue
        check = out.float().clone()
        fp8_ref = check if fp8_ref is None else fp8_ref
        diff = float((check - fp8_ref).norm() / fp8_ref.norm())
        lines.append(f"  fp8 ours {cfg}: {t:.3f} ms ({tf(t):.0f} TF/s), rel diff to the first config {diff:.1e}")
        best = t if best is None else min(best, t)
    # torch's fp8 grouped GEMM takes row-wise scales only: one per row of A, one per column of B.
    a_row = a.float().abs().amax(1).clamp_min(1e-4) / 448
    aq_row = (a.float() / a_row[:, None]).to(torch.float8_e4m3fn)
    b_row = b.float().abs().amax(2).clamp_min(1e-4) / 448
    bq_row = (b.float() / b_row[:, :, None]).to(torch.float8_e4m3fn)
    try:
        t_scaled = bench(
            lambda: torch._scaled_grouped_mm(
                aq_row, bq_row.transpose(1, 2), a_row, b_row, offs=ends, out_dtype=torch.bfloat16
            )
        )
        lines.append(
            f"{name} fp8 rows={a.shape[0]}: torch._scaled_grouped_mm (row-wise) {t_scaled:.3f} ms "
            f"({tf(t_scaled):.0f} TF/s), "
            f"ours (block-scaled) best {best:.3f} ms ({tf(best):.0f} TF/s), ours/torch {best / t_scaled:.2f}"
        )
    except Exception as exc:  # noqa: BLE001
        lines.append(f"{name} fp8: torch._scaled_grouped_mm failed: {type(exc).__name__}: {str(exc)[:120]}")
    return lines


def worker(rank, world, shape):
    dev = torch.device("cuda", torch.cuda.current_device())
    E, topk, H, I, T = SHAPES[shape]
    lines = []
    if rank == 0:
        lines += gemm_report("L1", shape, None, 2 * I, H, dev)
        lines += gemm_report("L2", shape, None, H, I, dev)
        # the fp8 recipe's backward dgrads: dY [rows, H] @ w2_t -> [rows, I]; dH [rows, 2I] @ w1_t -> [rows, H]
        lines += gemm_report("L2 dgrad", shape, None, I, H, dev)
        lines += gemm_report("L1 dgrad", shape, None, H, 2 * I, dev)
    dist.barrier()
    # Row movement: every received row pulled from the peer (worst case: all rows remote), by the
    # layer's pull-and-expand kernel with a plan where each peer token has one slot here.
    cfg = MegaMoEConfig(num_experts=E, hidden=H, intermediate=I, topk=topk, num_max_tokens_per_rank=T, recipe="bf16")
    buf = get_symm_buffer(None, cfg)
    peer = (rank + 1) % world
    n = T
    E_l = E // world
    buf.regions().x.normal_()
    ids = torch.full((world, T, 1), -1, dtype=torch.int32, device=dev)
    ids[peer, :, 0] = rank * E_l + torch.randint(0, E_l, (T,), device=dev, dtype=torch.int32)
    plan = build_plan(ids, rank, E_l, 16)
    dst = torch.empty(plan.pool_rows, H, dtype=torch.bfloat16, device=dev)
    nbytes = n * H * 2
    src_view = buf.regions(peer).x[:n]
    copy_dst = torch.empty(n, H, dtype=torch.bfloat16, device=dev)

    def pull():
        K_.pull_expand(buf.peer_base_ptrs, buf.layout.regions["x"], dst, plan)

    def copy():
        copy_dst.copy_(src_view)

    def both(fn):
        dist.barrier()
        return bench(fn)

    t_pull, t_copy = both(pull), both(copy)
    pull()
    rows = plan.recv_rows[:n, 0].long()
    ok = torch.equal(dst[rows], src_view[plan.recv_token[:n].long()])
    lines.append(
        f"rank {rank} pull {n} rows x {H} bf16 from the peer: ours {nbytes / t_pull / 1e6:.0f} GB/s, "
        f"peer copy (copy engine) {nbytes / t_copy / 1e6:.0f} GB/s, correct={ok}"
    )
    out = [None] * world
    dist.all_gather_object(out, lines)
    if rank == 0:
        print(f"# {torch.cuda.get_device_name()} x{world}, shape {shape}")
        for rank_lines in out:
            print("\n".join(rank_lines))


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", default="S1", choices=[s for s in sorted(SHAPES) if s != "tiny"])
    p.add_argument("--world", type=int, default=torch.cuda.device_count())
    a = p.parse_args()
    spawn(worker, a.world, (a.shape,), backend="nccl")


if __name__ == "__main__":
    main()
