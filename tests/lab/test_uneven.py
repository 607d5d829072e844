"""The uneven SmolLM2 run (issue 27): per-agent GRPO settings, rewards the tool agent can climb, validation and
training prompts disjoint from the test split, and a pipeline that resumes stage by stage with its times."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rlmerge.errors import ConfigError
from rlmerge.lab import jobs, pipeline
from rlmerge.lab.grpo import DensityTrace, GRPOSettings, reward_function
from rlmerge.lab.merging import SMOLLM2_UNEVEN_GRIDS, MethodPlan
from rlmerge.lab.paired import PAIRS
from rlmerge.lab.sizes import SIZES, with_steps
from rlmerge.lab.stages import fingerprint, run_stage
from rlmerge.lab.tasks import FAMILIES, Example, held_out_split, make_family, make_split
from rlmerge.lab.tasks.tool_use import ToolUse
from rlmerge.scoring import TaskScorer

# ---- splits ---------------------------------------------------------------------------------------------------


def test_validation_and_training_prompts_avoid_the_test_split() -> None:
    test = {ex.prompt for ex in make_split(make_family("coding"), "test", 128, 0)}
    plain = make_split(make_family("coding"), "val", 48, 0)
    assert sum(ex.prompt in test for ex in plain) > 0  # coding repeats prompts: without the rule they collide
    for split in ("val", "train"):
        kept = held_out_split("coding", split, 48, 0, disjoint_from_test=128)
        assert len(kept) == 48 and not any(ex.prompt in test for ex in kept), split
    # without the rule, and for the test split itself, the splits are what they always were
    assert held_out_split("coding", "val", 48, 0) == plain
    assert held_out_split("coding", "test", 16, 0, disjoint_from_test=128) == make_split(
        make_family("coding"), "test", 16, 0
    )


def test_a_disjoint_split_keeps_the_familys_mix() -> None:
    """Coding's string operations have 32 distinct prompts and a 128-example test split uses most of them: skipping
    every excluded draw left 6 of 64 validation examples on string ops (test: 35 of 128). Replacing an excluded
    draw by one of its own operation keeps the mix (2 of the 7 operations are on strings)."""
    strings = {"upper", "reverse"}
    drawn = []
    for seed in range(5):
        test = {ex.prompt for ex in make_split(make_family("coding"), "test", 128, seed)}
        val = held_out_split("coding", "val", 64, seed, disjoint_from_test=128)
        assert not any(ex.prompt in test for ex in val)
        drawn += val
    share = sum(ex.stratum in strings for ex in drawn) / len(drawn)
    assert abs(share - 2 / 7) < 0.075, share  # 320 draws: the binomial sd of the share is 0.025


def test_a_family_of_one_stratum_skips_the_excluded_draws() -> None:
    """Without strata the replacement draw is the next draw: the split is the one that skipping them gave."""

    class TenPrompts:
        name = "memory"

        def sample(self, rng: random.Random) -> Example:
            k = rng.randrange(10)
            return Example("memory", f"prompt {k}", " red", {"answer": "red", "codes": ["red"]})

    exclude = {f"prompt {k}" for k in range(5)}
    rng = random.Random("memory/val/2000003")
    skipped: list[Example] = []
    while len(skipped) < 32:
        ex = TenPrompts().sample(rng)
        if ex.prompt not in exclude:
            skipped.append(ex)
    assert make_split(TenPrompts(), "val", 32, 0, exclude=exclude) == skipped  # type: ignore[arg-type]
    assert make_split(TenPrompts(), "val", 32, 0) != skipped  # type: ignore[arg-type]


def test_a_split_that_cannot_avoid_the_excluded_prompts_says_so() -> None:
    class OnePrompt:
        name = "memory"

        def sample(self, rng: random.Random) -> Example:
            return Example("memory", "always the same", " red", {"answer": "red", "codes": ["red"]})

    with pytest.raises(ValueError, match="could not draw 2 val examples outside the 1 excluded prompts"):
        make_split(OnePrompt(), "val", 2, 0, exclude={"always the same"})  # type: ignore[arg-type]


def test_the_sweeps_scorer_validates_on_the_disjoint_split(monkeypatch: pytest.MonkeyPatch) -> None:
    import rlmerge.lab.evaluate as evaluate
    import rlmerge.scoring.subject as subject

    seen: list[list[Example]] = []
    monkeypatch.setattr(subject, "load_model", lambda built: (None, None))
    monkeypatch.setattr(evaluate, "score_each", lambda m, t, examples, kind: seen.append(examples) or [1.0, 0.0])
    built = SimpleNamespace(candidate=SimpleNamespace(id="c0"))
    scorer = TaskScorer(["lab:coding"], limit=48, seed=0, kind="chat", disjoint_from_test=128)
    assert scorer(built)["lab:coding"].score == 50.0  # type: ignore[arg-type] - only the candidate's id is read
    assert seen == [held_out_split("coding", "val", 48, 0, disjoint_from_test=128)]
    assert scorer.settings()["disjoint_from_test"] == 128
    assert "disjoint_from_test" not in TaskScorer(["lab:coding"]).settings()  # older sweeps' --resume stays valid
    with pytest.raises(ConfigError, match="disjoint_from_test -1"):
        TaskScorer(["lab:coding"], disjoint_from_test=-1)


# ---- rewards --------------------------------------------------------------------------------------------------


def _tool_example() -> Example:
    call = {"name": "send_email", "arguments": {"to": "kim", "subject": "rivers"}}
    return Example("tool_use", "p", " " + json.dumps(call), {"call": call})


@pytest.mark.parametrize(
    ("answer", "graded", "shaped"),
    [
        ({"name": "send_email", "arguments": {"to": "kim", "subject": "rivers"}}, 1.0, 1.0),
        ({"name": "send_email", "arguments": {"to": "kim", "subject": "tea"}}, 0.7, 0.5),  # one of two arguments
        ({"name": "send_email", "arguments": {"to": "kim", "subject": "rivers", "x": 1}}, 0.8, 0.5),  # an extra one
        ({"name": "call", "arguments": {"to": "kim"}}, 0.1, 0.2),  # wrong tool: its arguments earn nothing
        ({"name": "mail", "arguments": {"to": "kim", "subject": "rivers"}}, 0.1, 0.2),  # a made-up tool
        ({"name": "send_email", "arguments": {"kim": "on rivers"}}, 0.4, 0.5),
    ],
)
def test_graded_tool_reward_credits_each_argument(answer: dict, graded: float, shaped: float) -> None:
    ex = _tool_example()
    assert ToolUse().graded_reward(json.dumps(answer), ex) == pytest.approx(graded)
    assert ToolUse().reward(json.dumps(answer), ex) == pytest.approx(shaped)
    assert ToolUse().graded_reward("not a call", ex) == 0.0


def test_reward_modes_reach_trl() -> None:
    pytest.importorskip("trl", reason="the lab extra (rlmerge[lab]) is not installed")
    check = json.dumps(_tool_example().check)
    wrong_arg = ' {"name": "send_email", "arguments": {"to": "kim", "subject": "tea"}}'
    assert reward_function("tool_use", mode="graded")(["p"], [wrong_arg], check=[check]) == pytest.approx([0.7])
    assert reward_function("tool_use", mode="strict")(["p"], [wrong_arg], check=[check]) == [0.0]
    memory = json.dumps({"answer": "teal", "codes": ["red", "teal"]})
    assert reward_function("memory", mode="strict")(["p", "p"], [" red", " teal"], check=[memory] * 2) == [0.0, 1.0]
    with pytest.raises(ValueError, match="'memory' has no graded reward"):
        reward_function("memory", mode="graded")


def test_chat_view_grades_the_extracted_call() -> None:
    from rlmerge.lab.views import task_view

    view = task_view("chat", "tool_use", None)  # type: ignore[arg-type] - the view reads no tokenizer here
    reply = 'Here:\n```json\n{"name": "send_email", "arguments": {"to": "kim", "subject": "tea"}}\n```'
    assert view.graded is not None and view.graded(reply, _tool_example()) == pytest.approx(0.7)
    assert task_view("chat", "memory", None).graded is None  # type: ignore[arg-type]


# ---- density trace --------------------------------------------------------------------------------------------


def test_density_trace_counts_what_survives_the_bf16_save() -> None:
    pytest.importorskip("trl", reason="the lab extra (rlmerge[lab]) is not installed")
    model = torch.nn.Linear(4, 2, bias=False)  # 8 elements
    with torch.no_grad():
        model.weight.fill_(1.0)
        trace = DensityTrace(model)
        model.weight[0, 0] += 1e-3  # below half a bf16 step at 1.0 (2^-8): absorbed when saved
        model.weight[0, 1] += 1e-2  # above it: survives
    trace.on_optimizer_step(None, None, None, model=model)
    with torch.no_grad():
        model.weight[1, 0] -= 0.5
    trace.on_optimizer_step(None, None, None, model=model)
    assert trace.trace == [100.0 / 8, 200.0 / 8]


# ---- stages and resuming --------------------------------------------------------------------------------------


def test_a_finished_stage_is_reused_and_a_changed_one_runs_again(tmp_path: Path) -> None:
    calls: list[int] = []

    def work() -> dict[str, Any]:
        calls.append(1)
        return {"scores": [1.0, 0.0], "n": len(calls)}

    first = run_stage(tmp_path / "s.json", {"grid": [1.0, 2.0]}, work, log=lambda m: None)
    again = run_stage(tmp_path / "s.json", {"grid": [1.0, 2.0]}, work, log=lambda m: None)
    assert calls == [1] and again["result"] == first["result"] == {"scores": [1.0, 0.0], "n": 1}
    assert not first["reused"] and again["reused"]
    assert again["wall_s"] == first["wall_s"] >= 0.0 and again["cpu_s"] == first["cpu_s"] >= 0.0
    changed = run_stage(tmp_path / "s.json", {"grid": [1.0, 3.0]}, work, log=lambda m: None)
    assert calls == [1, 1] and changed["result"]["n"] == 2 and not changed["reused"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.json"]  # no partial file left


def test_a_models_scores_are_reused_only_for_the_same_examples(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model's saved scores are keyed by the examples themselves, not only the split's name and size: a split
    drawn by another rule (as the disjoint validation split was when it became stratified) is scored again."""
    scored: list[list[str]] = []

    def score(path: Path, sets: dict[str, list[Example]], kind: str) -> dict[str, list[float]]:
        scored.append([ex.prompt for ex in sets["coding"]])
        return {f: [1.0] * len(v) for f, v in sets.items()}

    monkeypatch.setattr(pipeline, "score_checkpoint_each", score)
    _fake_agent(tmp_path / "base", {"settings": "x"})
    size = _small_uneven()
    sets = {f: make_split(make_family(f), "val", 4, 0) for f in FAMILIES}
    other = {**sets, "coding": make_split(make_family("coding"), "val", 4, 1)}
    for s in (sets, sets, other):
        pipeline._score_models(pipeline.SeedResult(0), [("Base", tmp_path / "base")], s, size, tmp_path / "stages",
                               split="val")
    assert len(scored) == 2 and scored[1] == [ex.prompt for ex in other["coding"]]


