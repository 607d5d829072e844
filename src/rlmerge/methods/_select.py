"""Exact order statistics of |τ| over streamed blocks: a two-level radix select on float32 bit patterns.

For non-negative float32 values the bit pattern, read as an integer, orders like the value. Round 0
histograms the high 16 bits (32,768 bins: the sign bit is 0) of every streamed value; that fixes, for each
query (stream t, rank k), the bin holding its k-th largest value and the rank left inside that bin.
Round 1 histograms the low 16 bits of the values in that bin only, which fixes the value exactly.
Memory: N × 32,768 + Q × 65,536 int64 counters, whatever the number of values; the data are read twice.
"""

from __future__ import annotations

import torch

HI_BINS = 1 << 15  # high 16 bits of a non-negative float32
LO_BINS = 1 << 16


def _bits(absx: torch.Tensor) -> torch.Tensor:
    """|x| as float32 [.., n] → its bit pattern as int32 (order-preserving for x ≥ 0; int32 is ~3× faster)."""
    return absx.contiguous().view(torch.int32)


def _from_top(hist: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows of ``hist`` [Q, B] and ranks ``k`` [Q] (1 = largest): (bin, rank left inside that bin)."""
    desc = hist.flip(-1).cumsum(-1)  # [Q, B] count of values in bins ≥ this one (from the top)
    idx = torch.searchsorted(desc, k.unsqueeze(-1)).squeeze(-1)  # first position with cumsum ≥ k
    above = torch.where(idx > 0, desc.gather(-1, (idx - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1), 0)
    return hist.shape[-1] - 1 - idx, k - above


class KthLargest:
    """Exact k-th largest |value| per query over N streams fed block by block.

    >>> sel = KthLargest(n_streams=1, streams=[0])
    >>> sel.feed(torch.tensor([[0.5, -3.0, 2.0]]))  # round 0 ...
    >>> sel.next_round(ranks=[2])  # ... then the ranks wanted (2 = second largest)
    >>> sel.feed(torch.tensor([[0.5, -3.0, 2.0]]))  # round 1: the same values again
    >>> sel.next_round()
    >>> sel.values().tolist()
    [2.0]
    """

    def __init__(self, *, n_streams: int, streams: list[int]) -> None:
        self.n_streams = n_streams
        self.streams = torch.tensor(streams, dtype=torch.int64)  # [Q]: which stream each query ranks
        self.round = 0
        self.hist_hi = torch.zeros(n_streams * HI_BINS, dtype=torch.int64)
        self.hist_lo = torch.zeros((len(streams), LO_BINS), dtype=torch.int64)
        self.bin_hi = torch.zeros(len(streams), dtype=torch.int64)
        self.rank_left = torch.zeros(len(streams), dtype=torch.int64)
        self._result: torch.Tensor | None = None

    @property
    def done(self) -> bool:
        return self.round >= 2

    def feed(self, values: torch.Tensor) -> None:
        """Add a block of values [N, n] (signs ignored) to the current round."""
        bits = _bits(values.abs().cpu())  # [N, n]
        hi = bits >> 16
        if self.round == 0:
            hi += torch.arange(self.n_streams, dtype=torch.int32).unsqueeze(-1) * HI_BINS  # stream t → bins of t
            self.hist_hi += torch.bincount(hi.reshape(-1), minlength=self.n_streams * HI_BINS)
            return
        for q in range(len(self.streams)):
            t = int(self.streams[q])
            lo = bits[t][hi[t] == int(self.bin_hi[q])] & 0xFFFF
            self.hist_lo[q] += torch.bincount(lo, minlength=LO_BINS)

    def next_round(self, ranks: list[int] | None = None) -> None:
        """End a round; after round 0 give ``ranks`` [Q] (1 = largest), one per query."""
        if self.round == 0:
            if ranks is None or len(ranks) != len(self.streams):
                raise ValueError("next_round after round 0 needs one rank per query")
            k = torch.tensor(ranks, dtype=torch.int64)
            totals = self.hist_hi.view(self.n_streams, HI_BINS).sum(-1)
            if bool((k < 1).any()) or bool((k > totals[self.streams]).any()):
                raise ValueError("rank out of range for the number of values streamed")
            hist = self.hist_hi.view(self.n_streams, HI_BINS)[self.streams]
            self.bin_hi, self.rank_left = _from_top(hist, k)
            self.hist_hi = torch.zeros(0, dtype=torch.int64)  # round 0 done: free it
        elif self.round == 1:
            lo, _ = _from_top(self.hist_lo, self.rank_left)
            bits = (self.bin_hi << 16) | lo
            self._result = bits.to(torch.int32).view(torch.float32)
            self.hist_lo = torch.zeros(0, dtype=torch.int64)
        self.round += 1

    def values(self) -> torch.Tensor:
        """[Q] float32: the exact k-th largest |value| of each query."""
        if self._result is None:
            raise RuntimeError("KthLargest.values() before both rounds were fed")
        return self._result
