"""The fast path of both passes: fused kernels on raw stored blocks, reads and writes overlapped.

A job takes the fast path when numba is installed, the device is the CPU, the method has a fused kernel
(ram, ram+, task_arithmetic, linear), every agent has the tensor, and base, agents and output are
bfloat16 or float32 safetensors. Other jobs take the torch path (blocks.py + the method's kernel) in the
same run. The bytes written are the same either way (tests/test_fastpath.py).

Overlap: a reader thread ``preadv``s block k+1 into the other of two buffer slots while the kernel
(numba, GIL released, all cores) works on block k; a writer thread appends finished blocks to the output
in order. Memory stays bounded by the block size: two input slots and two output slots.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import kernels
from .methods import MethodSpec
from .plan import Job, Plan
from .stats import Statistics, TensorStats, check_finite

STORED = {torch.bfloat16: np.uint16, torch.float32: np.float32}  # dtypes the kernels decode and encode
FUSED = {"ram": kernels.MODE_RAM, "ram+": kernels.MODE_RAM, "task_arithmetic": kernels.MODE_TA,
         "linear": kernels.MODE_LINEAR}


def enabled(device: str) -> bool:
    """numba present, CPU device, and not switched off with RLMERGE_FAST=0."""
    return kernels.HAVE_NUMBA and torch.device(device).type == "cpu" and os.environ.get("RLMERGE_FAST", "1") != "0"


@dataclass(frozen=True)
class KernelArgs:
    """The constants one job's fused kernel needs, as float32 (the torch kernels' arithmetic)."""

    mode: int
    eps: np.float32
    lam: np.ndarray  # [N] float32
    use_lam: bool
    w: np.ndarray  # [N] float32
    normalize: bool
    div: np.float32
    scaling: np.float32


def kernel_args(spec: MethodSpec, p: Any, prepared: Any, ts: TensorStats | None, n: int,
                eps: float) -> KernelArgs | None:
    """None when the method has no fused kernel."""
    from .methods.ram import rescale_factor
    from .methods.task_arithmetic import _divisor, agent_weights

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
        return KernelArgs(mode, np.float32(p.epsilon), np.array(lam, dtype=np.float32), True, ones, False, one, one)
    if spec.name == "ram":
        return KernelArgs(mode, np.float32(p.epsilon), ones, False, ones, False, one, one)
    where = spec.name
    w = agent_weights(where, p.weights, n)
    div = np.float32(_divisor(where, w).item()) if p.normalize else one
    scaling = np.float32(getattr(p, "scaling", 1.0))
    return KernelArgs(mode, np.float32(eps), ones, False, w.numpy(), bool(p.normalize), div, scaling)


def eligible(plan: Plan, job: Job) -> bool:
    if job.kind != "merge" or not all(job.present) or job.out_dtype not in STORED or job.info.dtype not in STORED:
        return False
    if any(m.format != "safetensors" for m in (plan.base, *plan.agents)):
        return False
    dtypes = {a.tensors[job.name].dtype for a in plan.agents}
    return len(dtypes) == 1 and dtypes.pop() in STORED and len(plan.agents) <= kernels.MAX_AGENTS


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
        while (item := self._q.get()) is not None:
            fut, fn, args = item
            if self._abort:
                fut.cancel()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # handed to whoever waits on the future
                fut.set_exception(e)

    def close(self, *, abort: bool) -> None:
        self._abort = abort
        self._q.put(None)
        self._thread.join(timeout=5.0 if abort else None)


class FastPath:
    """Runs the fused kernels over the eligible jobs of a plan; see the module docstring."""

    def __init__(self, plan: Plan, block_size: int) -> None:
        self.plan = plan
        self.block = max(1, min(block_size, max((j.numel for j in plan.merge_jobs), default=1)))
        n = len(plan.agents)
        self.slots = [_Slot(n, self.block) for _ in range(2)]
        self.threads = max(1, torch.get_num_threads())
        self.hist = np.zeros((self.threads, 4**n), dtype=np.int64)  # one row per compute thread
        self.gram = np.zeros((self.threads, n, n), dtype=np.float64)
        self._dummy_out = np.empty(1, dtype=np.float32)
        for m in (plan.base, *plan.agents):  # open every file here, before the reader thread reads
            for f in m.files:
                m.handle(f)
        self._compute = ThreadPoolExecutor(self.threads, thread_name_prefix="rlmerge-compute")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="rlmerge-read")
        self._writer = _WriteQueue()
        self._last_write: Future[None] | None = None

    def close(self, *, abort: bool = False) -> None:
        """Stop the threads; ``abort`` (the merge failed or was interrupted) drops the queued writes."""
        self._compute.shutdown(wait=True, cancel_futures=True)
        self._reader.shutdown(wait=True, cancel_futures=True)
        self._writer.close(abort=abort)

    # -- reading ---------------------------------------------------------------------------------------
    def _read(self, slot: _Slot, job: Job, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        n = stop - start
        bdt = STORED[job.info.dtype]
        adt = STORED[self.plan.agents[0].tensors[job.name].dtype]
        size = np.dtype(adt).itemsize
        base = slot.base[: n * np.dtype(bdt).itemsize]
        self.plan.base.read_into(job.name, start, stop, memoryview(base))
        agents = slot.agents[: len(self.plan.agents) * n * size]
        for t, a in enumerate(self.plan.agents):
            a.read_into(job.name, start, stop, memoryview(agents[t * n * size:(t + 1) * n * size]))
        return base.view(bdt), agents.view(adt).reshape(len(self.plan.agents), n)

    def blocks(self, jobs: list[Job], passes: Callable[[Job], int] | None = None,
               ) -> Iterator[tuple[Job, int, int, _Slot, np.ndarray, np.ndarray]]:
        """Every block of ``jobs`` in order (each job's blocks ``passes(job)`` times over), each read while the
        previous one is being computed."""
        spans = [(j, s, min(s + self.block, j.numel)) for j in jobs for _ in range(passes(j) if passes else 1)
                 for s in range(0, j.numel, self.block)]
        pending: Future[tuple[np.ndarray, np.ndarray]] | None = None
        for k, (job, start, stop) in enumerate(spans):
            slot = self.slots[k % 2]
            if pending is None:
                pending = self._reader.submit(self._read, slot, job, start, stop)
            base, agents = pending.result()
            pending = None
            if k + 1 < len(spans):
                nxt = self.slots[(k + 1) % 2]
                if nxt.written is not None:  # its output must be on disk before the slot is reused
                    nxt.written.result()
                pending = self._reader.submit(self._read, nxt, *spans[k + 1])
            yield job, start, stop, slot, base, agents

    # -- computing -------------------------------------------------------------------------------------
    def run(self, job: Job, start: int, base: np.ndarray, agents: np.ndarray, args: KernelArgs,
            out: np.ndarray | None, ts: TensorStats | None) -> None:
        """The fused kernel on one block; statistics into ``ts`` when given."""
        n = base.shape[0]
        if ts is not None:
            self.hist[:] = 0
            self.gram[:] = 0.0
        mode = args.mode if out is not None else kernels.MODE_STATS
        dest = out if out is not None else self._dummy_out
        bad = self.parallel(n, lambda k, lo, hi: kernels.fused_range(
            base, agents, lo, hi, args.eps, mode, args.lam, args.use_lam, args.w, args.normalize, args.div,
            args.scaling, dest, ts is not None, self.hist[k], self.gram[k]))
        if any(bad):
            self.raise_non_finite(job, start, base, agents)
        if ts is not None:
            ts.add_patterns(self.hist.sum(0), self.gram.sum(0))

    def parallel(self, n: int, fn: Callable[[int, int, int], Any]) -> list[Any]:
        """``fn(k, lo, hi)`` on one slice [lo, hi) of [0, n) per compute thread k; the kernels release the GIL."""
        step = -(-n // self.threads)
        parts = [(k, min(n, k * step), min(n, (k + 1) * step)) for k in range(self.threads)]
        if self.threads == 1:
            return [fn(*parts[0])]
        return list(self._compute.map(lambda a: fn(*a), parts))

    def run_parts(self, parts: list[tuple[int, int]], fn: Callable[[int, int], Any]) -> list[Any]:
        """``fn(lo, hi)`` on the compute threads, one call per given slice (fastdare cuts at chunk boundaries)."""
        if len(parts) == 1:
            return [fn(*parts[0])]
        return list(self._compute.map(lambda a: fn(*a), parts))

    def raise_non_finite(self, job: Job, start: int, base: np.ndarray, agents: np.ndarray) -> None:
        def f32(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(a.copy()).view(dtype).float()

        b = f32(base, job.info.dtype)
        deltas = f32(agents, self.plan.agents[0].tensors[job.name].dtype) - b
        files = [str(a.tensors[job.name].file) for a in self.plan.agents]
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
    return KernelArgs(kernels.MODE_STATS, np.float32(eps), ones, False, ones, False, one, one)


def statistics_pass_fast(fast: FastPath, jobs: list[Job], stats: Statistics, bar: Any,
                         also: Callable[[Job, int, np.ndarray, np.ndarray], None] | None = None) -> None:
    """The statistics of ``jobs`` (all eligible) through the fused kernel; ``also`` sees every block too."""
    args = stats_args(len(fast.plan.agents), stats.epsilon)
    for job, start, stop, _slot, base, agents in fast.blocks(jobs):
        fast.run(job, start, base, agents, args, None, stats.for_tensor(job.name, job.numel, job.weight))
        if also is not None:
            also(job, start, base, agents)
        bar.advance((stop - start) * job.info.dtype.itemsize)
        if stop == job.numel:
            bar.tensor_done()


class OrderedWriter:
    """The writer's begin/write in plan order: queued on the fast path's writer thread when there is one."""

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


def merge_job_fast(fast: FastPath, blocks: Iterator[Any], job: Job, args: KernelArgs, ts: TensorStats | None,
                   out: OrderedWriter, bar: Any) -> None:
    """All blocks of one eligible job: fused kernel, statistics into ``ts`` when given, queued write."""
    for _ in range(-(-job.numel // fast.block)):
        bjob, start, stop, slot, base, agents = next(blocks)
        if bjob is not job:
            raise RuntimeError(f"fast path out of step: expected {job.name}, got {bjob.name}")
        merged = fast.out_view(slot, job, stop - start)
        fast.run(job, start, base, agents, args, merged, ts)
        out.write_slot(slot, merged)
        bar.advance((stop - start) * job.out_dtype.itemsize)