def test_a_stage_that_fails_leaves_nothing_that_reads_as_finished(tmp_path: Path) -> None:
    def broken() -> dict[str, Any]:
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        run_stage(tmp_path / "s.json", {}, broken)
    assert not (tmp_path / "s.json").exists()


def _fake_agent(folder: Path, info: dict[str, Any], weights: str = "weights") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / pipeline.DONE).write_text(json.dumps(info))
    (folder / "model.safetensors").write_text(weights)  # what the stages' fingerprint reads


def _small_uneven() -> Any:
    return replace(
        SIZES["smoke"],
        agent_grpo={f: replace(SIZES["smoke"].grpo, lr=lr) for f, lr in zip(FAMILIES, (1e-4, 1e-5, 5e-5))},
        disjoint=True,
    )


def test_agents_are_reused_only_with_the_settings_they_were_trained_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trained: list[tuple[str, float]] = []

    def fake_train(base: Path, fam: str, out: Path, settings: GRPOSettings, **kw: Any) -> dict[str, Any]:
        trained.append((fam, settings.lr))
        assert kw["disjoint_from_test"] == 6  # the smoke size's n_test
        out.mkdir(parents=True)
        return {"train_seconds": 1.0, "density_by_step": [1.0]}

    monkeypatch.setattr(pipeline, "train_agent", fake_train)
    size = _small_uneven()
    agents = pipeline.train_agents(size, tmp_path / "base", tmp_path / "agents", 0, pipeline.SeedResult(0))
    assert trained == [("tool_use", 1e-4), ("coding", 1e-5), ("memory", 5e-5)]
    marker = json.loads((agents[1] / pipeline.DONE).read_text())
    assert marker["settings"]["lr"] == 1e-5 and marker["disjoint_from_test"] == 6 and marker["cpu_s"] >= 0
    res = pipeline.SeedResult(0)
    pipeline.train_agents(size, tmp_path / "base", tmp_path / "agents", 0, res)
    assert len(trained) == 3 and all(res.stages[f"agent {f}"]["reused"] for f in FAMILIES)
    (agents[2] / "stale-file").write_text("from the old agent")
    changed = replace(size, agent_grpo={**size.agent_grpo, "memory": replace(size.agent_grpo["memory"], lr=2e-5)})
    pipeline.train_agents(changed, tmp_path / "base", tmp_path / "agents", 0, pipeline.SeedResult(0))
    assert trained[3:] == [("memory", 2e-5)] and not (agents[2] / "stale-file").exists()
    legacy = tmp_path / "legacy"  # a marker from before settings were recorded: reused as it is
    for f in FAMILIES:
        _fake_agent(legacy / f, {"train_seconds": 3.0})
    pipeline.train_agents(changed, tmp_path / "base", legacy, 0, pipeline.SeedResult(0))
    assert len(trained) == 4


