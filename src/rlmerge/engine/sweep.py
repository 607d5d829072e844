"""``rlmerge.sweep``: merge many candidates of the same inputs, score each, rank them, keep the best.

Every candidate is an ordinary merge (``merge.execute``: the same route, backends and passes), sharing one
statistics cache (cache.py): RAM+'s counts are gathered once for every preset, r, α and R; a TIES / Breadcrumbs
selection reuses the round-0 histograms and, for the same densities, the thresholds. A candidate whose model fits
in memory is built into a state dict (``io.memory.MemoryWriter``) and scored there; a larger one is merged into
``candidate-<id>/`` in the sweep folder, scored, and removed. Only the best ``keep`` are written as checkpoints
(through the normal writer, with provenance). ``backend="ray"`` scores candidates in parallel (distributed.py).

A scorer is any callable ``scorer(built) -> {task: score}`` (higher is better); a score is a number or a
``TaskScore`` (its examples, standard error and per-example results: engine/scores.py, recorded in results.json).
``rlmerge.scoring`` makes one from names: the lab's tasks, lm-eval, BFCL, HumanEval, a command, a Python function.

>>> res = rlmerge.sweep("base/", ["a1/", "a2/"], "sweep/", candidates=["ram+ r=0.05,0.1 alpha=1,2"],
...                     scorer=my_scorer, keep=1)                                 # doctest: +SKIP
>>> [(s.candidate.label, s.average) for s in res.ranking]                       # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .._version import __version__
from ..errors import ConfigError, InputError, OutputError, RLMergeError, raise_all
from ..io.hub import push, push_problems
from ..io.sweepdir import SweepDir
from ..report.sweep import pareto, render_report
from ..stream.blocks import DEFAULT_BLOCK, device_type
from .build import Built, Context, Memory, Scored, Scorer, build_and_score
from .cache import StatsCache, inputs_key
from .candidates import Candidate, check, parse_all
from .merge import check_copies, merge
from .preflight import Preflight, flat, preflight
from .scores import TaskScore, details_from_json, make

__all__ = ["Built", "NothingScored", "Scored", "Scorer", "SweepResult", "TaskScore", "sweep"]
Backend = Literal["local", "ray"]
RESULTS = "results.json"
SCHEMA = "rlmerge.sweep"


@dataclass
class SweepResult:
    scored: list[Scored]  # in candidate order
    ranking: list[Scored]  # best average first (candidates without scores last, in order)
    pareto: list[Scored]  # not beaten on every task by another candidate
    kept: list[Path] = field(default_factory=list)
    output: Path | None = None
    seconds: float = 0.0
    cache_hits: dict[str, int] = field(default_factory=dict)
    url: str | None = None  # where --push-to-hub put the best candidate

    @property
    def failed(self) -> list[Scored]:
        """The candidates the scorer failed on (each with its ``error``), in candidate order."""
        return [s for s in self.scored if s.error is not None]

    @property
    def statistics_passes(self) -> int:
        return sum(s.passes.count("statistics") for s in self.scored)

    @property
    def merge_passes(self) -> int:
        return sum(s.passes.count("merge") for s in self.scored)


def sweep(base: str | os.PathLike[str], agents: Sequence[str | os.PathLike[str]],
          output: str | os.PathLike[str] | None = None, *, candidates: Sequence[Candidate | str | Mapping[str, Any]],
          scorer: Scorer | None = None, keep: int = 0, resume: bool = False, force: bool = False,
          backend: Backend = "local", workers: int | None = None, memory: Memory = "auto", dtype: str | None = None,
          block_size: int = DEFAULT_BLOCK, device: str = "cpu", seed: int = 0, allow_missing: bool = False,
          count_tied_twice: bool = False, settings: Mapping[str, Any] | None = None, cache: StatsCache | None = None,
          on_result: Callable[[Scored], None] | None = None, quiet: bool = True, push_to_hub: str | None = None,
          private: bool = False, revision: str | None = None) -> SweepResult:
    """Merge and score every candidate; see the module docstring.

    ``output`` None: nothing is written (the Python API's grid search; a candidate too large for memory goes to a
    temporary folder). ``settings``: what else decides the scores (the tasks, their sizes), recorded in
    ``results.json`` and checked by ``resume``. ``on_result`` is called with each candidate as it is scored.
    """
    t0 = time.perf_counter()
    grids = [c for c in candidates if not isinstance(c, Candidate)]  # a recipe's candidates come parsed
    cands = check([*(c for c in candidates if isinstance(c, Candidate)),
                   *(parse_all(grids, seed=seed) if grids else [])])
    problems: list[RLMergeError] = []
    if type(keep) is not int or keep < 0:
        problems.append(ConfigError(f"keep = {keep!r} must be a whole number ≥ 0"))
    elif keep and output is None:
        problems.append(ConfigError(f"keep = {keep}: the best candidates are kept only in a sweep folder (-o)"))
    if push_to_hub is not None:
        problems += push_problems(push_to_hub, revision=revision) if type(keep) is int and keep >= 1 else [
            ConfigError("--push-to-hub uploads the best kept candidate: give --keep 1 (or more)")]
    if memory not in ("auto", "always", "never") or backend not in ("local", "ray"):
        problems.append(ConfigError(f"memory = {memory!r}, backend = {backend!r}",
                                    hint="memory: auto, always or never; backend: local or ray"))
    options = {"dtype": dtype, "block_size": block_size, "device": device, "allow_missing": allow_missing,
               "count_tied_twice": count_tied_twice}
    claim = (lambda models: SweepDir(output, inputs=models, resume=resume, force=force)) \
        if output is not None else None
    pf = _check(base, agents, cands, options, problems, claim)
    try:
        assert pf.match is not None and pf.base is not None  # no problems
        check_copies(pf.match)  # once for every candidate: they all copy the same tensors
        if backend == "ray":
            from .distributed import init  # Ray is imported only here (the ``ray`` extra)

            init()  # reached (or refused) before the sweep folder is claimed
        doc = _new_doc(pf, cands, settings, options)
        with contextlib.ExitStack() as stack:
            folder = stack.enter_context(claim(pf.models)) if claim is not None else None
            cache = cache if cache is not None else StatsCache(folder)
            done = _resumed(folder, doc, cands) if resume and folder is not None else {}
            ctx = Context(str(base), [str(a) for a in agents], options, memory, pf.base.side_dir,
                          folder.path if folder is not None else None)
            scored = {i: s for i, s in done.items()}
            todo = [c for c in cands if c.id not in scored]

            def record(s: Scored) -> None:
                scored[s.candidate.id] = s
                doc["candidates"] = [scored[c.id].to_json(doc["examples"]) for c in cands if c.id in scored]
                if folder is not None:
                    folder.write(RESULTS, _dump(doc))
                    cache.save()
                if on_result is not None:
                    on_result(s)

            if backend == "ray":
                from .distributed import score_on_ray  # Ray is imported only here (the ``ray`` extra)

                score_on_ray(ctx, todo, scorer, cache, record, workers=workers)
            else:
                for c in todo:
                    record(build_and_score(ctx, c, scorer, cache))
            ordered = [scored[c.id] for c in cands]
            doc["candidates"] = [s.to_json(doc["examples"]) for s in ordered]  # also when --resume found all done
            result = _summary(ordered, doc, output=folder.path if folder is not None else None)
            if folder is not None:
                result.kept = _keep(folder, ctx, result, doc, cache, keep, quiet=quiet)
                if push_to_hub is not None and result.kept:  # written and proven: now upload the best
                    result.url = push(result.kept[0], push_to_hub, private=private, revision=revision,
                                      message=f"Upload the best candidate of an rlmerge sweep "
                                              f"({result.ranking[0].candidate.label})")
                folder.write(RESULTS, _dump(doc))
                for name, data in render_report(doc).items():
                    folder.write(name, data)
                cache.save()
    finally:
        pf.close()
    result.seconds = time.perf_counter() - t0
    result.cache_hits = dict(cache.hits)
    if result.scored and len(result.failed) == len(result.scored):
        raise _nothing_scored(result)
    return result


class NothingScored(InputError):
    """The scorer failed on every candidate of a sweep (each failure is recorded in its results)."""


def _nothing_scored(result: SweepResult) -> NothingScored:
    """The scorer failed on every candidate: what it said (each distinct message once), and where it is recorded."""
    said = list(dict.fromkeys(s.error or "" for s in result.failed))
    more = f" (and {len(said) - 3} other messages)" if len(said) > 3 else ""
    return NothingScored(f"the scorer failed on every candidate ({len(result.failed)}), so nothing could be scored: "
                      + " | ".join(said[:3]) + more, file=str(result.output / RESULTS) if result.output else None,
                      hint=("each candidate's failure is recorded in results.json and report.md; " if result.output
                            else "") + "fix the cause, then rerun (with --resume: failed candidates are scored again)")


def _check(base: Any, agents: Sequence[Any], cands: list[Candidate], options: dict[str, Any],
           problems: list[RLMergeError], claim: Callable[[list[Any]], SweepDir] | None) -> Preflight:
    """Every candidate's preflight (headers only) and the sweep folder's problems (``claim``), every problem at
    once, before a weight is read; the first candidate's preflight, open, for the sweep."""
    first: Preflight | None = None
    seen: set[str] = set()
    for c in cands:
        pf = preflight(base, agents, None, method=c.method, params=dict(c.params), seed=c.seed, **options)
        for p in pf.problems:
            for q in flat(p):
                text = q.render()
                if text not in seen:  # an input's problem is every candidate's: said once
                    seen.add(text)
                    problems.append(q)
        if first is None:
            first = pf
        else:
            pf.close()
    if claim is not None and first is not None:
        problems += claim(first.models).problems()
    if problems and first is not None:
        first.close()
    raise_all(problems)
    assert first is not None  # candidates are never empty (parse_all)
    return first


