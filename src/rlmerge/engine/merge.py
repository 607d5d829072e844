"""The merge, top to bottom: open → match → statistics pass (if the method needs it) → merge pass → write."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._torch import torch
from ..errors import ConfigError, InputError, RLMergeError, raise_all
from ..io.checkpoint import SIDE_FILES, Checkpoint
from ..io.partial import PartialDir, fingerprint, input_identity
from ..io.writer import DEFAULT_SHARD_SIZE, CheckpointWriter, layout_shards, shard_header
from ..methods import BlockContext, MethodSpec
from ..report import REPORT_FILE, build_report, dtype_facts, to_json, to_markdown
from ..report.provenance import model_card, provenance
from ..stats import Statistics, check_finite
from . import fast_random as fastdare
from . import fast_select as fastgta
from .blocks import DEFAULT_BLOCK, Block, BlockReader, device_type, spans, tensor_bytes
from .fast import (
    EXACT_GRAM,
    FUSED,
    FastPath,
    OrderedWriter,
    eligible,
    enabled,
    kernel_args,
    merge_job_fast,
    statistics_pass_fast,
)
from .match import Job, Match
from .preflight import preflight
from .progress import Progress


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
          quiet: bool = True, recipe: Mapping[str, Any] | None = None, resume: bool = False,
          fsync: bool = True) -> MergeResult:
    """Merge ``agents`` (fine-tunes of ``base``) into a new Hugging Face checkpoint at ``output``.

    >>> res = rlmerge.merge("base/", ["coder/", "tools/", "memory/"], "merged/", method="ram+",
    ...                     params={"preset": "paper", "r": 0.1, "alpha": 2.0})  # doctest: +SKIP
    >>> res.lambdas  # doctest: +SKIP

    ``resume=True`` continues a run that was interrupted (Ctrl-C, SIGTERM, disk full) after its last
    complete shard; the output is byte-identical to an uninterrupted run. ``fsync=False`` leaves flushing the
    output to the OS (faster on a slow disk; a power cut soon after the merge may lose it, and ``resume``
    still verifies every kept shard by its CRC-32).
    """
    t0 = time.perf_counter()
    pf = preflight(base, agents, output, method=method, params=params, dtype=dtype, shard_size=shard_size,
                   block_size=block_size, device=device, force=force, resume=resume, allow_missing=allow_missing,
                   count_tied_twice=count_tied_twice, seed=seed)
    try:
        raise_all(pf.problems)
        assert pf.match is not None and pf.spec is not None  # no problems: every stage ran
        check_copies(pf.match)  # reads the copied tensors only, before anything is written
        extras = [x for x in pf.extras if x is not None]
        with PartialDir(output, force=force, resume=resume, inputs=pf.models) as partial:
            result = _run(pf.match, pf.spec, pf.params, partial, shard_bytes=pf.shard_bytes,
                          block_size=pf.block_size, device=device, seed=seed, quiet=quiet, recipe=recipe,
                          extras=extras, fsync=fsync)
    finally:
        pf.close()
    result.seconds = time.perf_counter() - t0
    return result


def _run(match: Match, spec: MethodSpec, p: Any, partial: PartialDir, *, shard_bytes: int, block_size: int,
         device: str, seed: int, quiet: bool, recipe: Mapping[str, Any] | None,
         extras: list[Checkpoint] | None = None, fsync: bool = True) -> MergeResult:
    stats = Statistics([a.label for a in match.agents], spec.epsilon(p))
    reader = BlockReader(match, block_size=block_size, device=device, rows=spec.row_blocks(p), extras=extras or None)
    observer = spec.observer(p, len(match.agents))
    metadata = {"rlmerge_method": spec.name}
    fp = fingerprint([match.base, *match.agents, *(extras or [])], {
        "method": spec.name, "params": repr(p), "seed": seed, "recipe": recipe, "metadata": metadata,
        "device": device_type(device),  # float results may differ between CPU and GPU kernels
        "headers": [shard_header(s, metadata).hex() for s in layout_shards(match.jobs, shard_bytes)]})
    writer = CheckpointWriter(partial, match.jobs, shard_size=shard_bytes, metadata=metadata, fingerprint=fp,
                              fsync=fsync, identity=input_identity([match.base, *match.agents, *(extras or [])]))
    gta = (fastgta.build(match, spec, p, block_size, device, observer, extras, stats.epsilon)
           or fastdare.build(match, spec, p, block_size, device, extras, stats.epsilon, seed))
    fast = gta.fast if gta is not None else _fast_path(match, spec, p, block_size, device, observer, extras)
    with Progress(quiet=quiet) as progress, writer, _closing(fast):
        # The fast TIES / DARE paths find per-tensor thresholds and L1 sums inside the merge pass; a whole-model
        # threshold needs a pass.
        needs_stats = spec.needs_stats(p) or (observer is not None and (gta is None or gta.whole_model))
        # A resumed run skips the kept shards' tensors in the merge pass, so it gathers the statistics
        # (for the report, and for RAM+'s ρ) in a statistics pass over the whole model first.
        two_pass = needs_stats or partial.resumed > 0
        if two_pass:
            statistics_pass(match, reader, stats, progress, observer, seed=seed, fast=fast, gta=gta)
            stats.observed = observer
        prepared = spec.prepare(p, stats if needs_stats else None, len(match.agents))
        warnings = [*match.warnings, *getattr(prepared, "warnings", ())]
        result = MergeResult(partial.output, spec.name, p, stats, warnings=warnings, read_bytes=match.read_bytes,
                             write_bytes=match.write_bytes)
        if prepared is not None and hasattr(prepared, "lambdas"):
            result.lambdas, result.rho = list(prepared.lambdas), list(prepared.rho)
        merge_pass(match, reader, spec, p, prepared, stats, writer, progress, collect=not two_pass, seed=seed,
                   fast=fast, gta=gta)
        if not needs_stats:
            result.warnings += _identical_agents(stats)
        _side_files(match.base, writer, match)
        # The statistics this merge already collected feed the report: no extra pass.
        doc = build_report(stats, dtype_facts(match), base=match.base.label, warnings=result.warnings)
        writer.write_text(REPORT_FILE, to_json(doc))
        writer.write_text("README.md", model_card(match, result) + "\n" + to_markdown(doc, level=2))
        writer.finish(provenance(match, result, recipe))
    return result


def _fast_path(match: Match, spec: MethodSpec, p: Any, block_size: int, device: str, observer: Any,
               extras: list[Checkpoint] | None) -> FastPath | None:
    """The fused-kernel path (fastpath.py) when numba is installed and the method has a fused kernel."""
    if not enabled(device) or spec.name not in FUSED or observer is not None or extras or spec.row_blocks(p):
        return None
    if not any(eligible(match, j) for j in match.jobs):
        return None
    return FastPath(match, block_size, exact_gram=spec.name in EXACT_GRAM)


@contextlib.contextmanager
def _closing(fast: FastPath | None) -> Iterator[None]:
    """Stop the fast path's threads before the writer closes (also when a merge is interrupted)."""
    try:
        yield
    except BaseException:
        if fast is not None:
            fast.close(abort=True)
        raise
    if fast is not None:
        fast.close()


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