def test_an_agent_that_does_not_beat_the_base_on_validation_is_trained_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gate: each run scored on its family's validation split against the base; a failed run is replaced by
    one with the next training seed, at most `agent_attempts` runs, and a resumed run goes on where it stopped."""
    trained: list[tuple[str, int]] = []
    scored: list[str] = []
    passes = {("tool_use", 0), ("coding", 1)}  # memory never passes

    def fake_train(base: Path, fam: str, out: Path, settings: GRPOSettings, **kw: Any) -> dict[str, Any]:
        trained.append((fam, kw["attempt"]))
        out.mkdir(parents=True)
        (out / "model.safetensors").write_text(f"{fam} {kw['attempt']}")  # another training seed: other weights
        return {"train_seconds": 1.0, "rewards": [0.1 * kw["attempt"]], "density_by_step": [1.0]}

    def fake_score(path: Path, sets: dict[str, list[Any]], kind: str) -> dict[str, list[float]]:
        ((fam, examples),) = sets.items()
        assert examples == held_out_split(fam, "val", 4, 0, 6)  # the seed's validation split, disjoint from test
        marker = json.loads((Path(path) / pipeline.DONE).read_text())
        scored.append(Path(path).name)
        learned = (fam, marker.get("attempt")) in passes  # the base's marker has no attempt
        return {fam: [1.0, 1.0, 1.0, 0.0] if learned else [1.0, 1.0, 0.0, 0.0]}

    monkeypatch.setattr(pipeline, "train_agent", fake_train)
    monkeypatch.setattr(pipeline, "score_checkpoint_each", fake_score)
    _fake_agent(tmp_path / "base", {"train_seconds": 0.0})
    size = replace(_small_uneven(), agent_attempts=3)
    res = pipeline.SeedResult(0)
    agents = pipeline.train_agents(size, tmp_path / "base", tmp_path / "agents", 0, res)
    assert trained == [("tool_use", 0), ("coding", 0), ("coding", 1), ("memory", 0), ("memory", 1), ("memory", 2)]
    coding = res.training["coding"]
    assert coding["attempt"] == 1 and coding["gate"]["passed"] and coding["gate"]["agent"] == 0.75
    assert [f["attempt"] for f in coding["failed_attempts"]] == [0]
    assert coding["failed_attempts"][0]["gate"] == {**coding["failed_attempts"][0]["gate"], "agent": 0.5,
                                                    "base": 0.5, "passed": False}
    assert json.loads((agents[1] / pipeline.DONE).read_text())["attempt"] == 1
    assert not res.training["memory"]["gate"]["passed"] and len(res.training["memory"]["failed_attempts"]) == 2
    assert any("memory" in w for w in res.warnings) and not any("coding" in w for w in res.warnings)
    assert res.stages["agent coding failed runs"]["wall_s"] >= 0 and not res.stages["gate coding"]["reused"]

    n = len(scored)  # a rerun reuses every agent and every gate score
    again = pipeline.SeedResult(0)
    pipeline.train_agents(size, tmp_path / "base", tmp_path / "agents", 0, again)
    assert len(trained) == 6 and len(scored) == n and again.training["coding"]["attempt"] == 1
    assert len(again.training["memory"]["failed_attempts"]) == 2 and again.stages["gate coding"]["reused"]

    shutil.rmtree(agents[2])  # memory's third run interrupted: the rerun trains that run, not the first
    pipeline.train_agents(size, tmp_path / "base", tmp_path / "agents", 0, pipeline.SeedResult(0))
    assert trained[6:] == [("memory", 2)]

    # a larger cap (not part of an agent's settings) goes on from the kept failing run: its fourth run passes
    passes.add(("memory", 3))
    more = pipeline.SeedResult(0)
    pipeline.train_agents(replace(size, agent_attempts=5), tmp_path / "base", tmp_path / "agents", 0, more)
    assert trained[7:] == [("memory", 3)] and more.training["memory"]["gate"]["passed"]
    assert [f["attempt"] for f in more.training["memory"]["failed_attempts"]] == [0, 1, 2]
    assert not any("memory" in w for w in more.warnings) and more.training["coding"]["attempt"] == 1
    trained[7:] = []

    ungated = tmp_path / "ungated"  # agent_attempts 1: no validation scores, one run each
    pipeline.train_agents(_small_uneven(), tmp_path / "base", ungated, 0, pipeline.SeedResult(0))
    assert [a for _, a in trained[7:]] == [0, 0, 0] and not list(ungated.glob("*.gate.json"))


def test_finished_merge_rows_are_skipped_until_their_inputs_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base, agents = tmp_path / "base", [tmp_path / "agents" / f for f in FAMILIES]
    for folder in (base, *agents):
        _fake_agent(folder, {"train_seconds": 1.0})
    calls: list[str] = []

    def fake_row(plan: MethodPlan, *args: Any) -> dict[str, Any]:
        calls.append(plan.label)
        return {"examples": {f: [1.0, 0.0] for f in FAMILIES}, "note": "scaling=1.0", "pick": {"params": {}}}

    monkeypatch.setattr(pipeline, "_merge_row", fake_row)
    plans = [MethodPlan("Task arithmetic", "task_arithmetic", {"scaling": [1.0, 2.0]}), MethodPlan("Average", "linear")]
    size = SIZES["smoke"]

    def run() -> pipeline.SeedResult:
        res = pipeline.SeedResult(0)
        pipeline.run_merges(size, base, agents, tmp_path / "merges", {}, res, plans, tmp_path / "stages")
        return res

    first = run()
    assert calls == ["Task arithmetic", "Average"] and first.scores["Average"] == {f: 0.5 for f in FAMILIES}
    second = run()
    assert calls == ["Task arithmetic", "Average"] and second.scores == first.scores
    assert second.stages["row Average"]["reused"] and second.notes["Task arithmetic"] == "scaling=1.0"
    _fake_agent(agents[0], {"train_seconds": 2.0})  # trained again to the same weights (another machine)
    run()
    assert calls[2:] == []
    _fake_agent(agents[0], {"train_seconds": 2.0}, weights="other")  # the tool agent changed: every row is stale
    run()
    assert calls[2:] == ["Task arithmetic", "Average"]


def test_a_row_of_one_point_records_no_validation_score(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A grid of one point is merged, not scored (nothing to pick): its record says None, not an average of 0."""
    from rlmerge.lab.grid import CandidateScore

    def fake_sweep(base: Any, agents: Any, method: str, candidates: Any, *args: Any, **kw: Any) -> list:
        if len(candidates) == 1:
            return [CandidateScore(dict(candidates[0]), {}, {}, tmp_path / "best-1", 0)]
        return [CandidateScore(dict(c), {"lab:memory": 50.0 + i}, {}, tmp_path / "best-1" if i == 1 else None,
                               1 - i) for i, c in enumerate(candidates)]

    monkeypatch.setattr(pipeline, "evaluate_candidates", fake_sweep)
    size = SIZES["smoke"]
    one = pipeline._run_plan(MethodPlan("Average", "linear"), size, tmp_path, [], tmp_path, 0, {}, None)[1]
    assert one["validation"] == [{"params": {}, "val_average": None}]
    two = pipeline._run_plan(MethodPlan("Task arithmetic", "task_arithmetic", {"scaling": [1.0, 2.0]}),
                             dataclasses.replace(size, max_grid=2), tmp_path, [], tmp_path, 0, {}, None)[1]
    assert [v["val_average"] for v in two["validation"]] == [0.5, 0.51] and two["params"] == {"scaling": 2.0}