# -- results.json -------------------------------------------------------------------------------------------
def _new_doc(pf: Preflight, cands: list[Candidate], settings: Mapping[str, Any] | None,
             options: dict[str, Any]) -> dict[str, Any]:
    assert pf.match is not None and pf.base is not None
    fixed = {"inputs": inputs_key(pf.match), "settings": dict(settings or {}),
             "dtype": str(pf.out_dtype) if pf.out_dtype else None, "device": device_type(options["device"])}
    return {"schema": SCHEMA, "version": 1, "rlmerge_version": __version__,
            "fingerprint": json.dumps(fixed, sort_keys=True, default=str),
            "base": pf.base.label, "agents": [a.label for a in pf.match.agents],
            "settings": dict(settings or {}), "planned": [c.to_json() for c in cands], "candidates": [],
            "examples": {}}  # per-example samples' ids, shared by the candidates scored on them (scores.py)


def _dump(doc: dict[str, Any]) -> bytes:
    return (json.dumps(doc, indent=2, default=str) + "\n").encode()


def _resumed(folder: SweepDir, doc: dict[str, Any], cands: list[Candidate]) -> dict[str, Scored]:
    """The candidates an earlier run of this sweep finished (its results.json), after checking it is this sweep."""
    raw = folder.read(RESULTS)
    if raw is None:
        return {}
    try:
        old = json.loads(raw)
    except ValueError:
        return {}
    if not isinstance(old, dict) or old.get("schema") != SCHEMA or old.get("fingerprint") != doc["fingerprint"]:
        raise OutputError("the sweep in this folder was run on other inputs or with other scoring settings",
                          file=str(folder.path / RESULTS),
                          hint="resume with the same models, tasks and options, or pass --force to start over")
    planned = {c.id: c for c in cands}
    examples = old.get("examples") or {}
    out = {}
    records = old.get("candidates")
    for rec in records if isinstance(records, list) else []:
        c = planned.get(rec.get("id")) if isinstance(rec, dict) else None
        if c is None or rec.get("error") is not None:  # a candidate the scorer failed on is scored again
            continue
        try:
            details = {k: make(v, task=k, where=RESULTS)
                       for k, v in details_from_json(dict(rec["scores"]), rec.get("details"), examples).items()}
            out[c.id] = Scored(c, {k: v.score for k, v in details.items()}, str(rec["where"]),
                               float(rec["merge_seconds"]), float(rec["score_seconds"]),
                               [str(p) for p in rec["passes"]], int(rec["read_bytes"]), rec.get("lambdas"), details)
        except (AttributeError, KeyError, TypeError, ValueError, RLMergeError):
            continue  # a record this rlmerge cannot read back (an older one's, or edited): the candidate is redone
    return out


