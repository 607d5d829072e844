"""Sparsify-then-combine task-vector baselines: TIES, DARE (+TA / +TIES), Breadcrumbs, DELLA.

One rule serves them all (mergekit's "generalized task arithmetic"; the pruning steps are in ``_ops.py``, the
combine step after them is the rule ``combine_rule``, which every backend runs):

    τ̃_t = prune(τ_t) · rescale_t              per agent: magnitude top-k, random drop, outlier window, MagPrune
    u_t = w_t · τ̃_t
    m_t = [sign(u_t) = sign(Σ_s u_s)]          only with sign election (TIES); else m_t = 1
    τ   = scaling · Σ_t m_t u_t / (Σ_t m_t w_t  if normalize else 1)
    θ   = θ₀ + τ

The presets differ only in data (the ``PRESETS`` table). Order statistics (top-k thresholds) and L1 rescale
factors come from the statistics pass through ``GtaObserver``, so the merge pass stays elementwise and any
block size gives the same bytes. Random drops use ``_ops.uniform``: seeded per (seed, agent, tensor, chunk).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from .._torch import torch
from ..errors import ConfigError
from ..params import check_range
from ._l1 import LaneSum, l1_factors
from ._ops import row_length, row_ranks, uniform, weight_sum
from ._select import ROUNDS, KthLargest, TieCut
from .rule import Expr, Program, Terms, program, torch_eval
from .spec import BlockContext, MethodSpec
from .task_arithmetic import PerAgent, Weights, agent_weights, check_each, each, per_agent

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
    div: np.float32  # Σ w without a mask (_ops.weight_sum); 1 when |Σ w| < 1e-8, as mergekit
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


# -- the statistics pass: thresholds and L1 factors ------------------------------------------------------------
def _ranks(prune: Prune, numel: int, density: float, gamma: float) -> tuple[int | None, int | None]:
    """(rank of the lower threshold, rank of the upper one), 1 = largest |τ|; None: no bound on that side.

    magnitude: keep the k = max(1, ⌊density·numel⌋) largest (mergekit ``magnitude``).
    magnitude-global: keep |τ| ≥ the (⌊density·d⌋ + 1)-th largest of the whole task vector (the TIES authors'
    ``topk_values_mask``: kthvalue(d − ⌊d·K⌋)).
    outliers: keep ascending positions [n_bot, n_bot + ⌊density·numel⌋) (mergekit ``magnitude_outliers``).
    """
    if density >= 1.0:
        return None, None
    if prune == "magnitude":
        return max(1, int(density * numel)), None
    if prune == "magnitude-global":
        return int(density * numel) + 1, None
    target, n_top = int(density * numel), int(gamma * numel)
    n_bot = max(0, numel - target - n_top)
    if target == 0:
        return 0, None  # keep nothing
    hi_rank = numel - n_bot - target + 1
    return numel - n_bot, (hi_rank if hi_rank > 1 else None)


class GtaObserver:
    """Collects what a preset needs from the statistics pass; becomes the method's ``prepared`` constants."""

    def __init__(self, preset: Preset, params: Any, n: int, at: Callable[[str], Any] | None = None) -> None:
        self.preset, self.params, self.n = preset, params, n
        self.at = at if at is not None else (lambda name: params)  # each tensor's parameters
        self.density = per_agent(params.density, n, "gta", "density")  # the whole model's (ties_global)
        self.gamma = per_agent(getattr(params, "gamma", 0.0), n, "gta", "gamma")
        self.bounds: dict[str, np.ndarray] = {}  # tensor → [2, N] float32 (lo, hi) on |τ|
        self.cuts: dict[str, np.ndarray] = {}  # tensor → [N] int64: |τ| = lo kept below this flat index (exact k)
        self.kept: dict[str, np.ndarray] = {}  # tensor ("": the whole model) → [N] non-zero τ kept (−1: untrimmed)
        # exact k (TIES' tie_break = index): the ties at the threshold are cut in flat order, found by one more stream
        # of the tensor in the statistics pass (torch) or while merging it (the numba path sets this False)
        self.exact = preset.prune == "magnitude" and getattr(params, "tie_break", None) in (None, "index")
        self.stream_cuts = True
        self.cut: TieCut | None = None  # the cut being found for the current tensor
        self.l1: dict[str, np.ndarray] = {}  # tensor → [N] float32 rescale factors
        self.warnings: tuple[str, ...] = ()
        self._sel: KthLargest | None = None
        self._queries: list[tuple[int, int, int]] = []  # (agent, side 0=lo/1=hi, rank)
        self._l1_acc = (LaneSum(n), LaneSum(n))  # Σ|τ_t|, Σ|kept τ_t|, in _l1.py's fixed order
        self._global_numel = 0
        self._name = ""

    def streams(self, name: str, numel: int, numba: bool) -> int:
        """Statistics-pass streams of a tensor, at most: every selection round for a whole-model threshold, and
        on the torch path for a per-tensor one (the numba path selects inside the merge pass)."""
        if not self.needs_selection:
            return 1
        if self.preset.prune == "magnitude-global":
            return ROUNDS
        return ROUNDS + int(self.exact) if self.selects(name, numel) and not numba else 1

    def density_of(self, name: str) -> tuple[float, ...]:
        """The keep densities of tensor ``name``, per agent."""
        return per_agent(self.at(name).density, self.n, "gta", "density")

    def gamma_of(self, name: str) -> tuple[float, ...]:
        return per_agent(getattr(self.at(name), "gamma", 0.0), self.n, "gta", "gamma")

    def ranks(self, name: str, numel: int) -> list[tuple[int | None, int | None]]:
        """Per agent, the ranks of tensor ``name``'s window bounds (``_ranks``)."""
        return [_ranks(self.preset.prune, numel, d, g) for d, g in zip(self.density_of(name), self.gamma_of(name))]

    def selects(self, name: str, numel: int) -> bool:
        """Whether tensor ``name`` needs thresholds of its own (per-tensor presets with a density below 1)."""
        return self.preset.prune != "magnitude-global" and any(r for rs in self.ranks(name, numel) for r in rs)

    @property
    def needs_selection(self) -> bool:
        return self.preset.windowed

    @property
    def needs_l1(self) -> bool:
        return getattr(self.params, "rescale", "none") == "l1"

    def observe(self, ctx: BlockContext, base: torch.Tensor, deltas: torch.Tensor) -> None:
        numel = math.prod(ctx.shape)
        if ctx.start == 0 and ctx.name != self._name:
            self.begin_tensor(ctx.name, numel)
        if self.cut is not None:  # the stream after the selection: where the ties at the threshold stop
            self.cut.feed(ctx.start, deltas.abs().cpu().numpy())
            return
        if self.needs_selection and self._sel is not None:
            if self._sel.round == 0 and self.preset.prune == "magnitude-global":
                self._global_numel += ctx.stop - ctx.start
            self._sel.feed(deltas)
        if self.needs_l1:
            kept, _ = prune_block(self.preset, self, deltas, ctx)
            self._l1_acc[0].add(deltas.abs(), ctx.start, numel)
            self._l1_acc[1].add(kept.abs(), ctx.start, numel)

    @property
    def selection(self) -> KthLargest | None:
        """The order statistics being gathered (None: nothing to select for this tensor)."""
        return self._sel

    def add_counts(self, hist: np.ndarray, numel: int) -> None:
        """What ``observe`` adds to the selection, from a histogram of ``numel`` elements the fast path counted."""
        if self._sel is None:
            return
        if self._sel.round == 0 and self.preset.prune == "magnitude-global":
            self._global_numel += numel
        self._sel.add_counts(hist)

    def begin_tensor(self, name: str, numel: int) -> None:
        self._name = name
        self.cut = None
        for acc in self._l1_acc:
            acc.reset()
        if self.preset.prune == "magnitude-global":
            if self._sel is None:
                self._sel = KthLargest(n_streams=self.n, streams=list(range(self.n)))
            return
        if not self.needs_selection:
            return
        self._queries = []
        ranks = self.ranks(name, numel)
        for t, (lo, hi) in enumerate(ranks):
            self._queries += [(t, side, r) for side, r in ((0, lo), (1, hi)) if r]  # rank 0: keep nothing
        streams = [q[0] for q in self._queries]
        self._sel = KthLargest(n_streams=self.n, streams=streams) if streams else None
        self.bounds[name] = self._default_bounds(ranks)

    def _default_bounds(self, ranks: list[tuple[int | None, int | None]]) -> np.ndarray:
        b = np.array([[0.0] * self.n, [INF] * self.n], dtype=np.float32)
        for t, (lo, _) in enumerate(ranks):
            if lo == 0:
                b[0, t], b[1, t] = INF, -1.0  # an empty window
        return b

    def again(self, name: str | None) -> bool:
        """After a tensor (``name``) or the whole model (None): True asks the engine to stream it again."""
        if name is not None and self.needs_l1:
            self.l1[name] = l1_factors(self._l1_acc[0].total, self._l1_acc[1].total)
        global_ = self.preset.prune == "magnitude-global"
        if name is None and self.cut is not None:
            return False
        if name is not None and self.cut is not None:  # the cut stream is over
            self.cuts[name], self.cut = self.cut.cut, None
            return False
        if (name is None) != global_ or self._sel is None:
            return False
        sel = self._sel
        if sel.round == 0:
            ranks = ([_ranks("magnitude-global", self._global_numel, d, 0.0)[0] or 1 for d in self.density]
                     if global_ else [q[2] for q in self._queries])
            sel.next_round(ranks)
        else:
            sel.next_round()
        if not sel.done:
            return True
        values = sel.values()
        if global_:
            lo = np.where(np.array(self.density) >= 1.0, np.float32(0.0), values).astype(np.float32)
            self.bounds[""] = np.stack([lo, np.full_like(lo, INF)])
            self.kept[""] = np.where(np.array(self.density) >= 1.0, -1, _kept(values, sel, None))
        else:
            for (t, side, _), v in zip(self._queries, values.tolist()):
                self.bounds[name][side, t] = v  # type: ignore[index]
            self._finish_ranks(name, values, sel)  # type: ignore[arg-type]
        self._sel = None
        return self.cut is not None and self.stream_cuts

    def _finish_ranks(self, name: str, values: np.ndarray, sel: KthLargest) -> None:
        """After a tensor's selection: the non-zero τ each agent keeps and, for exact k, the ties to cut."""
        if self.preset.prune != "magnitude":
            return
        need = np.full(self.n, -1, dtype=np.int64)
        kept = np.full(self.n, -1, dtype=np.int64)
        agents = [t for t, _, _ in self._queries]
        if self.exact:  # keep need = k − (values above the threshold) of the ties; all when that is every tie
            short = (values > 0) & (sel.ranks - sel.greater < sel.equal)
            need[agents] = np.where(short, sel.ranks - sel.greater, -1)
        kept[agents] = _kept(values, sel, need[agents] if self.exact else None)
        self.kept[name] = kept
        if (need >= 0).any():
            self.cut = TieCut(self.bounds[name][0], need)

    def cuts_of(self, name: str) -> np.ndarray | None:
        """[N] int64: |τ_t| equal to the lower bound is kept below flat index cut_t (None: every such value)."""
        return self.cuts.get(name)

    def kept_fraction(self, stats: Any) -> list[float] | None:
        """Per agent, the non-zero τ the trim kept over the elements merged (an untrimmed tensor, density 1,
        counts its changed elements, |τ| > ε); None for the presets that do not trim by magnitude."""
        if self.preset.prune not in ("magnitude", "magnitude-global") or not stats.tensors:
            return None
        kept = np.zeros(self.n, dtype=np.int64)
        numel = 0
        whole = self.kept.get("")
        for name, ts in stats.tensors.items():
            own = whole if whole is not None else self.kept.get(name)
            untrimmed = ts.changed if own is None else np.where(own < 0, ts.changed, 0)
            kept += untrimmed + (0 if own is None or whole is not None else np.maximum(own, 0))
            numel += ts.numel
        if whole is not None:
            kept += np.maximum(whole, 0)
        return (kept / max(numel, 1)).tolist()

    def window(self, name: str) -> np.ndarray:
        """[2, N] float32: keep |τ_t| in [lo_t, hi_t]."""
        return self.bounds[""] if self.preset.prune == "magnitude-global" else self.bounds[name]


