"""``rlmerge.sweep``: merge many candidates of the same inputs, score each, rank them, keep the best.

Every candidate is an ordinary merge (``engine.merge.execute``: the same route, backends and passes), sharing one
statistics cache (cache.py): RAM+'s counts are gathered once for every preset, r, α and R; a TIES / Breadcrumbs
selection reuses the round-0 histograms and, for the same densities, the thresholds. A candidate whose model fits
in memory is built into a state dict (``io.memory.MemoryWriter``) and scored there; a larger one is merged into
``candidate-<id>/`` in the sweep folder, scored, and removed. Only the best ``keep`` are written as checkpoints
(through the normal writer, with provenance). ``backend="ray"`` scores candidates in parallel (distributed.py).

The candidates are a grid's (candidates.py), or a search's trials (``search="tpe"`` …: space.py, search.py), asked
of Optuna and told their average. After the ranking, the candidates the scores cannot tell from the best are marked
(noise.py), and ``confirm`` scores the best again on a held-out split.

A scorer is any callable ``scorer(built) -> {task: score}`` (higher is better); a score is a number or a
``TaskScore`` (its examples, standard error and per-example results: scores.py, recorded in results.json).
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

from ..engine.merge import check_copies, merge
from ..engine.preflight import Preflight, flat, preflight
from ..errors import ConfigError, InputError, RLMergeError, raise_all
from ..io.hub import push, push_problems
from ..io.sweepdir import SweepDir
from ..report.sweep import pareto, render_report
from ..stream.blocks import DEFAULT_BLOCK
from .build import Built, Context, Memory, Reference, Scored, Scorer, build_and_score, score_reference
from .cache import StatsCache
from .candidates import Candidate, check, parse_all
from .noise import DRAWS, average_interval, compare
from .results import RESULTS, dump, from_record, new_doc, old_doc, read_confirmed, read_references, resumed
from .scores import TaskScore, details_json
from .space import Space, parse_spaces

__all__ = ["Built", "NothingScored", "Scored", "Scorer", "SweepResult", "TaskScore", "sweep"]
Backend = Literal["local", "ray"]
Search = Literal["grid", "random", "tpe", "cmaes"]


@dataclass
class SweepResult:
    scored: list[Scored]  # in candidate order
    ranking: list[Scored]  # best average first (candidates without scores last, in order)
    pareto: list[Scored]  # not beaten on every task by another candidate
    kept: list[Path] = field(default_factory=list)
    output: Path | None = None
    seconds: float = 0.0
    cache_hits: dict[str, int] = field(default_factory=dict)
    # the best and those the scores cannot tell from it (noise.py), best first; empty where nothing is known
    indistinguishable: list[Scored] = field(default_factory=list)
    confirmed: dict[str, Scored] = field(default_factory=dict)  # candidate id → its scores on the held-out split
    url: str | None = None  # where --push-to-hub put the best candidate
    references: list[Scored] = field(default_factory=list)  # the inputs scored as they are (base, agents), in order
    references_confirmed: dict[str, Scored] = field(default_factory=dict)  # reference id → held-out scores

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
          on_result: Callable[[Scored], None] | None = None, quiet: bool = True, search: Search = "grid",
          trials: int | None = None, confirm: Scorer | None = None, confirm_top: int | None = None,
          push_to_hub: str | None = None, private: bool = False, revision: str | None = None,
          references: bool = False) -> SweepResult:
    """Merge and score every candidate; see the module docstring.

    ``output`` None: nothing is written (the Python API's grid search; a candidate too large for memory goes to a
    temporary folder). ``settings``: what else decides the scores (the tasks, their sizes), recorded in
    ``results.json`` and checked by ``resume``. ``on_result`` is called with each candidate as it is scored.
    ``search``: ``grid`` (every candidate of the grids), or ``random``, ``tpe``, ``cmaes``: ``trials`` candidates
    sampled from the spaces ``candidates`` describe (space.py, search.py). ``confirm``: a scorer on a held-out split
    that scores the best ``confirm_top`` (default: ``keep``, else 3) again (``SweepResult.confirmed``).
    ``references``: score the base and each agent as they are, by the same scorer on the same examples, before the
    candidates (``SweepResult.references``; results.json's ``references`` and ``versus_inputs``); never ranked,
    kept or pushed, and not a search's trials.
    """
    t0 = time.perf_counter()
    problems: list[RLMergeError] = []
    cands, spaces = _plan(candidates, search, trials, seed, problems)
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
    if spaces is not None and scorer is None:
        problems.append(ConfigError(f"--search {search}: a search is steered by scores, and nothing scores the "
                                    "candidates", hint="give --tasks (or scorer=)"))
    if references and scorer is None:
        problems.append(ConfigError("--references scores the inputs beside the candidates, and nothing scores them",
                                    hint="give --tasks (or scorer=)"))
    if confirm_top is not None and (type(confirm_top) is not int or confirm_top < 1):
        problems.append(ConfigError(f"confirm_top = {confirm_top!r} must be a whole number ≥ 1"))
    options = {"dtype": dtype, "block_size": block_size, "device": device, "allow_missing": allow_missing,
               "count_tied_twice": count_tied_twice}
    claim = (lambda models: SweepDir(output, inputs=models, resume=resume, force=force)) \
        if output is not None else None
    pf = _check(base, agents, cands, options, problems, claim)
    try:
        assert pf.match is not None and pf.base is not None  # no problems
        check_copies(pf.match)  # once for every candidate: they all copy the same tensors
        refs = _references(pf) if references else []  # refused here: before anything is merged or written
        if backend == "ray":
            from ..engine.distributed import init  # Ray is imported only here (the ``ray`` extra)

            init()  # reached (or refused) before the sweep folder is claimed
        about = None if spaces is None else {"kind": search, "seed": seed, "spaces": [sp.text for sp in spaces]}
        doc = new_doc(pf, cands if spaces is None else [], settings, options, about)
        with contextlib.ExitStack() as stack:
            folder = stack.enter_context(claim(pf.models)) if claim is not None else None
            cache = cache if cache is not None else StatsCache(folder)
            ctx = Context(str(base), [str(a) for a in agents], options, memory, pf.base.side_dir,
                          folder.path if folder is not None else None)
            run = _Run(ctx, cache, folder, doc, backend=backend, workers=workers, on_result=on_result)
            # what an earlier run recorded, read once, before this one saves anything over its results.json
            old = old_doc(folder) if resume and folder is not None else None
            if resume and folder is not None:
                planned = {c.id: c for c in cands}
                run.scored.update(resumed(folder, old, doc, (lambda r: planned.get(r.get("id")))
                                          if spaces is None else from_record, keep_failed=spaces is not None))
            confirm_settings = None
            if confirm is not None:
                settings_of = getattr(confirm, "settings", None)
                confirm_settings = settings_of() if callable(settings_of) else {}
            earlier_refs = read_references(old, doc, refs, confirm_settings) if refs else ({}, {})
            earlier_confirmed = read_confirmed(old, doc, confirm_settings) if confirm is not None else {}
            if refs:
                assert scorer is not None  # checked above
                _score_references(run, refs, scorer, earlier_refs[0])
            if spaces is None:
                run.order = list(cands)
                run.evaluate([c for c in cands if c.id not in run.scored], scorer)
            else:
                _search(run, spaces, search, scorer, seed=seed, trials=trials)  # type: ignore[arg-type]
            ordered = [run.scored[c.id] for c in run.order]
            _incomplete(ordered)
            doc["candidates"] = [s.to_json(doc["examples"]) for s in ordered]  # also when --resume found all done
            result = _summary(ordered, doc, output=folder.path if folder is not None else None)
            _noise(result, doc, seed=seed)
            if refs:
                result.references = [run.references[r.id] for r in refs]
                doc["versus_inputs"] = versus_inputs(result.ranking[0] if result.ranking else None,
                                                     result.references, seed=seed)
            if confirm is not None:
                doc["confirm"] = {"top": confirm_top or keep or CONFIRM_TOP, "settings": confirm_settings}
                result.confirmed = _confirm(run, result, confirm, doc["confirm"]["top"], earlier_confirmed)
                if refs:
                    result.references_confirmed = _confirm_references(run, refs, confirm, earlier_refs[1])
            if folder is not None:
                result.kept = _keep(folder, ctx, result, doc, cache, keep, quiet=quiet)
                if push_to_hub is not None and result.kept:  # written and proven: now upload the best
                    result.url = push(result.kept[0], push_to_hub, private=private, revision=revision,
                                      message=f"Upload the best candidate of an rlmerge sweep "
                                              f"({result.ranking[0].candidate.label})")
                folder.write(RESULTS, dump(doc))
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


CONFIRM_TOP = 3  # candidates --confirm scores again when nothing is kept


def _references(pf: Preflight) -> list[Reference]:
    """The inputs as references: the base, then each agent (as results.json's ``agents`` names them). An input a
    scorer cannot load as it is (a LoRA adapter, a verl actor folder: not a model folder) is refused, all at once."""
    from ..io.lora import LoraAdapter
    from ..io.verl import VerlCheckpoint

    assert pf.base is not None and pf.match is not None
    from ..io.tokenizer import loadable_tokenizer

    base = pf.base.path  # an agent saved without tokenizer files is read with the base's tokenizer
    inputs = [Reference("base", "base", base),
              *(Reference("agent", a.label, a.path, i, None if loadable_tokenizer(a.path) else base)
                for i, a in enumerate(pf.match.agents, 1))]
    how = {LoraAdapter: ("a LoRA adapter", "merge the adapter into its base with PEFT (merge_and_unload(), then "
                                           "save_pretrained) and give that folder as the agent"),
           VerlCheckpoint: ("a verl actor folder", "convert it with verl's model_merger (python -m verl.model_merger "
                                                   "merge --backend fsdp --local_dir ACTOR --target_dir OUT) and give "
                                                   "OUT as the agent")}
    problems: list[RLMergeError] = [
        ConfigError(f"--references scores each input as it is, and {ckpt.label} is {what}, not a model a scorer can "
                    "load", file=str(ckpt.path), hint=f"{hint}, or leave --references out")
        for ckpt in [pf.base, *pf.match.agents] for kind, (what, hint) in how.items() if isinstance(ckpt, kind)]
    raise_all(problems)
    return inputs


def _score_references(run: _Run, refs: list[Reference], scorer: Scorer, earlier: dict[str, Scored]) -> None:
    """Score each input as it is, here (on the driver, also with the Ray backend), unless an earlier run recorded
    it; results.json's ``references`` after each one."""
    run.references.update(earlier)
    _record_references(run, refs)
    for ref in refs:
        if ref.id not in run.references:
            run.references[ref.id] = score_reference(ref, scorer)
            _record_references(run, refs)
            run.save()


def _record_references(run: _Run, refs: list[Reference]) -> None:
    run.doc["references"] = [{**run.references[r.id].to_json(run.doc["examples"]),
                              "interval": average_interval(run.references[r.id].details)}
                             for r in refs if r.id in run.references]


def _confirm_references(run: _Run, refs: list[Reference], scorer: Scorer,
                        earlier: dict[str, Scored]) -> dict[str, Scored]:
    """Each input scored again by the confirming scorer (the held-out split), an earlier run's kept: each record's
    ``confirmed`` in results.json's ``references``."""
    out = {r.id: earlier[r.id] if r.id in earlier else score_reference(r, scorer) for r in refs}
    for rec in run.doc.get("references") or []:
        c = out[rec["id"]]
        rec["confirmed"] = {**c.to_json(run.doc["examples"]), "interval": average_interval(c.details)}
    return out


def versus_inputs(best: Scored | None, refs: Sequence[Scored], *, seed: int) -> dict[str, Any]:
    """results.json's ``versus_inputs``: per task, the best input on it (the highest score of the references; of
    equal ones the first, the base before the agents) and the best candidate against it (``candidate``), with the
    difference candidate − input and its 95 % interval (noise.compare on that task alone: the paired bootstrap where
    both have per-example results on the same examples, else normal, else nothing) and its ``verdict``: ``above``
    (the interval is above 0), ``below``, or ``indistinguishable`` (it contains 0)."""
    out: dict[str, Any] = {"candidate": best.candidate.id if best is not None and best.scores else None, "tasks": {}}
    for task in dict.fromkeys(k for r in refs for k in r.scores):
        top = max((r for r in refs if task in r.scores), key=lambda r: _tie(r.scores[task]))
        rec: dict[str, Any] = {"input": top.candidate.id, "input_score": top.scores[task]}
        if best is not None and task in best.scores:
            rec["candidate_score"] = best.scores[task]
            v = compare({task: best.details[task]}, [{task: top.details[task]}], seed=seed)[0]
            if v is not None:
                rec.update({k: v[k] for k in ("difference", "low", "high", "how")})
                rec["verdict"] = "indistinguishable" if v["indistinguishable"] else "above" if v["low"] > 0 \
                    else "below"
        out["tasks"][task] = rec
    return out


def _plan(candidates: Sequence[Any], search: str, trials: Any, seed: int,
          problems: list[RLMergeError]) -> tuple[list[Candidate], list[Space] | None]:
    """(the candidates to check before any weight is read, the search's spaces or None for a grid): a grid's every
    candidate; a search's spaces, each at its first values (its other values were checked by the method already)."""
    if search == "grid":
        if trials is not None:
            problems.append(ConfigError(f"--trials {trials}: a grid tries every candidate; --trials counts a "
                                        "search's", hint="add --search tpe (or random, cmaes), or leave --trials out"))
        grids = [c for c in candidates if not isinstance(c, Candidate)]  # a recipe's candidates come parsed
        return check([*(c for c in candidates if isinstance(c, Candidate)),
                      *(parse_all(grids, seed=seed) if grids else [])]), None
    if search not in ("random", "tpe", "cmaes"):
        raise ConfigError(f"--search {search!r}", hint="grid (default), random, tpe or cmaes")
    if any(isinstance(c, Candidate) for c in candidates):
        raise ConfigError("a search samples from spaces: give them as strings or mappings, not Candidate objects")
    spaces = parse_spaces(list(candidates), seed=seed)
    from .search import check as search_check  # Optuna is imported only for a search (the ``search`` extra)

    problems += search_check(search, spaces, trials)
    return [sp.candidate(sp.first()) for sp in spaces], spaces


class _Run:
    """A sweep's candidates as they are built and scored: ``scored`` by id, their ``order`` in results.json, the
    study of a search; ``evaluate`` builds and scores candidates here or on Ray and records each as it finishes."""

    def __init__(self, ctx: Context, cache: StatsCache, folder: SweepDir | None, doc: dict[str, Any], *,
                 backend: str, workers: int | None, on_result: Callable[[Scored], None] | None) -> None:
        self.ctx, self.cache, self.folder, self.doc = ctx, cache, folder, doc
        self.backend, self.workers, self.on_result = backend, workers, on_result
        self.scored: dict[str, Scored] = {}
        self.references: dict[str, Scored] = {}  # reference id → the input scored as it is
        self.order: list[Candidate] = []
        self.study: Any = None

    def save(self) -> None:
        self.doc["candidates"] = [self.scored[c.id].to_json(self.doc["examples"]) for c in self.order
                                  if c.id in self.scored]
        if self.study is not None:
            self.doc["trials"] = self.study.to_json()
        if self.folder is not None:
            self.folder.write(RESULTS, dump(self.doc))

    def record(self, s: Scored) -> None:
        self.scored[s.candidate.id] = s
        if all(c.id != s.candidate.id for c in self.order):
            self.order.append(s.candidate)
        self.save()
        if self.folder is not None:
            self.cache.save()
        if self.on_result is not None:
            self.on_result(s)

    def evaluate(self, todo: Sequence[Candidate], scorer: Scorer | None,
                 done: Callable[[Scored], None] | None = None, *, record: bool = True) -> None:
        """Build and score ``todo``; ``record`` each (results.json), then ``done(scored)``."""
        def finished(s: Scored) -> None:
            if record:
                self.record(s)
            if done is not None:
                done(s)

        if self.backend == "ray":
            from .distributed import score_on_ray  # Ray is imported only here (the ``ray`` extra)

            score_on_ray(self.ctx, list(todo), scorer, self.cache, finished, workers=self.workers)
        else:
            for c in todo:
                finished(build_and_score(self.ctx, c, scorer, self.cache))


def _search(run: _Run, spaces: list[Space], kind: str, scorer: Scorer | None, *, seed: int, trials: int) -> None:
    """Ask, score and tell ``trials`` trials (search.py); the candidates in results.json in the order first asked."""
    from . import search

    run.study = study = search.Study(spaces, kind, seed=seed, folder=run.folder)
    batch = 1
    if run.backend == "ray":
        from .distributed import slots

        batch = run.workers or slots(run.ctx)
    run.doc["search"] = {"kind": kind, "trials": trials, "seed": seed, "batch": batch,
                         "spaces": [sp.text for sp in spaces]}
    for cid in study.candidates():  # an earlier run's trials, in order
        if cid in run.scored and all(c.id != cid for c in run.order):
            run.order.append(run.scored[cid].candidate)

    def asked(a: search.Asked) -> None:
        if a.candidate is not None and all(c.id != a.candidate.id for c in run.order):
            run.order.append(a.candidate)

    def evaluate(todo: list[Candidate], done: Callable[[Scored], None]) -> None:
        def told(s: Scored) -> None:
            done(s)
            run.save()  # the trial's state, now told

        run.evaluate(todo, scorer, told)

    search.run(study, trials, batch, known=run.scored.get, evaluate=evaluate, on_asked=asked)
    run.order = [c for c in run.order if c.id in run.scored]
    run.save()


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


def _incomplete(ordered: list[Scored]) -> None:
    """A candidate scored on fewer tasks than another one becomes a failure (``Scored.error``, naming the tasks it
    lacks, and what it did score): averages over different tasks cannot be ranked against each other (a command
    that leaves a task out when one of its evaluations fails). As every failure: no scores, ranked last, never kept,
    scored again by ``--resume``."""
    scored = [s for s in ordered if s.scores and s.error is None]
    tasks = list(dict.fromkeys(k for s in scored for k in s.scores))
    for s in scored:
        missing = [t for t in tasks if t not in s.scores]
        if missing:
            got = ", ".join(f"{t}={v:g}" for t, v in s.scores.items())
            s.error = (f"scored on {len(s.scores)} of the {len(tasks)} tasks other candidates were scored on: no "
                       f"score for {', '.join(map(repr, missing))} (it gave {got}); candidates are ranked only on "
                       "the same tasks")
            s.scores, s.details = {}, {}


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


def _noise(result: SweepResult, doc: dict[str, Any], *, seed: int) -> None:
    """Each candidate's interval and its difference from the best (noise.py), in results.json and the result."""
    ranked = [s for s in result.ranking if s.scores]
    if not ranked:
        return
    best = ranked[0]
    verdicts = dict(zip([s.candidate.id for s in ranked[1:]],
                        compare(best.details, [s.details for s in ranked[1:]], seed=seed)))
    for rec in doc["candidates"]:
        s = next((x for x in ranked if x.candidate.id == rec["id"]), None)
        if s is not None:
            rec["interval"] = average_interval(s.details)
            rec["vs_best"] = verdicts.get(s.candidate.id)
    same = [s for s in ranked[1:] if (verdicts.get(s.candidate.id) or {}).get("indistinguishable")]
    known = any(v is not None for v in verdicts.values())
    result.indistinguishable = [best, *same] if known else []
    doc["indistinguishable"] = [s.candidate.id for s in result.indistinguishable]
    doc["noise"] = {"level": 0.95, "draws": DRAWS, "seed": seed,
                    "how": sorted({v["how"] for v in verdicts.values() if v is not None})}


def _confirm(run: _Run, result: SweepResult, scorer: Scorer, top: int,
             earlier: dict[str, Scored]) -> dict[str, Scored]:
    """The best ``top`` candidates scored again by ``scorer`` (a held-out split), an earlier run's kept; results.json's
    ``confirmed``: each one's search and confirmed average, and the gap between them (the winner's curse)."""
    best = [s for s in result.ranking if s.error is None and s.scores][:top]
    out = {s.candidate.id: earlier[s.candidate.id] for s in best if s.candidate.id in earlier}
    todo = [s.candidate for s in best if s.candidate.id not in out]

    def done(s: Scored) -> None:
        out[s.candidate.id] = s

    run.evaluate(todo, scorer, done, record=False)
    doc = run.doc
    doc["confirmed"] = []
    for s in best:
        c = out[s.candidate.id]
        gap = None if c.average is None or s.average is None else s.average - c.average
        doc["confirmed"].append({"id": s.candidate.id, "search_average": s.average, "scores": c.scores,
                                 "average": c.average, "gap": gap, "interval": average_interval(c.details),
                                 "details": details_json(c.details, doc["examples"]),
                                 "merge_seconds": round(c.merge_seconds, 3), "score_seconds": round(c.score_seconds, 3),
                                 **({"error": c.error} if c.error is not None else {})})
    return {s.candidate.id: out[s.candidate.id] for s in best}


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
