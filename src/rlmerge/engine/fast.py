"""The fast path of both passes: fused kernels on the stored bytes, in place, with writes overlapped.

A job takes the fast path when numba is installed, the device is the CPU, the method has a fused kernel
(ram, ram+, task_arithmetic, linear, model_stock here; TIES/Breadcrumbs in fastgta.py, DARE in fastdare.py),
every agent has the tensor, and base, agents and output are bfloat16 or float32 safetensors. Other jobs take
the torch path (blocks.py + the method's kernel) in the same run. The bytes written are the same either way
(tests/test_fastpath.py).

Reading: a block is a view of the memory-mapped input files (mapping.py); the next block's pages are
requested ahead and a finished block's handed back, so the resident set is bounded by the blocks in flight.
A tensor that cannot be viewed in place (bytes not aligned to its dtype) is copied into a slot by a reader
thread while the previous block is computed. Computing: each block is split between the compute threads
(numba releases the GIL). Writing: a writer thread appends finished blocks to the output in order, from one
of four output slots, so that computing does not wait on every write.
"""
from __future__ import annotations

import math
import os
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import kernels
from .._torch import torch
from ..errors import ConfigError
from ..io.dtypes import BF16, F32, DType
from ..io.mapping import DONTNEED, WILLNEED, Mapped
from ..methods import MethodSpec
from ..methods.gta import _row
from ..stats import Statistics, TensorStats, check_finite
from .blocks import device_type
from .match import Job, Match

STORED = {BF16: np.uint16, F32: np.float32}  # dtypes the kernels decode and encode
FUSED = {"ram": kernels.MODE_RAM, "ram+": kernels.MODE_RAMPLUS, "task_arithmetic": kernels.MODE_TA,
         "linear": kernels.MODE_LINEAR, "model_stock": kernels.MODE_STOCK}
EXACT_GRAM = {"model_stock"}  # methods that merge with the Gram matrix: float64 products (see kernels.py)
ALIGN_MAX = 1 << 20  # elements: a row-cut block may grow to lcm(row, TILE) up to this (see row_step)


def enabled(device: str) -> bool:
    """numba present, CPU device, and not switched off with RLMERGE_FAST=0."""
    return kernels.HAVE_NUMBA and device_type(device) == "cpu" and os.environ.get("RLMERGE_FAST", "1") != "0"


def compute_threads() -> int:
    """Threads that run the kernels: RLMERGE_THREADS, else every CPU this process may use."""
    affinity = getattr(os, "sched_getaffinity", None)  # Linux; elsewhere every CPU
    cpus = max(1, len(affinity(0)) if affinity else (os.cpu_count() or 1))
    text = os.environ.get("RLMERGE_THREADS", "").strip()
    if not text:
        return cpus
    most = max(8, 4 * cpus)  # more only adds contention, and every thread keeps its own histograms
    if not text.isdigit() or not 1 <= int(text) <= most:
        raise ConfigError(f"RLMERGE_THREADS={text!r} must be a whole number from 1 to {most} ({cpus} CPU(s) here)",
                          hint=f"unset it to use all {cpus} CPU(s), or set e.g. RLMERGE_THREADS={cpus}")
    return int(text)


@dataclass(frozen=True)
class KernelArgs:
    """The constants one job's fused kernel needs, as float32 (the torch kernels' arithmetic)."""

    mode: int
    eps: np.float32
    lam: np.ndarray  # [N] float32, RAM+'s λ (MODE_RAMPLUS)
    w: np.ndarray  # [N] float32
    normalize: bool
    div: np.float32  # 1 when not normalising
    scaling: np.float32


