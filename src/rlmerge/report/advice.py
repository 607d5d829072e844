"""A short recommendation in plain words, with the numbers that led to it.

The rules are deliberately few and stated here, so a user can disagree with them knowingly:
- dense: every agent changed at least DENSE of the elements → RAM has little to protect; TIES or task
  arithmetic (task arithmetic when the task vectors point the same way, mean cosine ≥ SIMILAR).
- sparse and uneven: the densest agent changed at least UNEVEN× as many elements as the sparsest, or the
  unique shares differ by UNEVEN× → RAM+ (averaging would divide each agent's unique updates by N; RAM+
  also rescales them by λ from the overlap ratio ρ, paper arXiv:2601.13572 Eq. 6).
- sparse and even → RAM (RAM+'s λ would be nearly equal across agents).
"""

from __future__ import annotations

from typing import Any

from .tables import display_names

DENSE = 0.9  # density at ε above which an agent counts as dense
UNEVEN = 2.0  # max/min ratio of densities (or unique shares) above which agents count as uneven
SIMILAR = 0.3  # mean pairwise cosine above which dense task vectors count as similar


def _spread(values: list[float]) -> float:
    """max/min of positive values; ∞ when the smallest is 0 and the largest is not."""
    lo, hi = min(values), max(values)
    if lo > 0:
        return hi / lo
    return float("inf") if hi > 0 else 1.0


def recommend(doc: dict[str, Any]) -> dict[str, Any]:
    rows = doc["per_agent"]
    n = len(rows)
    dens = [r["density"] or 0.0 for r in rows]
    uniq = [r["unique_share"] or 0.0 for r in rows]
    cos = doc["pairwise"]["cosine"]
    mean_cos = sum(cos[a][b] for a in range(n) for b in range(n) if a != b) / (n * (n - 1)) if n > 1 else 1.0
    numbers = {"density_min": min(dens, default=0.0), "density_max": max(dens, default=0.0),
               "density_spread": _spread(dens) if dens else 1.0, "unique_share_spread": _spread(uniq) if uniq else 1.0,
               "mean_cosine": mean_cos}
    eps = doc["epsilon"]
    pct = ", ".join(f"{a} {d:.1%}" for a, d in zip(display_names(doc["agents"]), dens))
    if n < 2:
        method, why = "none", "only one agent: there is nothing to merge"
    elif min(dens) >= DENSE:
        method = "task_arithmetic" if mean_cos >= SIMILAR else "ties"
        why = (f"dense task vectors (density at |τ| > {eps:g}: {pct}): nearly every element is shared, so RAM "
               f"reduces to a plain mean; mean pairwise cosine {mean_cos:.2f} "
               + ("— similar directions, task arithmetic adds them well" if method == "task_arithmetic"
                  else "— dissimilar directions, TIES' sign election resolves the conflicts"))
    elif max(numbers["density_spread"], numbers["unique_share_spread"]) >= UNEVEN:
        method = "ram+"
        spread = max(numbers["density_spread"], numbers["unique_share_spread"])
        why = (f"sparse and uneven task vectors (density at |τ| > {eps:g}: {pct}; spread {_x(spread)}): averaging "
               f"would divide each agent's unique updates by {n}; RAM keeps them whole and RAM+ rescales them by "
               f"λ = {', '.join(_lam(r) for r in rows)} (paper preset)")
    else:
        method = "ram"
        why = (f"sparse task vectors of similar density ({pct}; spread {_x(numbers['density_spread'])}): RAM keeps "
               f"unique updates whole; RAM+'s λ ({', '.join(_lam(r) for r in rows)}) would differ little")
    return {"method": method, "summary": f"{method}: {why}", "numbers": numbers}


def _x(v: float) -> str:
    return "∞" if v == float("inf") else f"{v:.1f}×"


def _lam(row: dict[str, Any]) -> str:
    v = row["ram_plus"]["paper"]
    return f"{v:.3f}" if isinstance(v, float) else str(v)