def test_fingerprint_follows_the_files_not_the_marker(tmp_path: Path) -> None:
    """A stage's key holds what its checkpoints are: a new marker (another training time) over the same weights
    keeps it, so stages saved elsewhere are reused after a deterministic retraining; any file's bytes, or the
    folder's name, change it."""
    _fake_agent(tmp_path / "a", {"train_seconds": 1.0})
    before = fingerprint([tmp_path / "a"], pipeline.DONE)
    assert fingerprint([tmp_path / "a"], pipeline.DONE) == before
    _fake_agent(tmp_path / "a", {"train_seconds": 1.5})
    assert fingerprint([tmp_path / "a"], pipeline.DONE) == before
    (tmp_path / "a" / "config.json").write_text("{}")
    assert fingerprint([tmp_path / "a"], pipeline.DONE) != before
    (tmp_path / "a" / "config.json").unlink()
    _fake_agent(tmp_path / "a", {"train_seconds": 1.5}, weights="weightz")  # same size, other bytes
    assert fingerprint([tmp_path / "a"], pipeline.DONE) != before
    _fake_agent(tmp_path / "b", {"train_seconds": 1.0})
    assert fingerprint([tmp_path / "b"], pipeline.DONE) != before


def test_results_are_written_after_each_seed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_seed(size: Any, out: Path, seed: int, methods: Any, jobs: int = 1, book: Any = None
                  ) -> pipeline.SeedResult:
        if seed == 1:
            raise RuntimeError("the machine went away")
        res = pipeline.SeedResult(seed)
        for row in ("Base", "Task arithmetic"):
            res.examples[row] = {f: [1.0, 0.0] for f in FAMILIES}
            res.scores[row] = {f: 0.5 for f in FAMILIES}
        res.stages["base"] = {"wall_s": 1.0, "cpu_s": 0.5, "reused": False}
        return res

    monkeypatch.setattr(pipeline, "run_seed", fake_seed)
    with pytest.raises(RuntimeError, match="went away"):
        pipeline.run_lab("smoke", tmp_path / "out", seeds=2)
    done = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [s["seed"] for s in done["seeds"]] == [0] and done["seeds"][0]["stages"]["base"]["cpu_s"] == 0.5
    assert "| Task arithmetic |" in (tmp_path / "out" / "table.md").read_text()


