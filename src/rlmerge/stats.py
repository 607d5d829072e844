"""Streaming statistics of the task vectors: exact integer counts, float64 norms and dot products.

Counts follow ../shared/docs/ram-method.md: an element is *changed* by agent t when |τ_t| > ε
(strictly); c = number of agents that changed it; per agent, ``kofn[t, k]`` counts agent t's changed
elements that exactly k agents changed (k = 1 … N), so unique_t = kofn[t, 1] and
shared_t = Σ_{k≥2} kofn[t, k]. Everything is kept per tensor, and summed over the whole model on demand.

``rlmerge inspect`` turns on extra counters (density at other thresholds, values changed at all, a
magnitude histogram); a merge leaves them off so that its hot path stays as cheap as before.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._torch import torch
from .errors import InputError


@dataclass
class TensorStats:
    """Counters for one stored tensor, over all its blocks."""

    numel: int
    n_agents: int
    weight: int = 1  # 2 when the authors' double count of a tied tensor is reproduced
    thresholds: tuple[float, ...] = ()  # extra |τ| thresholds counted (inspect only; empty in a merge)
    kofn: np.ndarray = field(init=False)  # [N, N+1] int64; column 0 stays 0
    sumsq: np.ndarray = field(init=False)  # [N] float64, Σ τ²
    dots: np.ndarray = field(init=False)  # [N, N] float64, Σ τ_a τ_b
    overlap: np.ndarray = field(init=False)  # [N, N] int64, changed by both a and b
    sign_agree: np.ndarray = field(init=False)  # [N, N] int64, changed by both, same sign
    above: np.ndarray = field(init=False)  # [N, T] int64, |τ| > thresholds[j]  (T = 0 in a merge)
    nonzero: np.ndarray = field(init=False)  # [N] int64, τ ≠ 0: the value changed at all (inspect only)

    def __post_init__(self) -> None:
        n = self.n_agents
        self.above = np.zeros((n, len(self.thresholds)), dtype=np.int64)
        self.nonzero = np.zeros(n, dtype=np.int64)
        self.kofn = np.zeros((n, n + 1), dtype=np.int64)
        self.sumsq = np.zeros(n, dtype=np.float64)
        self.dots = np.zeros((n, n), dtype=np.float64)
        self.overlap = np.zeros((n, n), dtype=np.int64)
        self.sign_agree = np.zeros((n, n), dtype=np.int64)

    def update(self, deltas: torch.Tensor, mask: torch.Tensor, counts: torch.Tensor) -> None:
        """Add one block: deltas [N, n] float32, mask [N, n] bool (|τ|>ε), counts [n] (agents active)."""
        n = self.n_agents
        for t in range(n):
            # counts where agent t is active, 0 elsewhere; bin 0 then holds the inactive elements.
            self.kofn[t, 1:] += torch.bincount(counts * mask[t], minlength=n + 1)[1:].numpy()
        d64 = deltas.double()
        gram = d64 @ d64.T  # [N, N]
        self.dots += gram.numpy()
        self.sumsq += np.diag(gram.numpy())
        if n > 1:
            sign = torch.sign(deltas) * mask  # 0 where unchanged
            for a in range(n):
                for b in range(a + 1, n):
                    prod = sign[a] * sign[b]
                    both, agree = int((prod != 0).sum()), int((prod > 0).sum())
                    self.overlap[a, b] += both
                    self.overlap[b, a] += both
                    self.sign_agree[a, b] += agree
                    self.sign_agree[b, a] += agree
        if self.thresholds:
            self._update_extras(deltas)

    def _update_extras(self, deltas: torch.Tensor) -> None:
        # numpy's count_nonzero is ~10× faster than torch's bool sum on CPU: this keeps inspect near merge speed.
        d = deltas.numpy()  # [N, n] float32, a view
        for t in range(self.n_agents):
            mag = np.abs(d[t])
            for j, th in enumerate(self.thresholds):
                self.above[t, j] += np.count_nonzero(mag > th)
            self.nonzero[t] += np.count_nonzero(d[t])

    def add_patterns(self, hist: np.ndarray, gram: np.ndarray) -> None:
        """Add one block summarised by the fused kernel (kernels.py).

        hist [4^N] int64 counts elements per pattern code (bit t: agent t changed it; bit N+t: the change
        is negative); gram [N, N] float64 holds Σ τ_a τ_b in its upper triangle (a ≤ b).
        """
        n = self.n_agents
        kofn, both, agree = _pattern_tables(n)
        self.kofn += (kofn @ hist).reshape(n, n + 1)
        self.overlap += (both @ hist).reshape(n, n)
        self.sign_agree += (agree @ hist).reshape(n, n)
        full = np.triu(gram) + np.triu(gram, 1).T
        self.dots += full
        self.sumsq += np.diag(full)

    @property
    def changed(self) -> np.ndarray:
        return self.kofn.sum(axis=1)

    @property
    def unique(self) -> np.ndarray:
        return self.kofn[:, 1]

    @property
    def shared(self) -> np.ndarray:
        return self.kofn[:, 2:].sum(axis=1)


@functools.cache
def _pattern_tables(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Integer matrices from the 4^N pattern-code histogram to kofn [N·(N+1)], overlap and sign_agree [N·N]."""
    codes = np.arange(4**n)
    active = (codes[:, None] >> np.arange(n)) & 1  # [4^N, N]
    neg = (codes[:, None] >> (n + np.arange(n))) & 1
    kofn = np.zeros((n, n + 1, 4**n), dtype=np.int64)
    for t in range(n):
        kofn[t, active.sum(1), codes] = active[:, t]
    both = active[:, :, None] * active[:, None, :]  # [4^N, N, N]
    agree = both * (neg[:, :, None] == neg[:, None, :])
    off = ~np.eye(n, dtype=bool)  # the torch path leaves the diagonal at 0
    both, agree = both * off, agree * off
    return kofn.reshape(n * (n + 1), -1), both.reshape(4**n, -1).T.copy(), agree.reshape(4**n, -1).T.copy()


