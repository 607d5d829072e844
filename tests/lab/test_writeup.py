"""The write-up reads results.json as the pipeline writes it: paper's Table 1 beside ours, paired tables."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlmerge.lab.tasks import FAMILIES
from rlmerge.lab.writeup import _runs, real_size, tiny

ROWS = ["Base", *(f"Specialist: {f}" for f in FAMILIES), "Task arithmetic", "RAM", "RAM+ (paper defaults)"]


def _seed(seed: int, boost: float) -> dict:
    examples = {r: {f: [1.0, 0.0, 1.0, 0.0] for f in FAMILIES} for r in ROWS}
    examples["RAM"] = {f: [1.0, 1.0, 1.0, 0.0] if boost else [1.0, 0.0, 1.0, 0.0] for f in FAMILIES}
    scores = {r: {f: sum(v) / len(v) for f, v in e.items()} for r, e in examples.items()}
    agents = {f: {"density_pct": 10.0, "unique_share_pct": 40.0} for f in FAMILIES}
    return {
        "seed": seed, "scores": scores, "examples": examples, "notes": {"RAM": "epsilon=1e-05"},
        "picks": {"RAM": {"params": {"epsilon": 1e-5}, "position": {"epsilon": "inside"}, "grid_points": 3}},
        "training": {"base": {"warmup_seconds": 1.0}, **{f: {"train_seconds": 2.0} for f in FAMILIES}},
        "timings": {"base": 1.0, "merges": 3.0},
        "task_vectors": {"agents": agents, "count_share_pct": {"c=0": 70.0, "c=1": 30.0}, "cosine": {"a&b": 0.01}},
    }  # fmt: skip


def test_real_size_table_puts_the_papers_averages_beside_ours(tmp_path: Path) -> None:
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"seeds": [_seed(0, 1.0)]}))
    text = real_size(path)
    assert "| RAM | 75.0 | 75.0 | 75.0 | 75.0 | 64.82 | epsilon=1e-05 |" in text
    assert "| RAM+ (paper defaults) | 50.0 | 50.0 | 50.0 | 50.0 | 66.55 |" in text
    assert "| RAM − Task arithmetic | +25.0 |" in text  # paired difference, with its bootstrap interval
    assert "epsilon=1e-05 (epsilon inside)" in text


def test_tiny_combines_seeds_into_paired_t_intervals(tmp_path: Path) -> None:
    files = []
    for seed, boost in ((0, 1.0), (1, 0.0)):
        files.append(tmp_path / f"r{seed}.json")
        files[-1].write_text(json.dumps({"seeds": [_seed(seed, boost)]}))
    text = tiny(files, None)
    assert "| RAM − Task arithmetic | +25.0, +0.0 | +12.5 |" in text
    assert "| 0 | 50.0 → 50.0" in text and "| 1 + 2 + 2 + 2 + 0 + 3 + 0 | 10 |" in text


def test_uneven_run_beside_table1_with_agents_intervals_and_stage_times(tmp_path: Path) -> None:
    from rlmerge.lab.paired import pooled_difference
    from rlmerge.lab.writeup import uneven

    seeds = []
    for seed, boost in ((0, 1.0), (1, 0.0), (2, 1.0)):
        s = _seed(seed, boost)
        for f in FAMILIES:
            s["task_vectors"]["agents"][f] |= {"rho": 1.5, "lambda_paper": 1.15}
            s["training"][f]["settings"] = {"lr": 8e-5, "steps": 24, "reward": "graded"}
        s["stages"] = {"agent coding": {"wall_s": 100.0, "cpu_s": 90.0, "reused": False},
                       "row RAM": {"wall_s": 50.0, "cpu_s": 40.0, "reused": True}}
        seeds.append(s)
    # seed 2's coding agent took two runs: the first failed the gate on validation
    seeds[2]["training"]["coding"] |= {"gate": {"base": 0.5, "agent": 0.625, "n": 32, "p": 0.03125},
                                       "failed_attempts": [{"attempt": 0, "gate": {"base": 0.5, "agent": 0.125}}]}
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"seeds": seeds}))
    text = uneven(path)
    # ours: RAM 66.7 (mean of 75, 50, 75), TA and Base 50; the paper: RAM 64.82, TA 58.28, Base 48.70
    assert "| RAM | 66.7 | +16.7 | +16.7 | 1 | 64.82 | +16.12 | +6.54 | 2 |" in text
    assert "| Task arithmetic | 50.0 | +0.0 | +0.0 | 2 | 58.28 | +9.58 | +0.00 | 3 |" in text
    assert "| RAM − Task arithmetic | +25.0, +0.0, +25.0 | +16.7 |" in text  # over seeds, with its t-interval
    # the seeds' examples pooled: paired.pooled_difference's numbers, under their own heading
    d, lo, hi = pooled_difference(seeds, "RAM", "Task arithmetic")
    pooled = text.split("The 3 seeds' test examples pooled")[1].split("Seed 0, paired bootstrap")[0]
    assert f"| RAM − Task arithmetic | +25.0, +0.0, +25.0 | {d:+.1f} | [{lo:+.1f}, {hi:+.1f}] |" in pooled
    assert "| 1 | coding | 8e-05 × 24 | graded | 1 | 10.0 | 40.0 | 1.50 | 1.150 | 50.0 → 50.0 |" in text
    assert "| 2 | coding | 8e-05 × 24 | graded | 2 (50.0 → 12.5; 50.0 → 62.5, p 0.031) | 10.0 |" in text
    assert "| agent coding | 100 / 90 | 100 / 90 | 100 / 90 |" in text and "| total | 150 / 130 |" in text


def test_uneven_run_of_one_seed_bootstraps_each_specialist_on_its_own_task(tmp_path: Path) -> None:
    """With one seed there is no interval over seeds: each specialist − base on its own task gets the paired
    bootstrap over that task's test examples (oracle: bootstrap_difference on that family alone)."""
    from rlmerge.lab.paired import bootstrap_difference
    from rlmerge.lab.writeup import uneven

    s = _seed(0, 1.0)
    s["examples"]["Specialist: memory"]["memory"] = [1.0, 1.0, 1.0, 1.0]  # 100 against the base's 50
    s["scores"]["Specialist: memory"]["memory"] = 1.0
    for f in FAMILIES:
        s["task_vectors"]["agents"][f] |= {"rho": 1.5, "lambda_paper": 1.15}
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"seeds": [s]}))
    text = uneven(path)
    d, lo, hi = bootstrap_difference({"memory": [1.0] * 4}, {"memory": [1.0, 0.0, 1.0, 0.0]}, seed=0)
    assert (d, lo) == (50.0, 0.0)  # two of four examples gained: the low end can be no gain at all
    assert f"| Specialist: memory − Base, on memory | +50.0 | +50.0 | [{lo:+.1f}, {hi:+.1f}] |" in text