def kernel_args(spec: MethodSpec, p: Any, prepared: Any, ts: TensorStats | None, n: int,
                eps: float) -> KernelArgs | None:
    """None when the method has no fused kernel."""
    from ..methods.ram import rescale_factor
    from ..methods.task_arithmetic import _divisor, agent_weights

    mode = FUSED.get(spec.name)
    if mode is None:
        return None
    ones = np.ones(n, dtype=np.float32)
    one = np.float32(1.0)
    if spec.name == "ram+":
        if p.preset == "tensor-local":
            assert ts is not None  # the statistics pass ran (ram+ needs it)
            lam = [rescale_factor(p, int(s), int(u)) for s, u in zip(ts.shared, ts.unique)]
        else:
            lam = list(prepared.lambdas)
        return KernelArgs(mode, np.float32(p.epsilon), np.array(lam, dtype=np.float32), ones, False, one, one)
    if spec.name == "ram":
        return KernelArgs(mode, np.float32(p.epsilon), ones, ones, False, one, one)
    if spec.name == "model_stock":
        from ..methods.model_stock import tensor_t

        assert ts is not None  # the statistics pass ran (model_stock needs it)
        return KernelArgs(mode, np.float32(eps), ones, ones, True, np.float32(n), tensor_t(ts.dots, n))
    where = spec.name
    w = agent_weights(where, p.weights, n)
    div = _divisor(where, w) if p.normalize else one
    scaling = np.float32(getattr(p, "scaling", 1.0))
    return KernelArgs(mode, np.float32(eps), ones, w, bool(p.normalize), div, scaling)


def eligible(match: Match, job: Job) -> bool:
    if job.kind != "merge" or not all(job.present) or job.out_dtype not in STORED or job.info.dtype not in STORED:
        return False
    if any(m.format != "safetensors" for m in (match.base, *match.agents)):
        return False
    dtypes = {a.tensors[job.name].dtype for a in match.agents}
    return len(dtypes) == 1 and dtypes.pop() in STORED and len(match.agents) <= kernels.MAX_AGENTS


