"""median_active: per element, the median of the agents' task vectors over the agents that changed it.

    τ_i = the lower median of {τ_t,i : |τ_t,i| > ε}      (an even count: the lower of the two middle values)
    θ_i = θ₀,i + τ_i, or θ₀,i itself where no agent changed it

An example of a method declared outside rlmerge, exactly as one inside it is: one file, one ``METHODS`` list. Its
rule (rlmerge.methods.rule) is written once; the torch reference evaluates it on blocks and the numba backend
compiles it into its fused loop, and both write the same bytes. Use it with

    RLMERGE_PLUGINS=examples/plugins/median_active.py rlmerge merge BASE AGENT... -o OUT --method median_active

or install it and name it in your distribution's entry points (``[project.entry-points."rlmerge.methods"]``,
``median_active = "your_module"``). Elementwise: no statistics pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlmerge.methods import Expr, MethodSpec, Terms
from rlmerge.params import check_range


@dataclass(frozen=True)
class MedianActiveParams:
    epsilon: float = 1e-5  # an agent changed an element when |τ| > ε (strictly), as RAM's

    def __post_init__(self) -> None:
        check_range("median_active", "epsilon", self.epsilon, 0.0, 1.0)


def median_active_rule(t: Terms, p: MedianActiveParams) -> Expr:
    changed = [abs(x) > t.const.eps for x in t.x]
    c = t.count(changed)
    # the lower median's place among the c changed values, from 0: ⌊(c − 1) / 2⌋ = [c ≥ 3] + [c ≥ 5] + …
    k = t.count([c >= t.lit(2 * j + 1) for j in range(1, (t.n + 1) // 2)])
    median = t.kth(t.x, k, where=changed)  # the unchanged agents sort last, as +inf
    return t.where(c.eq(t.lit(0.0)), t.b, t.b + median)


def _constants(p: MedianActiveParams, prepared: Any, ts: Any, n: int, name: str) -> dict[str, Any]:
    return {"eps": p.epsilon}


METHODS = [
    MethodSpec("median_active", "the lower median of the agents' τ over those that changed the element",
               "rlmerge example plugin (examples/plugins/median_active.py)", "elementwise", MedianActiveParams,
               rule=median_active_rule, constants=_constants),
]
