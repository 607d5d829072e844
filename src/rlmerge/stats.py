"""Streaming statistics of the task vectors: exact integer counts, float64 norms and dot products.

Counts follow ../shared/docs/ram-method.md: an element is *changed* by agent t when |τ_t| > ε
(strictly); c = number of agents that changed it; per agent, ``kofn[t, k]`` counts agent t's changed
elements that exactly k agents changed (k = 1 … N), so unique_t = kofn[t, 1] and
shared_t = Σ_{k≥2} kofn[t, k]. Everything is kept per tensor, and summed over the whole model on demand.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .errors import InputError


@dataclass
class TensorStats:
    """Counters for one stored tensor, over all its blocks."""

    numel: int
    n_agents: int
    weight: int = 1  # 2 when the authors' double count of a tied tensor is reproduced
    kofn: np.ndarray = field(init=False)  # [N, N+1] int64; column 0 stays 0
    sumsq: np.ndarray = field(init=False)  # [N] float64, Σ τ²
    dots: np.ndarray = field(init=False)  # [N, N] float64, Σ τ_a τ_b
    overlap: np.ndarray = field(init=False)  # [N, N] int64, changed by both a and b
    sign_agree: np.ndarray = field(init=False)  # [N, N] int64, changed by both, same sign

    def __post_init__(self) -> None:
        n = self.n_agents
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

    @property
    def changed(self) -> np.ndarray:
        return self.kofn.sum(axis=1)

    @property
    def unique(self) -> np.ndarray:
        return self.kofn[:, 1]

    @property
    def shared(self) -> np.ndarray:
        return self.kofn[:, 2:].sum(axis=1)


def check_finite(deltas: torch.Tensor, sumsq_block: torch.Tensor, *, name: str, files: list[str],
                 start: int) -> None:
    """Raise on NaN/Inf in a task vector block; ``sumsq_block`` [N] is the cheap first check."""
    if bool(torch.isfinite(sumsq_block).all()):
        return
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

    @property
    def n_agents(self) -> int:
        return len(self.agents)

    def for_tensor(self, name: str, numel: int, weight: int = 1) -> TensorStats:
        ts = self.tensors.get(name)
        if ts is None:
            ts = self.tensors[name] = TensorStats(numel, self.n_agents, weight)
        return ts

    def _sum(self, attr: str) -> np.ndarray:
        vals = [getattr(ts, attr) * ts.weight for ts in self.tensors.values()]
        return np.sum(vals, axis=0) if vals else np.zeros(self.n_agents, dtype=np.int64)

    @property
    def numel(self) -> int:
        return sum(ts.numel * ts.weight for ts in self.tensors.values())

    @property
    def kofn(self) -> np.ndarray:
        return self._sum("kofn")

    @property
    def changed(self) -> np.ndarray:
        return self._sum("changed")

    @property
    def shared(self) -> np.ndarray:
        return self._sum("shared")

    @property
    def unique(self) -> np.ndarray:
        return self._sum("unique")

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


def overlap_ratio(shared: int, unique: int) -> float:
    """ρ = shared/unique with the documented edge cases: 0 when nothing changed, ∞ when no unique."""
    if unique == 0:
        return math.inf if shared > 0 else 0.0
    return shared / unique
