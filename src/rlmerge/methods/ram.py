"""RAM and RAM+ (Yuan et al., "Behavior Knowledge Merge in Reinforced Agentic Models", arXiv 2601.13572).

Elementwise rule (paper Eq. 4–6; ../shared/docs/ram-method.md):
    τ_i = 0                              if no agent changed i (|τ_t,i| ≤ ε for all t)
        = λ_t · τ_t,i                    if only agent t changed i (unique)
        = (1/c_i) Σ_{t active} τ_t,i     if c_i ≥ 2 agents changed i (mean over ACTIVE agents, not N)
RAM has λ_t = 1 and is elementwise. RAM+ rescales unique elements by λ_t computed from the overlap-unique
ratio ρ_t = shared_t / unique_t over the WHOLE model (a statistics pass), except the ``tensor-local``
preset, which reproduces mergekit's ``ramplus_tl`` with ρ per tensor. Two presets go beyond the paper
(methods/ram_beyond.py): ``magnitude`` (ρ from Σ|τ| instead of counts) and ``sign-elect`` (TIES's sign
election on the shared elements instead of the mean).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from ..errors import ConfigError
from ..params import check_range, flag
from ..stats import Statistics, TensorStats, overlap_ratio
from .interface import Rows
from .ram_beyond import MagnitudeSums, magnitude_rho, paper_lambda, sign_elected_mean
from .rule import Expr, Terms
from .spec import MethodSpec

Preset = Literal["paper", "paper-soft", "official", "tensor-local", "arm-r", "magnitude", "sign-elect"]
PAPER = "arXiv:2601.13572"

GLOBAL_PRESETS = ("paper", "paper-soft", "official")  # the presets whose λ is the whole model's (inspect shows them)
# Which knobs each preset reads, and its defaults (paper Eq. 6; appendix; authors' script; mergekit).
PRESETS: dict[str, dict[str, float]] = {
    "paper": {"r": 0.1, "alpha": 2.0},
    "paper-soft": {"r": 0.1},
    "official": {"rescale_factor": 1.2},
    "tensor-local": {"r": 0.1, "alpha": 0.2},
    "arm-r": {"rescale_factor": 1.2},
    "magnitude": {"r": 0.1, "alpha": 2.0},  # beyond the paper: ρ from Σ|τ| (methods/ram_beyond.py)
    "sign-elect": {"r": 0.1, "alpha": 2.0},  # beyond the paper: shared elements sign-elected, disjoint mean
}


@dataclass(frozen=True)
class RamParams:
    """RAM: λ = 1. ``epsilon``: an element counts as changed when |τ| > ε (strictly)."""

    epsilon: float = 1e-5

    def __post_init__(self) -> None:
        check_range("ram", "epsilon", self.epsilon, 0.0, 1.0)


@dataclass(frozen=True)
class RamPlusParams:
    """RAM+: ``preset`` picks the λ formula; unset knobs take the preset's defaults.

    paper:        λ = 1 + r·clip(ρ, 0, α)            r = 0.1, α = 2.0
    paper-soft:   λ = 1 + r·ρ/(1+ρ)                  r = 0.1
    official:     λ = 1 + (R−1)·min(1, ρ), R ≥ 1     R = rescale_factor = 1.2 (authors' arm-r-v2)
    tensor-local: paper formula, ρ per tensor        r = 0.1, α = 0.2 (mergekit ramplus_tl)
    arm-r:        λ = 1 + (R−1)·clip(shared/changed, 0, 1), R ≥ 1   R = 1.2 (authors' earlier arm-r)
    magnitude:    paper formula, ρ = Σ|τ| shared / Σ|τ| unique       r = 0.1, α = 2.0 (beyond the paper)
    sign-elect:   paper formula; shared elements: TIES sign election, mean of the agreeing agents (beyond)
    """

    preset: Preset = field(default="paper", metadata=flag(f"RAM+: {', '.join(PRESETS)}"))
    r: float | None = field(default=None, metadata=flag("RAM+ strength r (paper: 0.1)"))
    alpha: float | None = field(default=None, metadata=flag("RAM+ clip α on ρ (paper: 2.0)"))
    rescale_factor: float | None = field(default=None, metadata=flag("RAM+ official preset's R (1.2)"))
    epsilon: float = field(default=1e-5, metadata=flag("changed means |τ| > eps (1e-5)", name="--eps"))

    def __post_init__(self) -> None:
        defaults = PRESETS.get(self.preset)
        if defaults is None:
            raise ConfigError(f"unknown RAM+ preset {self.preset!r}", hint=f"choose one of: {', '.join(PRESETS)}")
        for knob in ("r", "alpha", "rescale_factor"):
            value = getattr(self, knob)
            if value is not None and knob not in defaults:
                uses = ", ".join(defaults)
                raise ConfigError(f"ram+: {knob} does not apply to preset {self.preset!r} (it uses {uses})",
                                  hint="drop it, or pick the preset that uses it")
            if value is None and knob in defaults:
                object.__setattr__(self, knob, defaults[knob])
        if self.r is not None:
            check_range("ram+", "r", self.r, 0.0, 10.0)
        if self.alpha is not None:
            check_range("ram+", "alpha", self.alpha, 0.0, 1e6)
        if self.rescale_factor is not None:
            check_range("ram+", "rescale_factor", self.rescale_factor, 0.0, 10.0, lo_open=True)
        check_range("ram+", "epsilon", self.epsilon, 0.0, 1.0)


@dataclass(frozen=True)
class UniqueParams:
    """The paper's unique-region probe (Fig. 3): base + one agent's unique elements, nothing else."""

    agent: int = 0  # index of the agent among those given (0-based)
    divide_by_n: bool = False  # scale by 1/N, as averaging would
    epsilon: float = 1e-5

    def __post_init__(self) -> None:
        check_range("unique", "epsilon", self.epsilon, 0.0, 1.0)
        if self.agent < 0:
            raise ConfigError(f"unique: agent = {self.agent} must be ≥ 0")


def rescale_factor(params: RamPlusParams, shared: int, unique: int) -> float:
    """λ for one agent from its shared/unique counts (whole model, or one tensor for tensor-local)."""
    rho = overlap_ratio(shared, unique)
    changed = shared + unique
    share = shared / changed if changed else 0.0  # = ρ/(1+ρ), finite at ρ = ∞; 0 for an agent that changed nothing
    if params.preset == "paper-soft":
        return 1.0 + params.r * share
    if params.preset in ("official", "arm-r"):  # 1 + (R − 1)·x, R ≥ 1
        x = min(1.0, rho) if params.preset == "official" else min(max(share, 0.0), 1.0)
        return 1.0 + (max(params.rescale_factor, 1.0) - 1.0) * x
    return paper_lambda(params.r, params.alpha, rho)  # paper, tensor-local, sign-elect; ρ = ∞ → α


@dataclass(frozen=True)
class Lambdas:
    """What RAM+ prepares from the whole-model counts: λ_t and the ρ_t it came from, per agent."""

    lambdas: tuple[float, ...]  # per agent (tensor-local: unused, computed per tensor)
    rho: tuple[float, ...]
    warnings: tuple[str, ...] = ()


def prepare_ram_plus(params: RamPlusParams, stats: Statistics | None, n_agents: int) -> Lambdas:
    if stats is None:
        raise RuntimeError("ram+ ran without its statistics pass")
    warnings = stats.identical_agents()
    if params.preset == "magnitude":  # ρ from the observer's exact Σ|τ| (methods/ram_beyond.py)
        rho = magnitude_rho(stats.observed)
        return Lambdas(tuple(paper_lambda(params.r, params.alpha, x) for x in rho), tuple(rho), tuple(warnings))
    if params.preset in ("official", "arm-r") and params.rescale_factor is not None and params.rescale_factor < 1:
        warnings.append(f"ram+ {params.preset}: rescale_factor {params.rescale_factor:g} is below 1, and R counts as 1 "
                        "there (the authors' script raises it to 1): every λ is 1, plain RAM; give R ≥ 1 to rescale")
    lambdas = tuple(rescale_factor(params, int(s), int(u)) for s, u in zip(stats.shared, stats.unique))
    return Lambdas(lambdas, tuple(stats.rho), tuple(warnings))


def _counted(t: Terms, extra: Any = None) -> tuple[Expr, Expr, Expr | None]:
    """(c, Σ active τ, Σ active τ × λ) in agent order, each sum from zero: the element's count of agents that
    changed it (|τ| > ε), their total, and (``extra`` = per-agent λ) their rescaled total."""
    zero, one = t.lit(0.0), t.lit(1.0)
    c = total = zero
    scaled = zero if extra is not None else None
    for i, x in enumerate(t.x):
        k = abs(x) > t.const.eps
        c = c + t.where(k, one, zero)
        total = total + t.where(k, x, zero)
        if scaled is not None:
            scaled = scaled + t.where(k, x * extra[i], zero)
    return c, total, scaled


def ram_rule(t: Terms, p: Any) -> Expr:
    """Paper Eq. 4: the mean over the agents that changed an element; one agent's τ whole; the base's bits where
    none did (not base + 0, which would turn −0 into +0)."""
    c, total, _ = _counted(t)
    mean = total / t.where(c > t.lit(1.0), c, t.lit(1.0))
    merged = t.b + t.where(c >= t.lit(2.0), mean, total)
    return t.where(c.eq(t.lit(0.0)), t.b, merged)


def ram_plus_rule(t: Terms, p: Any) -> Expr:
    """RAM with the single active agent's τ × λ_t (paper Eq. 5–6); preset ``sign-elect``: the shared elements
    take the mean of the agents agreeing with the elected sign (methods/ram_beyond.py)."""
    c, total, scaled = _counted(t, t.agent.lam)
    mean = (sign_elected_mean(t, total) if p.preset == "sign-elect"
            else total / t.where(c > t.lit(1.0), c, t.lit(1.0)))
    merged = t.b + t.where(c >= t.lit(2.0), mean, scaled)
    return t.where(c.eq(t.lit(0.0)), t.b, merged)


def unique_rule(t: Terms, p: UniqueParams) -> Expr:
    """The base, plus agent ``p.agent``'s τ (× ``scale``) where it alone changed the element."""
    c, _, _ = _counted(t)
    x = t.x[p.agent]
    only = (abs(x) > t.const.eps) & c.eq(t.lit(1.0))
    return t.where(only, t.b + x * t.const.scale, t.b)


def _ram_constants(p: RamParams, prepared: Any, ts: TensorStats | None, n: int, name: str) -> dict[str, Any]:
    return {"eps": p.epsilon}


class RamPlus(MethodSpec):
    """RAM+: λ_t from the whole model's counts (``prepare``), read by ``ram_plus_rule`` as ``t.agent.lam``
    (``_constants``), reported per agent (``report``). Preset ``tensor-local`` computes λ per tensor instead;
    ``magnitude`` takes ρ from its observer's exact Σ|τ|."""

    def needs_stats(self, p: RamPlusParams) -> bool:
        return True

    def observer(self, p: RamPlusParams, n: int, at: Any = None) -> MagnitudeSums | None:
        return MagnitudeSums(p.epsilon, n) if p.preset == "magnitude" else None

    def prepare(self, p: RamPlusParams, stats: Statistics | None, n: int) -> Lambdas:
        return prepare_ram_plus(p, stats, n)

    def per_tensor(self, p: RamPlusParams) -> tuple[str, ...]:
        return ("r", "alpha") if p.preset == "tensor-local" else ()

    def report(self, p: RamPlusParams, prepared: Any, observer: Any, stats: Statistics) -> Rows:
        return Rows(lambdas=list(prepared.lambdas), rho=list(prepared.rho), warnings=prepared.warnings)

    def inspect(self, stats: Statistics) -> dict[str, list[Any]]:
        """Per agent, λ for each whole-model preset with its default knobs at the statistics' ε (``ram_plus``),
        and tensor-local's λ over the tensors (``ram_plus_tensor_local``): docs/inspect.md."""
        lam = [{p: rescale_factor(RamPlusParams(preset=p, epsilon=stats.epsilon), int(s), int(u))
                for p in GLOBAL_PRESETS} for s, u in zip(stats.shared, stats.unique)]
        return {"ram_plus": lam, "ram_plus_tensor_local": _tensor_local(stats)}


def _tensor_local(stats: Statistics) -> list[dict[str, Any]]:
    """tensor-local λ (mergekit's ramplus_tl): per agent, over the tensors where it has unique elements."""
    params = RamPlusParams(preset="tensor-local", epsilon=stats.epsilon)
    out = []
    for t in range(stats.n_agents):
        lams, weights = [], []
        for ts in stats.tensors.values():
            u = int(ts.unique[t])
            if u:
                lams.append(rescale_factor(params, int(ts.shared[t]), u))
                weights.append(u * ts.weight)
        eff = float(np.dot(lams, weights) / sum(weights)) if weights else None
        out.append({"r": params.r, "alpha": params.alpha, "lambda_effective": eff,
                    "lambda_min": min(lams) if lams else None, "lambda_max": max(lams) if lams else None})
    return out


def _ram_plus_constants(p: RamPlusParams, prepared: Lambdas, ts: TensorStats | None, n: int,
                        name: str) -> dict[str, Any]:
    if p.preset == "tensor-local":
        if ts is None:
            raise RuntimeError("ram+ tensor-local ran without its statistics pass")
        lam = [rescale_factor(p, int(s), int(u)) for s, u in zip(ts.shared, ts.unique)]
    else:
        lam = list(prepared.lambdas)
    return {"eps": p.epsilon, "lam": lam}


def _unique_constants(p: UniqueParams, prepared: Any, ts: TensorStats | None, n: int, name: str) -> dict[str, Any]:
    return {"eps": p.epsilon, "scale": np.float32(1.0 / n if p.divide_by_n else 1.0)}


def _check_unique(params: UniqueParams, n: int) -> None:
    if params.agent >= n:
        raise ConfigError(f"unique: agent = {params.agent} but only {n} agent(s) were given",
                          hint=f"agents are numbered from 0: choose 0 … {n - 1}")



METHODS = [
    MethodSpec("ram", "RAM: mean over the agents that changed an element; unique elements kept whole",
               PAPER, "elementwise", RamParams, rule=ram_rule, constants=_ram_constants),
    RamPlus("ram+", "RAM+: RAM with each agent's unique elements rescaled by λ from the overlap ratio ρ",
            PAPER, "global", RamPlusParams, rule=ram_plus_rule, constants=_ram_plus_constants, float32_output=True,
            unique_scale="lam"),
    MethodSpec("unique", "base + one agent's unique elements only, at full size or divided by N (paper Fig. 3)",
               PAPER, "elementwise", UniqueParams, rule=unique_rule, constants=_unique_constants,
               checks=_check_unique),
]

__all__ = ["METHODS", "PRESETS", "RamParams", "RamPlus", "RamPlusParams", "UniqueParams", "ram_plus_rule", "ram_rule",
           "rescale_factor"]
