"""The device plan (backends/triton_plan.py) against plan.build_plan, table by table, bit for bit.

tests/test_triton_plan.py runs these on CPU through Triton's interpreter
(`TRITON_INTERPRET=1 python tests/plan_kernel_checks.py`); tests/test_gpu_triton.py on CUDA.
"""

from __future__ import annotations

import os
import sys

import torch

from megamoe_train.plan import build_plan

# (R, experts, T, K, align): the protocol's aligns (1, 16, 64, 128), K not a power of two, more
# experts per rank than 255 bins would hold, one token, T not a multiple of the chunk
CASES = [
    (1, 4, 9, 2, 4),
    (2, 8, 33, 3, 8),
    (4, 16, 20, 4, 16),
    (3, 6, 1, 2, 1),
    (2, 4, 17, 4, 1),
    (4, 4, 12, 3, 2),
    (2, 256, 300, 8, 128),
    (2, 254, 100, 6, 16),
    (2, 512, 40, 8, 64),
]


def routings(R, E, T, K, seed):
    """Fresh random ids with masked and out-of-range slots, plus skewed, one-expert and empty ones."""
    g = torch.Generator().manual_seed(seed)
    yield "random", torch.randint(-1, E + 2, (R, T, K), generator=g)
    skew = torch.randint(0, E, (R, T, K), generator=g)
    yield "skewed", torch.where(torch.rand(R, T, K, generator=g) < 0.7, skew % max(1, E // 8), skew)
    yield "one_expert", torch.full((R, T, K), E // 2)
    yield "empty", torch.full((R, T, K), -1)


def check_plan_tables(device):
    from megamoe_train.backends.triton_plan import build_plan as device_plan

    for i, (R, E, T, K, align) in enumerate(CASES):
        for name, ids in routings(R, E, T, K, i):
            ids = ids.to(torch.int32).to(device)
            E_l = E // R
            for owner in range(R):
                want, got = build_plan(ids, owner, E_l, align), device_plan(ids, owner, E_l, align)
                for field in want.__dataclass_fields__:
                    a, b = getattr(want, field), getattr(got, field)
                    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (
                        f"{field} differs: R={R} E={E} T={T} K={K} align={align} {name} owner={owner}"
                    )


def check_plan_from_buffers(device):
    """The protocol's path: each source's ids read at its own base address (here: R separate
    tensors, as R ranks' buffers are), an offset into each, and the call's ok flag (False: the
    tables of a call that routes nothing)."""
    from types import SimpleNamespace

    from megamoe_train.backends.triton_plan import build_plan_from_buffers

    R, E, T, K, align = 3, 12, 21, 3, 8
    pad = 5  # int32 words before the ids in every "buffer"
    for name, ids in routings(R, E, T, K, 7):
        ids = ids.to(torch.int32)
        buffers = [
            torch.cat([torch.full((pad,), 99, dtype=torch.int32), ids[s].flatten()]).to(device) for s in range(R)
        ]
        bases = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=device)
        region = SimpleNamespace(shape=(T, K), offset=pad * 4)
        for ok in (True, False):
            flag = torch.tensor(ok, device=device)
            for owner in range(R):
                want = build_plan(ids.to(device) if ok else torch.full_like(ids, -1).to(device), owner, E // R, align)
                got = build_plan_from_buffers(bases, region, flag, owner, E // R, align)
                for field in want.__dataclass_fields__:
                    a, b = getattr(want, field), getattr(got, field)
                    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (
                        f"{field} differs: {name} ok={ok} owner={owner}"
                    )


def check_store_routing(device):
    """The Triton executor's routing publication equals the reference's: ids outside [-1, E) as
    -1, rows past the call's tokens -1, weights copied, the verdict bad exactly when an id was
    out of range. Outputs poisoned first; T not a multiple of the kernel's block."""
    from types import SimpleNamespace

    from megamoe_train.backends import triton_kernels as K_
    from megamoe_train.backends.reference import ReferenceExecutor
    from megamoe_train.faults import STATUS_BAD, STATUS_OK

    E, K, capacity = 16, 3, 700
    cfg = SimpleNamespace(num_experts=E)
    g = torch.Generator().manual_seed(3)
    for n, lo, hi in ((700, -1, E), (513, -3, E + 2), (1, -1, E), (0, -1, E)):
        ids = torch.randint(lo, hi, (n, K), generator=g).to(device)
        weights = torch.rand(n, K, generator=g).to(device)
        outs = []
        for kernel in (False, True):
            ids_out = torch.full((capacity, K), 12345, dtype=torch.int32, device=device)
            w_out = torch.full((capacity, K), float("nan"), device=device)
            if kernel:
                verdict = torch.full((), STATUS_OK, dtype=torch.int32, device=device)
                K_.store_routing(ids, weights, ids_out, w_out, verdict, STATUS_BAD, E, block=256)
            else:
                verdict = ReferenceExecutor().store_routing(cfg, ids, weights, ids_out, w_out)
            outs.append((ids_out, w_out[:n], int(verdict)))
        (a_ids, a_w, a_v), (b_ids, b_w, b_v) = outs
        assert torch.equal(a_ids, b_ids) and torch.equal(a_w, b_w) and a_v == b_v, f"store_routing differs at n={n}"
        assert a_v == (STATUS_BAD if bool(((ids < -1) | (ids >= E)).any()) else STATUS_OK)


def check_routing_masks(device):
    """The Triton executor's owner masks equal the reference's: every routing of CASES (ids as
    published: out of range already -1), the call accepted and rejected, 8 ranks and K = 6 (not
    powers of the kernel's blocks)."""
    from megamoe_train.backends import triton_kernels as K_
    from megamoe_train.backends.reference import ReferenceExecutor

    for R, E, T, K, _ in CASES + [(8, 16, 70, 6, 1)]:
        for name, ids in routings(R, E, T, K, seed=R * 100 + T):
            ids = torch.where((ids >= 0) & (ids < E), ids, -1).to(torch.int32)[0].to(device)
            for ok in (True, False):
                all_ok = torch.tensor(ok, device=device)
                want = ReferenceExecutor().routing_masks(ids, all_ok, R, E // R)
                got = K_.routing_masks(ids, all_ok, R, E // R)
                for w, g in zip(want, got):
                    assert g.dtype == torch.bool and torch.equal(w, g), (
                        f"routing masks differ: {(R, E, T, K, name, ok)}"
                    )


def main():
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    check_plan_tables("cpu")
    check_plan_from_buffers("cpu")
    check_store_routing("cpu")
    check_routing_masks("cpu")
    print("all plan checks passed")


if __name__ == "__main__":
    sys.exit(main())
