"""One sweep candidate: merged (in memory where it fits, else into a scratch folder), scored, freed.

What a candidate's build shares with the others is a ``Context`` (picklable: a Ray task gets it whole) and the
statistics cache (cache.py). ``sweep.py`` runs candidates one after the other; ``distributed.py`` runs them as Ray
tasks. A scorer is any callable ``scorer(built) -> {task: score}`` (higher is better); a score is a number or a
``scores.TaskScore`` (or a mapping with its fields: n, stderr, per-example samples).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..engine import budget
from ..engine.merge import MergeResult, execute, merge, statistics_only
from ..engine.preflight import Preflight, preflight
from ..engine.route import route
from ..errors import RLMergeError, ScorerError, raise_all
from ..io.memory import MemoryWriter
from ..io.sweepdir import SweepDir
from .cache import StatsCache
from .candidates import Candidate
from .scores import TaskScore, details_json, make

Memory = Literal["auto", "always", "never"]
HEADROOM = 0.8  # of the memory available: what an in-memory candidate (model, scorer's copy, merge) may take


@dataclass
class Built:
    """A merged candidate, as a scorer gets it: a folder on disk (``path``), or tensors in memory."""

    candidate: Candidate | Reference  # a Reference: an input scored as it is (``path`` is its folder)
    path: Path | None  # a checkpoint folder (a candidate too large for memory, or a reference), else None
    tensors: dict[str, Any] | None  # name → torch tensor in the output dtype (in memory), else None
    config: dict[str, Any]  # the merged checkpoint's config.json
    side_dir: Path  # where the tokenizer and other side files are (the base's, or ``path``)
    result: MergeResult | None  # None for a reference (nothing was merged)
    files: dict[str, bytes] | None = None  # in memory: the side files the folder would hold (config, tokenizer, …)


Scorer = Callable[[Built], Mapping[str, float | TaskScore | Mapping[str, Any]]]


@dataclass
class Scored:
    """One candidate's outcome."""

    candidate: Candidate | Reference
    scores: dict[str, float]
    where: str  # "memory" or "disk": where it was built; "input" for a reference
    merge_seconds: float
    score_seconds: float
    passes: list[str]  # what its merge ran ("merge" alone when the cache held its statistics)
    read_bytes: int
    lambdas: list[float] | None = None
    details: dict[str, TaskScore] = field(default_factory=dict)  # task → score with n, stderr, samples
    error: str | None = None  # why the scorer failed on this candidate (then no scores): ranked last, never kept

    @property
    def average(self) -> float | None:
        return sum(self.scores.values()) / len(self.scores) if self.scores else None

    def to_json(self, examples: dict[str, list[str]] | None = None) -> dict[str, Any]:
        """results.json's record; ``examples`` collects the example ids of per-example samples (scores.py)."""
        return {**self.candidate.to_json(), "scores": self.scores, "average": self.average,
                "details": details_json(self.details, examples if examples is not None else {}), "where": self.where,
                "merge_seconds": round(self.merge_seconds, 3), "score_seconds": round(self.score_seconds, 3),
                "passes": self.passes, "read_bytes": self.read_bytes, "lambdas": self.lambdas,
                **({"error": self.error} if self.error is not None else {})}


