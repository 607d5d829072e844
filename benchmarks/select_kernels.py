"""CPU time of the kernels of a TIES / Breadcrumbs read on one block of a benchmark set (docs/benchmarks.md).

One thread, ``time.thread_time``, best of 3: the statistics kernel every method's first read runs
(``fused_range`` with no rule: the k-of-N pattern counts and the Gram sums), round 0's histogram (``hist_first``,
every agent), a later round's (``hist_next``, the queries still active), the gather that can replace the later
rounds (``gather_bin``) and TIES' merge at the thresholds found (``merge_range``: keep window, sign election,
disjoint mean), on the first ``--block`` elements of ``--tensor`` of a set ``benchmarks/run.py`` made, ranks at
``--density``.

    python benchmarks/select_kernels.py /work/bench-data/redesign/0.5b
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from safetensors import safe_open

from rlmerge import kernels
from rlmerge.kernels.layout import hist_shape
from rlmerge.methods._select import BINS, NO_CUT, KthLargest
from rlmerge.methods.sparsify import kernels as k
from rlmerge.methods.sparsify.presets import PRESETS, combine_constants


def bf16_tensor(folder: Path, name: str) -> torch.Tensor:
    """Tensor ``name`` of the checkpoint in ``folder`` (any of its shards), which must be bfloat16."""
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, "pt") as h:
            if name in h.keys():  # noqa: SIM118 (safe_open has keys(), no __contains__)
                t = h.get_tensor(name)
                if t.dtype != torch.bfloat16:
                    raise SystemExit(f"{f}: {name} is {t.dtype}, this script reads bfloat16 sets")
                return t
    raise SystemExit(f"{folder}: no tensor {name}")


def bits(t: torch.Tensor, n: int | None = None) -> np.ndarray:
    """The first ``n`` elements (None: all) of the bfloat16 tensor ``t``, flat, as their uint16 bits."""
    return t.reshape(-1)[:n].view(torch.int16).numpy().view(np.uint16).copy()


def bf16_bits(folder: Path, name: str, n: int | None = None) -> np.ndarray:
    return bits(bf16_tensor(folder, name), n)


def best(fn, repeat: int = 3) -> float:  # type: ignore[no-untyped-def]
    """The least CPU time of this thread over ``repeat`` calls of ``fn()``."""
    times = []
    for _ in range(repeat):
        t = time.thread_time()
        fn()
        times.append(time.thread_time() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("set", type=Path, help="a folder with base/ and the agents' folders (benchmarks/run.py)")
    ap.add_argument("--tensor", default="model.embed_tokens.weight")
    ap.add_argument("--block", type=int, default=1 << 22)
    ap.add_argument("--density", type=float, default=0.5)
    a = ap.parse_args()
    agents_dirs = sorted(d for d in a.set.iterdir() if d.is_dir() and d.name != "base")
    base = bf16_bits(a.set / "base", a.tensor, a.block)
    agents = tuple(bf16_bits(d, a.tensor, a.block) for d in agents_dirs)
    n, q = len(base), len(agents)
    hist = np.zeros((q, BINS[0] + 1), dtype=np.int64)
    print(f"{a.tensor}, {n} elements, agents {[d.name for d in agents_dirs]}, rank {int(a.density * n)}")
    patterns, gram = np.zeros(hist_shape(q), dtype=np.int64), np.zeros((q, q))
    rule = (np.zeros(0, np.float32), np.zeros((0, q), np.float32), np.empty(1, np.float32))
    t = best(lambda: kernels.fused_range(None, base, agents, 0, n, np.float32(1e-5), *rule, patterns, gram))
    print(f"statistics (fused_range, no rule, {q} agents): {t * 1e3:.1f} ms ({t / n * 1e9:.2f} ns an element)")
    t = best(lambda: k.hist_first(base, agents, 0, n, hist, None))
    print(f"hist_first (round 0, {q} agents): {t * 1e3:.1f} ms ({t / n * 1e9:.2f} ns an element)")
    hist[:] = 0
    k.hist_first(base, agents, 0, n, hist, None)
    sel = KthLargest(n_streams=q, streams=list(range(q)))
    sel.add_counts(hist)
    sel.next_round([max(1, int(a.density * n))] * q)
    print(f"queries still active after round 0: {int(sel.active.sum())}; values in their bins: {sel.in_bin.tolist()}")
    hq = np.zeros((q, BINS[1] + 8), dtype=np.int64)
    t = best(lambda: k.hist_next(base, agents, 0, n, sel.streams, sel.prefix, sel.active, *sel.digit, hq, None))
    print(f"hist_next (one later round): {t * 1e3:.1f} ms")
    sizes = sel.in_bin
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    bits, index = np.empty(int(sizes.sum()), np.uint32), np.empty(int(sizes.sum()), np.int64)
    t = best(lambda: k.gather_bin(base, agents, 0, n, 0, sel.streams, sel.prefix, sel.active, sel.above, starts,
                                  starts + sizes, np.zeros(q, np.int64), bits, index, None))
    print(f"gather_bin (instead of rounds 1 and 2): {t * 1e3:.1f} ms")
    while not sel.done:  # the thresholds, for the merge
        sel.hist = 0
        hq[:] = 0
        k.hist_next(base, agents, 0, n, sel.streams, sel.prefix, sel.active, *sel.digit, hq, None)
        sel.add_counts(hq[:, :BINS[sel.round]].copy())
        sel.next_round()
    c = combine_constants("ties", PRESETS["ties"], SimpleNamespace(weights=None, normalize=None, scaling=1.0), q)
    key, (consts, agent_consts) = kernels.rule_key(c.program, tau=True), c.program.arrays(c.values)
    lo = np.ascontiguousarray(sel.values(), dtype=np.float32)
    hi = np.full(q, np.inf, dtype=np.float32)
    cut, out = np.full(q, NO_CUT, dtype=np.int64), np.empty(n, dtype=np.uint16)
    t = best(lambda: k.select_merge_range(base, agents, 0, n, lo, hi, cut, 0, c.w, consts, agent_consts, key, out,
                                          None))
    print(f"merge_range (TIES' merge, {q} agents): {t * 1e3:.1f} ms ({t / n * 1e9:.2f} ns an element)")


if __name__ == "__main__":
    main()
