"""Latency of the first read of a peer's freshly written memory over NVLink (2 GPUs).

Why: in the layer's forward, whichever operation first touches the peer's status and ids after
the publish takes 50-106 us (a copy-engine write of the status word, a cat of the ids, now the
plan's count kernel), where the next kernel reading the same ids takes 25 us, and remote reads
after an idle GPU take 6-8 us. This separates the suspects.

Each trial, on both ranks at once: optionally sweep 512 MB of the peer's memory (address
translation pressure, as the pull and push make), write region A of this rank's symmetric
buffer (Triton stores, or a copy-engine copy, or nothing), device barrier (torch symmetric
memory's), then time with CUDA events: a read of the peer's A, the same read again, a read of
the peer's B (written by nobody since setup), and a read of this rank's own A. Reads are one
Triton kernel of --bytes bytes. Prints the per-trial times (first trial dropped: warm-up).

    python benchmarks/bench_peer_read.py [--bytes 400000] [--trials 6]
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import triton
import triton.language as tl

SWEEP_WORDS = 128 << 20  # int32 words of the peer sweep: 512 MB


@triton.jit
def _read(src_addr, out, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(src_addr.to(tl.pointer_type(tl.int32)) + i, mask=i < n, other=0)
    tl.atomic_add(out, tl.sum(v, axis=0))  # keeps the loads


@triton.jit
def _write(dst_addr, n, val, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_addr.to(tl.pointer_type(tl.int32)) + i, i + val, mask=i < n)


def _rank(rank: int, world: int, words: int, trials: int, port: int):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    from torch.distributed import _symmetric_memory as symm_mem

    region = max(words, 1 << 20)
    A, B, C = 0, region, 2 * region  # word offsets: written, never written, the sweep
    local = symm_mem.empty(C + SWEEP_WORDS, dtype=torch.int32, device="cuda")
    local.fill_(1)
    handle = symm_mem.rendezvous(local, dist.group.WORLD.group_name)
    peer, mine = handle.buffer_ptrs[1 - rank], handle.buffer_ptrs[rank]
    out = torch.zeros(1, dtype=torch.int32, device="cuda")
    src = torch.arange(words, dtype=torch.int32, device="cuda")

    def read(addr, n=words):
        _read[(triton.cdiv(n, 1024),)](addr, out, n, BLOCK=1024)

    def timed(fn):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        return start, end

    read(peer)
    _write[(triton.cdiv(words, 1024),)](mine, words, 0, BLOCK=1024)  # compile both before timing
    handle.barrier()
    torch.cuda.synchronize()
    for how in ("sm", "copy_engine", "none"):
        for sweep in (False, True):
            rows = []
            for trial in range(trials):
                torch.cuda._sleep(1_000_000)
                if sweep:
                    read(peer + 4 * C, SWEEP_WORDS)
                if how == "sm":
                    _write[(triton.cdiv(words, 1024),)](mine + 4 * A, words, trial, BLOCK=1024)
                elif how == "copy_engine":
                    local[A : A + words].copy_(src)
                handle.barrier()
                events = [
                    timed(lambda: read(peer + 4 * A)),
                    timed(lambda: read(peer + 4 * A)),
                    timed(lambda: read(peer + 4 * B)),
                    timed(lambda: read(mine + 4 * A)),
                ]
                torch.cuda.synchronize()
                rows.append([round(s.elapsed_time(e) * 1000, 1) for s, e in events])
            print(
                f"rank {rank} write={how} sweep={sweep}: [peer A 1st, peer A 2nd, peer B, own A] us: {rows[1:]}",
                flush=True,
            )
    handle.barrier()
    torch.cuda.synchronize()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bytes", type=int, default=400_000, help="bytes per read (the S1 ids: 8192 x 6 x 4 x 2 ranks)")
    p.add_argument("--trials", type=int, default=6)
    p.add_argument("--port", type=int, default=29534)
    a = p.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit("bench_peer_read: needs 2 GPUs")
    mp.spawn(_rank, args=(2, a.bytes // 4, a.trials, a.port), nprocs=2)


if __name__ == "__main__":
    main()