def _agent_files(match: Match, name: str) -> list[str]:
    return [str(a.tensors[name].file) if name in a.tensors else str(a.path) for a in match.agents]


def _ctx(job: Job, blk: Block, prepared: Any, stats: Statistics, seed: int) -> BlockContext:
    return BlockContext(job.name, blk.start, blk.stop, job.info.shape, job.present, prepared,
                        stats.tensors.get(job.name), seed, blk.extra)


def statistics_pass(match: Match, reader: BlockReader, stats: Statistics, progress: Progress, observer: Any = None,
                    *, seed: int = 0, fast: FastPath | None = None,
                    gta: fastgta.GtaFast | fastdare.DareFast | None = None) -> None:
    """Count every block; feed the method's observer, streaming a tensor (or the model) again if it asks."""
    jobs = match.merge_jobs
    with progress.task("statistics", total=sum(j.info.nbytes for j in jobs), tensors=len(jobs)) as bar:
        if gta is not None:  # every job is on the fast path; ties_global's selection rounds run here
            gta.statistics_pass(jobs, stats, bar)
            return
        if fast is not None and observer is None and not stats.thresholds:  # fused kernel for eligible jobs
            statistics_pass_fast(fast, [j for j in jobs if eligible(match, j)], stats, bar)
            jobs = [j for j in jobs if not eligible(match, j)]
        for job in jobs:
            files = _agent_files(match, job.name)
            for blk in reader.blocks(job):
                _count(stats, job.name, job.numel, job.weight, blk.start, blk.deltas, files)
                if observer is not None:
                    observer.observe(_ctx(job, blk, None, stats, seed), blk.base, blk.deltas)
                bar.advance(blk.n * job.info.dtype.itemsize)
            while observer is not None and observer.again(job.name):  # e.g. refine a per-tensor top-k
                _observe_again(observer, reader, [job], stats, seed)
            bar.tensor_done()
    while observer is not None and observer.again(None):  # e.g. refine a whole-model top-k
        _observe_again(observer, reader, jobs, stats, seed)


