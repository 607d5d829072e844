"""TIES and Breadcrumbs on the fast path: exact |τ| thresholds from fused histograms, then a fused merge rule.

The torch path (methods/gta.py) streams every tensor through a chain of torch ops once per round of the exact
k-th largest |τ| (methods/_select.py), then once to merge. Here the same rounds run through numba kernels on
the fast path's blocks (fastpath.py), and a tensor that fits in one block is read once: every selection round
and the merge run on the block already in memory. ``ties_global`` needs the whole model's thresholds before the
first element is merged, so its selection rounds are the statistics pass. The thresholds come from the same
``GtaObserver`` (same ranks, same bins), so the bytes written are the torch path's (tests/test_fastgta.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from .. import kernels
from ..methods import MethodSpec
from ..methods._ops import weight_sum
from ..methods._select import BINS, ROUNDS
from ..methods.gta import GtaObserver, _ranks
from ..methods.task_arithmetic import agent_weights
from ..stats import Statistics, TensorStats
from .fast import FastPath, OrderedWriter, eligible, enabled, next_block, statistics_pass_fast, stats_args
from .match import Job, Match

FAST_PRESETS = ("ties", "ties_global", "breadcrumbs", "breadcrumbs_ties")  # selection by magnitude, no L1 rescale


def build(match: Match, spec: MethodSpec, p: Any, block_size: int, device: str, observer: Any,
          extras: list[Any] | None, eps: float) -> GtaFast | None:
    """A GtaFast when every merged tensor can take the fast path (thresholds for all or none of them)."""
    if spec.name not in FAST_PRESETS or not enabled(device) or extras or not isinstance(observer, GtaObserver):
        return None
    if not match.merge_jobs or not all(eligible(match, j) for j in match.merge_jobs):
        return None
    return GtaFast(FastPath(match, block_size), observer, p, eps)


class GtaFast:
    def __init__(self, fast: FastPath, observer: GtaObserver, params: Any, eps: float) -> None:
        self.fast, self.obs = fast, observer
        self.stats_args = stats_args(len(fast.match.agents), eps)
        preset = observer.preset
        n = len(fast.match.agents)
        self.whole_model = preset.prune == "magnitude-global"
        self.w = agent_weights(preset.summary.split(":")[0], params.weights, n)
        div = weight_sum(self.w)  # methods/_ops.combine without a mask
        self.elect = preset.sign_election
        self.normalize = bool(preset.normalize if params.normalize is None else params.normalize)
        self.div = div if abs(div) >= 1e-8 else np.float32(1.0)
        self.scaling = np.float32(params.scaling)
        self.apply_scaling = params.scaling != 1.0
        # round 0 per agent: sub-histograms of the digit, then the zeros; later rounds per query, spares past the end
        self.hist0 = np.zeros((fast.threads, n, kernels.SUBHISTS, BINS[0] + 1), dtype=np.int64)
        self.histq = np.zeros((fast.threads, 0, max(BINS[1:]) + 8), dtype=np.int64)
        self._numel = 0

    # -- schedule ----------------------------------------------------------------------------------------
    def _selects(self, job: Job) -> bool:
        """Whether this tensor needs its own thresholds (per-tensor presets with a density below 1)."""
        o = self.obs
        return not self.whole_model and any(
            r for t in range(o.n) for r in _ranks(o.preset.prune, job.numel, o.density[t], o.gamma[t]))

    def passes(self, job: Job) -> int:
        """Reads of ``job`` in the merge pass: one per selection round and one to merge, unless it fits in one
        block (then it is read once)."""
        return ROUNDS + 1 if self._selects(job) and job.numel > self.fast.block else 1

    # -- the selection rounds --------------------------------------------------------------------------
    def _count(self, job: Job, start: int, base: np.ndarray, agents: Any) -> None:
        """Add one block to the current round's histogram."""
        sel = self.obs.selection
        assert sel is not None
        if sel.round == 0:
            self.fast.parallel(base.shape[0], lambda k, lo, hi: kernels.gta_hist_first(
                base, agents, lo, hi, self.hist0[k]))
            if self.hist0[:, :, :, kernels.GTA_NONFINITE_BIN:BINS[0]].any():  # |τ| ≥ inf: exponent all ones
                self.fast.raise_non_finite(job, start, base, agents)
            self._numel += base.shape[0]
            return
        if self.histq.shape[1] != len(sel.streams):
            self.histq = np.zeros((self.fast.threads, len(sel.streams), max(BINS[1:]) + 8), dtype=np.int64)
        shift, width = sel.digit
        self.fast.parallel(base.shape[0], lambda k, lo, hi: kernels.gta_hist_next(
            base, agents, lo, hi, sel.streams, sel.prefix, sel.active, shift, width, self.histq[k]))

    def _end_round(self, name: str | None) -> bool:
        """Hand the round's counts to the observer; True while another round is wanted."""
        sel = self.obs.selection
        assert sel is not None
        if sel.round == 0:
            counts = self.hist0.sum(axis=(0, 2))  # [N, BINS[0] + 1]: threads and sub-histograms added
            self.hist0[:] = 0
        else:
            counts = self.histq.sum(0)[:, :BINS[sel.round]]
            self.histq[:] = 0
        self.obs.add_counts(counts, self._numel)
        self._numel = 0
        return self.obs.again(name)

    # -- the statistics pass (ties_global: both rounds over the whole model; else counts only) -------------
    def statistics_pass(self, jobs: list[Job], stats: Statistics, bar: Any) -> None:
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
    def merge_job(self, blocks: Iterator[Any], job: Job, ts: TensorStats | None, out: OrderedWriter,
                  bar: Any) -> None:
        """All reads of one job (``passes(job)`` times its blocks): thresholds, then the fused merge."""
        fast = self.fast
        nblocks = -(-job.numel // fast.block)

        def take() -> tuple[int, int, Any, np.ndarray, np.ndarray]:  # counted on the first read only
            return next_block(blocks, job, fast, ts if first_read else None, self.stats_args)

        first_read = True
        selects = self._selects(job)
        if not self.whole_model:
            self.obs.begin_tensor(job.name, job.numel)  # its ranks and default window
        if self.passes(job) > 1:
            selecting = True
            for _ in range(ROUNDS):  # each round fixes one more digit of every threshold
                for _ in range(nblocks):
                    start, _stop, _slot, base, agents = take()  # a round not needed still takes its blocks
                    if selecting:
                        self._count(job, start, base, agents)
                first_read = False
                selecting = selecting and self._end_round(job.name)
        for _ in range(nblocks):
            start, stop, slot, base, agents = take()
            if selects and self.passes(job) == 1:  # the whole tensor is this block: select in memory
                while True:
                    self._count(job, start, base, agents)
                    if not self._end_round(job.name):
                        break
            merged = fast.out_view(slot, job, stop - start)
            self._merge(job, base, agents, merged)
            out.write_slot(slot, merged)
            bar.advance((stop - start) * job.out_dtype.itemsize)

    def _merge(self, job: Job, base: np.ndarray, agents: Any, merged: np.ndarray) -> None:
        keep_lo, keep_hi = (np.ascontiguousarray(r) for r in self.obs.window(job.name))
        self.fast.parallel(base.shape[0], lambda k, lo, hi: kernels.gta_merge_range(
            base, agents, lo, hi, keep_lo, keep_hi, self.w, self.elect, self.normalize, self.div, self.scaling,
            self.apply_scaling, merged))

