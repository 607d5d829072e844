"""Hyperparameter search on a validation split: merge every candidate, score it, keep the best.

`evaluate_candidates` is the one function that does the search: candidates in, validation scores out. It
merges through the lab's door to the engine (`merging.merge_checkpoints`, i.e. `rlmerge.merge`, written
in float32 so that no method is rounded back to bf16 before it is scored). When the engine grows its own
`rlmerge sweep`, that function is the only thing to replace. `pick` and `grid_position` read its output.
"""

from __future__ import annotations

import shutil
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlmerge.lab.merging import merge_checkpoints

# Validation scores of one checkpoint: family → accuracy in 0..1.
Scorer = Callable[[Path], Mapping[str, float]]


@dataclass
class CandidateScore:
    params: dict[str, Any]
    val: dict[str, float]  # family → validation accuracy (empty when the grid has one point: nothing to pick)
    info: dict[str, Any] = field(default_factory=dict)  # what the engine reported (λ per agent for RAM+)
    path: Path | None = None  # the merged checkpoint, kept for the chosen candidate only

    @property
    def val_average(self) -> float:
        return statistics.fmean(self.val.values()) if self.val else 0.0


def evaluate_candidates(
    base: Path,
    agents: Sequence[Path],
    method: str,
    candidates: Sequence[Mapping[str, Any]],
    work: Path,
    score: Scorer,
    *,
    extra: Mapping[str, Any] | None = None,
) -> list[CandidateScore]:
    """Merge each candidate (float32 output) and score it on validation; keep only the best merge on disk.

    `extra` parameters go to every candidate but are not part of it (e.g. Fisher side-input paths).
    A single candidate is merged but not scored. Raises the lab's EngineUnavailable / MergeFailed.
    """
    results: list[CandidateScore] = []
    best: CandidateScore | None = None
    for i, params in enumerate(candidates):
        out = work / f"candidate-{i}"
        info = merge_checkpoints(base, agents, out, method, {**params, **(extra or {})})
        val = dict(score(out)) if len(candidates) > 1 else {}
        cand = CandidateScore(dict(params), val, info, out)
        results.append(cand)
        if best is None or cand.val_average > best.val_average:
            if best is not None:
                _discard(best)
            best = cand
        else:
            _discard(cand)
    return results


def _discard(cand: CandidateScore) -> None:
    # Only a folder this module just had the engine write (work/candidate-i) is removed.
    if cand.path is not None:
        shutil.rmtree(cand.path, ignore_errors=True)
        cand.path = None


def pick(results: Sequence[CandidateScore]) -> CandidateScore:
    """The candidate with the best validation average (the first of equals: grids list defaults first)."""
    if not results:
        raise ValueError("no candidates were evaluated")
    return max(results, key=lambda c: c.val_average)  # max keeps the first of equal keys


def grid_position(grid: Mapping[str, Sequence[Any]], chosen: Mapping[str, Any]) -> dict[str, str]:
    """Per searched parameter: where the chosen value sits in its grid: low edge, high edge or inside."""
    out: dict[str, str] = {}
    for key, values in grid.items():
        if len(values) < 2:
            out[key] = "fixed"
            continue
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            out[key] = "categorical"
            continue
        lo, hi = min(values), max(values)
        v = chosen[key]
        out[key] = "low edge" if v == lo else "high edge" if v == hi else "inside"
    return out
