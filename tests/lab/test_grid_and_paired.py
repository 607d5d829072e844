"""Grid search through `rlmerge.sweep` (float32 merges, best kept) and the paired confidence intervals."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlmerge.lab.grid import evaluate_candidates, grid_position, pick
from rlmerge.lab.merging import MethodPlan, merge_checkpoints, plan_skip_reason
from rlmerge.lab.paired import bootstrap_difference, pooled_difference, seed_differences, t_interval


def _ckpt(folder: Path, w: torch.Tensor) -> Path:
    folder.mkdir()
    save_file({"w": w.to(torch.bfloat16)}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"model_type": "toy"}))
    return folder


@pytest.fixture
def models(tmp_path: Path) -> tuple[Path, list[Path]]:
    base = torch.zeros(8)
    a, b = base.clone(), base.clone()
    a[:4] = 0.5  # disjoint task vectors: task arithmetic at scaling s gives s * (a + b)
    b[4:] = 0.25
    return _ckpt(tmp_path / "base", base), [_ckpt(tmp_path / "a", a), _ckpt(tmp_path / "b", b)]


def test_grid_picks_the_best_validation_point_and_keeps_only_its_float32_merge(
    tmp_path: Path, models: tuple[Path, list[Path]]
) -> None:
    base, agents = models
    target = 2.0 * torch.tensor([0.5] * 4 + [0.25] * 4)  # reached at scaling 2.0

    def score(built) -> dict[str, float]:  # rlmerge.Built: the sweep's candidate, here built in memory
        w = built.tensors["w"]
        assert w.dtype == torch.float32  # scored as computed, not rounded back to bf16
        return {"fit": -float((w - target).abs().sum())}

    grid = {"scaling": [0.5, 1.0, 2.0, 3.0]}
    results = evaluate_candidates(
        base, agents, "task_arithmetic", MethodPlan("TA", "task_arithmetic", grid).candidates(), tmp_path / "g", score
    )
    chosen = pick(results)
    assert chosen.params == {"scaling": 2.0} and chosen.val_average == pytest.approx(0.0, abs=1e-6)
    assert [r.val_average < 0 for r in results] == [True, True, False, True]
    kept = sorted(p.name for p in (tmp_path / "g").iterdir() if p.is_dir())
    assert kept == ["best-1", "cache"] and chosen.path == tmp_path / "g" / "best-1"
    assert load_file(chosen.path / "model.safetensors")["w"].dtype == torch.float32
    assert grid_position(grid, chosen.params) == {"scaling": "inside"}
    assert grid_position(grid, {"scaling": 0.5}) == {"scaling": "low edge"}
    assert grid_position({"scaling": [0.5, 3.0], "preset": ["paper"]}, {"scaling": 3.0, "preset": "paper"}) == {
        "scaling": "high edge",
        "preset": "fixed",
    }


def test_ram_plus_merge_is_written_in_float32(tmp_path: Path, models: tuple[Path, list[Path]]) -> None:
    base, agents = models
    info = merge_checkpoints(base, agents, tmp_path / "m", "ram+", {"preset": "official"})
    w = load_file(tmp_path / "m" / "model.safetensors")["w"]
    # all elements unique (ρ = 0 → λ = 1 for the official preset): the deltas come back exactly
    assert w.dtype == torch.float32 and info["lambdas"] == [1.0, 1.0]
    assert torch.equal(w, torch.tensor([0.5] * 4 + [0.25] * 4))


def test_rows_the_engine_cannot_run_are_skipped_with_its_reason() -> None:
    assert plan_skip_reason(MethodPlan("x", "no-such-method")) is not None
    reason = plan_skip_reason(MethodPlan("x", "ram+", {"preset": ["no-such-preset"]}))
    assert reason is not None and "no-such-preset" in reason
    assert plan_skip_reason(MethodPlan("RAM+", "ram+", {"preset": ["paper"], "r": [0.1], "alpha": [2.0]})) is None


def test_t_interval_matches_the_hand_computation() -> None:
    mean, lo, hi = t_interval([1.0, 2.0, 3.0, 4.0])
    half = 3.182 * statistics.stdev([1.0, 2.0, 3.0, 4.0]) / 2.0  # t_{0.975, 3} = 3.182
    assert (mean, lo, hi) == pytest.approx((2.5, 2.5 - half, 2.5 + half))
    with pytest.raises(ValueError):
        t_interval([1.0])


def test_seed_differences_are_paired_per_seed() -> None:
    seeds = [
        {"A": {"x": 0.6, "y": 0.4}, "B": {"x": 0.5, "y": 0.3}},  # A − B = +10 points
        {"A": {"x": 0.2, "y": 0.2}, "B": {"x": 0.1, "y": 0.1}},  # +10 again: zero spread, zero-width interval
    ]
    (row,) = seed_differences(seeds, [("A", "B")])
    assert row["diffs"] == pytest.approx([10.0, 10.0]) and row["low"] == pytest.approx(10.0)


def test_bootstrap_interval_is_degenerate_when_the_rows_always_differ_the_same_way() -> None:
    ones, zeros = {"x": [1.0] * 10, "y": [1.0] * 5}, {"x": [0.0] * 10, "y": [0.0] * 5}
    assert bootstrap_difference(ones, zeros) == pytest.approx((100.0, 100.0, 100.0))
    same = {"x": [1.0, 0.0, 1.0], "y": [0.0, 1.0]}
    assert bootstrap_difference(same, same) == pytest.approx((0.0, 0.0, 0.0))
    mixed_a, mixed_b = {"x": [1.0, 1.0, 0.0, 0.0]}, {"x": [0.0, 1.0, 0.0, 1.0]}
    d, lo, hi = bootstrap_difference(mixed_a, mixed_b, draws=500)
    assert d == 0.0 and -100.0 <= lo < 0.0 < hi <= 100.0
    with pytest.raises(ValueError):
        bootstrap_difference({"x": [1.0]}, {"x": [1.0, 0.0]})


def test_pooled_difference_resamples_within_each_seed_and_averages_over_seeds() -> None:
    """Oracles: one seed pooled is that seed's bootstrap, draw for draw; a seed whose rows always differ by 100
    points beside one where they never differ pools to exactly 50 (each stratum's resample is constant); the point
    is the mean over seeds of each seed's difference; seeds lacking a row are left out."""
    a0 = {"coding": [1.0, 0.0, 1.0, 1.0, 0.0], "memory": [1.0, 1.0, 0.0]}
    b0 = {"coding": [0.0, 0.0, 1.0, 0.0, 1.0], "memory": [1.0, 0.0, 0.0]}
    s0 = {"seed": 0, "examples": {"A": a0, "B": b0}}
    assert pooled_difference([s0], "A", "B", seed=3) == bootstrap_difference(a0, b0, seed=3)

    ones = {"coding": [1.0] * 4, "memory": [1.0] * 3}
    zeros = {"coding": [0.0] * 4, "memory": [0.0] * 3}
    constant = [{"seed": 1, "examples": {"A": ones, "B": zeros}}, {"seed": 2, "examples": {"A": zeros, "B": zeros}}]
    assert pooled_difference(constant, "A", "B") == pytest.approx((50.0, 50.0, 50.0))

    s1 = {"seed": 1, "examples": {"A": {"coding": [0.0, 1.0], "memory": [1.0, 1.0, 1.0, 0.0]},
                                  "B": {"coding": [1.0, 1.0], "memory": [0.0, 1.0, 0.0, 0.0]}}}
    d, lo, hi = pooled_difference([s0, s1], "A", "B")
    per_seed = [bootstrap_difference(s["examples"]["A"], s["examples"]["B"])[0] for s in (s0, s1)]
    assert d == pytest.approx(statistics.fmean(per_seed)) and lo <= d <= hi
    # the seeds in another order pool the same strata: the same draws, the same interval
    assert pooled_difference([s1, s0], "A", "B") == (d, lo, hi)

    lacking = {"seed": 5, "examples": {"A": a0}}
    assert pooled_difference([s0, lacking], "A", "B") == pooled_difference([s0], "A", "B")
    assert pooled_difference([lacking], "A", "B") is None
    other_tasks = {"seed": 6, "examples": {"A": {"tool_use": [1.0]}, "B": {"tool_use": [0.0]}}}
    with pytest.raises(ValueError, match="different families"):
        pooled_difference([s0, other_tasks], "A", "B")
