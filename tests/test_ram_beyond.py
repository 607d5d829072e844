"""RAM+ presets beyond the paper (methods/ram_beyond.py, docs/methods.md): ``magnitude`` and ``sign-elect``, against
an independent float64 numpy reference written from docs/methods.md, on the fused and the torch path.

Tolerance: the engine computes each merged element in float32 with at most N + 3 rounded operations (N additions
of the sum, a multiplication by λ, a division by the count, the addition to the base) on values bounded by
|θ₀| + Σ_t λ_t |τ_t|; each rounding errs by at most 2⁻²⁴ of its result, so |engine − float64| ≤ (N + 3) · 2⁻²⁴ ·
(|θ₀| + Σ_t λ_t |τ_t|). λ itself is compared to 1e-12 relative (the engine's Σ|τ| are exact, numpy's float64 sums
err by ~1e-16 · n). Where the result is one agent's weights (N = 2, signs opposite) the output is checked bit for bit.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

import rlmerge
from conftest import TINY, load_output
from rlmerge.methods import REGISTRY
from rlmerge.methods.ram_beyond import MagnitudeSums
from rlmerge.methods.spec import BlockContext
from rlmerge.synthetic import config, random_base, write_checkpoint

EPS = 1e-5
PATHS = pytest.mark.parametrize("fast", ["1", "0"], ids=["fused", "torch"])


def _write(root: Path, taus: list[dict[str, np.ndarray]], seed: int = 0) -> tuple[Path, list[Path]]:
    """A float32 base (the tiny Qwen2 shape) and agents θ₀ + τ_t, stored in float32."""
    cfg = config(TINY, torch.float32)
    base = random_base(TINY, seed=seed)
    b = write_checkpoint(root / "base", base, cfg)
    agents = [write_checkpoint(root / f"agent{t}", {k: (v + torch.from_numpy(tau[k])).float()
                                                    for k, v in base.items()}, cfg)
              for t, tau in enumerate(taus)]
    return b, agents


def _sparse_taus(densities: tuple[float, ...], seed: int, shared_scale: float = 1.0) -> list[dict[str, np.ndarray]]:
    """Random sparse task vectors: a ``density`` fraction of elements moved by N(0, 1e-3²) (well above ε), the
    elements more than one agent moved × ``shared_scale`` (so that Σ|τ| and counts give different ratios)."""
    rng = np.random.default_rng(seed)
    shapes = {k: v.shape for k, v in random_base(TINY).items()}
    taus = [{k: ((rng.random(s) < d) * rng.normal(0.0, 1e-3, s)).astype(np.float32) for k, s in shapes.items()}
            for d in densities]
    for k in shapes:
        shared = sum((t[k] != 0).astype(int) for t in taus) >= 2
        for t in taus:
            t[k] = np.where(shared, t[k] * np.float32(shared_scale), t[k])
    return taus


def _reference(base: Path, agents: list[Path], preset: str, r: float, alpha: float
               ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], list[float], list[float]]:
    """(merged float64, error bound, λ, ρ) as docs/methods.md defines the preset, in float64 numpy."""
    b32 = {k: v.numpy() for k, v in load_output(base).items()}
    ags = [{k: v.numpy() for k, v in load_output(a).items()} for a in agents]
    n = len(ags)
    # τ_t = θ_t − θ₀ in float32, as every method defines it (docs/methods.md); everything after in float64
    taus = {k: np.stack([(a[k] - b32[k]).astype(np.float64) for a in ags]) for k in b32}
    b = {k: v.astype(np.float64) for k, v in b32.items()}
    shared_n, unique_n, shared_mag, unique_mag = np.zeros(n), np.zeros(n), np.zeros(n), np.zeros(n)
    for tau in taus.values():
        m = np.abs(tau) > EPS
        c = m.sum(0)
        for t in range(n):
            shared_n[t] += (m[t] & (c >= 2)).sum()
            unique_n[t] += (m[t] & (c == 1)).sum()
            shared_mag[t] += np.abs(tau[t])[m[t] & (c >= 2)].sum()
            unique_mag[t] += np.abs(tau[t])[m[t] & (c == 1)].sum()
    num, den = (shared_mag, unique_mag) if preset == "magnitude" else (shared_n, unique_n)
    rho = [math.inf if d == 0 and s > 0 else (0.0 if d == 0 else s / d) for s, d in zip(num, den)]
    lam = [1.0 + r * min(max(x, 0.0), alpha) for x in rho]
    out, bound = {}, {}
    for k, tau in taus.items():
        m = np.abs(tau) > EPS
        c = m.sum(0)
        active = np.where(m, tau, 0.0)
        unique = sum(lam[t] * active[t] for t in range(n))  # only one term is non-zero where c = 1
        if preset == "sign-elect":
            s = np.sign(active.sum(0))
            agree = m & (np.sign(tau) == s) & (s != 0)
            cnt = agree.sum(0)
            shared = np.where(cnt > 0, np.where(agree, tau, 0.0).sum(0) / np.maximum(cnt, 1), 0.0)
        else:
            shared = active.sum(0) / np.maximum(c, 1)
        out[k] = np.where(c == 0, b[k], b[k] + np.where(c >= 2, shared, unique))
        bound[k] = (n + 3) * 2.0**-24 * (np.abs(b[k]) + sum(lam[t] * np.abs(active[t]) for t in range(n)))
    return out, bound, lam, rho


def _check(tmp_path: Path, base: Path, agents: list[Path], preset: str, r: float, alpha: float, fast: str,
           monkeypatch: pytest.MonkeyPatch) -> tuple[rlmerge.MergeResult, dict[str, torch.Tensor]]:
    monkeypatch.setenv("RLMERGE_FAST", fast)
    res = rlmerge.merge(base, agents, tmp_path / "out", method="ram+",
                        params={"preset": preset, "r": r, "alpha": alpha}, dtype="float32", block_size=777, quiet=True)
    want, bound, lam, rho = _reference(base, agents, preset, r, alpha)
    got = load_output(tmp_path / "out")
    assert got.keys() == want.keys()
    for k in want:
        err = np.abs(got[k].double().numpy() - want[k])
        assert (err <= bound[k]).all(), (k, float(err.max()))
    assert res.lambdas is not None and res.rho is not None
    assert np.allclose(res.lambdas, lam, rtol=1e-12, atol=0.0), (res.lambdas, lam)
    assert [math.isinf(x) for x in res.rho] == [math.isinf(x) for x in rho]
    assert np.allclose([x for x in res.rho if not math.isinf(x)], [x for x in rho if not math.isinf(x)],
                       rtol=1e-12, atol=0.0)
    return res, got


@PATHS
@pytest.mark.parametrize("preset", ["magnitude", "sign-elect"])
def test_matches_the_float64_reference_on_random_sparse_agents(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               fast: str, preset: str) -> None:
    base, agents = _write(tmp_path / "in", _sparse_taus((0.05, 0.4, 0.6), seed=1, shared_scale=3.0))
    # r small and α large: λ = 1 + r·ρ unclipped, so the ratio itself is tested
    res, got = _check(tmp_path, base, agents, preset, 0.01, 1e6, fast, monkeypatch)
    # the oracle can fail: the preset is not the paper's RAM+ on these agents
    monkeypatch.setenv("RLMERGE_FAST", fast)
    paper = rlmerge.merge(base, agents, tmp_path / "paper", method="ram+",
                          params={"preset": "paper", "r": 0.01, "alpha": 1e6}, dtype="float32", quiet=True)
    if preset == "magnitude":
        assert all(abs(a - b) > 1e-4 for a, b in zip(res.lambdas, paper.lambdas))
    else:  # same λ, different shared elements (where active agents disagree in sign)
        assert res.lambdas == paper.lambdas
        other = load_output(tmp_path / "paper")
        assert any(not torch.equal(got[k], other[k]) for k in got)


def test_magnitude_ratio_does_not_depend_on_the_block_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base, agents = _write(tmp_path / "in", _sparse_taus((0.1, 0.3, 0.5), seed=2))
    monkeypatch.setenv("RLMERGE_FAST", "1")
    rhos = [rlmerge.merge(base, agents, tmp_path / f"out{b}", method="ram+", params={"preset": "magnitude"},
                          block_size=b, quiet=True).rho for b in (1 << 20, 777, 64)]
    assert rhos[0] == rhos[1] == rhos[2]


def test_magnitude_sums_are_exact() -> None:
    """Σ|τ| over shared and unique elements, split over blocks, equal math.fsum's correctly rounded sums exactly
    (values from subnormal to 1e30, where a float64 running sum would lose the small ones)."""
    rng = np.random.default_rng(3)
    n, size = 3, 5000
    mags = np.float32(10.0) ** rng.uniform(-44, 30, (n, size)).astype(np.float32)
    deltas = (mags * np.where(rng.random((n, size)) < 0.5, -1, 1) * (rng.random((n, size)) < 0.6)).astype(np.float32)
    sums = MagnitudeSums(0.0, n)
    for lo, hi in ((0, 1234), (1234, 4000), (4000, size)):
        ctx = BlockContext("w", lo, hi, (size,), (True,) * n, None, None)
        sums.observe(ctx, torch.zeros(hi - lo), torch.from_numpy(deltas[:, lo:hi]))
    shared, unique = sums.totals()
    active = np.abs(deltas) > 0
    c = active.sum(0)
    for t in range(n):
        assert shared[t] == math.fsum(np.abs(deltas[t][active[t] & (c >= 2)]).astype(np.float64))
        assert unique[t] == math.fsum(np.abs(deltas[t][active[t] & (c == 1)]).astype(np.float64))


@PATHS
@pytest.mark.parametrize("preset", ["magnitude", "sign-elect"])
def test_an_agent_identical_to_the_base(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fast: str,
                                        preset: str) -> None:
    taus = _sparse_taus((0.3, 0.0, 0.5), seed=4)
    base, agents = _write(tmp_path / "in", taus)
    res, _ = _check(tmp_path, base, agents, preset, 0.1, 2.0, fast, monkeypatch)
    assert res.lambdas[1] == 1.0 and res.rho[1] == 0.0
    assert any("agent1" in w and "identical to the base" in w for w in res.warnings)


@PATHS
@pytest.mark.parametrize("preset", ["magnitude", "sign-elect"])
def test_no_unique_elements(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fast: str, preset: str) -> None:
    """Every changed element is changed by all three agents: U_t = 0 < S_t, ρ = ∞, λ = 1 + r·α (unused)."""
    one = _sparse_taus((0.4,), seed=5)[0]
    rng = np.random.default_rng(6)
    taus = [{k: ((v != 0) * (1e-3 + rng.random(v.shape) * 1e-3) * rng.choice([-1.0, 1.0], v.shape)).astype(np.float32)
             for k, v in one.items()} for _ in range(3)]  # |τ| ≥ 1e-3: every agent moved every one of them
    base, agents = _write(tmp_path / "in", taus)
    res, _ = _check(tmp_path, base, agents, preset, 0.3, 2.0, fast, monkeypatch)
    assert all(math.isinf(x) for x in res.rho) and res.lambdas == [1.6, 1.6, 1.6]


@PATHS
def test_sign_elect_when_every_shared_element_disagrees(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        fast: str) -> None:
    """Two agents changing the same elements in opposite directions: each element takes the larger change, bit for
    bit θ₀ + τ₀ in float32 (the mean of one agent); an exact cancellation keeps the base's value (the
    paper's mean would give the midpoint in both cases)."""
    one = _sparse_taus((0.5,), seed=7)[0]
    rng = np.random.default_rng(8)
    mag = {k: ((v != 0) * (1e-3 + rng.random(v.shape) * 1e-3)).astype(np.float32) for k, v in one.items()}
    t0 = {k: m * (1 + rng.random(m.shape)).astype(np.float32) for k, m in mag.items()}  # |τ₀| > |τ₁| ≥ 1e-3
    base, agents = _write(tmp_path / "in", [t0, {k: -m for k, m in mag.items()}])
    _check(tmp_path, base, agents, "sign-elect", 0.1, 2.0, fast, monkeypatch)
    got = load_output(tmp_path / "out")
    b = {k: v.numpy() for k, v in load_output(base).items()}
    a0 = {k: v.numpy() for k, v in load_output(agents[0]).items()}
    for k in got:
        tau0 = a0[k] - b[k]  # float32, as the engine computes it
        want = np.where(mag[k] != 0, b[k] + tau0, b[k])
        assert np.array_equal(got[k].numpy().view(np.uint32), want.view(np.uint32)), k
    # exact cancellation: base 0.5, τ = ±2⁻⁸ (exact in float32), the elected sign is 0 and the base stays
    cancel = tmp_path / "cancel"
    name = "model.norm.weight"
    base_vals = load_output(base)
    base_vals[name] = torch.full_like(base_vals[name], 0.5)
    cfg = config(TINY, torch.float32)
    b2 = write_checkpoint(cancel / "base", base_vals, cfg)
    ags2 = []
    for t, sign in enumerate((1.0, -1.0)):  # every other tensor: both agents equal the base
        agent = dict(base_vals)
        agent[name] = base_vals[name] + sign * 2.0**-8
        ags2.append(write_checkpoint(cancel / f"agent{t}", agent, cfg))
    monkeypatch.setenv("RLMERGE_FAST", fast)
    rlmerge.merge(b2, ags2, cancel / "out", method="ram+", params={"preset": "sign-elect"}, dtype="float32", quiet=True)
    assert torch.equal(load_output(cancel / "out")[name], base_vals[name])


def test_each_preset_is_one_declaration_run_by_both_backends() -> None:
    """Both presets are ram+ presets with a rule (the fused kernels and the torch reference run it); only
    ``magnitude`` adds an observer (its Σ|τ| come from the statistics pass, which then runs on torch)."""
    spec = REGISTRY["ram+"]
    for preset in ("magnitude", "sign-elect"):
        p = spec.parse({"preset": preset})
        assert (p.r, p.alpha) == (0.1, 2.0)
        assert spec.program(p, 3) is not None
    assert isinstance(spec.observer(spec.parse({"preset": "magnitude"}), 3), MagnitudeSums)
    assert spec.observer(spec.parse({"preset": "sign-elect"}), 3) is None
    assert spec.observer(spec.parse({"preset": "paper"}), 3) is None
