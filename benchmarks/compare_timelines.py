"""Two kernel timelines of `profile_layer.py --timeline` side by side (dev tool for A/B work).

  python benchmarks/compare_timelines.py BEFORE.txt AFTER.txt [--min-delta-us 5] [--all]

Reads the first timeline in each file (rank 0's profiled iteration), pairs the kernels in launch
order (difflib's longest matching runs of kernel names, so a kernel added or removed on one side
does not shift every pair after it; kernels without a same-named partner are listed one-sided),
and prints, per pair, both durations and the change, then
the totals: which kernels an A/B moved, without reading two 100-line listings by eye.
"""

from __future__ import annotations

import argparse
import difflib
from dataclasses import dataclass

HEADER = "start us   dur us   gap us  kernel"


@dataclass
class Kernel:
    name: str
    dur_us: float


def read_timeline(path: str) -> list[Kernel]:
    """The kernels of the first timeline block in a profile_layer.py output file."""
    kernels, inside = [], False
    with open(path) as f:
        for line in f:
            if not inside:
                inside = line.strip() == HEADER
                continue
            parts = line.split(None, 3)
            if len(parts) < 4:
                break
            try:
                float(parts[0]), float(parts[2])
                dur = float(parts[1])
            except ValueError:
                break
            kernels.append(Kernel(parts[3].rstrip("\n"), dur))
    if not kernels:
        raise ValueError(f"{path}: no timeline (run profile_layer.py with --timeline)")
    return kernels


def pair_kernels(a: list[Kernel], b: list[Kernel]) -> list[tuple[Kernel | None, Kernel | None]]:
    """Launch-order pairs; a kernel only one side ran is paired with None."""
    matcher = difflib.SequenceMatcher(None, [k.name for k in a], [k.name for k in b], autojunk=False)
    pairs = []
    for tag, i0, i1, j0, j1 in matcher.get_opcodes():
        if tag == "equal":
            pairs += list(zip(a[i0:i1], b[j0:j1]))
            continue
        # replace / delete / insert: kernels of different names are not the same work
        pairs += [(k, None) for k in a[i0:i1]] + [(None, k) for k in b[j0:j1]]
    return pairs


def report(a: list[Kernel], b: list[Kernel], min_delta_us: float = 5.0, show_all: bool = False) -> str:
    lines = [f"{'before us':>10} {'after us':>10} {'change':>9}  kernel"]
    for ka, kb in pair_kernels(a, b):
        da = ka.dur_us if ka else 0.0
        db = kb.dur_us if kb else 0.0
        if not show_all and abs(db - da) < min_delta_us:
            continue
        name = (ka or kb).name
        fa = f"{da:10.1f}" if ka else f"{'-':>10}"
        fb = f"{db:10.1f}" if kb else f"{'-':>10}"
        lines.append(f"{fa} {fb} {db - da:+9.1f}  {name[:100]}")
    ta, tb = sum(k.dur_us for k in a), sum(k.dur_us for k in b)
    lines.append(f"{ta:10.1f} {tb:10.1f} {tb - ta:+9.1f}  total kernel time ({len(a)} -> {len(b)} kernels)")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("--min-delta-us", type=float, default=5.0, help="hide pairs that moved less (default 5 us)")
    p.add_argument("--all", action="store_true", help="show every pair")
    a = p.parse_args()
    print(report(read_timeline(a.before), read_timeline(a.after), a.min_delta_us, a.all))


if __name__ == "__main__":
    main()