def test_pilot_reports_each_agent_and_the_validation_scores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    size = _small_uneven()

    def fake_prepare(size: Any, out: Path, seed: int, res: pipeline.SeedResult) -> tuple[Path, list[Path]]:
        base, agents = out / "base", [out / "agents" / f for f in FAMILIES]
        for folder in (base, *agents):
            _fake_agent(folder, {"train_seconds": 1.0})
        res.task_vectors = {"agents": {}}
        return base, agents

    scored: list[str] = []

    def fake_score(path: Path, sets: dict[str, list[Example]], kind: str) -> dict[str, list[float]]:
        scored.append(path.name)
        assert all(len(v) == 5 for v in sets.values())
        return {f: [float(path.name == f)] * 5 for f in sets}

    monkeypatch.setattr(pipeline, "prepare_seed", fake_prepare)
    monkeypatch.setattr(pipeline, "score_checkpoint_each", fake_score)
    pilot = pipeline.run_pilot(size, tmp_path / "seed0", 0, n_val=5)
    assert scored == ["base", *FAMILIES] and pilot["n_val"] == 5
    assert pilot["val_examples"]["Specialist: coding"]["coding"] == [1.0] * 5
    assert pilot["val_examples"]["Base"]["coding"] == [0.0] * 5
    pipeline.run_pilot(size, tmp_path / "seed0", 0, n_val=5)
    assert len(scored) == 4  # a rerun reads the saved validation scores


