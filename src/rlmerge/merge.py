"""The merge, top to bottom: open → plan → statistics pass (if the method needs it) → merge pass → write."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .blocks import DEFAULT_BLOCK, BlockReader
from .checkpoint import SIDE_FILES, Checkpoint, open_all
from .errors import ConfigError
from .fastpath import (
    FUSED,
    FastPath,
    OrderedWriter,
    eligible,
    enabled,
    kernel_args,
    merge_job_fast,
    statistics_pass_fast,
)
from .methods import BlockContext, MethodSpec, get_method
from .plan import Plan, build_plan
from .progress import Progress
from .provenance import model_card, provenance
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
    fast = _fast_path(plan, spec, block_size, device)
    try:
        return _passes(plan, spec, p, out, stats, reader, fast, two_pass, shard_bytes=shard_bytes, force=force,
                       seed=seed, quiet=quiet, recipe=recipe)
    finally:
        if fast is not None:
            fast.close()


def _fast_path(plan: Plan, spec: MethodSpec, block_size: int, device: str) -> FastPath | None:
    """The fused-kernel path (fastpath.py) when numba is installed and the method has a fused kernel."""
    if not enabled(device) or spec.name not in FUSED:
        return None
    return FastPath(plan, block_size) if any(eligible(plan, j) for j in plan.jobs) else None


def _passes(plan: Plan, spec: MethodSpec, p: Any, out: Path, stats: Statistics, reader: BlockReader,
            fast: FastPath | None, two_pass: bool, *, shard_bytes: int, force: bool, seed: int, quiet: bool,
            recipe: Mapping[str, Any] | None) -> MergeResult:
    with Progress(quiet=quiet) as progress:
        if two_pass:
            statistics_pass(plan, reader, stats, progress, fast=fast)
        prepared = spec.prepare(p, stats if two_pass else None, len(plan.agents))
        warnings = [*plan.warnings, *getattr(prepared, "warnings", ())]
        result = MergeResult(out, spec.name, p, stats, warnings=warnings, read_bytes=plan.read_bytes,
                             write_bytes=plan.write_bytes)
        if prepared is not None and hasattr(prepared, "lambdas"):
            result.lambdas, result.rho = list(prepared.lambdas), list(prepared.rho)
        writer = CheckpointWriter(out, plan.jobs, shard_size=shard_bytes, force=force,
                                  metadata={"rlmerge_method": spec.name})
        with writer:
            merge_pass(plan, reader, spec, p, prepared, stats, writer, progress, collect=not two_pass, seed=seed,
                       fast=fast)
            if not two_pass:
                result.warnings += _identical_agents(stats)
            _side_files(plan.base, writer, plan)
            writer.write_text("rlmerge.json", provenance(plan, result, recipe))
            writer.write_text("README.md", model_card(plan, result))
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
                    fast: FastPath | None = None) -> None:
    jobs = plan.merge_jobs
    with progress.task("statistics", total=sum(j.info.nbytes for j in jobs), tensors=len(jobs)) as bar:
        if fast is not None:  # fused kernel for the eligible jobs, the torch path for the rest
            statistics_pass_fast(fast, [j for j in jobs if eligible(plan, j)], stats, bar)
            jobs = [j for j in jobs if not eligible(plan, j)]
        for job in jobs:
            files = _agent_files(plan, job.name)
            for blk in reader.blocks(job):
                _count(stats, job.name, job.numel, job.weight, blk.start, blk.deltas, files)
                bar.advance(blk.n * job.info.dtype.itemsize)
            bar.tensor_done()


def merge_pass(plan: Plan, reader: BlockReader, spec: MethodSpec, p: Any, prepared: Any, stats: Statistics,
               writer: CheckpointWriter, progress: Progress, *, collect: bool, seed: int,
               fast: FastPath | None = None) -> None:
    fast_jobs = [j for j in plan.jobs if eligible(plan, j)] if fast is not None else []
    fast_names = {j.name for j in fast_jobs}
    fast_blocks = fast.blocks(fast_jobs) if fast is not None else iter(())
    out = OrderedWriter(writer, fast)  # fast path: writes queued on a writer thread, in plan order
    with progress.task("merge", total=plan.write_bytes, tensors=len(plan.jobs)) as bar:
        for job in plan.jobs:
            out.begin(job)
            if job.kind == "copy":
                for start, stop in _spans(job.numel, reader.block_size):
                    out.write_now(plan.base.read_raw(job.name, start, stop))
                    bar.advance((stop - start) * job.out_dtype.itemsize)
                bar.tensor_done()
                continue
            if fast is not None and job.name in fast_names:
                ts = stats.tensors.get(job.name)
                args = kernel_args(spec, p, prepared, ts, len(plan.agents), stats.epsilon)
                assert args is not None  # fast is only built for methods with a fused kernel
                merge_job_fast(fast, fast_blocks, job, args,
                               stats.for_tensor(job.name, job.numel, job.weight) if collect else None, out, bar)
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
                out.write_now(merged.to(job.out_dtype).cpu())
                bar.advance(blk.n * job.out_dtype.itemsize)
            bar.tensor_done()
        out.drain()


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
