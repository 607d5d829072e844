"""Exact order statistics of |τ| over streamed blocks: a radix select on float32 bit patterns.

For non-negative float32 values the bit pattern, read as an integer, orders like the value; the sign bit is 0,
so 31 bits matter. Round r histograms one digit of those bits (``DIGITS``: bits 30–20, 19–10, 9–0), counting
only the values whose higher digits equal what the earlier rounds fixed for the query; after each round the
bin holding the query's k-th largest value, and the rank left inside that bin, are known. After the last
round the value is exact. Histograms of at most 2,048 bins stay in the cache, which is what makes the fast
path's counting kernels fast (a 65,536-bin table of a two-round select cost ~10 ns per element on the benchmark
machine); the data are read once per round.

Round 0 also counts the exact zeros (column ``BINS[0]``). RL task vectors are sparse: for a sparse agent the
k-th largest |τ| is often 0, and when round 0 shows the rank falls among the zeros the query is answered
there, without the later rounds (which would otherwise count every zero again).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .._torch import torch

DIGITS = ((20, 11), (10, 10), (0, 10))  # (shift, width) of each round's digit, high to low
BINS = tuple(1 << w for _, w in DIGITS)
ROUNDS = len(DIGITS)


def _from_top(hist: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For rows of ``hist`` [Q, B] and ranks ``k`` [Q] (1 = largest): (bin, rank left inside that bin).

    numpy, not torch: these are small arrays, and torch's intra-op threads cost milliseconds per call on a
    busy machine (measured: flip + cumsum of [3, 32768] took 10 ms with 2 torch threads under load).
    """
    desc = np.cumsum(hist[:, ::-1], axis=-1)  # [Q, B] count of values in bins ≥ this one (from the top)
    idx = np.array([np.searchsorted(row, kq) for row, kq in zip(desc, k)], dtype=np.int64)  # first cumsum ≥ k
    above = np.where(idx > 0, desc[np.arange(len(k)), np.maximum(idx - 1, 0)], 0)
    return hist.shape[-1] - 1 - idx, k - above


class Bins(Protocol):
    """The values gathered from a selection's bins after a round (KthLargest.finish, GtaObserver.gathered): per query
    q, every value whose bits above the round's digit equal the query's prefix, as float32 patterns (uint32) with
    their flat indices. ``GatheredBins`` is numpy's; the fast path's gather answers with its kernels
    (methods/sparsify/fast_select._Gather)."""

    def size(self, q: int) -> int:
        """How many values were gathered for query q."""
        ...

    def kth(self, queries: Sequence[tuple[int, int, int]], above: int) -> list[tuple[int, int, int]]:
        """Per (q, rank, prefix): the pattern of the rank-th largest (1 = largest) of q's values, how many of them
        exceed it and how many equal it; ``above``: the bits from there up are the prefix (the rest differ)."""
        ...

    def tie(self, q: int, pattern: int, left: int) -> tuple[int, int]:
        """How many of q's values equal ``pattern``, and the flat index of the ``left``-th of them in flat order
        (−1 when left ≤ 0 or fewer are there)."""
        ...


@dataclass
class GatheredBins:
    """``Bins`` with numpy: each query's patterns and flat indices, one array each, in any order: a partition per
    query. The reference the fast path's kernels (kernels.bin_kth, bin_tie) are held to."""

    bits: list[np.ndarray]
    index: list[np.ndarray]

    def size(self, q: int) -> int:
        return len(self.bits[q])

    def kth(self, queries: Sequence[tuple[int, int, int]], above: int) -> list[tuple[int, int, int]]:
        out = []
        for q, rank, _prefix in queries:
            bits = np.asarray(self.bits[q], dtype=np.uint32)
            at = len(bits) - rank  # the rank-th largest of the bin
            v = np.partition(bits, at)[at]
            out.append((int(v), int(np.count_nonzero(bits > v)), int(np.count_nonzero(bits == v))))
        return out

    def tie(self, q: int, pattern: int, left: int) -> tuple[int, int]:
        ties = self.index[q][self.bits[q] == pattern]
        return len(ties), int(np.partition(ties, left - 1)[left - 1]) if 0 < left <= len(ties) else -1


