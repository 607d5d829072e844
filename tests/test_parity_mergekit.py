"""Parity with mergekit 0.1.5, run as a separate program on the same tiny float32 checkpoints.

Deterministic methods: the same recipe through ``rlmerge merge --recipe`` and through mergekit must agree to
float32 rounding (each tensor's max |difference| ≤ a few ulps of its largest value). Random methods (DARE,
DELLA) cannot agree bit for bit (different generators), so both outputs are checked against the method's law:
the kept fraction, the rank-dependence of DELLA's keep probability, and mergekit's per-tensor L1 rescale.
All mergekit merges run in one subprocess (its import alone takes seconds).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from conftest import MERGEKIT_PY, TINY, load_output, run_mergekit
from rlmerge.cli import main as cli_main
from rlmerge.synthetic import config, perturb, random_base, write_checkpoint

pytestmark = pytest.mark.skipif(not MERGEKIT_PY.exists(),
                                reason="mergekit is not installed: run `make mergekit` (creates .venv-mergekit)")
ULP = 2.0 ** -23


def _models(root: Path) -> dict[str, str]:
    """float32 base, three sparse agents (the paper's densities) and one dense agent."""
    cfg = config(TINY, torch.float32)
    base = random_base(TINY, seed=7)
    paths = {"base": write_checkpoint(root / "base", base, cfg, tokenizer=False)}
    for i, (name, d) in enumerate([("coder", 0.032), ("tools", 0.462), ("memory", 0.543), ("dense", 1.0)]):
        paths[name] = write_checkpoint(root / name, perturb(base, d, seed=20 + i, dtype=torch.float32), cfg,
                                       tokenizer=False)
    return {k: str(v) for k, v in paths.items()}


def _recipe(method: str, models: list[tuple[str, dict]], params: dict | None = None, base: str | None = "base"
            ) -> dict:
    doc: dict = {"merge_method": method, "models": [{"model": m, "parameters": p} if p else {"model": m}
                                                     for m, p in models],
                 "dtype": "float32", "out_dtype": "float32"}
    if base:
        doc["base_model"] = base
    if params:
        doc["parameters"] = params
    return doc


SPARSE = ["coder", "tools", "memory"]
DETERMINISTIC = {
    "task_arithmetic": _recipe("task_arithmetic", [(m, {"weight": w}) for m, w in zip(SPARSE, (1.0, 0.5, 1.0))],
                               {"lambda": 0.7}),
    "ties": _recipe("ties", [(m, {"weight": w, "density": d}) for m, w, d in
                             zip(SPARSE, (1.0, 0.7, 1.0), (0.3, 0.2, 0.5))], {"lambda": 0.8}),
    "ties_sum": _recipe("ties", [(m, {"weight": 1.0}) for m in SPARSE],
                        {"density": 0.1, "normalize": False, "int8_mask": True}),
    "breadcrumbs": _recipe("breadcrumbs", [(m, {"weight": w}) for m, w in zip(SPARSE, (1.0, 0.5, 0.8))],
                           {"density": 0.9, "gamma": 0.01}),
    "breadcrumbs_ties": _recipe("breadcrumbs_ties", [(m, {"weight": 1.0, "density": d}) for m, d in
                                                     zip(SPARSE, (0.2, 0.4, 0.3))], {"gamma": 0.05}),
    "model_stock": _recipe("model_stock", [(m, {}) for m in SPARSE]),
    "model_stock_filter_wise": _recipe("model_stock", [(m, {}) for m in SPARSE], {"filter_wise": True}),
    "slerp": _recipe("slerp", [("coder", {}), ("tools", {})], {"t": 0.3}, base="coder"),
    "linear": _recipe("linear", [(m, {"weight": w}) for m, w in zip(SPARSE, (1.0, 2.0, 3.0))], base=None),
    "ram": _recipe("ram", [(m, {}) for m in SPARSE]),
    "ramplus_tl": _recipe("ramplus_tl", [(m, {}) for m in SPARSE], {"r": 0.1, "alpha": 0.2}),
}
RANDOM = {
    "dare_linear": _recipe("dare_linear", [("dense", {"weight": 1.0, "density": 0.3})], {"rescale": True}),
    "dare_ties": _recipe("dare_ties", [("dense", {"weight": 1.0, "density": 0.6})], {"rescale": True}),
    "della": _recipe("della", [("dense", {"weight": 1.0, "density": 0.5, "epsilon": 0.2})], {"rescale": True}),
}


def _resolve(doc: dict, paths: dict[str, str]) -> dict:
    doc = json.loads(json.dumps(doc))
    if doc.get("base_model"):
        doc["base_model"] = paths[doc["base_model"]]
    for m in doc["models"]:
        m["model"] = paths[m["model"]]
    return doc


@pytest.fixture(scope="module")
def parity(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path, dict[str, str]]]:
    """Every recipe merged by mergekit (one subprocess) and by `rlmerge merge --recipe`."""
    root = tmp_path_factory.mktemp("parity")
    paths = _models(root / "in")
    jobs, out = [], {}
    for name, doc in {**DETERMINISTIC, **RANDOM}.items():
        recipe = root / f"{name}.yml"
        recipe.write_text(yaml.safe_dump(_resolve(doc, paths)))
        jobs.append({"recipe": str(recipe), "out": str(root / f"mk-{name}"), "seed": 1})
        code = cli_main(["merge", "--recipe", str(recipe), "-o", str(root / f"rl-{name}"), "-q", "--seed", "1"])
        assert code == 0, name
        out[name] = (root / f"rl-{name}", root / f"mk-{name}", paths)
    run_mergekit(jobs, root, timeout=600)
    return out