def _observe_again(observer: Any, reader: BlockReader, jobs: list[Job], stats: Statistics, seed: int) -> None:
    """Stream ``jobs`` once more to the observer only (no counting: the statistics are already complete)."""
    for job in jobs:
        for blk in reader.blocks(job):
            observer.observe(_ctx(job, blk, None, stats, seed), blk.base, blk.deltas)


def merge_pass(match: Match, reader: BlockReader, spec: MethodSpec, p: Any, prepared: Any, stats: Statistics,
               writer: CheckpointWriter, progress: Progress, *, collect: bool, seed: int,
               fast: FastPath | None = None, gta: fastgta.GtaFast | fastdare.DareFast | None = None) -> None:
    pending = writer.pending(match.jobs)  # a resumed run skips the shards it kept
    # inspect's extra counters (stats.thresholds) are torch-path only
    fast = fast if not stats.thresholds else None
    fast_jobs = [j for j in pending if eligible(match, j)] if fast is not None else []
    passes = gta.passes if gta is not None else None  # TIES reads a large tensor 3 times (2 selection rounds)
    fast_blocks = fast.blocks(list(fast_jobs), passes) if fast is not None else iter(())
    out = OrderedWriter(writer, fast)  # fast path: writes queued on a writer thread, in job order
    with progress.task("merge", total=sum(j.out_nbytes for j in pending), tensors=len(pending)) as bar:
        for job in pending:
            out.begin(job)
            if job.kind == "copy":
                for start, stop in spans(job.numel, reader.block_size):
                    out.write_now(match.base.read_raw(job.name, start, stop))
                    bar.advance((stop - start) * job.out_dtype.itemsize)
                bar.tensor_done()
                continue
            if fast is not None and fast_jobs and job is fast_jobs[0]:
                fast_jobs.pop(0)
                ts = stats.for_tensor(job.name, job.numel, job.weight) if collect else None
                if gta is not None:
                    gta.merge_job(fast_blocks, job, ts, out, bar)
                    bar.tensor_done()
                    continue
                args = kernel_args(spec, p, prepared, stats.tensors.get(job.name), len(match.agents), stats.epsilon)
                assert args is not None  # fast is only built for methods with a fused kernel
                merge_job_fast(fast, fast_blocks, job, args, ts, out, bar)
                bar.tensor_done()
                continue
            files = _agent_files(match, job.name)
            for blk in reader.blocks(job):
                if collect:
                    _count(stats, job.name, job.numel, job.weight, blk.start, blk.deltas, files)
                else:
                    check_finite(blk.deltas, blk.deltas.sum(1), name=job.name, files=files, start=blk.start)
                merged = spec.merge(blk.base, blk.deltas, p, _ctx(job, blk, prepared, stats, seed))
                out.write_now(tensor_bytes(_cast(merged, job, blk.start)))
                bar.advance(blk.n * job.out_dtype.itemsize)
            bar.tensor_done()
        out.drain()


def _cast(merged: torch.Tensor, job: Job, start: int) -> torch.Tensor:
    """The merged float32 block in the output dtype; a value that dtype cannot hold is an error, not an inf."""
    out = merged.to(job.out_dtype.torch).cpu()
    if job.out_dtype.itemsize < 4:
        bad = torch.isinf(out) & torch.isfinite(merged.cpu())
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ConfigError(f"the merged value {float(merged[i]):g} at flat element {start + i} does not fit in "
                              f"{job.out_dtype}: it would be written as infinity", tensor=job.name,
                              hint="write bfloat16 or float32 (--dtype), which hold it")
    return out


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
            step = max(1, (1 << 24) // max(job.info.dtype.itemsize, 1))
            if info.dtype != job.info.dtype or any(
                    bytes(match.base.read_raw(job.name, a, b)) != bytes(agent.read_raw(job.name, a, b))
                    for a, b in spans(job.numel, step)):
                problems.append(InputError(f"the agent changed a {info.dtype.code} tensor, which rlmerge copies "
                                           "from the base instead of merging", file=str(info.file), tensor=job.name,
                                           hint="only float tensors are merged: restore this tensor to the "
                                                "base's, or leave this agent out"))
    raise_all(problems)


def _side_files(base: Checkpoint, writer: CheckpointWriter, match: Match) -> None:
    """config, generation config, tokenizer and chat-template files come from the base."""
    for name in SIDE_FILES:
        src = base.side_dir / name
        if not src.is_file():
            continue
        if name == "config.json":
            writer.write_text(name, _config_with_dtype(base.config, match))
        else:
            writer.copy_file(src)


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
    return json.dumps(cfg, indent=2, sort_keys=True) + "\n"