@dataclass(frozen=True)
class Reference:
    """An input scored as it is, beside the candidates (``references=True``): the base or an agent. The scorers get
    it as a candidate built on disk whose folder is the input's own (``Built.path``); it is never ranked, kept or
    pushed. ``id`` (``base``, ``agent1`` …) is what a command sees as ``RLMERGE_CANDIDATE`` and what results.json
    matches on ``--resume`` (with ``name``)."""

    role: Literal["base", "agent", "model"]  # "model": a checkpoint ``rlmerge eval`` scores, outside a sweep
    name: str  # "base", or the agent as results.json's ``agents`` names it (its label: the path given)
    path: Path  # the input's folder (a hub id resolved)
    index: int = 0  # the agent's (or eval's model's) position, from 1 (0: the base)
    # where its tokenizer is read when its folder has none (an RL checkpoint saved without one): the base's folder,
    # the tokenizer a merge of it writes by default; None: its own
    tokenizer: Path | None = None

    @property
    def id(self) -> str:
        return "base" if self.role == "base" else f"{self.role}{self.index}"

    @property
    def label(self) -> str:
        return "base" if self.role == "base" else self.name

    def to_json(self) -> dict[str, Any]:
        out = {"id": self.id, "name": self.name, "role": self.role, "path": str(self.path)}
        return out if self.tokenizer is None else {**out, "tokenizer": str(self.tokenizer)}

    def built(self) -> Built:
        """This input as the scorers get it: a candidate built on disk whose folder is its own."""
        config_file = self.path / "config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        return Built(self, self.path, None, config, self.tokenizer or self.path, None)


def score_reference(ref: Reference, scorer: Scorer) -> Scored:
    """Score input ``ref`` as it is, through the path of a candidate built on disk; a scorer failure is its outcome
    (``Scored.error``), as a candidate's."""
    built = ref.built()
    t0 = time.perf_counter()
    details: dict[str, TaskScore] = {}
    error = None
    try:
        details = _scores(ref, scorer(built))
    except Exception as e:  # as build_and_score: the failure is recorded, the sweep goes on
        error = failure(e)
    return Scored(ref, {k: v.score for k, v in details.items()}, "input", 0.0, time.perf_counter() - t0, [], 0, None,
                  details, error)


@dataclass
class Context:
    """What every candidate's build shares (picklable: a Ray task gets it whole)."""

    base: str
    agents: list[str]
    options: dict[str, Any]  # dtype, block_size, device, allow_missing, count_tied_twice
    memory: Memory
    side_dir: Path
    scratch: Path | None  # where a candidate too large for memory is merged (the sweep folder, or None: a temp)




def build_and_score(ctx: Context, c: Candidate, scorer: Scorer | None, cache: StatsCache) -> Scored:
    """Merge candidate ``c`` (in memory where it fits, else into a scratch folder), score it, free it."""
    t0 = time.perf_counter()
    pf = preflight(ctx.base, ctx.agents, None, method=c.method, params=dict(c.params), seed=c.seed, **ctx.options)
    scratch: Path | None = None
    try:
        raise_all(pf.problems)
        assert pf.match is not None and pf.spec is not None
        if _in_memory(ctx, pf):
            built = _in_memory_build(ctx, c, pf, cache)
        else:
            pf.close()
            scratch, built = _on_disk_build(ctx, c, cache)
    finally:
        pf.close()
    merged = time.perf_counter()
    details: dict[str, TaskScore] = {}
    error = None
    try:
        details = _scores(c, scorer(built)) if scorer is not None else {}
    except Exception as e:  # any scorer failure is this candidate's outcome; the sweep goes on (Ctrl-C is not)
        error = failure(e)
    finally:
        res = built.result
        assert res is not None  # a candidate's build merged
        del built  # the state dict goes before the next candidate is built
        if scratch is not None:
            _remove_scratch(ctx, scratch)
    return Scored(c, {k: v.score for k, v in details.items()}, "disk" if scratch is not None else "memory",
                  merged - t0, time.perf_counter() - merged, res.passes, res.read_bytes, res.lambdas, details, error)


def failure(e: BaseException) -> str:
    """How a scorer's exception is recorded: one line, an rlmerge error as it renders (its hint after a semicolon),
    anything else as ``Type: message``; cut at 2,000 characters."""
    text = e.render().replace("\n  -> ", "; ") if isinstance(e, RLMergeError) else f"{type(e).__name__}: {e}"
    text = " ".join(text.split())
    return text if len(text) <= 2000 else text[:1999] + "…"


