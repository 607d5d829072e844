"""The mechanism behind sparse (or dense) RL task vectors, measured: density against |w|, and a pruning control.

The threshold hypothesis (PULSE, arXiv 2602.03839; "The Path Not Taken", arXiv 2511.08567): a bf16
weight can only move in steps of its own spacing, 2^(e−7) at |w| in [2^e, 2^(e+1)), so a change smaller
than half a step, ≈ |w|/256 to |w|/512, is absorbed. Adam moves a weight by ≈ lr per step whatever its
gradient, so whether a weight changes depends on |w| against ~256 × (its total drift): small weights
change, large ones do not. `density_by_magnitude` bins the base's |w| by binary exponent and measures
the changed fraction in each bin, which the hypothesis predicts to fall from ~1 to ~0 as |w| grows.

`prune_task_vector` is the control for "is it the sparsity itself?": it keeps only the largest |τ|
of an agent, to a chosen density (the paper's 3.2 / 46.2 / 54.3 %), and writes the sparse agent.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

EXPONENTS = range(-16, 3)  # |w| bins [2^e, 2^(e+1)) for e = -16 … 2, plus "below" and "zero"


def _load(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    return state


def density_by_magnitude(base: Path, agent: Path, epsilon: float = 1e-5) -> list[dict[str, Any]]:
    """Changed fraction (|τ| > ε) of the elements in each |w₀| bin [2^e, 2^(e+1)); bins with no element dropped.

    Float tensors only; the base's values (bf16 upcast) decide the bin.
    """
    b_state, a_state = _load(base), _load(agent)
    n = torch.zeros(len(EXPONENTS) + 2, dtype=torch.float64)
    changed = torch.zeros_like(n)
    edges = torch.tensor([2.0**e for e in EXPONENTS], dtype=torch.float32)
    for name, b in b_state.items():
        if not b.is_floating_point() or name not in a_state:
            continue
        w = b.float().abs().flatten()
        moved = ((a_state[name].float() - b.float()).abs().flatten() > epsilon).double()
        # bin 0: w == 0; bin 1: 0 < w < 2^-16; bin 2 + i: [2^e_i, 2^e_{i+1}) (the last bin open above)
        idx = torch.where(w == 0, 0, 1 + torch.bucketize(w, edges, right=True))
        n += torch.bincount(idx, minlength=len(n)).double()
        changed += torch.bincount(idx, weights=moved, minlength=len(n))
    labels = [(0.0, 0.0), (0.0, 2.0 ** EXPONENTS[0])] + [(2.0**e, 2.0 ** (e + 1)) for e in EXPONENTS]
    labels[-1] = (labels[-1][0], math.inf)
    return [
        {"low": lo, "high": hi, "elements": int(k), "density": float(c / k)}
        for (lo, hi), k, c in zip(labels, n.tolist(), changed.tolist(), strict=True)
        if k > 0
    ]


def prune_task_vector(base: Path, agent: Path, density: float, out: Path) -> dict[str, float]:
    """Write `agent` with all but the largest-|τ| `density` fraction of its elements reset to the base.

    The kept elements take the agent's own stored value and the rest the base's, so the result is exact
    in the agents' dtype. Ties at the threshold are kept. Other files (config, tokenizer) are copied.
    """
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density {density} must be in (0, 1]")
    b_state, a_state = _load(base), _load(agent)
    names = [k for k, v in b_state.items() if v.is_floating_point()]
    mags = torch.cat([(a_state[k].float() - b_state[k].float()).abs().flatten() for k in names])
    k = max(1, round(density * mags.numel()))
    threshold = float(torch.topk(mags, k, sorted=False).values.min())
    threshold = max(threshold, torch.finfo(torch.float32).tiny)  # never keep an element with τ = 0
    out.mkdir(parents=True, exist_ok=False)
    pruned: dict[str, torch.Tensor] = {}
    kept = 0
    for name, a in a_state.items():
        if name not in names:
            pruned[name] = a
            continue
        keep = (a.float() - b_state[name].float()).abs() >= threshold
        kept += int(keep.sum())
        pruned[name] = torch.where(keep, a, b_state[name].to(a.dtype)).contiguous()
    save_file(pruned, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in Path(agent).iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy2(f, out / f.name)
    return {"target_density": density, "kept": float(kept), "elements": float(mags.numel()), "threshold": threshold}