@pytest.mark.parametrize("name", sorted(DETERMINISTIC))
def test_deterministic_methods_match_mergekit(parity, name: str) -> None:
    ours_dir, theirs_dir, _ = parity[name]
    ours, theirs = load_output(ours_dir), load_output(theirs_dir)
    assert set(ours) <= set(theirs)
    worst = 0.0
    for k, t in ours.items():
        ref = theirs[k]
        assert t.dtype == ref.dtype == torch.float32 and t.shape == ref.shape, k
        diff = float((t - ref).abs().max())
        scale = float(ref.abs().max())
        worst = max(worst, diff / (scale * ULP) if scale else diff)
        assert diff <= 8 * ULP * scale, f"{name} {k}: max |diff| {diff:.3g} vs scale {scale:.3g}"
    print(f"{name}: worst difference {worst:.2f} ulp of the tensor's max")


def _kept(out: dict, base: dict, agent: dict) -> tuple[int, int, list[tuple[torch.Tensor, torch.Tensor]]]:
    """(kept, total, per tensor (τ, merged τ)) over float tensors, kept meaning the output moved."""
    kept = total = 0
    pairs = []
    for k, b in base.items():
        tau, got = agent[k] - b, out[k] - b
        kept += int((got != 0).sum())
        total += b.numel()
        pairs.append((tau, got))
    return kept, total, pairs


@pytest.mark.parametrize(("name", "density"), [("dare_linear", 0.3), ("dare_ties", 0.6), ("della", 0.5)])
def test_random_methods_follow_the_same_law_as_mergekit(parity, name: str, density: float) -> None:
    ours_dir, theirs_dir, paths = parity[name]
    base, agent = load_output(Path(paths["base"])), load_output(Path(paths["dense"]))
    for out_dir in (ours_dir, theirs_dir):
        out = load_output(out_dir)
        kept, total, pairs = _kept(out, base, agent)
        sigma = math.sqrt(density * (1 - density) / total)
        assert abs(kept / total - density) < 6 * sigma, (out_dir.name, kept / total)
        for tau, got in pairs:  # rescale: true is mergekit's per-tensor L1 match, in both
            m = got != 0
            if not bool(m.any()):
                continue
            factor = float(tau.abs().sum()) / float((tau * m).abs().sum())
            ratio = got[m] / tau[m]
            assert torch.allclose(ratio, torch.full_like(ratio, factor), rtol=1e-5), out_dir.name


def test_della_keeps_large_magnitudes_more_often_like_mergekit(parity) -> None:
    """MagPrune: keep probability rises from density − ε (smallest in a row) to density + ε (largest)."""
    ours_dir, theirs_dir, paths = parity["della"]
    base, agent = load_output(Path(paths["base"])), load_output(Path(paths["dense"]))
    for out_dir in (ours_dir, theirs_dir):
        out = load_output(out_dir)
        top = bottom = n_top = n_bottom = 0
        for k, b in base.items():
            tau, got = (agent[k] - b).reshape(b.shape[0] if b.dim() > 1 else 1, -1), (out[k] - b).reshape(
                b.shape[0] if b.dim() > 1 else 1, -1)
            rank = tau.abs().argsort(-1).argsort(-1).float() / max(tau.shape[-1] - 1, 1)
            kept = got != 0
            top += int(kept[rank >= 0.5].sum())
            n_top += int((rank >= 0.5).sum())
            bottom += int(kept[rank < 0.5].sum())
            n_bottom += int((rank < 0.5).sum())
        # expected keep rates 0.5 + 0.2/2 = 0.6 (upper half of ranks) and 0.4 (lower half)
        for rate, n, want in ((top / n_top, n_top, 0.6), (bottom / n_bottom, n_bottom, 0.4)):
            assert abs(rate - want) < 6 * math.sqrt(want * (1 - want) / n), (out_dir.name, rate, want)
