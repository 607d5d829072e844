"""Which candidates of a sweep the scores cannot tell apart from the best: paired bootstrap where every task has
per-example results on the same examples, a normal interval from standard errors where it has those only.

A candidate's score is its average over tasks (what the ranking sorts by). For the best candidate B and another
candidate C, the difference is D = avg_t(score_B,t) − avg_t(score_C,t), and C is **indistinguishable from the
best** when the 95 % interval of D contains 0:

- **paired bootstrap** (``paired_bootstrap``), when B and C have per-example results for every task, on the same
  examples (results.json's ``examples`` keys equal: scores.py): the examples of each task are resampled with
  replacement (the same draw for B and C, and for every C), D is recomputed as the average over tasks of the
  per-task mean difference, and the 2.5 / 97.5 % percentiles of ``DRAWS`` draws (seeded by the sweep's seed) are
  the interval. It asks whether the gap is larger than the luck of these examples.
- **normal**, when every task of both has a standard error but some lack paired examples: D ± 1.96 · sqrt(Σ_t
  (se_B,t² + se_C,t²)) / T, the two candidates taken as independent, which overstates the noise of a difference on
  shared examples (wider: more candidates are called indistinguishable).
- otherwise nothing is said (a plain number has no noise known): the candidate is not marked either way.

Each candidate's own average gets the normal interval avg ± 1.96 · sqrt(Σ_t se_t²) / T (tasks taken as independent)
where every task has a standard error: the error bars of report.md and plot.png.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

DRAWS = 2000
Z95 = 1.959963984540054  # the two-sided 95 % normal quantile


def paired_bootstrap(a: Mapping[str, Sequence[float]], others: Sequence[Mapping[str, Sequence[float]]], *,
                     draws: int = DRAWS, seed: int = 0, scale: float = 1.0) -> list[tuple[float, float, float]]:
    """(difference, low, high) of avg(a) − avg(other) for each of ``others``: the paired bootstrap above, one draw
    of examples shared by every comparison. ``a[task]`` and ``other[task]`` are per-example results of the same
    examples in the same order; ``scale`` multiplies every difference (the lab's 0/1 results: 100, in points).

    The draws are ``random.Random(seed).choices`` over each task's examples in turn, tasks in sorted order (so that
    the lab's intervals, which this computed before it moved here, stay what they were)."""
    tasks = sorted(a)
    for other in others:
        if sorted(other) != tasks:
            raise ValueError(f"the two rows score different tasks: {tasks} and {sorted(other)}")
        for t in tasks:
            if len(a[t]) != len(other[t]) or not a[t]:
                raise ValueError(f"task {t}: the two rows must score the same, non-empty list of examples")
    sizes = [len(a[t]) for t in tasks]
    rng = random.Random(seed)
    idx = [np.empty((draws, n), dtype=np.int64) for n in sizes]
    for d in range(draws):  # as random.choices(population, k=n) draws: floor(random() * n), n times
        for i, n in enumerate(sizes):
            f = float(n)
            idx[i][d] = [math.floor(rng.random() * f) for _ in range(n)]
    out = []
    for other in others:
        diff = [np.asarray(a[t], dtype=np.float64) - np.asarray(other[t], dtype=np.float64) for t in tasks]
        point = scale * statistics.fmean(statistics.fmean(d.tolist()) for d in diff)
        means = np.stack([d[i].mean(axis=1) for d, i in zip(diff, idx)], axis=1)  # [draws, tasks]
        stats = sorted(scale * statistics.fmean(row) for row in means.tolist())
        out.append((point, stats[int(0.025 * draws)], stats[int(0.975 * draws) - 1]))
    return out


def average_interval(details: Mapping[str, Any]) -> dict[str, float] | None:
    """{"stderr", "low", "high"} of a candidate's average over its tasks (``TaskScore`` each), when every task has a
    standard error; else None."""
    if not details or any(s.stderr is None for s in details.values()):
        return None
    avg = math.fsum(s.score for s in details.values()) / len(details)
    se = math.sqrt(math.fsum(s.stderr ** 2 for s in details.values())) / len(details)
    return {"stderr": se, "low": avg - Z95 * se, "high": avg + Z95 * se}


def compare(best: Mapping[str, Any], others: Sequence[Mapping[str, Any]], *, draws: int = DRAWS,
            seed: int = 0) -> list[dict[str, Any] | None]:
    """For each of ``others`` (task → ``TaskScore``), its difference from ``best``: {"difference", "low", "high",
    "how": "paired bootstrap" | "normal", "indistinguishable"}, or None where nothing can be said."""
    out: list[dict[str, Any] | None] = [None] * len(others)
    paired = [i for i, o in enumerate(others) if _paired(best, o)]
    if paired:
        samples = {t: best[t].samples for t in best}
        found = paired_bootstrap(samples, [{t: others[i][t].samples for t in best} for i in paired],
                                 draws=draws, seed=seed)
        for i, (d, lo, hi) in zip(paired, found):
            out[i] = _verdict(d, lo, hi, "paired bootstrap")
    for i, o in enumerate(others):
        if out[i] is None and set(o) == set(best) and all(s.stderr is not None for s in [*o.values(), *best.values()]):
            d = (math.fsum(s.score for s in best.values()) - math.fsum(s.score for s in o.values())) / len(best)
            se = math.sqrt(math.fsum(best[t].stderr ** 2 + o[t].stderr ** 2 for t in best)) / len(best)
            out[i] = _verdict(d, d - Z95 * se, d + Z95 * se, "normal")
    return out


def _paired(best: Mapping[str, Any], other: Mapping[str, Any]) -> bool:
    """Every task of both has per-example results on the same examples (the same ids, in the same order)."""
    return bool(best) and set(other) == set(best) and all(
        best[t].samples is not None and other[t].samples is not None and best[t].ids == other[t].ids for t in best)


def _verdict(d: float, lo: float, hi: float, how: str) -> dict[str, Any]:
    return {"difference": d, "low": lo, "high": hi, "how": how, "indistinguishable": lo <= 0.0 <= hi}
