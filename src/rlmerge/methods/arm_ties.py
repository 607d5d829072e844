"""arm-ties: the RAM authors' TIES mode on the shared region (their script's ``--merge_mode arm-ties``).

Per tensor (../shared/docs/ram-method.md): an element changed by one agent keeps that agent's τ (no λ), one
changed by none keeps the base; on the shared elements (c ≥ 2) each agent's value v_t = τ_t where it changed the
element and 0 where it did not is trimmed on its own: with d shared elements in the tensor, the ⌊mask_rate · d⌋-th
smallest |v_t| over them is the agent's threshold, and |v_t| ≥ threshold is kept (every value when that rank is 0
or the threshold is 0). The elected sign is the sign of (Σ kept positive v − Σ kept |negative| v); the kept values
that agree strictly with a non-zero elected sign are averaged, × ``scaling``; no agreeing value (or sign 0) gives 0.

The thresholds are per tensor (an exact radix select over the shared region, in the statistics pass); the merge
is elementwise: the rule below runs on every backend. Reading of the script we had to make: its fallback "no kept
value is non-zero: keep the active mean" cannot happen on a non-empty shared region (the largest |v| is always
kept and is > ε), so it is not implemented.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._torch import torch
from ..params import check_range
from ..stats import Statistics, TensorStats
from ._select import ROUNDS, KthLargest
from .interface import BlockContext, Observer
from .ram_beyond import agreeing_mean
from .rule import Expr, Terms
from .spec import MethodSpec

PAPER = "arXiv:2601.13572 (authors' script, merge mode arm-ties)"


@dataclass(frozen=True)
class ArmTiesParams:
    mask_rate: float = 0.9  # the script's fixed trimming rate: the ⌊0.9 · d⌋-th smallest |v| is the threshold
    scaling: float = 1.0  # the script's fixed scaling of the elected mean
    epsilon: float = 1e-5

    def __post_init__(self) -> None:
        check_range("arm-ties", "mask_rate", self.mask_rate, 0.0, 1.0)
        check_range("arm-ties", "scaling", self.scaling, -10.0, 10.0)
        check_range("arm-ties", "epsilon", self.epsilon, 0.0, 1.0)


class SharedThresholds(Observer):
    """The statistics pass's observer: each agent's trimming threshold over each tensor's shared region."""

    def __init__(self, params: ArmTiesParams, n: int) -> None:
        self.params, self.n = params, n
        self.thresholds: dict[str, np.ndarray] = {}  # tensor → [N] float32
        self._name = ""
        self._sel = KthLargest(n_streams=n, streams=list(range(n)))
        self._shared = 0  # d: shared elements of the tensor being streamed

    def observe(self, ctx: BlockContext, base: torch.Tensor, deltas: torch.Tensor) -> None:
        if ctx.start == 0 and ctx.name != self._name:
            self._name, self._shared = ctx.name, 0
            self._sel = KthLargest(n_streams=self.n, streams=list(range(self.n)))
        active = deltas.abs() > self.params.epsilon  # [N, n]
        shared = active.sum(0) >= 2  # [n]
        if self._sel.round == 0:
            self._shared += int(shared.sum())
        self._sel.feed((deltas * active)[:, shared])  # v_t: τ where agent t changed it, 0 elsewhere

    def streams(self, name: str, numel: int, numba: bool) -> int:
        """Statistics-pass streams of a tensor, at most: one per selection round."""
        return ROUNDS

    def again(self, name: str | None) -> bool:
        """After a tensor: its next selection round, until its thresholds are known."""
        if name is None:
            return False
        sel, d = self._sel, self._shared
        if sel.round == 0:
            k = math.floor(self.params.mask_rate * d)
            if k == 0:  # nothing to trim (also no shared element at all): every value is kept
                self.thresholds[name] = np.zeros(self.n, dtype=np.float32)
                return False
            sel.next_round([d - k + 1] * self.n)  # the k-th smallest of d is the (d − k + 1)-th largest
        else:
            sel.next_round()
        if not sel.done:
            return True
        self.thresholds[name] = sel.values().astype(np.float32)
        return False


def arm_ties_rule(t: Terms, p: ArmTiesParams) -> Expr:
    zero, one = t.lit(0.0), t.lit(1.0)
    c = total = pos = neg = zero
    values, kept = [], []
    for i, x in enumerate(t.x):
        active = abs(x) > t.const.eps
        v = t.where(active, x, zero)
        keep = abs(v) >= t.agent.thr[i]
        c = c + t.where(active, one, zero)
        total = total + v
        pos = pos + t.where(keep & (v > zero), v, zero)
        neg = neg + t.where(keep & (v < zero), -v, zero)
        values.append(v)
        kept.append(keep)
    elected = agreeing_mean(t, values, kept, pos - neg) * t.const.scaling
    merged = t.b + t.where(c >= t.lit(2.0), elected, total)  # c = 1: total is the one agent's τ
    return t.where(c.eq(zero), t.b, merged)


def _constants(p: ArmTiesParams, prepared: SharedThresholds, ts: TensorStats | None, n: int,
               name: str) -> dict[str, Any]:
    return {"eps": p.epsilon, "scaling": p.scaling, "thr": prepared.thresholds[name]}


class ArmTies(MethodSpec):
    """Per-tensor thresholds from ``SharedThresholds`` in the statistics pass, read by ``arm_ties_rule`` as
    ``t.agent.thr`` (``_constants``)."""

    def needs_stats(self, p: ArmTiesParams) -> bool:
        return True

    def observer(self, p: ArmTiesParams, n: int, at: Any = None) -> SharedThresholds:
        return SharedThresholds(p, n)

    def prepare(self, p: ArmTiesParams, stats: Statistics | None, n: int) -> SharedThresholds:
        if stats is None or not isinstance(stats.observed, SharedThresholds):
            raise RuntimeError("arm-ties ran without its statistics pass")
        return stats.observed


METHODS = [
    ArmTies("arm-ties", "the RAM authors' arm-ties: unique elements kept, TIES on the shared region per tensor",
            PAPER, "tensor-local", ArmTiesParams, rule=arm_ties_rule, constants=_constants),
]
