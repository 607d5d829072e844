"""TIES and Breadcrumbs on the numba block stream: exact |τ| thresholds from histograms, then the merge rule.

A tensor that fits in one block is read once (selected in memory); ``ties_global``'s thresholds are its statistics
pass. A per-tensor selection whose queries' bins hold at most ``GATHER`` values after a round gathers them on the
next read and ends there (``KthLargest.finish``; TIES' tie cut from their indices); the reads planned for a larger
tensor stay ROUNDS + 1, and a round left over takes its blocks without computing on them. The thresholds come from
the torch path's ``GtaObserver``, so the bytes are the torch path's. With a sweep's cache (interface.Entries) a
tensor whose window is cached is read once, and one whose round-0 histogram is cached skips that round; what this
backend finds is added to the cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...io.writer import CheckpointWriter
from ...kernels import rule_key
from ...stats import TensorStats
from ...stream.fast import FastPath, job_reads, statistics_pass_fast, stats_args, write_slot
from ...stream.match import Job
from .._select import BINS, NO_CUT, ROUNDS, TieCut
from ..interface import Entries, Observer
from ..spec import Run
from . import kernels
from .observer import GtaObserver
from .presets import Preset, combine_constants

SCAN_PIECE = 1 << 16  # a pending stream's tie scan is split only into pieces at least this long


@dataclass(frozen=True)
class Select:
    """This backend as a selecting preset declares it to the route (spec.Capability)."""

    name: str  # the method's
    preset: Preset
    kind: str = "select"

    def observed(self, observer: Observer | None) -> bool:
        return self.preset.prune == "magnitude-global"  # a whole-model threshold: found in the statistics pass

    def merge_reads(self, observer: Observer | None, job: Job, block: int, step: int, cache: Entries | None) -> int:
        if not isinstance(observer, GtaObserver):
            raise TypeError(f"{self.name}: the selecting backend runs with the family's observer")
        return select_reads(observer, job, block, cache)

    def memory(self, jobs: Sequence[Job], n: int) -> int:
        return GATHER * _GATHERED_BYTES  # its histograms are kilobytes; a gathered bin at most this

    def open(self, run: Run, stream: FastPath) -> SelectBackend:
        return SelectBackend(run, stream, self.name, self.preset)


def select_reads(obs: GtaObserver, job: Job, block: int, cached: Entries | None = None) -> int:
    """Reads of ``job`` in the merge pass: one per selection round and one to merge, unless it fits in one
    block (then it is read once and selected in memory). A cached window: one read; a cached round-0
    histogram: one round fewer."""
    if not obs.selects(job.name, job.numel) or job.numel <= block:
        return 1
    if cached is not None:  # (a whole-model window is found in the statistics pass, not here)
        if obs.cached_window(cached, job.name) is not None:
            return 1
        if cached.get("hist0", "", job.name) is not None:
            return ROUNDS
    return ROUNDS + 1


# A selection is ended by gathering the values of its queries' bins (KthLargest.finish) instead of more rounds
# when they fit this many slots (per compute thread, every query of a tensor): after round 0 a bin is 1/8 of an
# octave of |τ|, a few per cent of a tensor; a larger one takes round 1 first (1/1024 of that).
GATHER = 1 << 21
_GATHERED_BYTES = 4 + 8  # a float32 pattern and a flat index


@dataclass
class _Gather:
    """The bins of a tensor's queries being gathered, block by block: per compute thread one part per query
    (``_select.Bins``, answered where the parts lie: kernels.bin_kth on the compute threads, kernels.bin_tie)."""

    sizes: np.ndarray  # [Q] the values in each query's bin (KthLargest.in_bin)
    starts: np.ndarray  # [Q] where each query's part begins in a thread's buffers
    bits: np.ndarray  # [threads, Σ sizes] uint32
    index: np.ndarray  # [threads, Σ sizes] int64
    fill: np.ndarray  # [threads, Q] int64: found so far
    fast: FastPath

    @classmethod
    def of(cls, sizes: np.ndarray, fast: FastPath) -> _Gather | None:
        total = int(sizes.sum())
        if total * fast.threads > GATHER:
            return None
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        threads = fast.threads
        return cls(sizes, starts, np.empty((threads, total), dtype=np.uint32),
                   np.empty((threads, total), dtype=np.int64), np.zeros((threads, len(sizes)), dtype=np.int64), fast)

    def check(self, name: str) -> _Gather:
        if not (self.fill.sum(0) == self.sizes).all():
            raise RuntimeError(f"{name}: gathered {self.fill.sum(0).tolist()} values of bins holding "
                               f"{self.sizes.tolist()}: the tensor changed while it was merged?")
        return self

    def size(self, q: int) -> int:
        return int(self.fill[:, q].sum())

    def kth(self, queries: Sequence[tuple[int, int, int]], above: int) -> list[tuple[int, int, int]]:
        if not queries:
            return []
        return [(int(v), int(greater), int(equal)) for v, greater, equal in self.fast.run_parts(
            list(queries), lambda q, rank, prefix: kernels.bin_kth(self.bits, self.starts[q], self._fill(q), rank,
                                                                   prefix, above))]

    def tie(self, q: int, pattern: int, left: int) -> tuple[int, int]:
        count, at = kernels.bin_tie(self.bits, self.index, self.starts[q], self._fill(q), np.uint32(pattern), left)
        return int(count), int(at)

    def _fill(self, q: int) -> np.ndarray:
        return np.ascontiguousarray(self.fill[:, q])  # [threads]: how many of query q's values each part holds


class SelectBackend:
    """TIES / Breadcrumbs on the numba path (spec.Runner)."""

    def __init__(self, run: Run, fast: FastPath, name: str, preset: Preset) -> None:
        n = len(fast.match.agents)
        observer = run.observer
        if not isinstance(observer, GtaObserver):
            raise TypeError(f"{name}: the selecting backend runs with the family's observer")
        self.run, self.fast, self.obs = run, fast, observer
        self.name, self.preset = name, preset
        observer.stream_cuts = False  # exact k: the ties at a threshold are cut while the tensor is merged
        self.no_cut = np.full(n, NO_CUT, dtype=np.int64)
        self.stats_args = stats_args(n, run.stats.epsilon)
        self.whole_model = observer.preset.prune == "magnitude-global"
        # round 0 per agent: the digit's counts, then the zeros; later rounds per query, spares past the end
        self.hist0 = np.zeros((fast.parts, n, BINS[0] + 1), dtype=np.int64)
        self.histq = np.zeros((fast.parts, 0, max(BINS[1:]) + 8), dtype=np.int64)
        self._numel = 0
        self._gather: _Gather | None = None  # the bins being gathered instead of the next round
        self._fused = False  # this block's round-0 counts were taken with its statistics (_with_statistics)

    def reads(self, job: Job) -> int:
        return select_reads(self.obs, job, self.fast.block, self.run.cache)

    # -- the selection rounds --------------------------------------------------------------------------
    def _count(self, job: Job, start: int, base: np.ndarray, agents: Any) -> None:
        """Add one block to the current round's histogram, or gather its values in the queries' bins."""
        sel = self.obs.selection
        assert sel is not None
        g = self._gather
        if g is not None:
            ends = g.starts + g.sizes
            self.fast.parallel(base.shape[0], lambda k, lo, hi: kernels.gather_bin(
                base, agents, lo, hi, start, sel.streams, sel.prefix, sel.active, sel.above, g.starts, ends,
                g.fill[k], g.bits[k], g.index[k], self.fast.tau_arg), ways=self.fast.threads)
            return
        if sel.round == 0:
            if not self._fused:  # (else the compute threads counted it after the block's statistics)
                self.fast.parallel(base.shape[0], self._first_part(base, agents))
            self._fused = False
            if self.hist0[:, :, kernels.NONFINITE_BIN:BINS[0]].any():  # |τ| ≥ inf: exponent all ones
                self.fast.raise_non_finite(job, start, base, agents)
            self._numel += base.shape[0]
            return
        if self.histq.shape[1] != len(sel.streams):
            self.histq = np.zeros((self.fast.parts, len(sel.streams), max(BINS[1:]) + 8), dtype=np.int64)
        shift, width = sel.digit
        self.fast.parallel(base.shape[0], lambda k, lo, hi: kernels.hist_next(
            base, agents, lo, hi, sel.streams, sel.prefix, sel.active, shift, width, self.histq[k], self.fast.tau_arg))

    def _first_part(self, base: np.ndarray, agents: Any) -> Callable[[int, int, int], None]:
        return lambda k, lo, hi: kernels.hist_first(base, agents, lo, hi, self.hist0[k], self.fast.tau_arg)

    def _with_statistics(self, start: int, base: np.ndarray, agents: Any) -> Callable[[int, int, int], None] | None:
        """``job_reads``' ``then``: round 0's counting of a block, for the compute threads to run right after its
        statistics (``_count`` then only checks it); None when the block is not counted in round 0."""
        sel = self.obs.selection
        if self._gather is not None or sel is None or sel.round != 0:
            return None
        self._fused = True
        return self._first_part(base, agents)

    def _end_round(self, name: str | None) -> bool:
        """Hand the round's counts (or gathered bins) to the observer; True while another round is wanted."""
        sel = self.obs.selection
        assert sel is not None
        if self._gather is not None:
            assert name is not None
            self.obs.gathered(name, self._gather.check(name))
            self._gather = None
            return False  # the selection is over
        if sel.round == 0:
            counts = self.hist0.sum(0)  # [N, BINS[0] + 1]: the threads' counts added
            self.hist0[:] = 0
            if name is not None and self.run.cache is not None:
                self.run.cache.put("hist0", "", name, np.asarray(counts, dtype=np.int64))
        else:
            counts = self.histq.sum(0)[:, :BINS[sel.round]]
            self.histq[:] = 0
        self.obs.add_counts(counts, self._numel)
        self._numel = 0
        return self._again(name)

    def _again(self, name: str | None) -> bool:
        """The observer's ``again``. When another round is wanted and the queries' bins are small enough, it gathers
        them instead (a per-tensor selection: its last read; a whole-model one keeps its rounds)."""
        more = self.obs.again(name)
        sel = self.obs.selection
        if more and name is not None and sel is not None and not self.obs.needs_l1:
            self._gather = _Gather.of(sel.in_bin, self.fast)
        return more

    def _cached_round0(self, job: Job) -> bool | None:
        """Round 0 of ``job`` from the cache: None when it holds no histogram, else whether more rounds follow."""
        cached = self.run.cache
        counts = cached.get("hist0", "", job.name) if cached is not None else None
        if cached is None or counts is None:
            return None
        cached.used("hist0")
        self.obs.add_counts(np.asarray(counts, dtype=np.int64), job.numel)
        return self._again(job.name)

    # -- the statistics pass (ties_global: both rounds over the whole model; else counts only) -------------
    def statistics(self, jobs: list[Job], bar: Any) -> None:
        stats = self.run.stats
        if not self.whole_model or not jobs:
            statistics_pass_fast(self.fast, jobs, stats, bar)
            return
        self.obs.begin_tensor(jobs[0].name, jobs[0].numel)
        statistics_pass_fast(self.fast, jobs, stats, bar, also=self._count)  # round 0 with the counts
        if self._end_round(None):
            while True:
                for job, start, _stop, _slot, base, agents in self.fast.blocks(jobs):
                    self._count(job, start, base, agents)
                if not self._end_round(None):
                    break

    # -- the merge pass --------------------------------------------------------------------------------
    def begin_merge(self, jobs: list[Job]) -> None:
        self._reads = {j.name: self.reads(j) for j in jobs}  # fixed now: the cache grows while merging
        self._blocks = self.fast.blocks(jobs, lambda j: self._reads[j.name])

    def merge_job(self, job: Job, ts: TensorStats | None, out: CheckpointWriter, bar: Any) -> None:
        """All reads of one job (``reads(job)`` times its blocks): thresholds, then the fused merge."""
        reads = self._reads[job.name]
        own = self.obs.selects(job.name, job.numel)
        cache = self.run.cache
        if not self.whole_model:
            self.obs.begin_tensor(job.name, job.numel)  # its ranks and default window
            if own and cache is not None and self.obs.recall(cache, job.name):  # selected by an earlier merge
                own = False
        selecting = reads > 1 and self._cached_round0(job) is not False
        for read, start, stop, slot, base, agents in job_reads(self.fast, self._blocks, job, reads, ts,
                                                               self.stats_args,
                                                               self._with_statistics if selecting else None):
            if read < reads - 1:  # a selection round: each fixes one more digit of the thresholds
                if selecting:  # (a round not needed still takes its blocks)
                    self._count(job, start, base, agents)
                if stop == job.numel:
                    selecting = selecting and self._end_round(job.name)
                continue
            if own and reads == 1:  # the whole tensor is this block: select in memory
                more = self._cached_round0(job)
                while more is not False:
                    self._count(job, start, base, agents)
                    more = self._end_round(job.name)
            cut = self.obs.cut  # exact k: where the ties at each threshold stop, found block by block
            if cut is not None and not cut.done:
                _feed_cut(self.fast, cut, start, base, agents)
            merged = self.fast.out_view(slot, job, stop - start)
            cuts = cut.cut if cut is not None else self.obs.cuts_of(job.name)  # (a recalled one: cuts_of)
            self._merge(job, start, base, agents, merged, self.no_cut if cuts is None else cuts)
            write_slot(out, slot, merged, bar)
            if stop == job.numel and own and cache is not None:  # selected (and cut) by this merge: kept
                self.obs.remember(cache, job.name)

    def _merge(self, job: Job, start: int, base: np.ndarray, agents: Any, merged: np.ndarray, cut: np.ndarray
               ) -> None:
        keep_lo, keep_hi = (np.ascontiguousarray(r) for r in self.obs.window(job.name))
        run = self.run
        c = combine_constants(self.name, self.preset, run.params_of(job.name), len(run.match.agents))
        cut = np.ascontiguousarray(cut, dtype=np.int64)
        key, (consts, agent_consts) = rule_key(c.program, tau=True), c.program.arrays(c.values)
        self.fast.parallel(base.shape[0], lambda k, lo, hi: kernels.select_merge_range(
            base, agents, lo, hi, keep_lo, keep_hi, cut, start, c.w, consts, agent_consts, key, merged,
            self.fast.tau_arg))