def check_finite(deltas: torch.Tensor, sumsq_block: torch.Tensor, *, name: str, files: list[str],
                 start: int, base: torch.Tensor | None = None, base_file: str | None = None) -> None:
    """Raise on NaN/Inf in a task vector block; ``sumsq_block`` [N] is the cheap first check. ``base`` (the block's
    θ₀, stored in ``base_file``) is looked at first: a non-finite base makes every agent's τ non-finite there, and
    it is the base's file that is broken."""
    if bool(torch.isfinite(sumsq_block).all()):
        return
    if base is not None:
        bad = ~torch.isfinite(base)
        if bool(bad.any()):
            where = start + int(bad.nonzero()[0, 0])
            raise InputError(f"NaN or Inf in the base at flat element {where}", file=base_file, tensor=name,
                             hint="the base checkpoint is broken; re-export it")
    for t in range(deltas.shape[0]):
        bad = ~torch.isfinite(deltas[t])
        if bool(bad.any()):
            where = start + int(bad.nonzero()[0, 0])
            raise InputError(f"NaN or Inf in the task vector at flat element {where}", file=files[t],
                             tensor=name, hint="the agent (or base) checkpoint is broken; re-export it")


@dataclass
class Statistics:
    """Whole-model statistics: per-tensor counters and the totals RAM+ needs."""

    agents: list[str]
    epsilon: float
    tensors: dict[str, TensorStats] = field(default_factory=dict)
    observed: Any = None  # the method's observer from the statistics pass (thresholds, sums), if it has one
    thresholds: tuple[float, ...] = ()  # extra counters (inspect): density at each of these thresholds
    magnitudes: Magnitudes | None = None  # extra (inspect): histogram of |τ| and |θ₀|, fed by the caller

    @property
    def n_agents(self) -> int:
        return len(self.agents)

    def identical_agents(self) -> list[str]:
        """A warning per agent that changed no element (|τ| ≤ ε everywhere): it contributes nothing."""
        return [f"agent {a} is identical to the base (no element with |τ| > ε): it contributes nothing"
                for a, c in zip(self.agents, self.changed) if c == 0]

    def for_tensor(self, name: str, numel: int, weight: int = 1) -> TensorStats:
        ts = self.tensors.get(name)
        if ts is None:
            ts = self.tensors[name] = TensorStats(numel, self.n_agents, weight, self.thresholds)
        return ts

    def _sum(self, attr: str, weighted: bool = False) -> np.ndarray:
        """The model's total of a per-tensor statistic. ``weighted``: a tied tensor counted twice when asked
        (``count_tied_twice``), which only the counts that feed ρ (shared, unique) are: norms, cosines, densities
        and histograms always count each stored element once."""
        vals = [getattr(ts, attr) * (ts.weight if weighted else 1) for ts in self.tensors.values()]
        return np.sum(vals, axis=0) if vals else np.zeros(self.n_agents, dtype=np.int64)

    @property
    def numel(self) -> int:
        return sum(ts.numel for ts in self.tensors.values())

    @property
    def kofn(self) -> np.ndarray:
        return self._sum("kofn")

    @property
    def changed(self) -> np.ndarray:
        return self._sum("changed")

    @property
    def shared(self) -> np.ndarray:
        return self._sum("shared", weighted=True)

    @property
    def unique(self) -> np.ndarray:
        return self._sum("unique", weighted=True)

    @property
    def unique_once(self) -> np.ndarray:
        """Changed by this agent only, each stored element once (a tied tensor too): with ``shared_once`` it adds
        up to ``changed``. What tables show; ``unique``/``shared`` are ρ's counts (count_tied_twice weighs them)."""
        return self.kofn[:, 1] if self.tensors else np.zeros(self.n_agents, dtype=np.int64)

    @property
    def shared_once(self) -> np.ndarray:
        """Changed by this agent and at least one other, each stored element once (see ``unique_once``)."""
        return self.kofn[:, 2:].sum(axis=1) if self.tensors else np.zeros(self.n_agents, dtype=np.int64)

    @property
    def density(self) -> np.ndarray:
        return self.changed / max(self.numel, 1)

    @property
    def rho(self) -> list[float]:
        """ρ_t = shared_t / unique_t over the whole model; ∞ when an agent has only shared elements."""
        return [overlap_ratio(int(s), int(u)) for s, u in zip(self.shared, self.unique)]

    @property
    def norms(self) -> np.ndarray:
        return np.sqrt(self._sum("sumsq"))

    @property
    def cosine(self) -> np.ndarray:
        dots = self._sum("dots")
        norms = np.sqrt(np.diag(dots))
        with np.errstate(invalid="ignore", divide="ignore"):
            cos = dots / np.outer(norms, norms)
        return np.nan_to_num(cos)


