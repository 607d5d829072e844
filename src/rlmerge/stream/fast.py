"""The numba block stream: blocks viewed in the mapped inputs, split between compute threads, slots for output.

Used by the numba backends (engine/backends.py; the sparsify family's methods/sparsify/fast_select.py and
fast_random.py) for the tensors the route gives them;
docs/architecture.md ("How the numba path works") has the design.
"""
from __future__ import annotations

import collections
import math
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import kernels
from .._threads import Workers
from .._torch import torch
from ..errors import ConfigError
from ..io.dtypes import BF16, F32
from ..io.mapping import Mapped
from ..io.writer import CheckpointWriter
from ..methods.rule import Program
from ..stats import Statistics, TensorStats, check_finite
from .blocks import device_type, read_delta, row_length
from .match import Job, Match

STORED = {BF16: np.uint16, F32: np.float32}  # dtypes the kernels decode and encode
ALIGN_MAX = 1 << 20  # elements: a row-cut block may grow to lcm(row, TILE) up to this (see row_step)
AHEAD = 2  # blocks whose pages are requested ahead of the one computed (FastPath.blocks)
OUT_SLOTS = 4  # output buffers: the blocks computed while the writer is still writing earlier ones, plus one
PARTS_PER_THREAD = 2  # a hand-off's parts per compute thread (FastPath.parallel)


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
class RuleArgs:
    """What one job's fused kernel runs: the method's traced rule (None: the statistics only), its constants for
    the tensor (methods/rule.Program.arrays) and the statistics' threshold ε."""

    program: Program | None
    consts: np.ndarray  # [C] float32
    agent_consts: np.ndarray  # [A, N] float32
    eps: np.float32
    rescaled: np.ndarray | None = None  # [N] bool: agents whose unique elements the rule rescales (engine/survival.py)


def stats_args(n_agents: int, eps: float) -> RuleArgs:
    return RuleArgs(None, np.zeros(0, dtype=np.float32), np.zeros((0, n_agents), dtype=np.float32), np.float32(eps))


def reads_tau(match: Match) -> bool:
    """The numba path reads every agent as its float32 τ (FastPath._read): an agent supplies τ rather than
    stored bytes (a LoRA adapter). Every kernel takes the agents that way too (``tau``)."""
    return not all(a.stored_bytes for a in match.agents)


def eligible(match: Match, job: Job) -> bool:
    """Whether ``job`` can run on the numba backend."""
    if job.kind != "merge" or not all(job.present) or job.out_dtype not in STORED or job.info.dtype not in STORED:
        return False
    if not match.base.stored_bytes:
        return False
    dtypes = {a.tensors[job.name].dtype for a in match.agents}  # as τ, the agents' dtypes need not agree
    return ((len(dtypes) == 1 or reads_tau(match)) and all(d in STORED for d in dtypes)
            and len(match.agents) <= kernels.MAX_AGENTS)


