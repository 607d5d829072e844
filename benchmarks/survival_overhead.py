"""What counting RAM+'s kept rescale (kernels/survival.py) adds to the fused RAM+ kernel, in one process.

    python benchmarks/survival_overhead.py [--elements 4194304] [--repeat 20]

One block of bf16 base + 3 agents (densities 3 / 46 / 54 %, one-step updates) in memory, the paper preset's
program; the fused kernel timed with and without the count, interleaved, median of the repeats, one thread.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from rlmerge import kernels
from rlmerge.methods import get_method
from rlmerge.stream.fast import RuleArgs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--elements", type=int, default=1 << 22)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    n = args.elements
    rng = np.random.default_rng(0)
    base = ((rng.standard_normal(n).astype(np.float32) * 0.02).view(np.uint32) >> 16).astype(np.uint16)
    agents = tuple(np.where(rng.random(n) < d, base + 1, base).astype(np.uint16) for d in (0.03, 0.46, 0.54))
    spec = get_method("ram+")
    p = spec.parse({})
    prog = spec.program(p, 3)
    consts, agent_consts = prog.arrays({"eps": p.epsilon, "lam": [1.2, 1.2, 1.2]})
    ra = RuleArgs(prog, consts, agent_consts, np.float32(p.epsilon), np.ones(3, dtype=bool))
    out = np.empty(n, dtype=np.uint16)
    kept = np.zeros((3, 2), dtype=np.int64)

    def once(count: bool) -> float:
        t = time.perf_counter()
        kernels.fused_range(prog, base, agents, 0, n, ra.eps, ra.consts, ra.agent_consts, out, None, None, False,
                            ra.rescaled if count else None, kept if count else None)
        return time.perf_counter() - t

    once(True), once(False)  # compile
    plain, counted = [], []
    for _ in range(args.repeat):
        plain.append(once(False))
        counted.append(once(True))
    a, b = statistics.median(plain), statistics.median(counted)
    print(f"fused ram+ on {n:,} elements, 3 agents, bf16: {a * 1e3:.2f} ms ({a / n * 1e9:.2f} ns/element); "
          f"with the kept count {b * 1e3:.2f} ms ({b / n * 1e9:.2f} ns/element): × {b / a:.2f}")


if __name__ == "__main__":
    main()
