"""The merge, top to bottom: open → match → statistics pass (if the method needs it) → merge pass → write."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..errors import InputError, RLMergeError, raise_all
from ..io.checkpoint import SIDE_FILES, Checkpoint, equal_bytes
from ..io.hub import push
from ..io.partial import PartialDir, input_identity
from ..io.tokenizer import GENERATION, TEMPLATE_FILES, TOKENIZER_FILES
from ..io.writer import DEFAULT_SHARD_SIZE, CheckpointWriter
from ..methods import MethodSpec, Rows, Run, Runner, inspected
from ..report import REPORT_FILE, build_report, dtype_facts, to_json, to_markdown
from ..report.card import adapter_lines, model_card
from ..report.provenance import provenance
from ..stats import Statistics
from ..stream.blocks import DEFAULT_BLOCK
from ..stream.match import Match
from . import survival
from .adapter import AdapterOptions, AdapterWriter, adapter_writer
from .backends import TorchBackend, closing, make_backends
from .cached import StatisticsCache, StatisticsView
from .passes import merge_pass, statistics_pass
from .preflight import output_fingerprint, preflight
from .progress import Progress
from .reproduce import Reproduce, reproduce
from .route import Route, route

TOKENIZER_SIDE = (*TOKENIZER_FILES, *TEMPLATE_FILES, GENERATION)  # side files the tokenizer plan decides


@dataclass
class MergeResult:
    output: Path
    method: str
    params: Any
    statistics: Statistics
    lambdas: list[float] | None = None
    rho: list[float] | None = None
    warnings: list[str] = field(default_factory=list)
    seconds: float = 0.0
    read_bytes: int = 0  # weights read, over every pass, as counted while reading
    write_bytes: int = 0
    passes: list[str] = field(default_factory=list)  # "statistics", "merge": what ran
    kept: list[float] | None = None  # per agent, the fraction of τ a magnitude trim kept (TIES), else None
    # per agent, the share of its rescaled unique elements whose written value keeps λ (RAM+), else None
    rescale_kept: list[float | None] | None = None
    merged_dtypes: list[str] = field(default_factory=list)  # what the merged tensors were written in
    defaults: list[str] = field(default_factory=list)  # mergekit defaults a recipe took, in words
    per_tensor: dict[str, str] = field(default_factory=dict)  # parameters a recipe gave per tensor, in words
    url: str | None = None  # where --push-to-hub put it
    adapter: dict[str, Any] | None = None  # --output-format peft: the ranks kept and the errors (AdapterWriter)


def merge(base: str | os.PathLike[str], agents: Sequence[str | os.PathLike[str]], output: str | os.PathLike[str],
          *, method: str = "ram+", params: Mapping[str, Any] | None = None, dtype: str | None = None,
          shard_size: str | int = DEFAULT_SHARD_SIZE, block_size: int = DEFAULT_BLOCK, device: str = "cpu",
          force: bool = False, allow_missing: bool = False, count_tied_twice: bool = False, seed: int = 0,
          quiet: bool = True, recipe: Mapping[str, Any] | None = None, resume: bool = False,
          fsync: bool = True, cache: StatisticsCache | None = None, defaults: Sequence[str] = (),
          notes: Sequence[str] = (), tokenizer_source: str | None = None,
          chat_template: str | None = None, push_to_hub: str | None = None, private: bool = False,
          revision: str | None = None, output_format: str = "hf", rank: Any = None,
          non_linear: str | None = None) -> MergeResult:
    """Merge ``agents`` (fine-tunes of ``base``) into a new Hugging Face checkpoint at ``output``.

    >>> res = rlmerge.merge("base/", ["coder/", "tools/", "memory/"], "merged/", method="ram+",
    ...                     params={"preset": "paper", "r": 0.1, "alpha": 2.0})  # doctest: +SKIP
    >>> res.lambdas  # doctest: +SKIP

    ``resume=True`` continues a run that was interrupted (Ctrl-C, SIGTERM, disk full) after its last
    complete shard; the output is byte-identical to an uninterrupted run. ``fsync=False`` leaves flushing the
    output to the OS (faster on a slow disk; a power cut soon after the merge may lose it, and ``resume``
    still verifies every kept shard by its CRC-32). ``cache``: statistics shared with other merges of the same
    inputs (engine/cached.py; ``rlmerge.sweep`` keeps one, ``rlmerge.sweeping.cache.StatsCache``).

    ``defaults`` and ``notes``: what a recipe's translation said (mergekit's defaults it applied, what it ignores),
    written to rlmerge.json and the model card. ``tokenizer_source`` (None, ``base``, ``union`` or an agent) and
    ``chat_template`` (``base``, ``auto``, an agent, a file or the template's text): the output's tokenizer, with
    mergekit's meaning (io/tokenizer_plan.py). ``push_to_hub``: a Hub repository the finished output is uploaded
    to (``private``, a branch ``revision``): checked before any weight is read, pushed only once the output is
    complete (io/hub.py); ``MergeResult.url`` says where. ``output_format="peft"``: the merged task vector as a
    LoRA adapter of the base (engine/adapter.py: ``rank`` R, ``"full"`` or ``"energy=F"``; ``non_linear`` ``"save"``
    puts changed norms, embeddings and biases into modules_to_save, ``"refuse"`` refuses them);
    ``MergeResult.adapter`` is each matrix's kept rank and relative error.
    """
    t0 = time.perf_counter()
    pf = preflight(base, agents, output, method=method, params=params, dtype=dtype, shard_size=shard_size,
                   block_size=block_size, device=device, force=force, resume=resume, allow_missing=allow_missing,
                   count_tied_twice=count_tied_twice, seed=seed, tokenizer_source=tokenizer_source,
                   chat_template=chat_template, output_format=output_format, rank=rank, non_linear=non_linear,
                   push_to_hub=push_to_hub, revision=revision, recipe=recipe)
    adapter = pf.adapter
    try:
        raise_all(pf.problems)
        assert pf.match is not None and pf.spec is not None  # no problems: every stage ran
        check_copies(pf.match)  # reads the copied tensors only, before anything is written
        extras = [x for x in pf.extras if x is not None]
        again = reproduce(pf, base, agents, given=params, recipe=recipe, dtype=dtype, seed=seed,
                          allow_missing=allow_missing, count_tied_twice=count_tied_twice,
                          tokenizer_source=tokenizer_source, chat_template=chat_template,
                          output_format=output_format if adapter else None,
                          rank=str(adapter.ranks) if adapter else None,
                          non_linear=adapter.non_linear if adapter else None)
        with PartialDir(output, force=force, resume=resume, inputs=pf.models) as partial:
            result = _run(pf.match, pf.spec, pf.params, partial, shard_bytes=pf.shard_bytes,
                          block_size=pf.block_size, device=device, seed=seed, quiet=quiet, recipe=recipe,
                          extras=extras, fsync=fsync, cache=cache.view(pf.match, extras) if cache else None,
                          at=pf.at, schedule=pf.parsed.schedule if pf.parsed else {}, defaults=list(defaults),
                          notes=list(notes), again=again,
                          adapter=(adapter, pf.out_dtypes) if adapter is not None else None)
    finally:
        pf.close()
    if push_to_hub is not None:  # the output is published (renamed into place): now, and only now, upload it
        result.url = push(result.output, push_to_hub, private=private, revision=revision,
                          message=f"Upload a {result.method} merge made with rlmerge")
    result.seconds = time.perf_counter() - t0
    return result


def _run(match: Match, spec: MethodSpec, p: Any, partial: PartialDir, *, shard_bytes: int, block_size: int,
         device: str, seed: int, quiet: bool, recipe: Mapping[str, Any] | None,
         extras: list[Checkpoint] | None = None, fsync: bool = True, cache: StatisticsView | None = None,
         at: Callable[[str], Any] | None = None, schedule: Mapping[str, Any] | None = None,
         defaults: list[str] | None = None, notes: list[str] | None = None,
         again: Reproduce | None = None, adapter: tuple[AdapterOptions, Any] | None = None) -> MergeResult:
    extras = extras or []
    metadata, fp = output_fingerprint(match, spec, p, seed=seed, recipe=recipe, device=device,
                                      shard_bytes=shard_bytes, extras=extras, schedule=schedule)

    def writer(background: bool) -> CheckpointWriter | AdapterWriter:
        if adapter is not None:  # --output-format peft: the task vector as LoRA factors, one matrix at a time
            return adapter_writer(partial, match, adapter[0], adapter[1], fingerprint=fp, fsync=fsync)
        return CheckpointWriter(partial, match.jobs, shard_size=shard_bytes, metadata=metadata, fingerprint=fp,
                                fsync=fsync, identity=input_identity([match.base, *match.agents, *extras]),
                                background=background)

    return execute(match, spec, p, writer, output=partial.output, block_size=block_size, device=device, seed=seed,
                   quiet=quiet, recipe=recipe, extras=extras, cache=cache, at=at, schedule=schedule,
                   defaults=defaults, notes=notes, again=again)


def execute(match: Match, spec: MethodSpec, p: Any, make_writer: Callable[[bool], Any], *, output: Path,
            block_size: int, device: str, seed: int, quiet: bool, recipe: Mapping[str, Any] | None,
            extras: Sequence[Checkpoint] = (), cache: StatisticsView | None = None,
            at: Callable[[str], Any] | None = None, schedule: Mapping[str, Any] | None = None,
            defaults: Sequence[str] | None = None, notes: Sequence[str] | None = None,
            again: Reproduce | None = None) -> MergeResult:
    """One merge on this machine, into the writer ``make_writer(background)`` returns: ``CheckpointWriter`` (shards
    in a partial folder) or ``io.memory.MemoryWriter`` (a sweep's candidate, a state dict). ``cache``: statistics
    an earlier merge of the same inputs gathered (a sweep's); what it covers is not read again, and what this merge
    gathers is added to it. ``at``/``schedule``: a recipe's per-tensor parameters (the cache is not used with
    them); ``defaults``/``notes``: what the recipe's translation applied and ignored, for the provenance; ``again``:
    the recipe that reproduces the merge, for the model card."""
    if at is not None:
        cache = None  # the cache is keyed by one set of parameters
    run = new_run(match, spec, p, seed=seed, extras=extras, cache=cache, at=at)
    chosen = route(match, spec, p, device=device, block_size=block_size, extras=run.extras, cached=cache, at=at)
    fast, torch_backend = make_backends(chosen, run, block_size=block_size, device=device)
    writer = make_writer(fast is not None)
    with Progress(quiet=quiet) as progress, closing(fast), writer:
        if writer.resumed:  # the kept shards' tensors are not merged again: a statistics pass recounts them
            chosen = route(match, spec, p, device=device, block_size=block_size, extras=run.extras, resumed=True,
                           cached=cache, at=at)
        result = stages(run, chosen, writer, Local(fast, torch_backend, writer, progress), output=output,
                        recipe=recipe, schedule=schedule, defaults=defaults, notes=notes, again=again)
    result.read_bytes, result.write_bytes = run.read_bytes, match.write_bytes
    return result


# -- the stages of a merge, after its route: here (``Local``) or as Ray tasks (distributed.py) ---------------------
class Passes(Protocol):
    """Where a merge's two passes run, over the tensors ``chosen`` gives each backend: on this machine (``Local``)
    or as Ray tasks (``distributed.OnRay``). Either fills ``run.stats`` in the order a local merge counts (the
    statistics pass: numba's tensors, then torch's; the merge pass, with ``collect``: job order), adds what it
    reads to ``run.read_bytes``, and writes every pending tensor through the merge's writer."""

    def statistics(self, run: Run, chosen: Route) -> None: ...

    def merge(self, run: Run, chosen: Route, *, collect: bool) -> None: ...


@dataclass
class Local:
    """The passes on this machine: the backends the route chose, through ``passes.py``."""

    fast: Runner | None
    torch: TorchBackend
    writer: Any
    progress: Progress

    def statistics(self, run: Run, chosen: Route) -> None:
        statistics_pass(run, chosen, self.fast, self.torch, self.progress)

    def merge(self, run: Run, chosen: Route, *, collect: bool) -> None:
        merge_pass(run, chosen, self.fast, self.torch, self.writer, self.progress, collect=collect)


def new_run(match: Match, spec: MethodSpec, p: Any, *, seed: int, extras: Sequence[Checkpoint] = (),
            cache: StatisticsView | None = None, at: Callable[[str], Any] | None = None) -> Run:
    """What a merge's passes share, before them: empty statistics, and the method's observer if it has one."""
    stats = Statistics([a.label for a in match.agents], spec.epsilon(p))
    return Run(match, spec, p, stats, seed=seed, observer=spec.observer(p, len(match.agents), at),
               extras=list(extras), cache=cache, at=at)


def stages(run: Run, chosen: Route, writer: Any, passes: Passes, *, output: Path,
           recipe: Mapping[str, Any] | None, schedule: Mapping[str, Any] | None = None,
           defaults: Sequence[str] | None = None, notes: Sequence[str] | None = None,
           again: Reproduce | None = None) -> MergeResult:
    """A merge after its route, with ``writer`` entered: the statistics (``gather_statistics``), the method's
    ``prepare``, the merge pass, and what follows it (``after_merge``). ``passes`` runs the two passes: ``execute``
    hands it this machine's backends, ``distributed.merge_on_ray`` Ray tasks; every decision between them is made
    here, once."""
    collect = gather_statistics(run, chosen, passes, resumed=writer.resumed > 0)
    run.prepared = run.spec.prepare(run.params, run.stats if chosen.method_statistics else None,
                                    len(run.match.agents))
    passes.merge(run, chosen, collect=collect)
    return after_merge(run, chosen, writer, collect=collect, output=output, recipe=recipe, schedule=schedule,
                  defaults=defaults, notes=notes, again=again)


def gather_statistics(run: Run, chosen: Route, passes: Passes, *, resumed: bool) -> bool:
    """The statistics before the merge pass: the statistics pass when the route runs one (then kept in the cache),
    else what the cache holds for this merge. True when there are none: the merge pass counts them (``collect``)."""
    match, spec, p, cache = run.match, run.spec, run.params, run.cache
    if chosen.statistics:
        passes.statistics(run, chosen)
        keep_statistics(run, chosen)
        return False
    if cache is None:
        return True
    run.stats = cached_statistics(cache, match, spec, p, chosen,
                                  counted=chosen.method_statistics or resumed) or run.stats
    if not run.stats.tensors:
        return True
    if chosen.method_statistics:  # what the skipped pass would have observed
        cache.fill_observer(run.observer, match.merge_jobs)
        run.stats.observed = run.observer
    return False


def keep_statistics(run: Run, chosen: Route) -> None:
    """After a statistics pass: its observer is the statistics', and the cache keeps both for later merges."""
    run.stats.observed = run.observer
    if run.cache is not None:
        run.cache.put_counts(run.spec, run.params, run.stats, chosen.stats_fast)
        run.cache.put_observer(run.observer)


def after_merge(run: Run, chosen: Route, writer: Any, *, collect: bool, output: Path,
                recipe: Mapping[str, Any] | None, schedule: Mapping[str, Any] | None = None,
                defaults: Sequence[str] | None = None, notes: Sequence[str] | None = None,
                again: Reproduce | None = None) -> MergeResult:
    """After the merge pass: the counts it made into the cache, the result with the method's rows and warnings,
    then the finished output (``finish_output``)."""
    match, spec, p, stats = run.match, run.spec, run.params, run.stats
    if collect and run.cache is not None:
        run.cache.put_counts(spec, p, stats, chosen.fast)  # counted by the backend that merged each tensor
    result = MergeResult(output, spec.name, p, stats, passes=chosen.passes, defaults=list(defaults or ()),
                         per_tensor={k: str(v) for k, v in (schedule or {}).items()})
    method_rows(result, spec.report(p, run.prepared, run.observer, stats), [*(notes or ()), *match.warnings])
    if not chosen.method_statistics and spec.task_vectors:  # linear averages the models: a copy of the base counts
        result.warnings += stats.identical_agents()
    rescale_survival(result, match, writer.annotations())
    finish_output(writer, match, result, recipe, again)
    return result


def statistics_only(match: Match, spec: MethodSpec, p: Any, chosen: Route, *, block_size: int, device: str,
                    seed: int, extras: Sequence[Checkpoint] = (),
                    cache: StatisticsView | None = None) -> tuple[Statistics, Any, int]:
    """The statistics pass of ``chosen`` alone: (statistics, the method's observer after it, bytes read). What a
    sweep counts once before its candidates run elsewhere, and what a Ray task counts for its tensors."""
    run = new_run(match, spec, p, seed=seed, extras=extras, cache=cache)
    local_statistics(run, chosen, block_size=block_size, device=device)
    keep_statistics(run, chosen)
    return run.stats, run.observer, run.read_bytes


def local_statistics(run: Run, chosen: Route, *, block_size: int, device: str) -> None:
    """The statistics pass on this machine, on backends opened for it alone."""
    fast, torch_backend = make_backends(chosen, run, block_size=block_size, device=device)
    with Progress(quiet=True) as progress, closing(fast):
        Local(fast, torch_backend, None, progress).statistics(run, chosen)


def method_rows(result: MergeResult, rows: Rows, warnings: list[str]) -> None:
    """What the method reported about its merge (``MethodSpec.report``), into ``result``, after ``warnings``."""
    result.lambdas = None if rows.lambdas is None else list(rows.lambdas)
    result.rho = None if rows.rho is None else list(rows.rho)
    result.kept = None if rows.kept is None else list(rows.kept)
    result.warnings = [*warnings, *rows.warnings]


def rescale_survival(result: MergeResult, match: Match, notes: Mapping[str, Any]) -> None:
    """What the output dtype kept of a rescale (survival.py), from every tensor's note; a warning where little."""
    counts = survival.totals(notes, len(match.agents))
    result.rescale_kept = survival.fractions(counts)
    result.warnings += survival.warnings([a.label for a in match.agents], counts, match.merged_dtypes)


def finish_output(writer: Any, match: Match, result: MergeResult, recipe: Mapping[str, Any] | None,
                  again: Reproduce | None = None) -> None:
    """After the last tensor: side files, the report and model card, then the writer's ``finish`` (the index,
    ``rlmerge.json``, the rename onto the output)."""
    result.merged_dtypes = match.merged_dtypes
    if isinstance(writer, AdapterWriter):  # its factors are all written: its report is complete
        writer.complete()
        result.adapter = writer.summary()
    _side_files(match.base, writer, match, model=result.adapter is None)
    # The statistics this merge already collected feed the report: no extra pass.
    doc = build_report(result.statistics, dtype_facts(match), base=match.base.label, warnings=result.warnings,
                       methods=inspected(result.statistics))
    writer.write_text(REPORT_FILE, to_json(doc))
    card = model_card(match, result, reproduce=again, adapter=result.adapter, extra=adapter_lines(result.adapter))
    writer.write_text("README.md", card + "\n" + to_markdown(doc, level=2))
    writer.finish(provenance(match, result, recipe))


def cached_statistics(cache: StatisticsView, match: Match, spec: MethodSpec, p: Any, chosen: Route, *,
            counted: bool) -> Statistics | None:
    """The counts ``cache`` holds for this merge, as this merge would have counted them, or None.

    ``counted``: a statistics pass would have counted them (numba's tensors first, then torch's); else the merge
    pass would have, in job order, each on the backend that merges it."""
    jobs = match.merge_jobs
    numba = chosen.stats_fast if counted else chosen.fast
    if not cache.has_counts(spec, p, jobs, numba):
        return None
    order = [j for j in jobs if j.name in numba] + [j for j in jobs if j.name not in numba] if counted else jobs
    return cache.statistics(spec, p, [a.label for a in match.agents], order, numba)



def check_copies(match: Match) -> None:
    """A tensor rlmerge does not merge (integers, buffers) is copied from the base: every agent that has it must
    hold the same bytes, or the agent's change would be silently lost. Raises naming the file and the tensor."""
    problems: list[RLMergeError] = []
    for job in match.jobs:
        if job.kind != "copy":
            continue
        for agent, here in zip(match.agents, job.present):
            if not here:
                continue
            info = agent.tensors[job.name]
            if job.numel == 0 and info.is_float:  # an empty float tensor: no value of the agent's to lose
                continue
            if not equal_bytes(match.base, job.name, agent, job.name):
                problems.append(InputError(f"the agent changed a {info.dtype.code} tensor, which rlmerge copies "
                                           "from the base instead of merging", file=str(info.file), tensor=job.name,
                                           hint="only float tensors are merged: restore this tensor to the "
                                                "base's, or leave this agent out"))
    raise_all(problems)


def _side_files(base: Checkpoint, writer: Any, match: Match, *, model: bool = True) -> None:
    """config.json and the base's other side files; the tokenizer, chat-template and generation files the tokenizer
    plan chose (io/tokenizer_plan.py: the base's unless asked otherwise). An adapter (``model=False``) gets the
    tokenizer files only: a config.json would make its folder look like a model without weights."""
    chosen = match.tokenizer.files if match.tokenizer is not None else None
    for name in SIDE_FILES:
        src = base.side_dir / name
        if not model and name not in TOKENIZER_FILES and name not in TEMPLATE_FILES:
            continue
        if name == "config.json":
            if src.is_file():
                writer.write_text(name, _config_with_dtype(base.config, match))
        elif chosen is not None and name in TOKENIZER_SIDE:
            given = chosen.get(name)
            if isinstance(given, bytes):
                writer.write_bytes(name, given)
            elif given is not None:
                writer.copy_file(given)
        elif src.is_file():
            writer.copy_file(src)
    for module in match.code:  # the model's or tokenizer's own code (auto_map): copied, never run
        writer.copy_file(module)


def _config_with_dtype(config: dict[str, Any], match: Match) -> str:
    """The base's config, with its dtype field naming the dtype most merged tensors are written in."""
    cfg = dict(config)
    floats = [j.out_dtype for j in match.jobs if j.kind == "merge"]
    if floats:
        name = str(max(set(floats), key=floats.count)).removeprefix("torch.")
        for key in ("torch_dtype", "dtype"):
            if key in cfg:
                cfg[key] = name
        if "torch_dtype" not in cfg and "dtype" not in cfg:
            cfg["torch_dtype"] = name
    if match.untied_output:  # lm_head is stored: loaders must not tie it to the embeddings
        cfg["tie_word_embeddings"] = False
    if match.tokenizer is not None and match.tokenizer.vocab_size is not None:  # the output's vocabulary rows
        cfg["vocab_size"] = match.tokenizer.vocab_size
    return json.dumps(cfg, indent=2, sort_keys=True) + "\n"