def fast_block(match: Match, block_size: int) -> int:
    """Elements per block on the numba path: a whole number of the kernels' tiles (tiles then sit at the same
    offsets of a tensor whatever the block size and the number of threads, and so do the statistics' float32
    partial sums), at most the largest merged tensor. Grown by up to 1/SLACK to hold whole a tensor just larger
    than ``block_size``: it then takes one block instead of one and a sliver, and a selecting method reads it
    once instead of once per round (Qwen2-0.5B's MLP matrices, 4.36 M elements, against the default 4.19 M)."""
    block = _tiles(block_size)
    near = max((j.numel for j in match.merge_jobs if block < j.numel <= block + block // SLACK), default=0)
    return max(1, min(max(block, _tiles(near)), max((j.numel for j in match.merge_jobs), default=1)))


SLACK = 8  # a block grows by at most 1/SLACK of the size asked for (fast_block)


def _tiles(n: int) -> int:
    return -(-n // kernels.TILE) * kernels.TILE


def row_step(shape: tuple[int, ...], numel: int, block: int) -> int:
    """Elements per block of a tensor whose blocks must hold whole rows (DELLA: ``shape[1:]``; a 1-D tensor is
    one row): the whole tensor when it fits in ``block``, else a multiple of lcm(row, TILE), so that every
    block starts at a whole tile too and the statistics' float32 partial sums do not depend on the block size
    (kernels.py). At least one such unit, which may exceed ``block`` up to ALIGN_MAX; a row with a large odd
    factor, whose unit is larger still, is cut at rows only (its report may then differ in the last bits between
    block sizes; the merged bytes never do)."""
    row = row_length(shape)
    if numel <= block:
        return max(numel, 1)
    unit = math.lcm(row, kernels.TILE)
    if unit > max(block, ALIGN_MAX):
        unit = row
    return max(unit, block // unit * unit)


class _Slot:
    """One output buffer [block] (bytes, viewed per dtype), and the write of it still in flight."""

    def __init__(self, block: int) -> None:
        self.out = np.empty(block * 4, dtype=np.uint8)
        self.written: Future[None] | None = None  # the write of ``out`` still in flight


class _Copy:
    """One set of input buffers, for a block that cannot be viewed in place: base [block], agents [N, block]
    (bytes, viewed per dtype) and the base in float32 when the agents are read as τ."""

    def __init__(self, n_agents: int, block: int) -> None:
        self.base = np.empty(block * 4, dtype=np.uint8)
        self.agents = np.empty(n_agents * block * 4, dtype=np.uint8)
        self.b32 = np.empty(block, dtype=np.float32)


class FastPath:
    """Runs the fused kernels over the eligible jobs of a match; see the module docstring."""

    def __init__(self, match: Match, block_size: int, *, exact_gram: bool = False, rows: bool = False,
                 on_read: Callable[[int], None] | None = None) -> None:
        self.match = match
        self.exact_gram = exact_gram
        self.rows = rows  # blocks cut at row boundaries (``step``)
        self.on_read = on_read  # told the bytes of every block read
        self.block = fast_block(match, block_size)
        n = len(match.agents)
        size = max((min(self.step(j), j.numel) for j in match.merge_jobs), default=self.block) if rows else self.block
        self.slots = [_Slot(max(size, 1)) for _ in range(OUT_SLOTS)]
        self.copies = [_Copy(n, max(size, 1)) for _ in range(2)]  # the block computed, and the next one read
        self.threads = compute_threads()
        self.parts = self.threads * PARTS_PER_THREAD  # of a hand-off (parallel); per-part sums are indexed by part
        self.hist = np.zeros((self.parts, *kernels.hist_shape(n)), dtype=np.int64)  # per part
        self.gram = np.zeros((self.parts, n, n), dtype=np.float64)
        self._dummy_out = np.empty(1, dtype=np.float32)
        self.mapped = Mapped()
        self.tau = reads_tau(match)  # every agent's τ is read into the blocks, in float32 (_read)
        self._compute = Workers(self.threads, "rlmerge-compute")
        self._reader = Workers(1, "rlmerge-read")
        self._ahead = Workers(1, "rlmerge-readahead")  # page-cache requests for the blocks ahead (_prefetch)

    @property
    def tau_arg(self) -> bool | None:
        """The selection and DARE kernels' ``tau`` argument: True when the blocks hold τ, else None
        (kernels/codec._tau decides from its type)."""
        return True if self.tau else None

    def step(self, job: Job) -> int:
        """Elements per block of ``job``: ``block``, or with ``rows`` whole rows and tiles (row_step)."""
        return row_step(job.info.shape, job.numel, self.block) if self.rows else self.block

    def close(self, *, abort: bool = False) -> None:
        """Stop the threads and drop the mappings (``abort``: an interrupted run; see rlmerge._threads)."""
        ended = self._compute.close(abort=abort)
        ended = self._reader.close(abort=abort) and ended
        ended = self._ahead.close(abort=abort) and ended
        if ended:  # a call still running may read the mapped files: they then go with the process
            self.mapped.close()

    # -- reading ---------------------------------------------------------------------------------------
    def _read(self, slot: _Copy, job: Job, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """A copy of the block in ``slot``: base [n] and agents [N, n], read-only like the mapped views. The agents'
        stored values, or with ``tau`` every agent's τ in float32 as the torch path computes it
        (engine/blocks.read_delta: θ_t − θ₀ in float32, or an adapter's own τ), so the kernels see the same values."""
        n, count = stop - start, len(self.match.agents)
        bdt = STORED[job.info.dtype]
        base = slot.base[: n * np.dtype(bdt).itemsize].view(bdt)
        self.match.base.read_into(job.name, start, stop, memoryview(base.view(np.uint8)))
        if self.tau:
            agents = slot.agents[: count * n * 4].view(np.float32).reshape(count, n)
            b32 = torch.from_numpy(slot.b32[:n]).copy_(torch.from_numpy(base).view(job.info.dtype.torch))
            for t, a in enumerate(self.match.agents):
                read_delta(a, job.name, start, stop, b32, torch.from_numpy(agents[t]))
        else:
            adt = STORED[self.match.agents[0].tensors[job.name].dtype]
            agents = slot.agents[: count * n * np.dtype(adt).itemsize].view(adt).reshape(count, n)
            for t, a in enumerate(self.match.agents):
                a.read_into(job.name, start, stop, memoryview(agents[t].view(np.uint8)))
        base.flags.writeable = agents.flags.writeable = False  # one kernel signature for copies and views
        return base, agents

    def _views(self, job: Job, start: int, stop: int, *, checked: bool = False,
               ) -> tuple[np.ndarray, tuple[np.ndarray, ...]] | None:
        """The block viewed in the mapped files, or None when some tensor cannot be viewed in place (``checked``:
        its prefetch, which checked the files' sizes, has run; Mapped.view)."""
        models = (self.match.base, *self.match.agents)
        views = [self.mapped.view(m, job.name, start, stop, checked=checked) for m in models]
        if any(v is None for v in views):
            return None
        return views[0], tuple(views[1:])  # type: ignore[return-value]

    def _release(self, job: Job, start: int, stop: int) -> None:
        """A computed block's pages out of this process's mappings (they stay in the page cache)."""
        for m in (self.match.base, *self.match.agents):
            self.mapped.release(m, job.name, start, stop)

    def _prefetch(self, job: Job, start: int, stop: int) -> None:
        """Ask for a block's bytes ahead (Mapped.prefetch, which also notes the files' sizes)."""
        for m in (self.match.base, *self.match.agents):
            self.mapped.prefetch(m, job.name, start, stop)

    def blocks(self, jobs: list[Job], passes: Callable[[Job], int] | None = None,
               ) -> Iterator[tuple[Job, int, int, _Slot, np.ndarray, tuple[np.ndarray, ...]]]:
        """Every block of ``jobs`` in order (each job's blocks ``passes(job)`` times over).

        A block's agents come as a tuple of [n] views of the mapped files; a tensor that cannot be viewed in
        place is copied into one of two sets of buffers (``copies``) by the reader thread while the previous block
        is computed. A block's output slot is one of OUT_SLOTS, taken in turn once the writer has written what it
        held: the compute threads may run up to OUT_SLOTS − 1 blocks ahead of the writer, whose work comes in
        bursts (a chunk's writeback waited for every 32 MiB, io/writer.settle). With two slots, 0.5B merges took up
        to 10 % longer (docs/benchmarks.md, 2026-12-07). The pages of the
        next AHEAD blocks are requested by the readahead thread, which checks the files' sizes as it does, and
        hands back a finished block's pages (at most AHEAD finished blocks wait for it): the thread that sets up
        the blocks makes no system call per block, which cost ~0.6 s of a 0.5B TIES merge while the compute
        threads waited.
        """
        spans = [(j, s, min(s + self.step(j), j.numel)) for j in jobs for _ in range(passes(j) if passes else 1)
                 for s in range(0, j.numel, self.step(j))]
        pending: Future[tuple[np.ndarray, np.ndarray]] | None = None  # the next block's copy, being read
        ready = None  # the next block's views
        asked: dict[int, Future[None]] = {}  # span → its prefetch on the readahead thread
        released: collections.deque[Future[None]] = collections.deque()  # computed blocks' releases, queued there
        for i in range(1, min(AHEAD, len(spans))):
            asked[i] = self._ahead.submit(self._prefetch, *spans[i])
        for k, (job, start, stop) in enumerate(spans):
            slot = self.slots[k % OUT_SLOTS]
            if slot.written is not None:  # its output buffer must be written before it is reused
                slot.written.result()
            views = ready if k else self._views(job, start, stop)
            if views is None:
                if pending is None:
                    pending = self._reader.submit(self._read, self.copies[k % 2], job, start, stop)
                base, agents = pending.result()
                views = (base, tuple(agents))
            pending = ready = None
            if k + AHEAD < len(spans):
                asked[k + AHEAD] = self._ahead.submit(self._prefetch, *spans[k + AHEAD])
            if k + 1 < len(spans):
                nxt, fetched = spans[k + 1], asked.pop(k + 1, None)
                ready = self._views(*nxt, checked=fetched is not None and fetched.done())
                if ready is None:  # a copy: read it while this block is computed
                    pending = self._reader.submit(self._read, self.copies[(k + 1) % 2], *nxt)
            if self.on_read is not None:
                self.on_read((stop - start) * sum(m.tensors[job.name].dtype.itemsize  # stored bytes (τ: more)
                                                  for m in (self.match.base, *self.match.agents)))
            yield job, start, stop, slot, views[0], views[1]
            released.append(self._ahead.submit(self._release, job, start, stop))
            if len(released) > AHEAD:  # at most AHEAD computed blocks still mapped, however slow the requests
                released.popleft().result()

    # -- computing -------------------------------------------------------------------------------------
    def run(self, job: Job, start: int, base: np.ndarray, agents: np.ndarray, args: RuleArgs,
            out: np.ndarray | None, ts: TensorStats | None, kept: np.ndarray | None = None,
            then: Callable[[int, int, int], Any] | None = None) -> None:
        """The fused kernel on one block; statistics into ``ts`` when given (which also checks every τ); ``kept``
        [threads, N, 2]: what the written block kept of the rule's rescale (``args.rescaled``, survival.py);
        ``then(k, lo, hi)``: another kernel on the same slices, run by each compute thread after this one (one
        hand-off per block instead of two)."""
        n = base.shape[0]
        if ts is not None:
            self.hist[:] = 0
            self.gram[:] = 0.0
        prog = args.program if out is not None else None
        dest = out if out is not None else self._dummy_out

        def part(k: int, lo: int, hi: int) -> bool:
            bad = kernels.fused_range(
                prog, base, agents, lo, hi, args.eps, args.consts, args.agent_consts, dest,
                self.hist[k] if ts is not None else None, self.gram[k] if ts is not None else None, self.exact_gram,
                args.rescaled if kept is not None else None, kept[k] if kept is not None else None, self.tau)
            if then is not None:
                then(k, lo, hi)
            return bool(bad)

        bad = self.parallel(n, part)
        if any(bad):
            self.raise_non_finite(job, start, base, agents)
        if ts is not None:
            ts.add_patterns(self.hist.sum(axis=(0, 1)), self.gram.sum(0))

    def parallel(self, n: int, fn: Callable[[int, int, int], Any], ways: int | None = None) -> list[Any]:
        """``fn(k, lo, hi)`` on slice k [lo, hi) of [0, n), ``ways`` slices (default ``parts``) taken by whichever
        compute thread is free; the kernels release the GIL. Slices are whole tiles, and only the first may be
        empty: a tensor of one tile runs on the calling thread, without a hand-off.

        More slices than threads: on two cores the compute threads share them with the writer, the readahead and
        the main thread, and a hand-off waits for its slowest slice; with PARTS_PER_THREAD slices per thread the
        thread that was not held up takes more of them (docs/benchmarks.md, 2026-12-07). A kernel whose buffers
        per slice are large (TIES' gathered bins, bounded by fast_select.GATHER per thread) passes ``ways`` =
        threads."""
        # slices start at multiples of the kernels' tile: the tiles, and so the statistics' float32 partial
        # sums, are the same whatever the number of slices
        ways = ways or self.parts
        step = -(-n // ways // kernels.TILE) * kernels.TILE if n > kernels.TILE else n
        return self.run_parts([(k, min(n, k * step), min(n, (k + 1) * step)) for k in range(ways)
                               if k == 0 or k * step < n], fn)

    def run_parts(self, parts: list[tuple[int, ...]], fn: Callable[..., Any]) -> list[Any]:
        """``fn(*part)`` on the compute threads, one call per given part (fast_random cuts at chunk boundaries)."""
        if len(parts) == 1:
            return [fn(*parts[0])]
        return self._compute.map(fn, parts)

    def block_tau(self, base: np.ndarray, agents: Any) -> np.ndarray:
        """τ [N, n] float32 of (part of) a block, as the kernels see it: each agent's stored values decoded minus
        the base's, or with ``tau`` the agents as the block holds them."""
        if self.tau:
            return np.stack(agents)
        b = _decoded(base)
        return np.stack([_decoded(a) - b for a in agents])

    def raise_non_finite(self, job: Job, start: int, base: np.ndarray, agents: Any) -> None:
        files = [str(a.tensors[job.name].file) for a in self.match.agents]
        with np.errstate(invalid="ignore"):  # Inf - Inf: a NaN τ is what is being looked for, not a warning
            tau = self.block_tau(base, agents)
        check_finite(torch.from_numpy(tau), torch.tensor([float("nan")]), name=job.name, files=files, start=start,
                     base=torch.from_numpy(_decoded(base)), base_file=str(job.info.file))

    def out_view(self, slot: _Slot, job: Job, n: int) -> np.ndarray:
        dt = STORED[job.out_dtype]
        return slot.out[: n * np.dtype(dt).itemsize].view(dt)


def _decoded(x: np.ndarray) -> np.ndarray:
    """Stored values in float32: bfloat16 bits (uint16) are the high half of a float32; float32 as it is."""
    return (x.astype(np.uint32) << np.uint32(16)).view(np.float32) if x.dtype == np.uint16 else x


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


def job_reads(fast: FastPath, blocks: Iterator[Any], job: Job, reads: int, ts: TensorStats | None = None,
              args: RuleArgs | None = None, then: Callable[[int, np.ndarray, Any], Any] | None = None,
              ) -> Iterator[tuple[int, int, int, _Slot, np.ndarray, Any]]:
    """The blocks of ``reads`` reads of ``job`` from ``blocks`` (``FastPath.blocks``), as (read, start, stop, slot,
    base, agents); the first read's are counted into ``ts`` by the statistics kernel (``args``: stats_args) when
    both are given, and ``then(start, base, agents)`` may give a kernel for the compute threads to run on the
    same block right after it (``FastPath.run``'s ``then``; None: none). A read ends at the block with
    stop = job.numel."""
    for read in range(reads):
        for _ in range(-(-job.numel // fast.step(job))):
            bjob, start, stop, slot, base, agents = next(blocks)
            if bjob is not job:
                raise RuntimeError(f"fast path out of step: expected {job.name}, got {bjob.name}")
            if read == 0 and ts is not None and args is not None:
                fast.run(job, start, base, agents, args, None, ts,
                         then=then(start, base, agents) if then is not None else None)
            yield read, start, stop, slot, base, agents


def write_slot(out: CheckpointWriter, slot: _Slot, merged: np.ndarray, bar: Any) -> None:
    """Queue a slot's output and count it on ``bar``; the slot is reused only once it is written
    (``FastPath.blocks`` waits)."""
    slot.written = out.write_later(memoryview(merged.view(np.uint8)))
    bar.advance(merged.nbytes)
