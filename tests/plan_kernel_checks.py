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
CASES = [(1, 4, 9, 2, 4), (2, 8, 33, 3, 8), (4, 16, 20, 4, 16), (3, 6, 1, 2, 1), (2, 4, 17, 4, 1),
         (4, 4, 12, 3, 2), (2, 256, 300, 8, 128), (2, 254, 100, 6, 16), (2, 512, 40, 8, 64)]


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
                        f"{field} differs: R={R} E={E} T={T} K={K} align={align} {name} owner={owner}")


def main():
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    check_plan_tables("cpu")
    print("all plan checks passed")


if __name__ == "__main__":
    sys.exit(main())
