"""Hyperparameter search on a validation split: one `rlmerge.sweep` per method, the best merge kept.

`evaluate_candidates` is the one function that does the search: a row's grid in, validation scores out. It runs
the engine's `rlmerge.sweep` once: every candidate is merged in float32 (so that no method is rounded back to
bf16 before it is scored), in memory where it fits, and scored by the scorer the sweep calls (the lab's:
`rlmerge.scoring.TaskScorer` on the validation split, in the view of the lab's models, `views.py`); only the
sweep's best is written, as `best-1/` in the row's sweep folder. A cache the caller passes (`sweeping.cache.
StatsCache`) lets the rows of one seed count each statistic once: RAM+'s counts serve every RAM+ row but
magnitude-ρ's (its exact sums are not cached).
`pick` is the sweep's ranking (best validation average, the first of equals: grids list defaults first);
`grid_position` says where the pick sits in its grid.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlmerge.lab.merging import EngineUnavailable, MergeFailed, skip_reason

# A sweep's scorer: the built candidate (rlmerge.Built: tensors in memory or a folder) → task → score.
Scorer = Callable[[Any], Mapping[str, float]]


@dataclass
class CandidateScore:
    params: dict[str, Any]
    val: dict[str, float]  # task → validation score as the scorer gave it (the lab's: "lab:FAMILY" → accuracy in
    #                        %); empty when the grid has one point: nothing to pick
    info: dict[str, Any] = field(default_factory=dict)  # what the engine reported (λ per agent for RAM+)
    path: Path | None = None  # the kept checkpoint (best-1), for the chosen candidate only
    rank: int = 0  # place in the sweep's ranking (0: the chosen one)

    @property
    def val_average(self) -> float:
        """The sweep's average of `val` (what it ranks by)."""
        return sum(self.val.values()) / len(self.val) if self.val else 0.0


def evaluate_candidates(
    base: Path,
    agents: Sequence[Path],
    method: str,
    candidates: Sequence[Mapping[str, Any]],
    work: Path,
    score: Scorer,
    *,
    extra: Mapping[str, Any] | None = None,
    seed: int = 0,
    cache: Any = None,
) -> list[CandidateScore]:
    """Sweep the candidates (float32 output), score each on validation, keep only the best merge (`work/best-1`).

    `work` is the sweep's folder (made by the sweep; an earlier sweep's is started over). `extra` parameters go
    to every candidate but are not part of it (e.g. Fisher's side-input paths). A candidate's `seed` entry, if
    any, is its seed (random methods: DARE, DELLA), else `seed`. A single candidate is merged but not scored.
    Raises the lab's EngineUnavailable / MergeFailed.
    """
    reason = skip_reason(method)
    if reason is not None:
        raise EngineUnavailable(reason)
    import rlmerge
    from rlmerge.sweeping.candidates import Candidate

    cands = []
    for params in candidates:
        merged = {k: v for k, v in {**params, **(extra or {})}.items() if k != "seed"}
        cands.append(Candidate(method, tuple(merged.items()), int(params.get("seed", seed))))
    settings = getattr(score, "settings", None)
    try:
        res = rlmerge.sweep(
            base,
            agents,
            work,
            candidates=cands,
            scorer=score if len(cands) > 1 else None,
            keep=1,
            force=True,  # as the old loop overwrote its candidate folders: the lab reruns a row whole
            dtype="float32",  # scored as the method computed it (the authors' script writes float32 too)
            settings=settings() if callable(settings) else None,
            cache=cache,
        )
        ids = [c.id for c in cands]
    except rlmerge.NothingScored as err:  # the lab's own scorer failing is a bug to see, not a row to skip
        raise RuntimeError(str(err)) from err
    except rlmerge.RLMergeError as err:  # e.g. a preset or parameter this engine does not know
        raise MergeFailed(str(err)) from err
    if res.failed:  # the sweep records a scorer's failure and goes on; a row's numbers must not lack a candidate
        raise RuntimeError(f"the scorer failed on {len(res.failed)} candidate(s): {res.failed[0].error}")
    scored = {s.candidate.id: s for s in res.scored}
    rank = {s.candidate.id: i for i, s in enumerate(res.ranking)}
    out = []
    for params, cid in zip(candidates, ids, strict=True):
        s = scored[cid]
        info = {"lambdas": [float(x) for x in s.lambdas]} if s.lambdas is not None else {}
        out.append(CandidateScore(dict(params), dict(s.scores), info, res.kept[0] if rank[cid] == 0 else None,
                                  rank[cid]))
    return out


def pick(results: Sequence[CandidateScore]) -> CandidateScore:
    """The candidate the sweep ranked first: best validation average, the first of equals (grids list defaults
    first; equal to 12 significant digits, so the float rounding of a sum does not break a tie)."""
    if not results:
        raise ValueError("no candidates were evaluated")
    return min(results, key=lambda c: c.rank)  # min keeps the first of equal keys (a candidate given twice)


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
