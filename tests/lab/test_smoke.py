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


@pytest.mark.slow
def test_a_run_interrupted_inside_a_stage_resumes_at_that_stage(
    smoke: tuple[Path, dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlmerge.lab import pipeline

    out, summary = smoke
    first = summary["seeds"][0]
    stages = out / "seed0" / "stages"
    for row in ("Average", "Task_arithmetic"):  # as if the run had stopped before these two rows
        (stages / f"row-{row}.json").unlink()

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("a finished base or agent was built again")

    monkeypatch.setattr(pipeline, "build_base", never)
    monkeypatch.setattr(pipeline, "train_agent", never)
    real_score, scored = pipeline.score_checkpoint_each, []

    def stopped_in_task_arithmetic(path: Path, *args: object) -> object:
        scored.append(path)
        if "sweep-Task_arithmetic" in str(path):
            raise KeyboardInterrupt  # Ctrl-C while the row's pick is scored on test
        return real_score(path, *args)

    monkeypatch.setattr(pipeline, "score_checkpoint_each", stopped_in_task_arithmetic)
    with pytest.raises(KeyboardInterrupt):
        run_lab("smoke", out, seeds=1)
    assert (stages / "row-Average.json").is_file() and not (stages / "row-Task_arithmetic.json").exists()
    assert not list(stages.glob("*.partial"))  # nothing half-written that a rerun could read as finished
    monkeypatch.setattr(pipeline, "score_checkpoint_each", lambda path, *args: scored.append(path) or real_score(
        path, *args))
    scored.clear()
    again = run_lab("smoke", out, seeds=1)["seeds"][0]
    # of the staged rows only the unfinished one's pick is scored again (the unique-region rows are not staged)
    assert [p.parent.name for p in scored if not p.name.startswith("unique-")] == ["sweep-Task_arithmetic"]
    assert not again["stages"]["row Task arithmetic"]["reused"]
    assert all(t["reused"] for k, t in again["stages"].items() if k != "row Task arithmetic")
    for row in ("Average", "Task arithmetic"):
        assert again["scores"][row] == first["scores"][row]  # the same numbers as the uninterrupted run


@pytest.mark.slow
def test_a_new_machine_goes_on_from_the_saved_stage_records_side_by_side(smoke: tuple[Path, dict], tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """What crosses machines is the stage records (collect.sh keeps them in the repository), not the checkpoints:
    a fresh --out given --stages-from trains the base and agents again (to the same bytes: what lets saved stages
    be reused on another machine) and reuses every saved test score and merge row instead of computing it.

    Run with --jobs 2: the agents, the test scores and the merge rows go to two worker processes, and what they
    compute there (the agents, and the scores and rows the saved run had not finished: a deterministic row, a
    seeded random one, a statistics one and Fisher's, the base's and a specialist's test scores) is every number
    of the one-process run (each stage seeds itself; nothing depends on which process ran it). The stages are
    saved as in one process: a rerun reads them all back. (One lab run checks both, so the suite trains the smoke
    size's base twice, not three times.)"""
    import shutil
    from concurrent.futures import ProcessPoolExecutor

    from rlmerge.errors import InputError
    from rlmerge.lab import jobs, pipeline
    from rlmerge.lab.stages import fingerprint

    sent: list[str] = []

    class Spy(ProcessPoolExecutor):
        def submit(self, fn, /, *args, **kwargs):  # type: ignore[no-untyped-def]
            sent.append(args[0].__name__)  # memory.measured(stage, *its args)
            return super().submit(fn, *args, **kwargs)

    monkeypatch.setattr(jobs, "ProcessPoolExecutor", Spy)
    out, summary = smoke
    first = summary["seeds"][0]
    saved = tmp_path / "saved"  # what collect.sh copies: seedN/stages/*.json and seedN/agents/*.json
    shutil.copytree(out / "seed0" / "stages", saved / "seed0" / "stages")
    unfinished = {"row Average": "row-Average", "row DARE+TIES": "row-DARE+TIES", "row RAM+": "row-RAM+",
                  "row Fisher": "row-Fisher", "test scores Base": "test-Base",
                  "test scores Specialist: coding": "test-Specialist_coding"}
    for name in unfinished.values():  # stages the saved run had not finished
        (saved / "seed0" / "stages" / f"{name}.json").unlink()
    # the stages' peaks, for --jobs to plan with (one larger than any this run will measure: kept, as the largest)
    (saved / "memory.json").write_text(json.dumps({"peak_bytes": {"agent tool_use": 1 << 40}}))
    again = run_lab("smoke", tmp_path / "new", seeds=1, stages_from=saved, jobs=2)["seeds"][0]
    ran = [p for p in METHOD_PLANS if skip_reason(p.method) is None]
    assert sent.count("_agent_family") == len(FAMILIES) and sent.count("_score_stage") == 1 + len(FAMILIES)
    assert sent.count("_row_stage") == len(ran)  # every stage went to the pool (a saved one is read back there)
    assert again["scores"] == first["scores"] and again["examples"] == first["examples"]
    assert again["task_vectors"] == first["task_vectors"] and again["skipped"] == first["skipped"]
    for name in ("base", *(f"agents/{f}" for f in FAMILIES)):  # trained again, elsewhere: the same bytes
        assert fingerprint([out / "seed0" / name], pipeline.DONE) == fingerprint(
            [tmp_path / "new" / "seed0" / name], pipeline.DONE), name
    peaks = json.loads((tmp_path / "new" / "memory.json").read_text())["peak_bytes"]
    assert peaks["agent tool_use"] == 1 << 40 and {"agent coding", "row Average"} <= set(peaks)
    assert not again["stages"]["base"]["reused"] and not again["stages"]["agent coding"]["reused"]
    reused = {k for k, t in again["stages"].items() if t["reused"]}
    assert reused == {k for k in first["stages"] if k.startswith(("row ", "test scores", "task vectors"))} - set(
        unfinished)
    rerun = run_lab("smoke", tmp_path / "new", seeds=1)["seeds"][0]
    assert all(t["reused"] for t in rerun["stages"].values()) and rerun["scores"] == first["scores"]
    with pytest.raises(InputError, match="no such folder"):
        run_lab("smoke", tmp_path / "other", seeds=1, stages_from=tmp_path / "missing")