class KthLargest:
    """Exact k-th largest |value| per query over N streams fed block by block, in up to ``ROUNDS`` rounds.

    >>> sel = KthLargest(n_streams=1, streams=[0])
    >>> sel.feed(torch.tensor([[0.5, -3.0, 2.0]]))  # round 0 ...
    >>> sel.next_round(ranks=[2])  # ... then the ranks wanted (2 = second largest)
    >>> while not sel.done:
    ...     sel.feed(torch.tensor([[0.5, -3.0, 2.0]]))  # the same values again, once per round
    ...     sel.next_round()
    >>> sel.values().tolist()
    [2.0]

    Round 0 is counted per stream (``[N, BINS[0] + 1]``: digit counts without the zeros, then the zeros),
    shared by a stream's queries; later rounds per query (``[Q, BINS[r]]``), over the values whose bits above
    the round's digit equal ``prefix[q]``, for the queries still ``active``.
    """

    def __init__(self, *, n_streams: int, streams: list[int]) -> None:
        self.n_streams = n_streams
        self.streams = np.array(streams, dtype=np.int64)  # [Q]: which stream each query ranks
        self.round = 0
        self.hist: np.ndarray | int = 0  # this round's counts once fed (an array added to 0 is adopted)
        self.prefix = np.zeros(len(streams), dtype=np.int64)  # [Q] the bits fixed so far, right-aligned
        self.rank_left = np.zeros(len(streams), dtype=np.int64)
        self.active = np.ones(len(streams), dtype=bool)  # [Q] False once the answer is known (a zero)
        self._result: np.ndarray | None = None
        self.ranks = np.zeros(len(streams), dtype=np.int64)  # [Q] the ranks asked for (after round 0)
        self.greater = np.zeros(len(streams), dtype=np.int64)  # [Q] once done: how many values exceed the answer
        self.equal = np.zeros(len(streams), dtype=np.int64)  # [Q] once done: how many equal it
        self.in_bin = np.zeros(len(streams), dtype=np.int64)  # [Q] after a round: the values in the query's bin

    @property
    def done(self) -> bool:
        return self.round >= ROUNDS or (self.round > 0 and not self.active.any())

    @property
    def digit(self) -> tuple[int, int]:
        """(shift, width) of this round's digit."""
        return DIGITS[self.round]

    def feed(self, values: torch.Tensor) -> None:
        """Add a block of values [N, n] (signs ignored) to the current round (the torch path)."""
        bits = values.abs().cpu().contiguous().view(torch.int32)  # [N, n]; int32 is ~3× faster than int64
        shift, width = self.digit
        digit = (bits >> shift) & ((1 << width) - 1)
        if self.round == 0:
            digit = torch.where(bits == 0, BINS[0], digit)  # the zeros in a column of their own
            digit += torch.arange(self.n_streams, dtype=torch.int32).unsqueeze(-1) * (BINS[0] + 1)
            counts = torch.bincount(digit.reshape(-1), minlength=self.n_streams * (BINS[0] + 1))
            self.add_counts(counts.numpy().reshape(self.n_streams, BINS[0] + 1))
            return
        hist = np.zeros((len(self.streams), BINS[self.round]), dtype=np.int64)
        for q in np.flatnonzero(self.active):
            t = int(self.streams[q])
            inside = (bits[t] >> (shift + width)) == int(self.prefix[q])
            hist[q] = torch.bincount(digit[t][inside], minlength=BINS[self.round]).numpy()
        self.add_counts(hist)

    def add_counts(self, hist: np.ndarray) -> None:
        """Add counts another kernel made (the fast path): [N, BINS[0] + 1] in round 0, [Q, BINS[r]] after."""
        self.hist = hist if isinstance(self.hist, int) else self.hist + hist

    def next_round(self, ranks: list[int] | None = None) -> None:
        """End a round; after round 0 give ``ranks`` [Q] (1 = largest), one per query."""
        if self.round == 0:
            if ranks is None or len(ranks) != len(self.streams):
                raise ValueError("next_round after round 0 needs one rank per query")
            k = np.array(ranks, dtype=np.int64)
            counted = np.broadcast_to(self.hist, (self.n_streams, BINS[0] + 1))[self.streams]  # 0: nothing fed
            hist = counted[:, :BINS[0]].copy()
            hist[:, 0] += counted[:, BINS[0]]  # the zeros are the smallest values of bin 0
            if bool((k < 1).any()) or bool((k > hist.sum(-1)).any()):
                raise ValueError("rank out of range for the number of values streamed")
            digit, self.rank_left = _from_top(hist, k)
            self.ranks = k
            self.active = ~((digit == 0) & (self.rank_left > counted[:, 0]))  # the rank falls among the zeros
            zeros = ~self.active  # answered: 0, with every non-zero value above it
            self.greater = np.where(zeros, k - self.rank_left + counted[:, 0], 0)
            self.equal = np.where(zeros, counted[:, BINS[0]], 0)
            self.in_bin = np.where(self.active, hist[np.arange(len(k)), digit], 0)
        else:
            hist = np.broadcast_to(self.hist, (len(self.streams), BINS[self.round]))
            digit, self.rank_left = _from_top(hist, np.where(self.active, self.rank_left, 1))
            digit = np.where(self.active, digit, 0)
            self.in_bin = np.where(self.active, hist[np.arange(len(digit)), digit], 0)
            if self.round == ROUNDS - 1:  # the last digit: its bin holds one value, the answer
                at = hist[np.arange(len(digit)), digit]
                self.greater = np.where(self.active, self.ranks - self.rank_left, self.greater)
                self.equal = np.where(self.active, at, self.equal)
        self.prefix = np.where(self.active, (self.prefix << DIGITS[self.round][1]) | digit, 0)
        self.hist = 0
        self.round += 1
        if self.done:  # a query answered early has prefix 0: the value 0
            self._result = self.prefix.astype(np.uint32).view(np.float32).copy()

    @property
    def above(self) -> int:
        """After a round: the bits below the fixed prefix; a value is in query q's bin when its pattern shifted right
        by this equals prefix[q]."""
        shift, width = self.digit
        return shift + width

    def finish(self, bins: Bins) -> None:
        """End the selection after a round from every value in each active query's bin instead of more rounds:
        ``bins`` holds them, ``in_bin[q]`` per query (an answered query's are ignored). The fast path gathers a bin
        when it is small enough (fast_select.py)."""
        if self.round == 0 or self.done:
            raise RuntimeError("KthLargest.finish after round 0 and before the last round only")
        active = np.flatnonzero(self.active)
        for q in active:
            if bins.size(q) != self.in_bin[q]:
                raise RuntimeError(f"KthLargest.finish: {bins.size(q)} values gathered for query {q}, its bin holds "
                                   f"{self.in_bin[q]}")
        queries = [(int(q), int(self.rank_left[q]), int(self.prefix[q])) for q in active]
        for q, (v, greater, equal) in zip(active, bins.kth(queries, self.above)):
            self.greater[q] = self.ranks[q] - self.rank_left[q] + greater
            self.equal[q] = equal
            self.prefix[q] = v
        self.prefix = np.where(self.active, self.prefix, 0)
        self.round = ROUNDS
        self._result = self.prefix.astype(np.uint32).view(np.float32).copy()

    def values(self) -> np.ndarray:
        """[Q] float32: the exact k-th largest |value| of each query."""
        if self._result is None:
            raise RuntimeError("KthLargest.values() before every round was fed")
        return self._result


