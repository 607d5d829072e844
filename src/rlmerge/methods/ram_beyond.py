"""Two RAM+ presets beyond the paper (issue 17, item 4), each dropping one assumption the paper lists as a limitation.

``magnitude``: the overlap ratio from importance by |τ| instead of element counts (the paper's λ rests on an
isotropic-importance assumption: every changed element counts the same). Over the whole model, with m_t,i =
[|τ_t,i| > ε] and c_i = Σ_t m_t,i,

    S_t = Σ_{i: m_t,i, c_i ≥ 2} |τ_t,i|,   U_t = Σ_{i: m_t,i, c_i = 1} |τ_t,i|,   ρ^|τ|_t = S_t / U_t,
    λ_t = 1 + r · clip(ρ^|τ|_t, 0, α)        (r = 0.1, α = 2; ρ = ∞ when U_t = 0 < S_t, 0 when both are 0)

The sums are exact: each |τ| (a float32) is a 24-bit integer times a power of two, so per agent, region and
binary exponent the integers are summed exactly (int64), and the totals are rounded once. The ratio is then the
same whatever the block size, thread count or tensor order, as the counts' ρ is.

``sign-elect``: on the shared elements (c_i ≥ 2), the sign is elected as TIES does, s_i = sign(Σ_{t active}
τ_t,i) (the float32 sum in agent order), and only the active agents that agree with it strictly are averaged
(the disjoint mean); s_i = 0 gives τ_i = 0. The paper averages every active agent, which assumes the agents
that changed an element moved it compatibly; its stated limitation is that such shared-region collisions grow
with N. Unique elements: λ_t · τ_t,i with the ``paper`` λ (counts), so r = 0 is RAM with the election.
"""

from __future__ import annotations

import math

import numpy as np

from .._torch import torch
from .interface import BlockContext, Observer
from .rule import Expr, Terms

_EXPONENTS = 256  # float32 biased exponents; subnormals (0) share the scale of exponent 1


class MagnitudeSums(Observer):
    """Statistics-pass observer of preset ``magnitude``: per agent, the exact Σ|τ| over its shared elements and
    over its unique elements (a tied tensor counted twice when the statistics count it twice)."""

    def __init__(self, epsilon: float, n: int) -> None:
        self.epsilon, self.n = epsilon, n
        # [agent, region (0 shared, 1 unique), exponent]: Σ of 24-bit significands, exact in int64 up to 2^39 values
        self._acc = np.zeros((n, 2, _EXPONENTS), dtype=np.int64)

    def observe(self, ctx: BlockContext, base: torch.Tensor, deltas: torch.Tensor) -> None:
        mag = deltas.abs()
        active = mag > self.epsilon  # [N, n]
        c = active.sum(0)
        region = torch.where(c >= 2, 0, 1).expand_as(active)  # [N, n]: 0 shared, 1 unique (where active)
        agent = torch.arange(self.n, device=deltas.device).unsqueeze(1).expand_as(active)
        bits = mag[active].cpu().numpy().astype(np.float32, copy=False).view(np.uint32)
        exp = (bits >> np.uint32(23)).astype(np.int64)
        significand = (bits & np.uint32(0x7FFFFF)).astype(np.int64) + np.where(exp > 0, 1 << 23, 0)
        key = ((agent[active].cpu().numpy() * 2 + region[active].cpu().numpy()) * _EXPONENTS
               + np.maximum(exp, 1))
        # float64 bincount of integers < 2^24: exact while a block holds fewer than 2^29 values per bucket
        sums = np.bincount(key, weights=significand.astype(np.float64), minlength=self.n * 2 * _EXPONENTS)
        weight = ctx.tensor_stats.weight if ctx.tensor_stats is not None else 1
        self._acc += weight * sums.astype(np.int64).reshape(self.n, 2, _EXPONENTS)

    def again(self, name: str | None) -> bool:
        return False  # one look at each block is enough

    def totals(self) -> tuple[list[float], list[float]]:
        """(S_t, U_t) per agent: Σ significand · 2^(exponent − 150), each rounded once to float64."""
        out: list[list[float]] = [[], []]
        for t in range(self.n):
            for region in (0, 1):
                exact = sum(int(v) << int(e) for e, v in enumerate(self._acc[t, region]) if v)
                out[region].append(math.ldexp(float(exact), -150) if exact else 0.0)
        return out[0], out[1]


def magnitude_rho(sums: MagnitudeSums) -> list[float]:
    """ρ^|τ|_t = S_t / U_t, with the counts' edge cases (∞ when U_t = 0 < S_t, 0 when both are 0)."""
    shared, unique = sums.totals()
    return [math.inf if u == 0.0 and s > 0.0 else (0.0 if u == 0.0 else s / u) for s, u in zip(shared, unique)]


def paper_lambda(r: float, alpha: float, rho: float) -> float:
    """The paper's Eq. 6 on any ratio: 1 + r · clip(ρ, 0, α) (ρ = ∞ gives 1 + r·α)."""
    return 1.0 + r * min(max(rho, 0.0), alpha)


def sign_elected_mean(t: Terms, total: Expr) -> Expr:
    """The mean of the active agents whose τ agrees strictly in sign with ``total`` (Σ active τ); 0 when none does
    (``total`` is 0). Every active agent with a positive τ agrees with a positive total, so none agreeing means
    the sum cancelled exactly."""
    return agreeing_mean(t, t.x, [abs(x) > t.const.eps for x in t.x], total)


def agreeing_mean(t: Terms, values: list[Expr], keeps: list[Expr], sign: Expr) -> Expr:
    """The mean of the ``values`` that are kept and agree strictly in sign with ``sign``, in agent order; 0 where
    none does: the disjoint mean of a sign election (sign-elect here, arm-ties' shared region)."""
    zero, one = t.lit(0.0), t.lit(1.0)
    agreed = count = zero
    for v, k in zip(values, keeps):
        agree = k & (((v > zero) & (sign > zero)) | ((v < zero) & (sign < zero)))
        agreed = agreed + t.where(agree, v, zero)
        count = count + t.where(agree, one, zero)
    return t.where(count > zero, agreed / t.where(count > zero, count, one), zero)


__all__ = ["MagnitudeSums", "agreeing_mean", "magnitude_rho", "paper_lambda", "sign_elected_mean"]
