"""End to end on the smoke size: every stage must produce real numbers (not that any method wins)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="the lab extra (rlmerge[lab]) is not installed")

from rlmerge.lab.merging import METHOD_PLANS, skip_reason  # noqa: E402 - after the importorskip
from rlmerge.lab.pipeline import run_lab  # noqa: E402
from rlmerge.lab.tasks import FAMILIES  # noqa: E402


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("lab-smoke")
    return out, run_lab("smoke", out, seeds=1)


def _is_score(x: float) -> bool:
    return isinstance(x, float) and math.isfinite(x) and 0.0 <= x <= 1.0


@pytest.mark.slow
def test_base_and_agents_are_bf16_checkpoints_with_tokenizer(smoke: tuple[Path, dict]) -> None:
    out, _ = smoke
    for folder in [out / "seed0" / "base", *(out / "seed0" / "agents" / f for f in FAMILIES)]:
        config = json.loads((folder / "config.json").read_text())
        assert config["dtype"] == "bfloat16"
        assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()


@pytest.mark.slow
def test_training_and_task_vectors_are_real_numbers(smoke: tuple[Path, dict]) -> None:
    seed = smoke[1]["seeds"][0]
    assert seed["training"]["base"]["warmup_seconds"] > 0
    for fam in FAMILIES:
        assert seed["training"][fam]["train_seconds"] > 0
        assert math.isfinite(seed["training"][fam]["last_reward"])
        density = seed["task_vectors"]["agents"][fam]["density_pct"]
        assert 0.0 < density <= 100.0, f"agent {fam} did not move away from the base"
    assert sum(seed["task_vectors"]["count_share_pct"].values()) == pytest.approx(100.0)


@pytest.mark.slow
def test_every_row_is_scored_on_every_task(smoke: tuple[Path, dict]) -> None:
    seed = smoke[1]["seeds"][0]
    rows = seed["scores"]
    assert {"Base", *(f"Specialist: {f}" for f in FAMILIES)} <= set(rows)
    for row, scores in rows.items():
        assert set(scores) == set(FAMILIES), row
        assert all(_is_score(v) for v in scores.values()), (row, scores)
    for plan in METHOD_PLANS:  # each method either ran or says why it did not
        assert plan.label in rows or plan.label in seed["skipped"], plan.label
        if skip_reason(plan.method) is None:
            assert plan.label in rows, seed["skipped"].get(plan.label)


@pytest.mark.slow
def test_outputs_written(smoke: tuple[Path, dict]) -> None:
    out, summary = smoke
    assert (out / "plot.png").read_bytes()[:4] == b"\x89PNG"
    assert "| Base |" in (out / "table.md").read_text()
    assert json.loads((out / "results.json").read_text())["size"] == "smoke"
    assert summary["total_seconds"] < 180


@pytest.mark.slow
def test_a_rerun_resumes_from_the_saved_stages(smoke: tuple[Path, dict]) -> None:
    out, summary = smoke
    first = summary["seeds"][0]
    assert first["stages"] and not any(t["reused"] for t in first["stages"].values())
    assert all(t["wall_s"] > 0 and t["cpu_s"] >= 0 for t in first["stages"].values())
    again = run_lab("smoke", out, seeds=1)["seeds"][0]  # nothing left to do: every stage is read back
    assert set(again["stages"]) == set(first["stages"]) and all(t["reused"] for t in again["stages"].values())
    assert again["scores"] == first["scores"] and again["examples"] == first["examples"]
    assert {k: (t["wall_s"], t["cpu_s"]) for k, t in again["stages"].items()} == {
        k: (t["wall_s"], t["cpu_s"]) for k, t in first["stages"].items()
    }
