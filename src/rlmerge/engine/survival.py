"""How much of a method's rescale of unique elements the output dtype kept (RAM+'s λ; docs/methods.md, "Rounding").

A method declares ``unique_scale`` (methods/spec.py): the per-agent constant its rule multiplies a unique
element's τ by. For every tensor it merges, the backend counts per agent [rescaled, kept]: the elements only that
agent changed, in a tensor where its factor is not 1, and of those the ones whose written value differs from
RAM's (``b + τ``) rounded to the same dtype (kernels/fused.py, in the fused loop; ``count_torch`` on the torch
path). The counts go with the tensor's shard (``CheckpointWriter.annotate``), so a resumed merge reports what an
unstopped one does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .._torch import torch
from ..methods import MethodSpec

NOTE = "rescale"  # the key of the counts in a tensor's note
WARN_BELOW = 0.5  # warn when an agent keeps less than this share of its rescale


def rescaled(spec: MethodSpec, constants: Mapping[str, Any], n: int) -> np.ndarray | None:
    """[N] bool: the agents whose unique elements this tensor rescales (factor ≠ 1 in float32, as the rule
    reads it), or None for a method without a rescale."""
    if spec.unique_scale is None:
        return None
    lam = np.asarray(constants[spec.unique_scale], dtype=np.float32).reshape(n)
    return lam != np.float32(1.0)


def count_torch(base: torch.Tensor, deltas: torch.Tensor, out: torch.Tensor, eps: float,
                flags: np.ndarray) -> np.ndarray:
    """[N, 2] int64 counts of one block on the torch path: base [n], deltas [N, n] float32, out [n] as written."""
    changed = deltas.abs() > eps
    only = changed & (changed.sum(0) == 1)
    ram = (base.unsqueeze(0) + deltas).to(out.dtype)  # RAM's value of each agent's unique element, rounded
    kept = only & (ram != out.unsqueeze(0))
    counts = torch.stack([only.sum(1), kept.sum(1)], 1).cpu().numpy().astype(np.int64)
    counts[~flags] = 0
    return counts


def totals(notes: Mapping[str, Any], n: int) -> np.ndarray | None:
    """[N, 2] sums of every tensor's counts, or None when no tensor was counted."""
    counted = [np.asarray(v[NOTE], dtype=np.int64) for v in notes.values() if isinstance(v, dict) and NOTE in v]
    return np.sum(counted, axis=0).reshape(n, 2) if counted else None


def fractions(counts: np.ndarray | None) -> list[float | None] | None:
    """Per agent, the share of its rescaled unique elements whose written value keeps the rescale (None: no
    element was rescaled)."""
    if counts is None:
        return None
    return [float(k) / float(r) if r else None for r, k in counts.tolist()]


def warnings(labels: Sequence[str], counts: np.ndarray | None, dtypes: Sequence[str]) -> list[str]:
    """A warning per agent that kept less than WARN_BELOW of its rescale in the output dtype."""
    out = []
    for label, (r, k) in zip(labels, [] if counts is None else counts.tolist()):
        if r and k / r < WARN_BELOW:
            out.append(f"only {k / r:.2%} of {label}'s rescaled unique elements ({k:,} of {r:,}) keep λ in "
                       f"{'/'.join(dtypes)}: the rest rounded back to RAM's value; write float32 (--dtype float32, "
                       "ram+'s default) to keep the method")
    return out