# ---- the size ---------------------------------------------------------------------------------------------------


def test_with_steps_overrides_every_agent() -> None:
    size = with_steps(SIZES["smollm2-uneven"], grpo_steps=2)
    assert {size.grpo_for(f).steps for f in FAMILIES} == {2}
    assert size.grpo_for("tool_use").lr == SIZES["smollm2-uneven"].grpo_for("tool_use").lr


def test_uneven_size_answers_the_issue() -> None:
    size = SIZES["smollm2-uneven"]
    drift = {f: size.grpo_for(f).lr * size.grpo_for(f).steps ** 0.5 for f in FAMILIES}
    assert drift["tool_use"] < drift["coding"] < drift["memory"]  # sparse tool use, denser coding, densest memory
    assert size.n_test >= 128 and size.disjoint and size.disjoint_from_test == size.n_test
    tuned = {len(p.candidates()) for p in SMOLLM2_UNEVEN_GRIDS if len(p.candidates()) > 1}
    assert len(tuned) == 1 and min(tuned) >= 6  # every tuned row the same number of grid points, at least 6
    for pair in (("RAM+", "Task arithmetic"), ("RAM+", "TIES"), ("RAM+", "DARE+TA"), ("RAM", "Task arithmetic")):
        assert pair in PAIRS
    from rlmerge.lab.merging import plan_skip_reason

    assert all(plan_skip_reason(p) is None for p in SMOLLM2_UNEVEN_GRIDS)  # the engine takes every grid point


def test_an_interrupted_lab_run_says_its_finished_stages_are_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C in `rlmerge lab` keeps every finished stage (a rerun resumes): the message says so, not the merge
    commands' "nothing was written"."""
    from rlmerge.cli import main
    from rlmerge.lab import pipeline

    def stopped(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "run_lab", stopped)
    out = tmp_path / "lab-out"
    assert main(["lab", "--size", "tiny", "--out", str(out)]) == 130
    said = " ".join(capsys.readouterr().err.split())
    assert "nothing was written" not in said
    assert "kept in" in said and "lab-out" in said and "resumes" in said


def test_a_stop_ends_the_workers_stages_at_once(tmp_path: Path) -> None:
    """--jobs: when the run stops (Ctrl-C reaching only the main process, or a stage that failed), the workers'
    stages end with it instead of the run waiting for them to finish."""
    import multiprocessing
    import time

    start = time.time()
    with pytest.raises(KeyboardInterrupt), jobs.workers_for(2) as workers:
        assert workers.pool is not None
        workers.pool.submit(time.sleep, 60)
        workers.pool.submit(time.sleep, 60)
        time.sleep(2)  # both workers started
        raise KeyboardInterrupt
    while multiprocessing.active_children() and time.time() - start < 20:  # reaped by the executor's thread
        time.sleep(0.1)
    assert not multiprocessing.active_children() and time.time() - start < 20  # not the 60 s of their stages