def _summary(ordered: list[Scored], doc: dict[str, Any], *, output: Path | None) -> SweepResult:
    """Rank: scored candidates by average, then those without scores (no scorer), then those the scorer failed on."""
    scored = [s for s in ordered if s.scores]
    ranking = (sorted(scored, key=lambda s: -_tie(s.average or 0.0))
               + [s for s in ordered if not s.scores and s.error is None] + [s for s in ordered if s.error is not None])
    front = pareto([s.scores for s in scored])
    doc["tasks"] = list(dict.fromkeys(k for s in ordered for k in s.scores))
    doc["ranking"] = [s.candidate.id for s in ranking]
    doc["pareto"] = [scored[i].candidate.id for i in front]
    return SweepResult(ordered, ranking, [scored[i] for i in front], output=output)


def _tie(average: float) -> float:
    """The average to 12 significant digits: what ranks candidates. Scores are measured fractions, and the float
    rounding of their sum must not break a tie: 3 of 48 right on one task, or 2 on one and 1 on another, average
    2.0833333333333335 and 2.083333333333333 % over three tasks. The sort is stable, so of equal averages the
    first candidate (in the order given: a grid lists its defaults first) ranks first."""
    return float(f"{average:.12g}")


def _keep(folder: SweepDir, ctx: Context, result: SweepResult, doc: dict[str, Any], cache: StatsCache, keep: int,
          *, quiet: bool) -> list[Path]:
    """Write the best ``keep`` candidates as checkpoints ``best-1`` … (with provenance); remove stale ones. A candidate
    the scorer failed on is never kept."""
    kept, names = [], {}
    for rank, s in enumerate([s for s in result.ranking if s.error is None][:keep], 1):
        name = f"best-{rank}"
        out = folder.checkpoint(name)
        recipe = {"sweep": {"rank": rank, "candidate": s.candidate.to_json(), "scores": s.scores,
                            "average": s.average, "results": str(folder.path / RESULTS)}}
        if not _holds(out, s.candidate.id):
            merge(ctx.base, ctx.agents, out, method=s.candidate.method, params=dict(s.candidate.params),
                  seed=s.candidate.seed, force=True, recipe=recipe, cache=cache, quiet=quiet, **ctx.options)
        kept.append(out)
        names[name] = s.candidate.id
    for stale in folder.kept():
        if stale not in names:
            folder.remove_checkpoint(stale)
    doc["kept"] = names
    return kept


def _holds(out: Path, cid: str) -> bool:
    """Whether ``out`` is a finished checkpoint of candidate ``cid`` that a sweep kept."""
    try:
        doc = json.loads((out / "rlmerge.json").read_text())
    except (OSError, ValueError):
        return False
    sweep = (doc.get("recipe") or {}).get("sweep") or {}
    return sweep.get("candidate", {}).get("id") == cid and SweepDir.proven(out)
