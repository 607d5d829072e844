"""The engine loop: the statistics pass and the merge pass, each tensor on the backend the route chose for it."""

from __future__ import annotations

from ..io.writer import CheckpointWriter
from ..methods import Run, Runner
from ..stream.blocks import spans
from .backends import TorchBackend
from .progress import Progress
from .route import Route


def statistics_pass(run: Run, route: Route, fast: Runner | None, torch: TorchBackend, progress: Progress) -> None:
    """Every merged tensor's statistics (and the method's observer), numba tensors first, then torch's."""
    jobs = run.match.merge_jobs
    with progress.task("statistics", total=sum(j.info.nbytes for j in jobs), tensors=len(jobs)) as bar:
        if fast is not None:
            fast.statistics([j for j in jobs if j.name in route.stats_fast], bar)
        torch.statistics([j for j in jobs if j.name not in route.stats_fast], bar)


def merge_pass(run: Run, route: Route, fast: Runner | None, torch: TorchBackend, writer: CheckpointWriter,
               progress: Progress, *, collect: bool) -> None:
    """Every pending tensor in job order: copied from the base, or merged by its backend (``collect``: the
    statistics are gathered here, no statistics pass ran)."""
    match = run.match
    pending = writer.pending(match.jobs)  # a resumed run skips the shards it kept
    if fast is not None:
        fast.begin_merge([j for j in pending if j.name in route.fast])
    with progress.task("merge", total=sum(j.out_nbytes for j in pending), tensors=len(pending)) as bar:
        for job in pending:
            writer.start(job)
            if job.kind == "copy":
                for start, stop in spans(job.numel, torch.reader.block_size):
                    writer.write_now(match.base.read_raw(job.name, start, stop))
                    run.read_bytes += (stop - start) * job.info.dtype.itemsize
                    bar.advance((stop - start) * job.out_dtype.itemsize)
            else:
                ts = run.stats.for_tensor(job.name, job.numel, job.weight) if collect else None
                (fast if fast is not None and job.name in route.fast else torch).merge_job(job, ts, writer, bar)
            bar.tensor_done()
        writer.drain()