def test_a_worker_killed_midway_is_named_with_what_to_do() -> None:
    """--jobs: a worker the system kills (out of memory, as a GRPO run beside a test suite was on 2026-12-06) ends
    the run with an error that says so and how to go on, not a BrokenProcessPool traceback."""
    import os

    from rlmerge.errors import RLMergeError

    with pytest.raises(RLMergeError, match="worker process of --jobs died") as err, jobs.workers_for(2) as workers:
        jobs.each(workers, os._exit, [(9,)], ["agent tool_use"])
    assert "--jobs 1" in str(err.value)


_SIGTERM_SCRIPT = """
import multiprocessing, signal, sys, threading, time
from rlmerge.cli import main
from rlmerge.lab import jobs as lab_jobs, pipeline

def run_lab(size, out, *, jobs=1, **kwargs):  # the lab's stages as long sleeps in its --jobs workers
    with lab_jobs.workers_for(jobs, log=lambda line: None) as workers:
        def started():
            while len(multiprocessing.active_children()) < jobs:
                time.sleep(0.05)
            print(" ".join(str(p.pid) for p in multiprocessing.active_children()), flush=True)
            if sys.argv[2] == "thread":  # the kernel may hand a process's signal to any of its threads: this one
                sys.stdin.readline()
                signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
        threading.Thread(target=started, daemon=True).start()
        lab_jobs.each(workers, time.sleep, [(120,)] * jobs, [f"agent {i}" for i in range(jobs)])

if __name__ == "__main__":
    pipeline.run_lab = run_lab
    sys.exit(main(["lab", "--size", "tiny", "--jobs", "2", "--out", sys.argv[1]]))
"""


def _running(pid: int) -> bool:
    """The process exists and is not a zombie waiting for its parent."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
@pytest.mark.parametrize("taken_by", ["main thread", "thread"])
def test_a_sigterm_to_the_main_process_alone_ends_the_workers(tmp_path: Path, taken_by: str) -> None:
    """--jobs: a job scheduler's timeout (SIGTERM to the lab's process, not its group) ends the workers' stages too,
    and the command exits as interrupted (130), instead of leaving workers that write stage records after it.

    ``thread``: the signal is taken by another thread of the process than the main one (the kernel may wake any
    thread that does not block it; Python then runs its handler in the main thread only when that thread runs
    Python again): the lab's wait on its workers still ends within seconds, not when a stage ends (120 s here)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "lab_sigterm.py"
    script.write_text(_SIGTERM_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "out"), taken_by.split()[0]],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        workers = [int(p) for p in proc.stdout.readline().split()]
        assert len(workers) == 2 and all(_running(p) for p in workers)
        if taken_by == "thread":
            proc.stdin.write("term\n")
            proc.stdin.flush()
        else:
            os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 130
        deadline = time.time() + 20
        while any(_running(p) for p in workers) and time.time() < deadline:
            time.sleep(0.1)
        assert not any(_running(p) for p in workers)  # not the 120 s of their stages
        assert proc.stderr is not None and "kept in" in " ".join(proc.stderr.read().split())
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_the_sign_test_counts_the_examples_the_two_score_differently() -> None:
    from rlmerge.lab.paired import sign_test

    assert sign_test(7, 0) == 1 / 128  # seed 0's tool-use agent if it lost none of the base's 7
    assert sign_test(8, 1) == 10 / 512  # P(X >= 8), X ~ Bin(9, 1/2)
    assert sign_test(1, 0) == 0.5 and sign_test(0, 0) == 1.0 and sign_test(0, 3) == 1.0
    assert abs(sign_test(10, 3) - sum(math.comb(13, k) for k in range(10, 14)) / 2**13) < 1e-15


@pytest.mark.parametrize(("base", "agent", "alpha", "passed"), [
    ([0] * 32, [1] * 5 + [0] * 27, 0.05, True),  # 5 better, 0 worse: p 1/32
    ([0] * 32, [1] * 4 + [0] * 28, 0.05, False),  # 4 better: p 1/16, above the base all the same
    ([1] + [0] * 31, [0] + [1] * 2 + [0] * 29, 0.05, False),  # seed 1's tool use, in kind: one example up
    ([1] + [0] * 31, [0] + [1] * 2 + [0] * 29, None, True),  # the old rule: above the base is enough
    ([1] * 6 + [0] * 26, [0] * 6 + [1] * 6 + [0] * 20, 0.05, False),  # as many better as worse
])
def test_the_gate_needs_the_sign_test_where_the_size_asks_for_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 base: list, agent: list, alpha: Any,
                                                                 passed: bool) -> None:
    def fake_score(path: Path, sets: dict[str, list[Any]], kind: str) -> dict[str, list[float]]:
        ((fam, examples),) = sets.items()
        return {fam: [float(x) for x in (agent if Path(path).name == "agent" else base)]}

    monkeypatch.setattr(pipeline, "score_checkpoint_each", fake_score)
    for name in ("base", "agent"):
        _fake_agent(tmp_path / name, {"train_seconds": 0.0})
    size = replace(_small_uneven(), n_val=32, agent_attempts=3, gate_alpha=alpha)
    gate = pipeline._gate(size, tmp_path / "base", tmp_path / "agent", "tool_use", 0)
    assert gate["passed"] is passed and gate["alpha"] == alpha
    better = sum(a > b for a, b in zip(agent, base))
    assert (gate["better"], gate["worse"]) == (better, sum(a < b for a, b in zip(agent, base)))
    assert SIZES["smollm2-uneven"].gate_alpha == 0.05


