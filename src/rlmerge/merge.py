"""The merge, top to bottom: open → plan → statistics pass (if the method needs it) → merge pass → write."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .blocks import DEFAULT_BLOCK, Block, BlockReader
from .checkpoint import SIDE_FILES, Checkpoint, open_all
from .errors import ConfigError
from .methods import BlockContext, MethodSpec, get_method
from .plan import Job, Plan, build_plan
from .progress import Progress
from .provenance import model_card, provenance
from .report import REPORT_FILE, build_report, dtype_facts, to_json, to_markdown
from .stats import Statistics, check_finite
from .writer import DEFAULT_SHARD_SIZE, CheckpointWriter, parse_size

DTYPE_ALIASES = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
    "half": torch.float16, "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
}


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    if name is None or isinstance(name, torch.dtype):
        return name
    try:
        return DTYPE_ALIASES[str(name).lower().removeprefix("torch.")]
    except KeyError:
        raise ConfigError(f"unknown dtype {name!r}", hint="use bfloat16, float16 or float32") from None


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
    read_bytes: int = 0
    write_bytes: int = 0


def merge(base: str | os.PathLike[str], agents: Sequence[str | os.PathLike[str]], output: str | os.PathLike[str],
          *, method: str = "ram+", params: Mapping[str, Any] | None = None, dtype: str | None = None,
          shard_size: str | int = DEFAULT_SHARD_SIZE, block_size: int = DEFAULT_BLOCK, device: str = "cpu",
          force: bool = False, allow_missing: bool = False, count_tied_twice: bool = False, seed: int = 0,
          quiet: bool = True, recipe: Mapping[str, Any] | None = None) -> MergeResult:
    """Merge ``agents`` (fine-tunes of ``base``) into a new Hugging Face checkpoint at ``output``.

    >>> res = rlmerge.merge("base/", ["coder/", "tools/", "memory/"], "merged/", method="ram+",
    ...                     params={"preset": "paper", "r": 0.1, "alpha": 2.0})  # doctest: +SKIP
    >>> res.lambdas  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    spec = get_method(method)
    p = spec.parse(params)  # bad parameters fail before any file is opened
    out_dtype = parse_dtype(dtype)
    shard_bytes = parse_size(shard_size)
    out = Path(output)
    CheckpointWriter(out, [], force=force)  # refuses an existing output now, before any work
    models = open_all([base, *agents])
    try:
        plan = build_plan(models[0], models[1:], dtype=out_dtype, allow_missing=allow_missing,
                          count_tied_twice=count_tied_twice)
        result = _run(plan, spec, p, out, shard_bytes=shard_bytes, block_size=block_size, device=device,
                      force=force, seed=seed, quiet=quiet, recipe=recipe)
    finally:
        for m in models:
            m.close()
    result.seconds = time.perf_counter() - t0
    return result


def _run(plan: Plan, spec: MethodSpec, p: Any, out: Path, *, shard_bytes: int, block_size: int, device: str,
         force: bool, seed: int, quiet: bool, recipe: Mapping[str, Any] | None) -> MergeResult:
    stats = Statistics([a.label for a in plan.agents], spec.epsilon(p))
    reader = BlockReader(plan, block_size=block_size, device=device)
    two_pass = spec.needs_stats(p)
    with Progress(quiet=quiet) as progress:
        if two_pass:
            statistics_pass(plan, reader, stats, progress)
        prepared = spec.prepare(p, stats if two_pass else None, len(plan.agents))
        warnings = [*plan.warnings, *getattr(prepared, "warnings", ())]
        result = MergeResult(out, spec.name, p, stats, warnings=warnings, read_bytes=plan.read_bytes,
                             write_bytes=plan.write_bytes)
        if prepared is not None and hasattr(prepared, "lambdas"):
            result.lambdas, result.rho = list(prepared.lambdas), list(prepared.rho)
        writer = CheckpointWriter(out, plan.jobs, shard_size=shard_bytes, force=force,
                                  metadata={"rlmerge_method": spec.name})
        with writer:
            merge_pass(plan, reader, spec, p, prepared, stats, writer, progress, collect=not two_pass, seed=seed)
            if not two_pass:
                result.warnings += _identical_agents(stats)
            _side_files(plan.base, writer, plan)
            writer.write_text("rlmerge.json", provenance(plan, result, recipe))
            # The statistics this merge already collected feed the report: no extra pass.
            doc = build_report(stats, dtype_facts(plan), base=plan.base.label, warnings=result.warnings)
            writer.write_text(REPORT_FILE, to_json(doc))
            writer.write_text("README.md", model_card(plan, result) + "\n" + to_markdown(doc, level=2))
            writer.finish()
    return result