# |x| as float32 bits, shifted right by 16: the sign-free bfloat16 truncation of x (8 exponent and 7 mantissa
# bits). Positive floats order like their bits, so a bin holds [lo, lo·(1 + 2⁻⁷)) and quantiles read from
# it are exact up to that relative resolution. Bin 0 holds zero and float32 subnormals (< 1.2e-38).
MAG_SHIFT = 16
MAG_BINS = 1 << (31 - MAG_SHIFT)


@dataclass
class Magnitudes:
    """Whole-model histograms of |τ_t| per agent and of |θ₀|, binned by bit pattern (see MAG_SHIFT)."""

    n_agents: int
    tau: np.ndarray = field(init=False)  # [N, MAG_BINS] int64
    base: np.ndarray = field(init=False)  # [MAG_BINS] int64

    def __post_init__(self) -> None:
        self.tau = np.zeros((self.n_agents, MAG_BINS), dtype=np.int64)
        self.base = np.zeros(MAG_BINS, dtype=np.int64)

    def update(self, base: torch.Tensor, deltas: torch.Tensor, weight: int = 1) -> None:
        """Add one block: base [n] float32, deltas [N, n] float32 (NaN-free: checked by the pass)."""
        self.base += weight * _hist(base.cpu().numpy())
        d = deltas.cpu().numpy()
        for t in range(self.n_agents):
            self.tau[t] += weight * _hist(d[t])


def _hist(x: np.ndarray) -> np.ndarray:
    """float32 [n] → MAG_BINS counts of |x| by bit pattern. Row by row in numpy: cache-friendly, ~4× torch's."""
    bins = (x.view(np.int32) >> MAG_SHIFT) & (MAG_BINS - 1)  # the & drops the sign bit: |x|
    return torch.bincount(torch.from_numpy(bins), minlength=MAG_BINS).numpy()


def bin_lower_edge(b: np.ndarray | int) -> np.ndarray:
    """The smallest |x| of bin ``b``: the float32 whose bits are ``b << MAG_SHIFT``."""
    return (np.asarray(b, dtype=np.int64) << MAG_SHIFT).astype(np.int32).view(np.float32)


def hist_quantiles(hist: np.ndarray, qs: tuple[float, ...], *, skip_zero: bool = True) -> list[float | None]:
    """Quantiles of a MAG_BINS histogram: the ⌈q·n⌉-th smallest value (1-based), truncated to its bin's edge.

    ``skip_zero`` leaves out bin 0 (zero and subnormals): quantiles of the non-zero entries. None when empty.
    """
    h = hist.copy()
    if skip_zero:
        h[0] = 0
    cum = np.cumsum(h)
    n = int(cum[-1]) if len(cum) else 0
    if n == 0:
        return [None for _ in qs]
    ranks = [max(1, math.ceil(q * n)) for q in qs]
    idx = np.searchsorted(cum, ranks, side="left")
    return [float(v) for v in bin_lower_edge(idx)]


def overlap_ratio(shared: int, unique: int) -> float:
    """ρ = shared/unique with the documented edge cases: 0 when nothing changed, ∞ when no unique."""
    if unique == 0:
        return math.inf if shared > 0 else 0.0
    return shared / unique
