"""The sparsify family's presets and parameters, and the combine step they all end with.

One rule serves them all (mergekit's "generalized task arithmetic"; the pruning steps are in ``observer.py``, the
combine step after them is the rule ``combine_rule``, which every backend runs):

    τ̃_t = prune(τ_t) · rescale_t              per agent: magnitude top-k, random drop, outlier window, MagPrune
    u_t = w_t · τ̃_t
    m_t = [sign(u_t) = sign(Σ_s u_s)]          only with sign election (TIES); else m_t = 1
    τ   = scaling · Σ_t m_t u_t / (Σ_t m_t w_t  if normalize else 1)
    θ   = θ₀ + τ

The presets differ only in data (the ``PRESETS`` table).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ...errors import ConfigError
from ...params import PerAgent, Weights, agent_weights, check_each, check_range, each, per_agent, weight_sum
from ..rule import Expr, Program, Terms, program

Prune = Literal["magnitude", "magnitude-global", "random", "outliers", "magprune"]
Rescale = Literal["inverse", "l1", "none"]
INF = math.inf


@dataclass(frozen=True)
class Preset:
    prune: Prune
    sign_election: bool
    normalize: bool  # default of ``normalize``
    paper: str
    summary: str

    @property
    def windowed(self) -> bool:
        """It keeps a window of |τ| whose bounds an exact selection finds (TIES, Breadcrumbs); else it draws its
        keep masks (DARE, DELLA), and the seed is part of what it merges."""
        return self.prune in ("magnitude", "magnitude-global", "outliers")


PRESETS: dict[str, Preset] = {
    "ties": Preset("magnitude", True, True, "arXiv:2306.01708",
                   "TIES: top-k by magnitude PER TENSOR (as mergekit), sign election, disjoint mean"),
    "ties_global": Preset("magnitude-global", True, True, "arXiv:2306.01708",
                          "TIES as in the paper: top-k by magnitude over each WHOLE task vector"),
    "dare_ta": Preset("random", False, False, "arXiv:2311.03099",
                      "DARE + task arithmetic: random drop with rate p, rescale, sum"),
    "dare_ties": Preset("random", True, True, "arXiv:2311.03099",
                        "DARE + TIES: random drop with rate p, rescale, sign election, disjoint mean"),
    "breadcrumbs": Preset("outliers", False, False, "arXiv:2312.06795",
                          "Model Breadcrumbs: drop the largest gamma and the smallest per tensor, sum"),
    "breadcrumbs_ties": Preset("outliers", True, False, "arXiv:2312.06795",
                               "Model Breadcrumbs with TIES sign election"),
    "della": Preset("magprune", True, True, "arXiv:2406.11617",
                    "DELLA: MagPrune (keep probability rising with magnitude rank in each row), TIES merge"),
    "della_linear": Preset("magprune", False, False, "arXiv:2406.11617",
                           "DELLA's MagPrune, then a plain (weighted) sum"),
}


@dataclass(frozen=True)
class Combine:
    """The combine step's constants, as every backend uses them (``combine_rule`` on torch, the numba kernels)."""

    w: np.ndarray  # [N] float32 weights
    elect: bool  # TIES sign election
    normalize: bool  # divide by Σ w (the kept agents' Σ w with sign election)
    div: np.float32  # Σ w without a mask (params.weight_sum); 1 when |Σ w| < 1e-8, as mergekit
    scaling: np.float32

    @property
    def program(self) -> Program:
        """``combine_rule`` for these constants and N agents (× scaling only where it is not 1)."""
        return program(combine_rule, (self.elect, self.normalize, bool(self.scaling != 1.0)), len(self.w))

    @property
    def values(self) -> dict[str, Any]:
        """The constants ``combine_rule`` reads."""
        return {"w": self.w, "div": self.div, "scaling": self.scaling}


def combine_constants(name: str, preset: Preset, params: Any, n: int) -> Combine:
    """``Combine`` for method ``name`` of ``preset`` with ``params`` and ``n`` agents."""
    w = agent_weights(name, params.weights, n)
    div = weight_sum(w)
    return Combine(w, preset.sign_election, bool(preset.normalize if params.normalize is None else params.normalize),
                   div if abs(div) >= 1e-8 else np.float32(1.0), np.float32(params.scaling))


def combine_rule(t: Terms, p: tuple[bool, bool, bool]) -> Expr:
    """θ₀ + scaling · Σ_t m_t u_t / (Σ_t m_t w_t with sign election, else Σ w) from u_t = ``t.x[t]``, the pruned,
    rescaled and weighted τ; ``p`` = (elect, normalize, scale) of ``Combine``. The sign is elected by total
    mass (+ where Σ_t u_t ≥ 0, mergekit's ``sum`` consensus), m_t is 1 where u_t has that sign strictly, and an
    element no agent kept divides by 1, as mergekit does. Sums run over agents in order. The numba kernels run
    this rule too, in τ form, on the u_t they prune (kernels/select.combine)."""
    elect, normalize, scale = p
    zero, one = t.lit(0.0), t.lit(1.0)
    total = t.x[0]
    for u in t.x[1:]:
        total = total + u
    if elect:
        sign = t.where(total >= zero, one, t.lit(-1.0))
        masks = [t.where(u * sign > zero, one, zero) for u in t.x]  # u · ±1 is exact: > 0 iff u has the sign
        total, den = t.x[0] * masks[0], t.agent.w[0] * masks[0]
        for i in range(1, t.n):
            total, den = total + t.x[i] * masks[i], den + t.agent.w[i] * masks[i]
        if normalize:
            total = total / t.where(den.eq(zero), one, den)
    elif normalize:
        total = total / t.const.div
    return t.b + (total * t.const.scaling if scale else total)