def _identical_agents(stats: Statistics) -> list[str]:
    return [f"agent {a} is identical to the base (no element with |τ| > ε): it contributes nothing"
            for a, c in zip(stats.agents, stats.changed) if c == 0]


def _count(stats: Statistics, name: str, numel: int, weight: int, start: int, deltas: torch.Tensor,
           files: list[str]) -> None:
    mask = deltas.abs() > stats.epsilon
    counts = mask.sum(0)
    ts = stats.for_tensor(name, numel, weight)
    before = ts.sumsq.copy()
    ts.update(deltas.cpu(), mask.cpu(), counts.cpu())
    check_finite(deltas, torch.from_numpy(ts.sumsq - before), name=name, files=files, start=start)


def _agent_files(plan: Plan, name: str) -> list[str]:
    return [str(a.tensors[name].file) if name in a.tensors else str(a.path) for a in plan.agents]


def statistics_pass(plan: Plan, reader: BlockReader, stats: Statistics, progress: Progress, *,
                    on_block: Callable[[Job, Block], None] | None = None) -> None:
    """Count every merge job's blocks into ``stats``; ``on_block`` sees each block after (inspect's extras)."""
    jobs = plan.merge_jobs
    with progress.task("statistics", total=sum(j.info.nbytes for j in jobs), tensors=len(jobs)) as bar:
        for job in jobs:
            files = _agent_files(plan, job.name)
            for blk in reader.blocks(job):
                _count(stats, job.name, job.numel, job.weight, blk.start, blk.deltas, files)
                if on_block is not None:
                    on_block(job, blk)
                bar.advance(blk.n * job.info.dtype.itemsize)
            bar.tensor_done()


def merge_pass(plan: Plan, reader: BlockReader, spec: MethodSpec, p: Any, prepared: Any, stats: Statistics,
               writer: CheckpointWriter, progress: Progress, *, collect: bool, seed: int) -> None:
    with progress.task("merge", total=plan.write_bytes, tensors=len(plan.jobs)) as bar:
        for job in plan.jobs:
            writer.begin(job)
            if job.kind == "copy":
                for start, stop in _spans(job.numel, reader.block_size):
                    writer.write(plan.base.read_raw(job.name, start, stop))
                    bar.advance((stop - start) * job.out_dtype.itemsize)
                bar.tensor_done()
                continue
            files = _agent_files(plan, job.name)
            for blk in reader.blocks(job):
                if collect:
                    _count(stats, job.name, job.numel, job.weight, blk.start, blk.deltas, files)
                else:
                    check_finite(blk.deltas, blk.deltas.sum(1), name=job.name, files=files, start=blk.start)
                ctx = BlockContext(job.name, blk.start, blk.stop, job.info.shape, job.present, prepared,
                                   stats.tensors.get(job.name), seed)
                merged = spec.merge(blk.base, blk.deltas, p, ctx)
                writer.write(merged.to(job.out_dtype).cpu())
                bar.advance(blk.n * job.out_dtype.itemsize)
            bar.tensor_done()


def _spans(numel: int, size: int) -> Iterator[tuple[int, int]]:
    for start in range(0, numel, size):
        yield start, min(start + size, numel)


def _side_files(base: Checkpoint, writer: CheckpointWriter, plan: Plan) -> None:
    """config, generation config, tokenizer and chat-template files come from the base."""
    for name in SIDE_FILES:
        src = base.path / name
        if not src.is_file():
            continue
        if name == "config.json":
            writer.write_text(name, _config_with_dtype(base.config, plan))
        else:
            writer.copy_file(src)


def _config_with_dtype(config: dict[str, Any], plan: Plan) -> str:
    """The base's config, with its dtype field naming the dtype most merged tensors are written in."""
    cfg = dict(config)
    floats = [j.out_dtype for j in plan.jobs if j.kind == "merge"]
    if floats:
        name = str(max(set(floats), key=floats.count)).removeprefix("torch.")
        for key in ("torch_dtype", "dtype"):
            if key in cfg:
                cfg[key] = name
        if "torch_dtype" not in cfg and "dtype" not in cfg:
            cfg["torch_dtype"] = name
    return json.dumps(cfg, indent=2, sort_keys=True) + "\n"
