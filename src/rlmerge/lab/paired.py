"""Paired comparisons of two rows (e.g. RAM+ − TA) with confidence intervals.

Two intervals, for two questions:
- over seeds (`seed_differences`): each seed is a whole pipeline (its own base, agents and test sets);
  the per-seed differences of the average score get a Student-t 95 % interval, t with n − 1 degrees of
  freedom. It answers "would another run of the pipeline give the same sign?" and needs ≥ 2 seeds.
- over test examples (`bootstrap_difference`): one seed, the same test examples scored for both rows;
  examples are resampled with replacement within each family (the same draw for both rows: paired), the
  difference of the average over families is recomputed, and the 2.5 / 97.5 % percentiles are the
  interval. It answers "is the gap larger than the luck of this test set?" for these agents only.
- over the seeds' test examples pooled (`pooled_difference`): the per-seed bootstrap with every seed's examples
  resampled within their seed and family; its point is the mean over seeds. It answers the second question for
  all the seeds' agents together (more examples, a narrower interval), not the first: the agents' training
  luck is in the interval over seeds only.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from rlmerge.sweeping.noise import paired_bootstrap

# Two-sided 95 % Student-t quantiles t_{0.975, df} for df = 1 … 30 (standard tables).
T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip
Z975 = 1.960  # df > 30: the normal quantile (within 2 % of t)

# The comparisons the report lists: (row, against).
PAIRS: tuple[tuple[str, str], ...] = (
    ("RAM+", "Task arithmetic"),
    ("RAM+", "TIES"),
    ("RAM+", "DARE+TA"),
    ("RAM", "Task arithmetic"),
    ("RAM", "TIES"),
    ("RAM+", "RAM"),
    ("RAM", "DARE+TA"),
    ("RAM+", "DARE+TIES"),
    ("RAM", "Average"),
    ("RAM+ (paper defaults)", "Task arithmetic"),
    # research rows beyond the paper (merging.BEYOND_TINY): each against TA and against RAM+
    *((row, other) for row in ("ARM-R", "ARM-TIES", "RAM+ magnitude-ρ", "RAM+ sign-elect")
      for other in ("Task arithmetic", "RAM+")),
)


def sign_test(better: int, worse: int) -> float:
    """One-sided exact sign test (McNemar's, exact) of two models scored on the same examples: the chance of at
    least ``better`` examples the first gets right and the second wrong, out of the ``better + worse`` they score
    differently, were each of those a coin flip. 1.0 when they never differ."""
    n = better + worse
    return sum(math.comb(n, k) for k in range(better, n + 1)) / 2**n if n else 1.0


def t_interval(values: Sequence[float]) -> tuple[float, float, float]:
    """(mean, low, high): the 95 % Student-t interval of the mean. Needs at least two values."""
    if len(values) < 2:
        raise ValueError("a t-interval needs at least two values")
    mean = statistics.fmean(values)
    df = len(values) - 1
    t = T975[df - 1] if df <= len(T975) else Z975
    half = t * statistics.stdev(values) / len(values) ** 0.5
    return mean, mean - half, mean + half


def average(scores: Mapping[str, float]) -> float:
    return statistics.fmean(scores.values())


def seed_differences(
    seeds: Sequence[Mapping[str, Mapping[str, float]]], pairs: Sequence[tuple[str, str]] = PAIRS
) -> list[dict[str, object]]:
    """Per pair: per-seed differences of the average score (points) and their 95 % t-interval.

    `seeds[s][row][family]` is an accuracy in 0..1. Seeds missing either row are left out of that pair.
    """
    out: list[dict[str, object]] = []
    for a, b in pairs:
        diffs = [100.0 * (average(s[a]) - average(s[b])) for s in seeds if a in s and b in s]
        row: dict[str, object] = {"pair": f"{a} − {b}", "diffs": diffs}
        if len(diffs) >= 2:
            mean, lo, hi = t_interval(diffs)
            row |= {"mean": mean, "low": lo, "high": hi}
        elif diffs:
            row |= {"mean": diffs[0], "low": None, "high": None}
        else:
            continue
        out.append(row)
    return out


def bootstrap_difference(
    a: Mapping[str, Sequence[float]],
    b: Mapping[str, Sequence[float]],
    *,
    draws: int = 2000,
    seed: int = 0,
) -> tuple[float, float, float]:
    """(difference, low, high) in points: paired bootstrap over test examples of avg(a) − avg(b).

    `a[family]` and `b[family]` are the 0/1 scores of the same examples in the same order. The sweep's
    implementation (`rlmerge.sweeping.noise.paired_bootstrap`, which the lab's began as), in points.
    """
    return paired_bootstrap(a, [b], draws=draws, seed=seed, scale=100.0)[0]


def pooled_difference(
    seeds: Sequence[Mapping[str, Any]], a: str, b: str, *, draws: int = 2000, seed: int = 0
) -> tuple[float, float, float] | None:
    """(difference, low, high) in points of rows ``a`` − ``b``, the mean over ``seeds`` of the per-seed average over
    families, with a paired bootstrap that resamples each seed's examples within its seed and family.
    ``seeds[s]["examples"][row][family]``: 0/1 scores, as bootstrap_difference's; ``seeds[s]["seed"]`` names the
    seed. None when no seed scored both rows; seeds missing either row are left out (as seed_differences does).

    Every seed scores the same families, so the average over the (seed, family) strata is the mean over seeds of
    each seed's average, and with one seed this is bootstrap_difference itself."""
    both = [s for s in seeds if a in s["examples"] and b in s["examples"]]
    if not both:
        return None
    families = {frozenset(s["examples"][a]) for s in both} | {frozenset(s["examples"][b]) for s in both}
    if len(families) != 1:
        raise ValueError(f"{a} − {b}: the seeds score different families; pool only seeds of one task set")
    pa = {f"{s['seed']:06d}/{f}": s["examples"][a][f] for s in both for f in s["examples"][a]}
    pb = {f"{s['seed']:06d}/{f}": s["examples"][b][f] for s in both for f in s["examples"][b]}
    return bootstrap_difference(pa, pb, draws=draws, seed=seed)


def markdown_pairs(rows: Sequence[Mapping[str, object]], *, how: str) -> str:
    """A table of paired differences: pair, per-seed (or per-test-set) values, mean, 95 % interval."""
    lines = ["| difference (points, average over tasks) | per seed | mean | 95 % interval |", "|---|---|---|---|"]
    for r in rows:
        diffs = ", ".join(f"{d:+.1f}" for d in r.get("diffs", []))  # type: ignore[union-attr]
        lo, hi = r.get("low"), r.get("high")
        ci = f"[{lo:+.1f}, {hi:+.1f}]" if lo is not None and hi is not None else "n/a (one seed)"
        lines.append(f"| {r['pair']} | {diffs} | {r['mean']:+.1f} | {ci} |")
    lines += ["", f"Interval: {how}."]
    return "\n".join(lines)


def paired_report(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Paired differences between rows: a t-interval over seeds, and per seed a bootstrap over examples."""
    seeds = [r["scores"] for r in results]
    over_seeds = seed_differences(seeds) if len(seeds) > 1 else []
    per_seed: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        rows = []
        for a, b in PAIRS:
            if a in r["examples"] and b in r["examples"]:
                d, lo, hi = bootstrap_difference(r["examples"][a], r["examples"][b], seed=r["seed"])
                rows.append({"pair": f"{a} − {b}", "diffs": [d], "mean": d, "low": lo, "high": hi})
        per_seed[str(r["seed"])] = rows
    text = []
    if over_seeds:
        text.append(markdown_pairs(over_seeds, how=f"Student-t 95 % over {len(seeds)} seeds (t, n − 1 df)"))
    for seed, rows in per_seed.items():
        text.append(
            f"Seed {seed}:\n\n"
            + markdown_pairs(rows, how="paired bootstrap over test examples, 2000 draws, 2.5/97.5 percentiles")
        )
    return {"over_seeds": over_seeds, "bootstrap_per_seed": per_seed, "markdown": "\n\n".join(text)}
