"""Task-vector inspection: density, unique share and pairwise overlap of the agents' changes.

Measured exactly as the paper's Sec. 3.2 (arXiv 2601.13572): τ = agent − base in float32 after upcasting
the bf16 checkpoints, an element is changed when |τ| > ε (strictly), counted over all stored tensors of
the model. This is an analysis of small lab checkpoints held in memory; merging itself goes through the
engine (`rlmerge.merge`), never through this module.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

# Paper, Sec. 3.2 (Qwen2.5-7B-Instruct agents): density and unique share per agent family, in percent.
PAPER_DENSITY = {"coding": 3.2, "tool_use": 46.2, "memory": 54.3}
PAPER_UNIQUE_SHARE = {"coding": 6.3, "tool_use": 40.8, "memory": 47.5}


def load_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    """All tensors of a (possibly sharded) safetensors checkpoint, upcast to float32."""
    files = sorted(Path(checkpoint).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {checkpoint}; save the model with safe_serialization=True")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update({k: v.float() for k, v in load_file(f).items()})
    return state


def task_vector_stats(base: Path, agents: dict[str, Path], epsilon: float = 1e-5) -> dict[str, object]:
    """Density, unique share, overlap-unique ratio ρ, pairwise overlap and cosine per agent, in percent."""
    base_state = load_state(base)
    names = list(agents)
    masks: dict[str, list[torch.Tensor]] = {}
    deltas: dict[str, list[torch.Tensor]] = {}
    for name, path in agents.items():
        state = load_state(path)
        if state.keys() != base_state.keys():
            raise ValueError(f"{path} does not have the base's tensors: {sorted(state.keys() ^ base_state.keys())[:5]}")
        deltas[name] = [(state[k] - base_state[k]).flatten() for k in sorted(base_state)]
        masks[name] = [d.abs() > epsilon for d in deltas[name]]
    total = sum(t.numel() for t in base_state.values())
    count = [sum(masks[n][i].int() for n in names) for i in range(len(base_state))]  # c_i per tensor
    per_agent: dict[str, dict[str, float]] = {}
    for n in names:
        changed = sum(int(m.sum()) for m in masks[n])
        shared = sum(int((m & (c >= 2)).sum()) for m, c in zip(masks[n], count, strict=True))
        unique = changed - shared
        per_agent[n] = {
            "density_pct": 100.0 * changed / total,
            "unique_share_pct": 100.0 * unique / changed if changed else 0.0,
            # ρ as the method page defines its edge cases: 0 for an unchanged agent, ∞ with no unique part.
            "rho": (shared / unique if unique else float("inf")) if changed else 0.0,
            "changed": float(changed),
        }
    overlap = {  # share of a's changed elements that b also changed
        f"{a}&{b}": 100.0
        * sum(int((ma & mb).sum()) for ma, mb in zip(masks[a], masks[b], strict=True))
        / max(1.0, per_agent[a]["changed"])
        for a in names
        for b in names
        if a != b
    }
    cosine = {}
    for i, a in enumerate(names):
        va = torch.cat(deltas[a])
        for b in names[i + 1 :]:
            vb = torch.cat(deltas[b])
            cosine[f"{a}&{b}"] = float(torch.nn.functional.cosine_similarity(va, vb, dim=0))
    by_c = {f"c={k}": 100.0 * sum(int((c == k).sum()) for c in count) / total for k in range(len(names) + 1)}
    return {
        "total_elements": total,
        "epsilon": epsilon,
        "agents": per_agent,
        "overlap_pct": overlap,
        "cosine": cosine,
        "count_share_pct": by_c,
    }