def _common_checks(where: str, weights: Weights, scaling: float) -> None:
    check_range(where, "scaling", scaling, -10.0, 10.0)
    check_each(where, "weight", weights, -10.0, 10.0)


TieBreak = Literal["index", "keep-all"]


@dataclass(frozen=True)
class TiesParams:
    """TIES: keep the top ``density`` fraction of |τ| (the paper's k; RAM paper grid 0.1/0.2/0.3).

    tie_break: ``index`` keeps exactly k per tensor, the values equal to the threshold first in flat order
    (``ties``' default: mergekit's and the paper's count); ``keep-all`` keeps every value equal to the threshold
    (``ties_global``'s, the TIES authors' ``topk_values_mask``; more than k where |τ| values tie, as in bf16)."""

    density: PerAgent = 0.2
    weights: Weights = None
    normalize: bool | None = None  # None: the preset's (disjoint mean)
    scaling: float = 1.0  # the paper's λ (mergekit ``lambda``)
    tie_break: TieBreak | None = None  # None: the method's (ties: index, ties_global: keep-all)

    def __post_init__(self) -> None:
        check_each("ties", "density", self.density, 0.0, 1.0, lo_open=True)
        _common_checks("ties", self.weights, self.scaling)


@dataclass(frozen=True)
class DareParams:
    """DARE: drop each element with probability ``p`` (or keep with ``density`` = 1 − p), then rescale.

    rescale: ``inverse`` multiplies kept elements by 1/(1 − p) (the paper); ``l1`` matches each tensor's L1
    norm before and after the drop (mergekit's ``rescale: true``); ``none`` does not rescale.
    """

    p: PerAgent | None = None  # drop rate; default 0.9 (the DARE paper's setting for LLMs)
    density: PerAgent | None = None  # mergekit's name: keep probability = 1 − p
    rescale: Rescale = "inverse"
    weights: Weights = None
    normalize: bool | None = None
    scaling: float = 1.0

    def __post_init__(self) -> None:
        if self.p is not None and self.density is not None:
            raise ConfigError("dare: give either p (drop rate) or density (keep rate = 1 − p), not both")
        if self.p is not None:
            check_each("dare", "p", self.p, 0.0, 1.0, hi_open=True)
            keep = tuple(1.0 - p for p in each(self.p))
            object.__setattr__(self, "density", keep if isinstance(self.p, tuple) else keep[0])
        elif self.density is None:
            object.__setattr__(self, "p", 0.9)
            object.__setattr__(self, "density", 1.0 - 0.9)
        check_each("dare", "density", self.density, 0.0, 1.0, lo_open=True)
        _common_checks("dare", self.weights, self.scaling)


@dataclass(frozen=True)
class BreadcrumbsParams:
    """Breadcrumbs: per tensor, drop the ``gamma`` fraction of largest |τ|, then the smallest, keeping ``density``."""

    density: PerAgent = 0.9
    gamma: PerAgent = 0.01
    weights: Weights = None
    normalize: bool | None = None
    scaling: float = 1.0

    def __post_init__(self) -> None:
        check_each("breadcrumbs", "density", self.density, 0.0, 1.0, lo_open=True)
        check_each("breadcrumbs", "gamma", self.gamma, 0.0, 1.0, hi_open=True)
        _common_checks("breadcrumbs", self.weights, self.scaling)


@dataclass(frozen=True)
class DellaParams:
    """DELLA MagPrune: keep probability from density − ε (smallest in a row) to density + ε (largest)."""

    density: PerAgent = 0.7
    epsilon: PerAgent = 0.15  # mergekit's default; density ± ε must stay inside (0, 1)
    rescale: Rescale = "inverse"  # inverse: 1/p_i per element (the paper); l1: mergekit's
    weights: Weights = None
    normalize: bool | None = None
    scaling: float = 1.0

    def __post_init__(self) -> None:
        check_each("della", "density", self.density, 0.0, 1.0, lo_open=True)
        check_each("della", "epsilon", self.epsilon, 0.0, 0.5, hi_open=True)
        for d in each(self.density):
            for e in each(self.epsilon):
                if d < 1.0 and (d - e <= 0 or d + e >= 1):  # density 1 keeps everything (mergekit: no pruning)
                    raise ConfigError(f"della: density ± epsilon = {d} ± {e} leaves (0, 1)",
                                      hint="choose epsilon < min(density, 1 − density)")
        _common_checks("della", self.weights, self.scaling)


def magprune_epsilon(params: Any, n: int) -> tuple[float, ...]:
    """MagPrune's ε per agent, 0 for an agent with density 1: every element is kept (p = 1), as mergekit does."""
    dens = per_agent(params.density, n, "della", "density")
    eps = per_agent(getattr(params, "epsilon", 0.0), n, "della", "epsilon")
    return tuple(0.0 if d >= 1.0 else e for d, e in zip(dens, eps))