def row_step(shape: tuple[int, ...], numel: int, block: int) -> int:
    """Elements per block of a tensor whose blocks must hold whole rows (DELLA: ``shape[1:]``; a 1-D tensor is
    one row): the whole tensor when it fits in ``block``, else a multiple of lcm(row, TILE), so that every
    block starts at a whole tile too and the statistics' float32 partial sums do not depend on the block size
    (kernels.py). At least one such unit, which may exceed ``block`` up to ALIGN_MAX; a row with a large odd
    factor, whose unit is larger still, is cut at rows only (its report may then differ in the last bits between
    block sizes; the merged bytes never do)."""
    row = _row(shape)
    if numel <= block:
        return max(numel, 1)
    unit = math.lcm(row, kernels.TILE)
    if unit > max(block, ALIGN_MAX):
        unit = row
    return max(unit, block // unit * unit)


class _Slot:
    """One set of raw buffers: base [block], agents [N, block], output [block] (bytes, viewed per dtype)."""

    def __init__(self, n_agents: int, block: int) -> None:
        self.base = np.empty(block * 4, dtype=np.uint8)
        self.agents = np.empty(n_agents * block * 4, dtype=np.uint8)
        self.out = np.empty(block * 4, dtype=np.uint8)
        self.written: Future[None] | None = None  # the write of ``out`` still in flight


class _WriteQueue:
    """Calls run in submission order on one daemon thread.

    A daemon thread and a bounded wait on abort: an interrupted merge (Ctrl-C, SIGTERM) must neither wait
    for nor be kept alive by a write stuck on a slow disk; the interrupted output is partial anyway.
    """

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._abort = False
        self._thread = threading.Thread(target=self._loop, name="rlmerge-write", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        self._q.put((fut, fn, args))
        return fut

    def _loop(self) -> None:
        failed: BaseException | None = None  # after a failed call, the later ones fail with its error
        while (item := self._q.get()) is not None:
            fut, fn, args = item
            if self._abort:
                fut.cancel()
            if not fut.set_running_or_notify_cancel():
                continue
            if failed is not None:
                fut.set_exception(failed)
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # handed to whoever waits on the future
                failed = e
                fut.set_exception(e)

    def close(self, *, abort: bool) -> None:
        self._abort = abort
        self._q.put(None)
        self._thread.join(timeout=5.0 if abort else None)


class FastPath:
    """Runs the fused kernels over the eligible jobs of a match; see the module docstring."""

    def __init__(self, match: Match, block_size: int, *, exact_gram: bool = False, rows: bool = False) -> None:
        self.match = match
        self.exact_gram = exact_gram
        self.rows = rows  # blocks cut at row boundaries (``step``)
        # a whole number of the kernels' tiles: tiles then sit at the same offsets of a tensor whatever the
        # block size and the number of threads, and so do the statistics' float32 partial sums (kernels.py)
        block = -(-block_size // kernels.TILE) * kernels.TILE
        self.block = max(1, min(block, max((j.numel for j in match.merge_jobs), default=1)))
        n = len(match.agents)
        size = max((min(self.step(j), j.numel) for j in match.merge_jobs), default=self.block) if rows else self.block
        self.slots = [_Slot(n, max(size, 1)) for _ in range(4)]
        self.threads = compute_threads()
        self.hist = np.zeros((self.threads, *kernels.hist_shape(n)), dtype=np.int64)  # per compute thread
        self.gram = np.zeros((self.threads, n, n), dtype=np.float64)
        self._dummy_out = np.empty(1, dtype=np.float32)
        self.mapped = Mapped()
        self._compute = ThreadPoolExecutor(self.threads, thread_name_prefix="rlmerge-compute")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="rlmerge-read")
        self._writer = _WriteQueue()
        self._last_write: Future[None] | None = None

    def step(self, job: Job) -> int:
        """Elements per block of ``job``: ``block``, or with ``rows`` whole rows and tiles (row_step)."""
        return row_step(job.info.shape, job.numel, self.block) if self.rows else self.block

    def close(self, *, abort: bool = False) -> None:
        """Stop the threads; ``abort`` (the merge failed or was interrupted) drops the queued writes."""
        self._compute.shutdown(wait=True, cancel_futures=True)
        self._reader.shutdown(wait=True, cancel_futures=True)
        self._writer.close(abort=abort)
        self.mapped.close()

    # -- reading ---------------------------------------------------------------------------------------
    def _read(self, slot: _Slot, job: Job, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """A copy of the block in ``slot``: base [n], agents [N, n] (read-only, like the mapped views)."""
        n = stop - start
        bdt = STORED[job.info.dtype]
        adt = STORED[self.match.agents[0].tensors[job.name].dtype]
        size = np.dtype(adt).itemsize
        base = slot.base[: n * np.dtype(bdt).itemsize]
        self.match.base.read_into(job.name, start, stop, memoryview(base))
        agents = slot.agents[: len(self.match.agents) * n * size]
        for t, a in enumerate(self.match.agents):
            a.read_into(job.name, start, stop, memoryview(agents[t * n * size:(t + 1) * n * size]))
        base, agents = base.view(bdt), agents.view(adt).reshape(len(self.match.agents), n)
        base.flags.writeable = agents.flags.writeable = False  # one kernel signature for copies and views
        return base, agents

    def _views(self, job: Job, start: int, stop: int) -> tuple[np.ndarray, tuple[np.ndarray, ...]] | None:
        """The block viewed in the mapped files, or None when some tensor cannot be viewed in place."""
        models = (self.match.base, *self.match.agents)
        views = [self.mapped.view(m, job.name, start, stop) for m in models]
        if any(v is None for v in views):
            return None
        return views[0], tuple(views[1:])  # type: ignore[return-value]

    def _advise(self, job: Job, start: int, stop: int, advice: int) -> None:
        if advice:
            for m in (self.match.base, *self.match.agents):
                self.mapped.advise(m, job.name, start, stop, advice)

    def blocks(self, jobs: list[Job], passes: Callable[[Job], int] | None = None,
               ) -> Iterator[tuple[Job, int, int, _Slot, np.ndarray, tuple[np.ndarray, ...]]]:
        """Every block of ``jobs`` in order (each job's blocks ``passes(job)`` times over).

        A block's agents come as a tuple of [n] views of the mapped files; a tensor that cannot be viewed in
        place is copied into a slot by the reader thread while the previous block is computed. The next
        block's pages are requested ahead, a finished block's pages are released.
        """
        spans = [(j, s, min(s + self.step(j), j.numel)) for j in jobs for _ in range(passes(j) if passes else 1)
                 for s in range(0, j.numel, self.step(j))]
        pending: Future[tuple[np.ndarray, np.ndarray]] | None = None
        for k, (job, start, stop) in enumerate(spans):
            slot = self.slots[k % 2]
            if slot.written is not None:  # its output buffer must be written before it is reused
                slot.written.result()
            views = None if pending is not None else self._views(job, start, stop)
            if views is None:
                if pending is None:
                    pending = self._reader.submit(self._read, slot, job, start, stop)
                base, agents = pending.result()
                views = (base, tuple(agents))
            pending = None
            if k + 1 < len(spans):
                nxt = spans[k + 1]
                self._advise(*nxt, WILLNEED)
                if self._views(*nxt) is None:  # a copy: read it while this block is computed
                    pending = self._reader.submit(self._read, self.slots[(k + 1) % 2], *nxt)
            yield job, start, stop, slot, views[0], views[1]
            self._advise(job, start, stop, DONTNEED)

    # -- computing -------------------------------------------------------------------------------------
    def run(self, job: Job, start: int, base: np.ndarray, agents: np.ndarray, args: KernelArgs,
            out: np.ndarray | None, ts: TensorStats | None) -> None:
        """The fused kernel on one block; statistics into ``ts`` when given (which also checks every τ)."""
        n = base.shape[0]
        if ts is not None:
            self.hist[:] = 0
            self.gram[:] = 0.0
        mode = args.mode if out is not None else kernels.MODE_STATS
        dest = out if out is not None else self._dummy_out
        bad = self.parallel(n, lambda k, lo, hi: kernels.fused_range(
            mode, base, agents, lo, hi, args.eps, args.lam, args.w, args.normalize, args.div, args.scaling, dest,
            self.hist[k] if ts is not None else None, self.gram[k] if ts is not None else None, self.exact_gram))
        if any(bad):
            self.raise_non_finite(job, start, base, agents)
        if ts is not None:
            ts.add_patterns(self.hist.sum(axis=(0, 1)), self.gram.sum(0))

    def parallel(self, n: int, fn: Callable[[int, int, int], Any]) -> list[Any]:
        """``fn(k, lo, hi)`` on one slice [lo, hi) of [0, n) per compute thread k; the kernels release the GIL."""
        # slices start at multiples of the kernels' tile: the tiles, and so the statistics' float32 partial
        # sums, are the same whatever the number of threads
        step = -(-n // self.threads // kernels.TILE) * kernels.TILE if n > kernels.TILE else n
        parts = [(k, min(n, k * step), min(n, (k + 1) * step)) for k in range(self.threads)]
        if self.threads == 1:
            return [fn(*parts[0])]
        return list(self._compute.map(lambda a: fn(*a), parts))

    def run_parts(self, parts: list[tuple[int, int]], fn: Callable[[int, int], Any]) -> list[Any]:
        """``fn(lo, hi)`` on the compute threads, one call per given slice (fastdare cuts at chunk boundaries)."""
        if len(parts) == 1:
            return [fn(*parts[0])]
        return list(self._compute.map(lambda a: fn(*a), parts))

    def raise_non_finite(self, job: Job, start: int, base: np.ndarray, agents: Any) -> None:
        def f32(a: np.ndarray, dtype: DType) -> torch.Tensor:
            return torch.from_numpy(np.array(a)).view(dtype.torch).float()

        b = f32(base, job.info.dtype)
        deltas = f32(np.stack(agents), self.match.agents[0].tensors[job.name].dtype) - b
        files = [str(a.tensors[job.name].file) for a in self.match.agents]
        check_finite(deltas, torch.tensor([float("nan")]), name=job.name, files=files, start=start)

    def out_view(self, slot: _Slot, job: Job, n: int) -> np.ndarray:
        dt = STORED[job.out_dtype]
        return slot.out[: n * np.dtype(dt).itemsize].view(dt)

    # -- writing, in order, on the writer thread -------------------------------------------------------
    def submit_write(self, fn: Callable[..., None], *args: Any, slot: _Slot | None = None) -> None:
        fut = self._writer.submit(fn, *args)
        self._last_write = fut
        if slot is not None:
            slot.written = fut

    def drain(self) -> None:
        """Wait for every queued write (and raise its error, if any)."""
        if self._last_write is not None:
            self._last_write.result()
        for s in self.slots:
            if s.written is not None:
                s.written.result()


def stats_args(n_agents: int, eps: float) -> KernelArgs:
    ones = np.ones(n_agents, dtype=np.float32)
    one = np.float32(1.0)
    return KernelArgs(kernels.MODE_STATS, np.float32(eps), ones, ones, False, one, one)


def statistics_pass_fast(fast: FastPath, jobs: list[Job], stats: Statistics, bar: Any,
                         also: Callable[[Job, int, np.ndarray, tuple[np.ndarray, ...]], None] | None = None) -> None:
    """The statistics of ``jobs`` (all eligible) through the fused kernel; ``also`` sees every block too."""
    args = stats_args(len(fast.match.agents), stats.epsilon)
    for job, start, stop, _slot, base, agents in fast.blocks(jobs):
        fast.run(job, start, base, agents, args, None, stats.for_tensor(job.name, job.numel, job.weight))
        if also is not None:
            also(job, start, base, agents)
        bar.advance((stop - start) * job.info.dtype.itemsize)
        if stop == job.numel:
            bar.tensor_done()


class OrderedWriter:
    """The writer's begin/write in job order: queued on the fast path's writer thread when there is one."""

    def __init__(self, writer: Any, fast: FastPath | None) -> None:
        self.writer = writer
        self.fast = fast

    def begin(self, job: Job) -> None:
        if self.fast is None:
            self.writer.begin(job)
        else:
            self.fast.submit_write(self.writer.begin, job)

    def write_now(self, data: Any) -> None:
        """Write data whose buffer the caller reuses next: everything queued goes first."""
        if self.fast is not None:
            self.fast.drain()
        self.writer.write(data)

    def write_slot(self, slot: _Slot, out: np.ndarray) -> None:
        assert self.fast is not None
        self.fast.submit_write(self.writer.write, memoryview(out.view(np.uint8)), slot=slot)

    def drain(self) -> None:
        if self.fast is not None:
            self.fast.drain()


def next_block(blocks: Iterator[Any], job: Job, fast: FastPath | None = None, ts: TensorStats | None = None,
               args: KernelArgs | None = None) -> tuple[int, int, _Slot, np.ndarray, Any]:
    """The next block of ``blocks``, which must belong to ``job``: (start, stop, slot, base, agents); counted
    into ``ts`` by ``fast``'s statistics kernel (``args``: stats_args) when ``ts`` is given."""
    bjob, start, stop, slot, base, agents = next(blocks)
    if bjob is not job:
        raise RuntimeError(f"fast path out of step: expected {job.name}, got {bjob.name}")
    if fast is not None and ts is not None and args is not None:
        fast.run(job, start, base, agents, args, None, ts)
    return start, stop, slot, base, agents


def merge_job_fast(fast: FastPath, blocks: Iterator[Any], job: Job, args: KernelArgs, ts: TensorStats | None,
                   out: OrderedWriter, bar: Any) -> None:
    """All blocks of one eligible job: fused kernel, statistics into ``ts`` when given, queued write."""
    for _ in range(-(-job.numel // fast.step(job))):
        start, stop, slot, base, agents = next_block(blocks, job)
        merged = fast.out_view(slot, job, stop - start)
        fast.run(job, start, base, agents, args, merged, ts)
        out.write_slot(slot, merged)
        bar.advance((stop - start) * job.out_dtype.itemsize)