def _feed_cut(fast: FastPath, cut: TieCut, start: int, base: np.ndarray, agents: Any) -> None:
    """Feed one block to ``cut``: the streams still pending scanned on the compute threads, each scan stopping at
    the value it is looking for (kernels.tie_scan). With fewer pending streams than threads a stream's block is
    cut into that many pieces scanned side by side (one pending stream used to scan on one thread while the
    others waited): each piece counts its ties up to the stream's ``left``, and the piece where the running
    count reaches ``left`` is scanned again for the exact index when an earlier piece held some of them."""
    pending = [int(t) for t in np.flatnonzero(cut.pending)]
    if not pending:
        return
    n = base.shape[0]
    ways = max(1, min(fast.threads // len(pending), n // SCAN_PIECE))
    step = -(-n // ways)
    parts = [(t, lo, min(n, lo + step)) for t in pending for lo in range(0, n, step)]

    def scan(t: int, lo: int, hi: int, left: int | None = None) -> tuple[int, int]:
        return kernels.tie_scan(base, agents, lo, hi, t, cut.thr[t], cut.left(t) if left is None else left,
                                fast.tau_arg)

    found = dict(zip(parts, fast.run_parts(parts, scan)))
    for t in pending:
        left, seen, index = cut.left(t), 0, -1
        for part in (p for p in parts if p[0] == t):
            count, at = (int(x) for x in found[part])
            if left > 0 and seen + count >= left:  # the left-th tie is in this piece
                index = at if seen == 0 else int(scan(*part, left - seen)[1])
                seen = left
                break
            seen += count
        cut.add(t, start, seen, index)