def warm(ctx: Context, cands: Sequence[Candidate], cache: StatsCache) -> None:
    """Count here, once per kind, the statistics ``cands`` need (RAM+'s counts, a whole-model threshold): candidates
    then built elsewhere in parallel (Ray) find them in the cache instead of each counting them."""
    for c in cands:
        pf = preflight(ctx.base, ctx.agents, None, method=c.method, params=dict(c.params), seed=c.seed, **ctx.options)
        try:
            raise_all(pf.problems)
            assert pf.match is not None and pf.spec is not None
            extras = [x for x in pf.extras if x is not None]
            view = cache.view(pf.match, extras)
            chosen = route(pf.match, pf.spec, pf.params, device=ctx.options["device"], block_size=pf.block_size,
                           extras=extras, cached=view)
            if chosen.statistics:
                statistics_only(pf.match, pf.spec, pf.params, chosen, block_size=pf.block_size,
                                device=ctx.options["device"], seed=c.seed, extras=extras, cache=view)
        finally:
            pf.close()


def memory_needed(pf: Preflight) -> int:
    """Bytes an in-memory candidate takes at its peak: the merged tensors, a float32 copy of them (a scorer's
    model) and the merge's own working memory (the route's estimate)."""
    assert pf.match is not None and pf.memory is not None
    return pf.match.write_bytes + 4 * sum(j.numel for j in pf.match.jobs) + pf.memory.total


def _in_memory(ctx: Context, pf: Preflight) -> bool:
    if ctx.memory != "auto":
        return ctx.memory == "always"
    free = budget.available_memory()
    return free is None or memory_needed(pf) <= HEADROOM * free


def _in_memory_build(ctx: Context, c: Candidate, pf: Preflight, cache: StatsCache) -> Built:
    assert pf.match is not None and pf.spec is not None
    extras = [x for x in pf.extras if x is not None]
    writers: list[MemoryWriter] = []

    def make(background: bool) -> MemoryWriter:
        writers.append(MemoryWriter(pf.match.jobs, metadata={"rlmerge_method": pf.spec.name}))  # type: ignore
        return writers[-1]

    res = execute(pf.match, pf.spec, pf.params, make, output=Path(f"memory:{c.id}"), block_size=pf.block_size,
                  device=ctx.options["device"], seed=c.seed, quiet=True, recipe=None, extras=extras,
                  cache=cache.view(pf.match, extras))
    return Built(c, None, writers[0].tensors(), writers[0].config(), ctx.side_dir, res, dict(writers[0].files))


def _on_disk_build(ctx: Context, c: Candidate, cache: StatsCache) -> tuple[Path, Built]:
    parent = ctx.scratch if ctx.scratch is not None else Path(tempfile.mkdtemp(prefix="rlmerge-sweep-"))
    out = parent / f"candidate-{c.id}"
    res = merge(ctx.base, ctx.agents, out, method=c.method, params=dict(c.params), seed=c.seed, force=True,
                fsync=False, cache=cache, **ctx.options)
    config = json.loads((out / "config.json").read_text()) if (out / "config.json").is_file() else {}
    return out, Built(c, out, None, config, out, res)


def _remove_scratch(ctx: Context, out: Path) -> None:
    """Remove a scored candidate's folder: inside the sweep folder once proven rlmerge's; a temp folder whole."""
    if ctx.scratch is not None:
        SweepDir.remove_written(out)
    else:
        shutil.rmtree(out.parent, ignore_errors=True)


def _scores(c: Candidate | Reference, scores: Mapping[str, Any]) -> dict[str, TaskScore]:
    """The scorer's values, checked (scores.make: a ScorerError says what is wrong); none at all is a failure."""
    if not dict(scores):
        raise ScorerError(f"the scorer on candidate {c.label!r} returned no tasks (an empty mapping)",
                          hint="a scorer returns {task: score} with at least one task")
    return {str(k): make(v, task=str(k), where=f"the scorer on candidate {c.label!r}")
            for k, v in dict(scores).items()}