def test_uneven_run_from_runs_made_side_by_side_is_one_table(tmp_path: Path) -> None:
    """Seeds run side by side (one `rlmerge lab --first-seed S` each) make one table, the same as one run of all
    the seeds; a seed given twice, or runs of other agent settings, are refused, naming the files."""
    from rlmerge.lab.writeup import uneven

    seeds = []
    for seed, boost in ((0, 1.0), (1, 0.0), (2, 1.0)):
        s = _seed(seed, boost)
        for f in FAMILIES:
            s["task_vectors"]["agents"][f] |= {"rho": 1.5, "lambda_paper": 1.15}
        seeds.append(s)
    config = {"agent_grpo": {"coding": {"lr": 3e-5}}}
    whole = tmp_path / "whole.json"
    whole.write_text(json.dumps({"seeds": seeds, "config": config}))
    parts = []
    for s in (seeds[2], seeds[0], seeds[1]):  # in any order
        parts.append(tmp_path / f"s{s['seed']}.json")
        parts[-1].write_text(json.dumps({"seeds": [s], "config": config}))
    assert uneven(parts, tmp_path / "plot.png") == uneven(whole)
    assert (tmp_path / "plot.png").stat().st_size > 0
    with pytest.raises(ValueError, match="more than one run") as e:
        uneven([parts[0], parts[0]])
    assert str(parts[0]) in str(e.value)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"seeds": [_seed(3, 1.0)], "config": {"agent_grpo": {"coding": {"lr": 1e-5}}}}))
    with pytest.raises(ValueError, match="different settings"):
        uneven([parts[0], other])


def test_an_agents_runs_are_listed_in_training_order_with_the_kept_one_named() -> None:
    """Every run failed the gate and the best, run 1, was trained again and kept: the table lists the runs in the
    order they were trained and says which was kept; a run that passed last needs no such note."""
    def gate(agent: float, p: float) -> dict[str, float]:
        return {"base": 0.5, "agent": agent, "p": p}

    best = {"attempt": 0, "gate": gate(0.75, 0.125),
            "failed_attempts": [{"attempt": 1, "gate": gate(0.5, 1.0)}, {"attempt": 2, "gate": gate(0.625, 0.5)}]}
    assert _runs(best) == "3 (50.0 → 75.0, p 0.12; 50.0 → 50.0, p 1; 50.0 → 62.5, p 0.5; run 1 kept)"
    passed = {"attempt": 1, "gate": gate(0.875, 0.01), "failed_attempts": [{"attempt": 0, "gate": gate(0.5, 1.0)}]}
    assert _runs(passed) == "2 (50.0 → 50.0, p 1; 50.0 → 87.5, p 0.01)"
    assert _runs({"attempt": 0}) == "1"
