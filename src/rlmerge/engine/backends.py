"""The backends that run a merge's two passes, behind one interface; ``route`` says which runs which tensor.

- ``TorchBackend``: float32 blocks read into reused buffers (stream/blocks.py) and the method's torch reference (any
  method, input, device);
- ``FusedBackend``: the numba block stream (stream/fast.py) and the method's elementwise rule compiled
  (kernels/fused.py);
- a family's own (``MethodSpec.backend``, as the route chose it: e.g. methods/sparsify/fast_select.py), opened on
  the numba block stream.

Each backend (methods/spec.Runner) counts a tensor's statistics (``statistics``), and merges it (``begin_merge``
with the tensors it will merge, in order, then ``merge_job`` for each), writing through the checkpoint writer in
job order. They write the same bytes (the golden matrix, tests/test_golden.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from .._torch import torch
from ..io.writer import CheckpointWriter
from ..methods import MethodSpec, Run, Runner
from ..stats import Statistics, TensorStats, check_finite
from ..stream.blocks import Block, BlockReader, tensor_bytes
from ..stream.fast import FastPath, RuleArgs, job_reads, statistics_pass_fast, write_slot
from ..stream.match import Job, Match
from . import survival
from .route import Route


def rescaled(run: Run, name: str) -> np.ndarray | None:
    """The agents whose unique elements tensor ``name`` rescales (survival.py), None for a method without."""
    if run.spec.unique_scale is None:
        return None
    p, n = run.params_of(name), len(run.match.agents)
    values = run.spec.values(p, run.prepared, run.stats.tensors.get(name), n, name)
    return survival.rescaled(run.spec, values, n)


def make_backends(route: Route, run: Run, *, block_size: int, device: str) -> tuple[Runner | None, TorchBackend]:
    """(the numba backend the route chose, or None; the torch backend, for every other tensor)."""
    torch_backend = TorchBackend(run, BlockReader(run.match, block_size=block_size, device=device,
                                                  rows=run.spec.row_blocks(run.params), extras=run.extras or None))
    if route.kind == "torch":
        return None, torch_backend
    fast = FastPath(run.match, block_size, exact_gram=run.spec.exact_gram, rows=run.spec.row_blocks(run.params),
                    on_read=lambda n: _count_read(run, n))
    if route.backend is not None:  # the family's own, as it declared itself (spec.Capability)
        return route.backend.open(run, fast), torch_backend
    return FusedBackend(run, fast), torch_backend


@contextlib.contextmanager
def closing(fast: Runner | None) -> Iterator[None]:
    """Stop the numba backend's threads when the passes end; when they were interrupted, without waiting long
    for a call still running (rlmerge._threads)."""
    aborted = True
    try:
        yield
        aborted = False
    finally:
        if fast is not None and fast.fast is not None:
            fast.fast.close(abort=aborted)


def _count_read(run: Run, nbytes: int) -> None:
    run.read_bytes += nbytes


def rule_args(spec: MethodSpec, p: Any, prepared: Any, ts: TensorStats | None, n: int, eps: float,
              name: str) -> RuleArgs:
    """The fused kernel's arguments for tensor ``name`` of an elementwise method."""
    prog = spec.program(p, n)
    if prog is None:
        raise RuntimeError(f"method {spec.name!r}: the fused backend runs a rule, and these parameters have none")
    values = spec.values(p, prepared, ts, n, name)
    consts, agent_consts = prog.arrays(values)
    return RuleArgs(prog, consts, agent_consts, np.float32(eps), survival.rescaled(spec, values, n))


def merge_job_fast(fast: FastPath, blocks: Iterator[Any], job: Job, args: RuleArgs, ts: TensorStats | None,
                   out: CheckpointWriter, bar: Any) -> None:
    """All blocks of one eligible job: fused kernel, statistics into ``ts`` when given, queued write; a rescale's
    survival counted and noted with the tensor (survival.py)."""
    counts = None if args.rescaled is None else np.zeros((fast.parts, len(args.rescaled), 2), dtype=np.int64)
    for _, start, stop, slot, base, agents in job_reads(fast, blocks, job, 1):
        merged = fast.out_view(slot, job, stop - start)
        fast.run(job, start, base, agents, args, merged, ts, counts)
        write_slot(out, slot, merged, bar)
    if counts is not None:
        out.annotate(job.name, {survival.NOTE: counts.sum(0).tolist()})