NO_CUT = np.iinfo(np.int64).max  # a cut past every element: every value equal to the threshold is kept


class TieCut:
    """Where to stop keeping a tensor's values equal to a threshold, so that exactly k are kept (TIES' exact top-k).

    Per stream t (an agent), ``need[t]`` of the values with |v| = ``thr[t]`` are to be kept (−1: all of them); the
    tie-break keeps the first ones in flat order. Fed the tensor's |v| blocks in order, ``cut[t]`` becomes the flat
    index after the need[t]-th such value: |v| = thr is kept where index < cut. Until a stream's cut is found,
    ``cut`` is ``NO_CUT``, which is right for every block fed so far (fewer than need[t] ties were in them).
    """

    def __init__(self, thr: np.ndarray, need: np.ndarray) -> None:
        self.thr = np.asarray(thr, dtype=np.float32)
        self.need = np.asarray(need, dtype=np.int64)
        self.seen = np.zeros(len(self.need), dtype=np.int64)
        self.cut = np.full(len(self.need), NO_CUT, dtype=np.int64)
        self.pending = self.need >= 0

    @property
    def done(self) -> bool:
        return not bool(self.pending.any())

    def feed(self, start: int, absd: np.ndarray) -> None:
        """|v| [N, n] float32 of flat elements [start, start + n) of the tensor, blocks in order: numpy on both
        paths (the numba path never pages in torch's kernels, ~200 MB of RSS)."""
        for t in np.flatnonzero(self.pending):
            eq = absd[t] == self.thr[t]
            left = self.left(t)
            index = np.flatnonzero(eq)[left - 1] if 0 < left <= int(eq.sum()) else -1
            self.add(t, start, int(eq.sum()), int(index))

    def left(self, t: int) -> int:
        """How many more values equal to thr[t] stream t keeps."""
        return int(self.need[t] - self.seen[t])

    def add(self, t: int, start: int, count: int, index: int) -> None:
        """What a scan of stream t from flat element ``start`` found: ``count`` values equal to thr[t], and the
        flat index (from ``start``) of the left(t)-th of them, −1 when the scan did not meet it (the fast path's
        kernel stops there; ``feed`` counts the whole block)."""
        left = self.left(t)
        if count >= left:  # left 0 (nothing more to keep): the cut is the block's start
            self.cut[t] = start + (index if left > 0 else -1) + 1
            self.pending[t] = False
        else:
            self.seen[t] += count