def test_when_every_run_fails_the_gate_the_best_on_validation_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No run passes: the run with the highest validation accuracy is kept, trained again from its seed when it was
    not the last (the last may have collapsed); a rerun keeps it without training, also after that training was
    interrupted, and a larger cap goes on with the next unused training seed."""
    trained: list[int] = []
    accuracy = {0: [1.0, 0.0, 0.0, 0.0], 1: [1.0, 1.0, 0.0, 0.0], 2: [0.0, 0.0, 0.0, 0.0], 3: [1.0, 1.0, 0.0, 0.0],
                4: [1.0, 1.0, 1.0, 1.0]}  # the base: [1, 1, 0, 0]; run 2 (attempt 1) best of three, as good as 4

    def fake_train(base: Path, fam: str, out: Path, settings: GRPOSettings, **kw: Any) -> dict[str, Any]:
        if fam == "memory":
            trained.append(kw["attempt"])
        out.mkdir(parents=True)
        (out / "model.safetensors").write_text(f"{fam} {kw['attempt']}")
        return {"train_seconds": 1.0, "rewards": [0.1 * kw["attempt"]], "density_by_step": [1.0]}

    def fake_score(path: Path, sets: dict[str, list[Any]], kind: str) -> dict[str, list[float]]:
        ((fam, _),) = sets.items()
        attempt = json.loads((Path(path) / pipeline.DONE).read_text()).get("attempt")
        if attempt is None:  # the base
            return {fam: [1.0, 1.0, 0.0, 0.0]}
        return {fam: accuracy[attempt] if fam == "memory" else [1.0, 1.0, 1.0, 1.0]}

    monkeypatch.setattr(pipeline, "train_agent", fake_train)
    monkeypatch.setattr(pipeline, "score_checkpoint_each", fake_score)
    _fake_agent(tmp_path / "base", {"train_seconds": 0.0})
    size = replace(_small_uneven(), agent_attempts=3, gate_alpha=None)  # passes: above the base's 50 %
    res = pipeline.SeedResult(0)
    agents = pipeline.train_agents(size, tmp_path / "base", tmp_path / "agents", 0, res)
    assert trained == [0, 1, 2, 1]  # three runs, then the second again
    memory = res.training["memory"]
    assert memory["attempt"] == 1 and (agents[2] / "model.safetensors").read_text() == "memory 1"
    assert memory["gate"]["agent"] == 0.5 and not memory["gate"]["passed"]
    assert sorted(f["attempt"] for f in memory["failed_attempts"]) == [0, 2]  # the runs not kept
    assert any("run 2, the best on validation, is kept" in w for w in res.warnings)

    again = pipeline.SeedResult(0)  # a rerun keeps it: nothing trained
    pipeline.train_agents(size, tmp_path / "base", tmp_path / "agents", 0, again)
    assert trained == [0, 1, 2, 1] and again.training["memory"]["attempt"] == 1

    shutil.rmtree(agents[2])  # the best run's second training interrupted: a rerun trains it, not a fourth run
    pipeline.train_agents(size, tmp_path / "base", tmp_path / "agents", 0, pipeline.SeedResult(0))
    assert trained == [0, 1, 2, 1, 1]

    more = pipeline.SeedResult(0)  # a larger cap: the next unused seed; run 4 ties run 2 and, the last, is kept
    pipeline.train_agents(replace(size, agent_attempts=4), tmp_path / "base", tmp_path / "agents", 0, more)
    assert trained == [0, 1, 2, 1, 1, 3] and more.training["memory"]["attempt"] == 3
    assert sorted(f["attempt"] for f in more.training["memory"]["failed_attempts"]) == [0, 1, 2]
    last = pipeline.SeedResult(0)  # and a run better than every earlier one is kept where it ends
    pipeline.train_agents(replace(size, agent_attempts=5), tmp_path / "base", tmp_path / "agents", 0, last)
    assert trained[-1] == 4 and last.training["memory"]["attempt"] == 4 and last.training["memory"]["gate"]["passed"]