class TorchBackend:
    """Any method on any input and device: blocks of float32 τ and the method's torch reference."""

    fast = None

    def __init__(self, run: Run, reader: BlockReader) -> None:
        self.run, self.reader = run, reader

    def reads(self, job: Job) -> int:
        return 1

    def _blocks(self, job: Job) -> Any:
        for blk in self.reader.blocks(job):
            self.run.read_bytes += self.reader.bytes_of(job, blk)
            yield blk

    def statistics(self, jobs: list[Job], bar: Any) -> None:
        """Count every block; feed the method's observer, streaming a tensor (or the model) again if it asks."""
        run, observer = self.run, self.run.observer
        for job in jobs:
            files = _agent_files(run.match, job.name)
            for blk in self._blocks(job):
                count(run.stats, job, blk, files)
                if observer is not None:
                    observer.observe(run.context(job, blk, None), blk.base, blk.deltas)
                bar.advance(blk.n * job.info.dtype.itemsize)
            while observer is not None and observer.again(job.name):  # e.g. refine a per-tensor top-k
                self._observe_again([job])
            bar.tensor_done()
        while observer is not None and observer.again(None):  # e.g. refine a whole-model top-k
            self._observe_again(jobs)

    def _observe_again(self, jobs: list[Job]) -> None:
        """Stream ``jobs`` once more to the observer only (the counts are already complete)."""
        for job in jobs:
            for blk in self._blocks(job):
                self.run.observer.observe(self.run.context(job, blk, None), blk.base, blk.deltas)

    def begin_merge(self, jobs: list[Job]) -> None:
        pass

    def merge_job(self, job: Job, ts: TensorStats | None, out: CheckpointWriter, bar: Any) -> None:
        run = self.run
        files = _agent_files(run.match, job.name)
        flags = rescaled(run, job.name)
        counts = np.zeros((len(run.match.agents), 2), dtype=np.int64)
        for blk in self._blocks(job):
            if ts is not None:
                count(run.stats, job, blk, files)
            else:
                check_finite(blk.deltas, blk.deltas.sum(1), name=job.name, files=files, start=blk.start,
                             base=blk.base, base_file=str(job.info.file))
            merged = run.spec.merge_block(blk.base, blk.deltas, run.params_of(job.name),
                                          run.context(job, blk, run.prepared))
            written = cast(merged, job, blk.start)
            if flags is not None:
                counts = counts + survival.count_torch(blk.base, blk.deltas, written, run.stats.epsilon, flags)
            out.write_now(tensor_bytes(written))
            bar.advance(blk.n * job.out_dtype.itemsize)
        if flags is not None:
            out.annotate(job.name, {survival.NOTE: counts.tolist()})


class FusedBackend:
    """An elementwise method's rule, compiled, on the numba block stream."""

    def __init__(self, run: Run, fast: FastPath) -> None:
        self.run, self.fast = run, fast

    def reads(self, job: Job) -> int:
        return 1

    def statistics(self, jobs: list[Job], bar: Any) -> None:
        statistics_pass_fast(self.fast, jobs, self.run.stats, bar)

    def begin_merge(self, jobs: list[Job]) -> None:
        self._blocks = self.fast.blocks(jobs)

    def merge_job(self, job: Job, ts: TensorStats | None, out: CheckpointWriter, bar: Any) -> None:
        run = self.run
        args = rule_args(run.spec, run.params_of(job.name), run.prepared, run.stats.tensors.get(job.name),
                         len(run.match.agents), run.stats.epsilon, job.name)
        merge_job_fast(self.fast, self._blocks, job, args, ts, out, bar)


def count(stats: Statistics, job: Job, blk: Block, files: list[str]) -> None:
    """Add one block of τ to the tensor's statistics (torch), checking that every τ is finite."""
    mask = blk.deltas.abs() > stats.epsilon
    counts = mask.sum(0)
    ts = stats.for_tensor(job.name, job.numel, job.weight)
    before = ts.sumsq.copy()
    ts.update(blk.deltas.cpu(), mask.cpu(), counts.cpu())
    check_finite(blk.deltas, torch.from_numpy(ts.sumsq - before), name=job.name, files=files, start=blk.start,
                 base=blk.base, base_file=str(job.info.file))


def cast(merged: torch.Tensor, job: Job, start: int) -> torch.Tensor:
    """The merged float32 block in the output dtype; a value that dtype cannot hold is an error, not an inf."""
    from ..errors import ConfigError

    out = merged.to(job.out_dtype.torch).cpu()
    if job.out_dtype.itemsize < 4:
        bad = torch.isinf(out) & torch.isfinite(merged.cpu())
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ConfigError(f"the merged value {float(merged[i]):g} at flat element {start + i} does not fit in "
                              f"{job.out_dtype}: it would be written as infinity", tensor=job.name,
                              hint="write bfloat16 or float32 (--dtype), which hold it")
    return out


def _agent_files(match: Match, name: str) -> list[str]:
    return [str(a.tensors[name].file) if name in a.tensors else str(a.path) for a in match.agents]
