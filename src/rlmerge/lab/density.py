"""Task-vector inspection for the lab: density, unique share, ρ, pairwise overlap and cosine, in percent.

The numbers come from the engine's own statistics pass, `rlmerge.inspect` (paper Sec. 3.2, arXiv
2601.13572: τ = agent − base in float32 after upcasting, an element changed when |τ| > ε strictly, over all
stored tensors); this module only renames them into the lab's report (percentages, "a&b" pair keys).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

# Paper, Sec. 3.2 (Qwen2.5-7B-Instruct agents): density and unique share per agent family, in percent.
PAPER_DENSITY = {"coding": 3.2, "tool_use": 46.2, "memory": 54.3}
PAPER_UNIQUE_SHARE = {"coding": 6.3, "tool_use": 40.8, "memory": 47.5}


def _pct(x: float | None) -> float:
    return 100.0 * x if x is not None else 0.0


def task_vector_stats(base: Path, agents: Mapping[str, Path], epsilon: float = 1e-5) -> dict[str, Any]:
    """Density, unique share, overlap-unique ratio ρ, pairwise overlap and cosine per agent, in percent.

    Raises the engine's typed errors (`rlmerge.InputError` when an agent does not match the base).
    """
    import rlmerge

    names = list(agents)
    doc = rlmerge.inspect(base, [agents[n] for n in names], epsilon=epsilon).doc
    total = int(doc["elements"])
    per_agent: dict[str, dict[str, float]] = {}
    for name, row in zip(names, doc["per_agent"], strict=True):
        rho = row["rho"]
        per_agent[name] = {
            "density_pct": _pct(row["density"]),
            "unique_share_pct": _pct(row["unique_share"]),
            "rho": float("inf") if rho == "inf" else float(rho),  # JSON's "inf" back to a float
            "changed": float(row["changed"]),
            "lambda_paper": float(row["ram_plus"]["paper"]),  # RAM+'s λ at the paper's r = 0.1, α = 2
        }
    overlap = doc["pairwise"]["overlap"]  # [a][b]: elements both changed
    overlap_pct = {  # share of a's changed elements that b also changed
        f"{a}&{b}": 100.0 * overlap[i][j] / max(1.0, per_agent[a]["changed"])
        for i, a in enumerate(names)
        for j, b in enumerate(names)
        if i != j
    }
    cosine = {
        f"{a}&{b}": float(doc["pairwise"]["cosine"][i][j])
        for i, a in enumerate(names)
        for j, b in enumerate(names)
        if j > i
    }
    # kofn[t][k-1]: agent t's changed elements that k agents changed; each such element is counted k times.
    by_k = [sum(row["kofn"][k - 1] for row in doc["per_agent"]) / k for k in range(1, len(names) + 1)]
    count_share = {"c=0": 100.0 * (total - sum(by_k)) / total if total else 0.0}
    count_share |= {f"c={k}": 100.0 * n / total if total else 0.0 for k, n in enumerate(by_k, start=1)}
    return {
        "total_elements": total,
        "epsilon": epsilon,
        "agents": per_agent,
        "overlap_pct": overlap_pct,
        "cosine": cosine,
        "count_share_pct": count_share,
        "sign_agreement": {
            f"{a}&{b}": doc["pairwise"]["sign_agreement"][i][j]
            for i, a in enumerate(names)
            for j, b in enumerate(names)
            if j > i
        },
    }
