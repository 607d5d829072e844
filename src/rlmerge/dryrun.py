"""`rlmerge plan`: everything a merge would find wrong, and what it would cost, from headers only.

No weight is read. Every stage that can be checked before the merge runs (method and parameters, dtype
and shard size, the output folder, each input checkpoint, base/agent matching, memory) is checked, and
all problems are returned together rather than stopping at the first.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .blocks import DEFAULT_BLOCK
from .budget import MemoryEstimate, available_memory, check_memory, estimate_memory
from .checkpoint import Checkpoint, resolve
from .errors import OutputError, ProblemsError, RLMergeError
from .methods import get_method
from .partial import PROGRESS, check_output_location, partial_path
from .plan import Plan, build_plan
from .writer import DEFAULT_SHARD_SIZE, layout_shards, parse_size


@dataclass
class DryRun:
    """What ``rlmerge plan`` reports. ``problems`` empty means the merge can start."""

    method: str
    problems: list[RLMergeError] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    plan: Plan | None = None
    passes: list[str] = field(default_factory=list)  # "statistics", "merge"
    read_bytes: int = 0  # over all passes
    write_bytes: int = 0
    shards: int = 0
    memory: MemoryEstimate | None = None
    available_memory: int | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        mem = self.memory
        return {
            "ok": self.ok, "method": self.method, "passes": self.passes, "read_bytes": self.read_bytes,
            "write_bytes": self.write_bytes, "shards": self.shards,
            "tensors": len(self.plan.jobs) if self.plan else None,
            "peak_memory_bytes": mem.total if mem else None, "block": mem.block if mem else None,
            "mapped_bin_bytes": mem.mapped if mem else None, "available_memory_bytes": self.available_memory,
            "problems": [p.render() for p in self.problems], "warnings": self.warnings,
        }


def _flat(e: RLMergeError) -> list[RLMergeError]:
    return list(e.problems) if isinstance(e, ProblemsError) else [e]


def _check_output(output: Path, *, force: bool, resume: bool) -> list[RLMergeError]:
    out: list[RLMergeError] = []
    if output.exists() and not force:
        out.append(OutputError("output folder already exists", file=str(output),
                               hint="choose another -o, or pass --force to replace it"))
    progress = partial_path(output) / PROGRESS
    if progress.is_file() and not (resume or force):
        try:
            n = len(json.loads(progress.read_text()).get("shards", []))
        except (OSError, ValueError, AttributeError):
            n = 0
        if n:
            out.append(OutputError(f"an interrupted merge left {n} completed shard(s) in {partial_path(output)}",
                                   file=str(output), hint="add --resume to continue it, or --force to start over"))
    parent = next((p for p in output.absolute().parents if p.exists()), None)
    if parent is not None and not os.access(parent, os.W_OK):
        out.append(OutputError("the output's folder is not writable", file=str(parent),
                               hint="choose a writable output folder"))
    return out


def dry_run(base: str | os.PathLike[str], agents: Sequence[str | os.PathLike[str]],
            output: str | os.PathLike[str] | None = None, *, method: str = "ram+",
            params: Mapping[str, Any] | None = None, dtype: str | None = None,
            shard_size: str | int = DEFAULT_SHARD_SIZE, block_size: int = DEFAULT_BLOCK,
            allow_missing: bool = False, count_tied_twice: bool = False, force: bool = False,
            resume: bool = False, available: int | None = None, **_ignored: Any) -> DryRun:
    """Check a merge without running it; ``available`` overrides the memory available (bytes).

    >>> report = dry_run("base/", ["coder/", "tools/"], "merged/", method="ram+")  # doctest: +SKIP
    >>> report.ok, report.read_bytes, report.memory.total  # doctest: +SKIP
    """
    report = DryRun(method)
    problems = report.problems
    spec, p, out_dtype, shard_bytes = _configuration(method, params, dtype, shard_size, problems)
    extra_specs = list(spec.extra_inputs(p) or ()) if spec is not None and p is not None else []
    models = _open([base, *agents], problems)
    extras = _open(extra_specs, problems)
    if output is not None:
        problems += _check_output(Path(output), force=force, resume=resume)
        try:
            check_output_location(Path(output), [m for m in models + extras if m is not None])
        except RLMergeError as e:
            problems.append(e)
    if models[0] is None:
        return report
    opened = [m for m in models[1:] if m is not None]
    report.memory = estimate_memory(models[0], [*opened, *(x for x in extras if x)], block_size,
                                    n_agents=len(agents) + len(extra_specs))
    report.available_memory = available_memory() if available is None else available
    try:
        check_memory(report.memory, len(agents), report.available_memory)
    except RLMergeError as e:
        problems.append(e)
    # Agents that could not be opened are left out, so the others are still matched against the base;
    # the figures below are then lower bounds.
    try:
        plan = build_plan(models[0], opened, dtype=out_dtype, allow_missing=allow_missing,
                          count_tied_twice=count_tied_twice)
        if all(extras):
            from .merge import check_side_inputs  # merge imports the modules this one does: import late

            check_side_inputs(plan, extras)  # type: ignore[arg-type]
    except RLMergeError as e:
        problems += [x for x in _flat(e) if opened or "no agents given" not in x.message]
        return report
    _costs(report, plan, spec is not None and (spec.needs_stats(p) or spec.observer(p, len(opened)) is not None),
           shard_bytes)
    return report


def _configuration(method: str, params: Mapping[str, Any] | None, dtype: str | None, shard_size: str | int,
                   problems: list[RLMergeError]) -> tuple[Any, Any, Any, int]:
    """(method spec, parameters, output dtype, shard bytes), each None/default where it is a problem."""
    from .merge import parse_dtype  # merge imports the modules this one does: import late

    spec = p = out_dtype = None
    shard_bytes = DEFAULT_SHARD_SIZE
    try:
        spec = get_method(method)
        p = spec.parse(params)
    except RLMergeError as e:
        problems += _flat(e)
    try:
        out_dtype = parse_dtype(dtype)
    except RLMergeError as e:
        problems += _flat(e)
    try:
        shard_bytes = parse_size(shard_size)
    except RLMergeError as e:
        problems += _flat(e)
    return spec, p, out_dtype, shard_bytes


def _open(specs: Sequence[str | os.PathLike[str]], problems: list[RLMergeError]) -> list[Checkpoint | None]:
    out: list[Checkpoint | None] = []
    for s in specs:
        try:
            path, rev = resolve(s)
            out.append(Checkpoint(path, label=str(s), revision=rev))
        except RLMergeError as e:
            problems += _flat(e)
            out.append(None)
    return out


def _costs(report: DryRun, plan: Plan, two_pass: bool, shard_bytes: int) -> None:
    """Passes, bytes read over all of them (an observer asking for more passes reads more), bytes written."""
    report.plan, report.warnings = plan, list(plan.warnings)
    report.passes = ["statistics", "merge"] if two_pass else ["merge"]
    stats_read = sum(j.info.nbytes + sum(a.tensors[j.name].nbytes for a, here in zip(plan.agents, j.present) if here)
                     for j in plan.merge_jobs)
    report.read_bytes = plan.read_bytes + (stats_read if two_pass else 0)
    report.write_bytes = plan.write_bytes
    report.shards = len(layout_shards(plan.jobs, shard_bytes))
