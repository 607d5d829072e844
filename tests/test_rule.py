"""The rule language (methods/rule.py) and its numba form (kernels/fused.py): the same bytes from both backends.

Literals are written into the generated loop exactly (±inf, values with no short decimal form), and the order
statistics built from selects (``sort``, ``kth``) agree with an obviously-correct numpy loop.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from rlmerge.methods.rule import network, torch_eval, trace

numba = pytest.importorskip("numba")
torch = pytest.importorskip("torch")

from rlmerge import kernels  # noqa: E402


def _both(rule, n: int, base: np.ndarray, agents: np.ndarray, values: dict | None = None) -> tuple[np.ndarray, ...]:
    """The rule's merged float32 values from the numba kernel and from the torch reference."""
    prog = trace(rule, None, n)
    consts, agent_consts = prog.arrays(values or {})
    out = np.zeros_like(base)
    kernels.fused_range(prog, base, tuple(agents), 0, base.shape[0], np.float32(0), consts, agent_consts, out,
                        None, None)
    ref = torch_eval(prog, torch.from_numpy(base), torch.from_numpy(agents - base),
                     values or {})
    return out, ref.numpy()


def test_literals_are_exact_inf_and_a_non_round_constant() -> None:
    """``t.lit(inf)`` compiled to a NameError (the generator wrote repr(inf)); 0.1 must be float32(0.1) exactly."""
    def rule(t, p):  # type: ignore[no-untyped-def]
        capped = t.where(abs(t.x[0]) > t.lit(0.5), t.lit(math.inf), t.x[0] * t.lit(0.1))
        return t.b + t.where(t.x[1] < t.lit(-math.inf), t.lit(1.0), capped) + t.lit(-0.0) * t.lit(1 / 3)

    rng = np.random.default_rng(1)
    base = rng.normal(size=4096).astype(np.float32)
    agents = (base + rng.normal(size=(2, 4096)).astype(np.float32)).astype(np.float32)
    fast, ref = _both(rule, 2, base, agents)
    tau = agents - base
    want = np.where(np.abs(tau[0]) > np.float32(0.5), np.float32(np.inf), tau[0] * np.float32(0.1)) + base
    assert np.isinf(fast).any() and fast.tobytes() == ref.tobytes() == want.astype(np.float32).tobytes()


def test_the_sorting_network_sorts_every_zero_one_input() -> None:
    """The 0–1 principle: a comparator network that sorts every 0/1 input sorts every input."""
    for n in range(1, 9):
        for code in range(1 << n):
            v = [(code >> i) & 1 for i in range(n)]
            for i, j in network(n):
                if v[j] < v[i]:
                    v[i], v[j] = v[j], v[i]
            assert v == sorted(v), (n, code)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_kth_over_the_agents_a_predicate_selects(n: int) -> None:
    """Per element, the k-th smallest τ over the agents with τ > 0, k = the element's count − 1 (the largest) and
    k = 0 (the smallest); +inf where none is selected. Against a numpy loop, on both backends."""
    def rule(t, p):  # type: ignore[no-untyped-def]
        pos = [x > t.lit(0.0) for x in t.x]
        c = t.count(pos)
        top = t.kth(t.x, t.where(c > t.lit(0.0), c - t.lit(1.0), t.lit(0.0)), where=pos)
        return t.where(c.eq(t.lit(0.0)), t.b, top - t.kth(t.x, 0, where=pos))

    rng = np.random.default_rng(n)
    m = 3000
    base = rng.normal(size=m).astype(np.float32)
    tau = rng.normal(size=(n, m)).astype(np.float32)
    tau[:, :50] = -1.0  # no agent selected
    agents = base + tau
    fast, ref = _both(rule, n, base, agents)
    want = np.empty(m, dtype=np.float32)
    t32 = agents - base  # the τ both backends see
    for i in range(m):
        chosen = sorted(float(x) for x in t32[:, i] if x > 0)
        want[i] = base[i] if not chosen else np.float32(chosen[-1]) - np.float32(chosen[0])
    assert fast.tobytes() == ref.tobytes() == want.tobytes()
