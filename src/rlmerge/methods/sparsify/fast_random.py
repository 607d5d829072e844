"""DARE and DELLA on the numba block stream: the torch path's random drop, rescale and merge, byte for byte.

L1 sums are taken inside the merge pass (a tensor larger than a block is read twice); DELLA's blocks hold whole
rows. docs/architecture.md has the design; tests/test_fastdare.py and test_fastdella.py the proof.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...io.writer import CheckpointWriter
from ...kernels import rule_key
from ...params import per_agent
from ...stats import TensorStats
from ...stream.blocks import row_length
from ...stream.fast import FastPath, job_reads, statistics_pass_fast, stats_args, write_slot
from ...stream.match import Job
from ..interface import Entries, Observer
from ..spec import Run
from . import kernels
from .l1 import CHUNK, l1_factors
from .presets import Preset, Rescale, combine_constants, magprune_epsilon
from .rng import chunk_seed

RESCALE = {"none": 0, "inverse": 1, "l1": 2}  # _numba_dare.RESCALE_*
# ``l1``: the keep bits of a tensor, from its L1 sums, are kept for its merge (no second draw and ranking) when
# they take at most this many bytes (N agents · numel / 8; the 0.5B set's embedding: 51 MB); a larger tensor
# draws (and ranks) again
MASK_BYTES = 64 << 20


def pieces(start: int, n: int, threads: int) -> list[tuple[int, int]]:
    """[lo, hi) per thread over a block of n elements that starts at element ``start`` of its tensor, cut only
    at chunk boundaries (a piece's random numbers continue one stream), about n / threads each."""
    first = -start % CHUNK  # the block's first chunk boundary
    cuts = [0]
    for k in range(1, threads):
        cut = first + max(0, round((k * n / threads - first) / CHUNK)) * CHUNK  # the boundary nearest k·n/threads
        if cuts[-1] < cut < n:
            cuts.append(cut)
    return list(zip(cuts, [*cuts[1:], n]))


def random_reads(rescale: Rescale, job: Job, step: int) -> int:
    """Reads of ``job`` in the merge pass: 2 (L1 sums, merge) for ``l1`` unless it fits in one block."""
    return 2 if rescale == "l1" and job.numel > step else 1


@dataclass(frozen=True)
class Random:
    """This backend as a preset that draws its keep masks declares it to the route (spec.Capability)."""

    name: str  # the method's
    preset: Preset
    rescale: Rescale
    kind: str = "random"

    def observed(self, observer: Observer | None) -> bool:
        return False  # nothing is gathered over the whole model: L1 sums are taken while merging

    def merge_reads(self, observer: Observer | None, job: Job, block: int, step: int, cache: Entries | None) -> int:
        return random_reads(self.rescale, job, step)

    def memory(self, jobs: Sequence[Job], n: int) -> int:
        """A tensor's keep bits, kept from its L1 sums to its merge (``l1``), up to MASK_BYTES."""
        if self.rescale != "l1":
            return 0
        return min(max((n * -(-j.numel // 8) for j in jobs), default=0), MASK_BYTES)

    def open(self, run: Run, stream: FastPath) -> RandomBackend:
        return RandomBackend(run, stream, self.name, self.preset)


class RandomBackend:
    """The merge pass of dare_ta / dare_ties / della / della_linear on the fast path; the statistics pass is
    fastpath's."""

    whole_model = False  # nothing is gathered over the whole model before merging

    def __init__(self, run: Run, fast: FastPath, name: str, preset: Preset) -> None:
        n = len(fast.match.agents)
        params = run.params
        self.name, self.preset = name, preset
        self.run, self.fast, self.n, self.seed = run, fast, n, run.seed
        self.params = params
        self.stats_args = stats_args(n, run.stats.epsilon)
        self.magprune = preset.prune == "magprune"
        self.rescale = RESCALE[params.rescale]
        self.ones = np.ones(n, dtype=np.float32)
        self.no_mask = np.empty((n, 0), dtype=np.uint8)
        self._bits = np.empty(0, dtype=np.uint8)  # reused by every tensor's keep bits

    def reads(self, job: Job) -> int:
        return random_reads(self.params.rescale, job, self.fast.step(job))

    def _constants(self, job: Job) -> None:
        """The tensor's combine constants and keep probability's terms, as gta.prune_block rounds them: density − ε,
        2ε (float32; DARE: ε = 0)."""
        run, n = self.run, self.n
        params = run.params_of(job.name)
        self.c = combine_constants(self.name, self.preset, params, n)
        self.key, self.consts = rule_key(self.c.program, tau=True), self.c.program.arrays(self.c.values)
        dens = np.array(per_agent(params.density, n, "gta", "density"), dtype=np.float32)
        eps = np.array(magprune_epsilon(params, n) if self.magprune else (0.0,) * n, dtype=np.float32)
        self.plo = dens - eps if self.magprune else dens
        self.p2e = np.float32(2.0) * eps

    def statistics(self, jobs: list[Job], bar: Any) -> None:
        statistics_pass_fast(self.fast, jobs, self.run.stats, bar)  # a resumed run's counts; DARE needs none

    def _rowlen(self, job: Job) -> int:
        """The kernels' ``row``: MagPrune's row length (a 1-D tensor is one row), 0 for DARE."""
        return row_length(job.info.shape) if self.magprune else 0

    def _mask(self, job: Job) -> np.ndarray:
        """[N, ⌈numel / 8⌉] uint8 for the tensor's keep bits, or [N, 0] (none) above MASK_BYTES."""
        size = self.n * -(-job.numel // 8)
        if size > MASK_BYTES:
            return self.no_mask
        if self._bits.size < size:
            self._bits = np.empty(size, dtype=np.uint8)
        return self._bits[:size].reshape(self.n, -1)

    def _seeds(self, job: Job) -> np.ndarray:
        """[N, chunks] uint32: the low 32 bits of each chunk's seed, all that torch's manual_seed keeps."""
        chunks = -(-job.numel // CHUNK)
        return np.array([[chunk_seed(self.seed, t, job.name, c) & 0xFFFFFFFF for c in range(chunks)]
                         for t in range(self.n)], dtype=np.uint32)

    def _threads(self, job: Job, start: int, base: np.ndarray, agents: np.ndarray,
                 fn: Callable[[int, int], bool]) -> None:
        """``fn(lo, hi)`` on each thread's pieces of the block; a non-finite τ is named as on the torch path."""
        bad = self.fast.run_parts(pieces(start, base.shape[0], self.fast.threads), fn)
        if any(bad):
            self.fast.raise_non_finite(job, start, base, agents)

    # -- the merge pass --------------------------------------------------------------------------------
    def begin_merge(self, jobs: list[Job]) -> None:
        self._blocks = self.fast.blocks(jobs, self.reads)

    def merge_job(self, job: Job, ts: TensorStats | None, out: CheckpointWriter, bar: Any) -> None:
        """All reads of one job (``reads(job)`` times its blocks): L1 sums if asked, then the fused merge."""
        seeds = self._seeds(job)
        self._constants(job)
        reads = self.reads(job)
        l1 = _L1Sums(self.n, self._mask(job)) if self.rescale == RESCALE["l1"] else None
        factor = self.ones
        for read, start, stop, slot, base, agents in job_reads(self.fast, self._blocks, job, reads, ts,
                                                               self.stats_args):
            if l1 is not None and read == 0:  # the L1 sums (with one read: of the whole tensor, this block)
                self._l1_block(job, start, stop, base, agents, seeds, l1)
                if stop == job.numel:
                    factor = l1.factors()
                if reads == 2:
                    continue
            merged = self.fast.out_view(slot, job, stop - start)
            self._merge_block(job, start, base, agents, seeds, factor, merged,
                              l1.bits if l1 is not None else self.no_mask)
            write_slot(out, slot, merged, bar)

    def _merge_block(self, job: Job, start: int, base: np.ndarray, agents: np.ndarray, seeds: np.ndarray,
                     factor: np.ndarray, merged: np.ndarray, mask: np.ndarray) -> None:
        self._threads(job, start, base, agents, lambda lo, hi: kernels.dare_merge_range(
            base, agents, lo, hi, start, self._rowlen(job), seeds, self.plo, self.p2e, self.rescale, factor, self.c.w,
            *self.consts, self.key, merged, mask, self.fast.tau_arg))

    def _l1_block(self, job: Job, start: int, stop: int, base: np.ndarray, agents: np.ndarray, seeds: np.ndarray,
                  l1: _L1Sums) -> None:
        part = np.empty((2, self.n, (stop - 1) // CHUNK - start // CHUNK + 1, 8), dtype=np.float64)
        self._threads(job, start, base, agents, lambda lo, hi: kernels.dare_l1_range(
            base, agents, lo, hi, start, self._rowlen(job), seeds, self.plo, self.p2e, l1.carry, part, l1.bits,
            self.fast.tau_arg))
        kernels.dare_fold(part, l1.carry, l1.total, start, stop, job.numel)


class _L1Sums:
    """One tensor's Σ|τ_t| (row 0) and Σ|kept τ_t| (row 1) so far, the lanes of a chunk left open, and where its
    keep bits go ([N, 0]: nowhere)."""

    def __init__(self, n: int, bits: np.ndarray) -> None:
        self.bits = bits
        self.total = np.zeros((2, n), dtype=np.float64)
        self.carry = np.zeros((2, n, 8), dtype=np.float64)

    def factors(self) -> np.ndarray:
        return l1_factors(self.total[0], self.total[1])
