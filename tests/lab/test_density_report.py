"""Task-vector statistics on hand-built checkpoints with known changes; table and plot output."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rlmerge.lab.density import task_vector_stats
from rlmerge.lab.merging import MethodPlan
from rlmerge.lab.report import markdown_table, plot, summarize


def _save(folder: Path, tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir()
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder


def test_density_unique_and_overlap_match_hand_counts(tmp_path: Path) -> None:
    base = {"w": torch.ones(10), "b": torch.ones(2, 5)}  # 20 elements
    a, b = {k: v.clone() for k, v in base.items()}, {k: v.clone() for k, v in base.items()}
    a["w"][:4] += 0.5  # a changes w[0:4]
    b["w"][2:6] += 0.5  # b changes w[2:6]: shared w[2:4]
    b["b"][0, :2] += 0.5  # and two more elements of b, unique
    a["w"][9] += 1e-6  # below ε (and lost in bf16 anyway): not a change
    stats = task_vector_stats(
        _save(tmp_path / "base", base), {"a": _save(tmp_path / "a", a), "b": _save(tmp_path / "b", b)}
    )
    agents = stats["agents"]
    assert stats["total_elements"] == 20
    assert agents["a"]["density_pct"] == pytest.approx(100 * 4 / 20)
    assert agents["b"]["density_pct"] == pytest.approx(100 * 6 / 20)
    assert agents["a"]["unique_share_pct"] == pytest.approx(50.0)  # w[0:2] of 4
    assert agents["b"]["rho"] == pytest.approx(2 / 4)  # shared 2, unique 4
    assert stats["overlap_pct"]["a&b"] == pytest.approx(50.0)
    assert stats["count_share_pct"] == pytest.approx({"c=0": 60.0, "c=1": 30.0, "c=2": 10.0})


def test_agent_without_unique_elements_reports_infinite_rho(tmp_path: Path) -> None:
    base = {"w": torch.zeros(4)}
    same = {"w": torch.tensor([1.0, 0, 0, 0])}
    stats = task_vector_stats(
        _save(tmp_path / "base", base), {"a": _save(tmp_path / "a", same), "b": _save(tmp_path / "b", same)}
    )
    assert math.isinf(stats["agents"]["a"]["rho"])


def test_mismatched_checkpoints_are_refused_with_the_engines_error(tmp_path: Path) -> None:
    import rlmerge

    base = _save(tmp_path / "base", {"w": torch.zeros(4)})
    other = _save(tmp_path / "a", {"v": torch.zeros(4)})
    with pytest.raises(rlmerge.InputError):
        task_vector_stats(base, {"a": other})


SCORES = {
    "Base": [
        {"tool_use": 0.1, "coding": 0.2, "memory": 0.3},
        {"tool_use": 0.3, "coding": 0.2, "memory": 0.1},
    ],
    "RAM": [{"tool_use": 0.5, "coding": 0.5, "memory": 0.5}, {"tool_use": 0.5, "coding": 0.5, "memory": 0.5}],
}


def test_summary_is_mean_and_sample_std_in_percent() -> None:
    table = summarize(SCORES)
    assert table["Base"]["tool_use"] == pytest.approx((20.0, math.sqrt(200.0)))
    assert table["Base"]["average"] == pytest.approx((20.0, 0.0))
    md = markdown_table(SCORES, {"RAM": "λ=1"})
    assert "| RAM | 50.0 ± 0.0 | 50.0 ± 0.0 | 50.0 ± 0.0 | 50.0 ± 0.0 | λ=1 |" in md
    assert "2 seed(s)" in md


def test_plot_writes_a_png(tmp_path: Path) -> None:
    plot(SCORES, tmp_path / "p.png", "t")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_grid_candidates_are_the_cartesian_product() -> None:
    plan = MethodPlan("TIES", "ties", {"density": [0.2, 0.5], "scaling": [1.0]})
    assert plan.candidates() == [{"density": 0.2, "scaling": 1.0}, {"density": 0.5, "scaling": 1.0}]
    assert MethodPlan("RAM", "ram").candidates() == [{}]


def test_unchanged_agent_has_rho_zero(tmp_path: Path) -> None:
    base = {"w": torch.zeros(4)}
    stats = task_vector_stats(_save(tmp_path / "base", base), {"a": _save(tmp_path / "a", base)})
    assert stats["agents"]["a"]["rho"] == 0.0 and stats["agents"]["a"]["density_pct"] == 0.0


def test_combine_gathers_rows_across_runs(tmp_path: Path) -> None:
    import json

    from rlmerge.lab.report import combine

    for i, runs in enumerate(([SCORES["Base"][0]], [SCORES["Base"][1]])):
        (tmp_path / f"r{i}.json").write_text(json.dumps({"seeds": [{"scores": {"Base": runs[0]}}]}))
    combined = combine([tmp_path / "r0.json", tmp_path / "r1.json"])
    assert combined == {"Base": SCORES["Base"]}