def _kept(values: np.ndarray, sel: KthLargest, need: np.ndarray | None) -> np.ndarray:
    """Non-zero values kept per query: those above the threshold, and the ties kept (all, or ``need`` of them; none
    when the threshold is 0)."""
    ties = sel.equal if need is None else np.where(need >= 0, need, sel.equal)
    return np.where(values > 0, sel.greater + ties, sel.greater)


# -- the merge pass -----------------------------------------------------------------------------------------------
def prune_block(preset: Preset, obs: GtaObserver, deltas: torch.Tensor,
                ctx: BlockContext) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(pruned τ [N, n] before any L1 factor, per-element keep probability [N, n] for ``inverse`` or None)."""
    n_agents, n = deltas.shape
    numel = math.prod(ctx.shape)
    if preset.windowed:  # keep lo_t ≤ |τ_t| ≤ hi_t; with TIES' exact k |τ_t| = lo_t only at flat index < cut_t
        absd, cuts = deltas.abs(), obs.cuts_of(ctx.name)
        lo, hi = torch.from_numpy(obs.window(ctx.name)).to(deltas.device).unsqueeze(-1)  # [N, 1] each
        above = absd >= lo
        if cuts is not None:
            index = torch.arange(ctx.start, ctx.stop, device=deltas.device)
            above = (absd > lo) | ((absd == lo) & (index < torch.from_numpy(cuts).to(deltas.device).unsqueeze(-1)))
        return deltas * (above & (absd <= hi)), None
    u = torch.stack([uniform(ctx.seed, t, ctx.name, numel, ctx.start, ctx.stop) for t in range(n_agents)])
    u = u.to(deltas.device)
    dens = torch.tensor(obs.density_of(ctx.name), dtype=torch.float32, device=deltas.device).unsqueeze(-1)  # [N, 1]
    if preset.prune == "random":
        prob = dens.expand(n_agents, n)
    else:  # magprune: p_i = density − ε + 2ε · (rank of |τ_i| in its row, normalised to [0, 1])
        eps = torch.tensor(magprune_epsilon(obs.at(ctx.name), n_agents),
                           dtype=torch.float32, device=deltas.device).unsqueeze(-1)
        prob = (dens - eps) + row_ranks(deltas.abs(), row_length(ctx.shape)) * (2 * eps)
    keep = u < prob
    return deltas * keep, prob



def _merge(name: str, preset: Preset, base: torch.Tensor, deltas: torch.Tensor, params: Any,
           ctx: BlockContext) -> torch.Tensor:
    obs: GtaObserver = ctx.prepared
    c = combine_constants(name, preset, params, deltas.shape[0])
    w = torch.from_numpy(c.w).to(deltas.device)
    pruned, prob = prune_block(preset, obs, deltas, ctx)
    rescale = getattr(params, "rescale", "none")
    if rescale == "inverse" and prob is not None:
        pruned = pruned / prob
    elif rescale == "l1":
        pruned = pruned * torch.from_numpy(obs.l1[ctx.name]).to(deltas.device).unsqueeze(-1)
    return torch_eval(c.program, base, pruned * w.unsqueeze(-1), c.values)


def _needed(obs: GtaObserver) -> GtaObserver | None:
    """The observer, if the statistics pass has anything to find for it (thresholds, L1 sums)."""
    return obs if (obs.needs_selection or obs.needs_l1) else None


def _spec(name: str, params: type) -> MethodSpec:
    preset = PRESETS[name]
    scope = {"magnitude-global": "global", "magnitude": "tensor-local", "outliers": "tensor-local"}.get(
        preset.prune, "elementwise")
    return MethodSpec(
        name, preset.summary, preset.paper, scope, params,  # type: ignore[arg-type]
        lambda b, d, p, c: _merge(name, preset, b, d, p, c),
        prepare=lambda p, stats, n: getattr(stats, "observed", None) or GtaObserver(preset, p, n),
        observer=lambda p, n, at=None: _needed(GtaObserver(preset, p, n, at)), sparsify=preset,
        row_blocks=lambda p: preset.prune == "magprune", epsilon=lambda p: 1e-5,
        per_tensor=lambda p: _per_tensor(preset, p), check=lambda p, n: _check_tie_break(name, preset, p))


def _check_tie_break(name: str, preset: Preset, p: Any) -> None:
    if preset.prune == "magnitude-global" and getattr(p, "tie_break", None) == "index":
        raise ConfigError(f"{name}: tie_break = index is not available for a whole-model threshold",
                          hint="ties_global keeps every |τ| equal to its threshold (the TIES authors' rule); use "
                               "ties for an exact k per tensor")


def _per_tensor(preset: Preset, p: Any) -> tuple[str, ...]:
    """What may vary per tensor: the weights and λ; the keep density and its companions unless the threshold is the
    whole model's (ties_global)."""
    names = ("weights", "scaling") if preset.prune == "magnitude-global" else (
        "weights", "scaling", "density", "p", "gamma", "epsilon")
    return tuple(n for n in names if hasattr(p, n))


METHODS = [
    _spec("ties", TiesParams), _spec("ties_global", TiesParams), _spec("dare_ta", DareParams),
    _spec("dare_ties", DareParams), _spec("breadcrumbs", BreadcrumbsParams),
    _spec("breadcrumbs_ties", BreadcrumbsParams), _spec("della", DellaParams), _spec("della_linear", DellaParams),
]
