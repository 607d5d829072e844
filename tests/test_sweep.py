"""`rlmerge sweep` end to end: candidates, scores, ranking, Pareto set, kept checkpoints, --resume, the CLI.

Oracles: a kept checkpoint against `rlmerge.merge` run alone with the candidate's settings (every tensor byte,
the report, the config); a candidate built in memory against the same candidate built on disk (the scorer sees
the same tensors); the ranking and Pareto set against a brute force over the scores; the lab scorer's numbers
against the lab's own `score_examples` on the kept checkpoint loaded from disk; --resume against a sweep that
was never stopped.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import rlmerge
from conftest import CHAT_TEMPLATE, assert_same_tensors, lab_checkpoints, load_output
from rlmerge.errors import ConfigError, InputError, OutputError, RLMergeError
from rlmerge.report.sweep import pareto
from rlmerge.sweeping.candidates import parse_all, parse_grid

GRIDS = ["ram+ r=0.05,0.2 alpha=1,2", "ties density=0.2,0.5", "task_arithmetic scaling=0.5,1.0"]


def tensors_of(built: rlmerge.Built) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in built.tensors.items()} if built.tensors is not None else load_output(built.path)


class Distance:
    """Two 'tasks': closeness (negative L2 over every float tensor) of the merge to agent 1 and to agent 2."""

    def __init__(self, agents: list[Path]) -> None:
        self.targets = [load_output(a) for a in agents[:2]]
        self.seen: dict[str, dict[str, torch.Tensor]] = {}
        self.calls = 0

    def score(self, tensors: dict[str, torch.Tensor]) -> dict[str, float]:
        return {f"near{i}": -sum(float((tensors[k].float() - t[k].float()).square().sum()) for k in t
                                 if k in tensors and t[k].is_floating_point()) ** 0.5
                for i, t in enumerate(self.targets, 1)}

    def __call__(self, built: rlmerge.Built) -> dict[str, float]:
        self.calls += 1
        tensors = tensors_of(built)
        self.seen[built.candidate.id] = tensors
        return self.score(tensors)


def test_grid_grammar() -> None:
    labels = [c.label for c in parse_grid("ram+ r=0.05,0.1 alpha=1,2")]
    assert labels == ["ram+ r=0.05 alpha=1", "ram+ r=0.05 alpha=2", "ram+ r=0.1 alpha=1", "ram+ r=0.1 alpha=2"]
    assert [c.params for c in parse_grid("linear weights=[1,0.5],[2,1]")] == [
        (("weights", ["1", "0.5"]),), (("weights", ["2", "1"]),)]
    assert len(parse_grid("dare_ties density=0.5 seed=0,1,2")) == 3  # a random method's seed is a grid axis
    # r=0.1 and r=0.10 are one candidate, and so are a default spelled out and left out
    assert len(parse_all(["ram+ r=0.1,0.10", "ties density=0.2 scaling=1.0", "ties density=0.2"])) == 2
    with pytest.raises(ConfigError, match="seed changes nothing"):
        parse_grid("task_arithmetic scaling=1 seed=0,1")
    with pytest.raises(ConfigError, match="KEY=V1"):
        parse_grid("ties density")
    for seed in (1.5, True, "x"):  # a recipe candidate's seed is typed as the recipe's: int(1.5) was 1
        with pytest.raises(ConfigError, match="is not a whole number"):
            parse_all([{"method": "dare_ties", "parameters": {"density": 0.5}, "seed": seed}])
    with pytest.raises(RLMergeError) as e:  # every bad candidate at once
        parse_all(["ram+ r=abc", "ties density=7"])
    assert "r=abc" in str(e.value.render()) and "density=7" in str(e.value.render())


def test_sweep_ranks_scores_keeps_and_its_kept_checkpoints_are_plain_merges(example, tmp_path: Path) -> None:
    base, agents = example
    scorer = Distance(agents)
    res = rlmerge.sweep(base, agents, tmp_path / "sweep", candidates=GRIDS, scorer=scorer, keep=2, memory="always")
    assert len(res.scored) == 8 and scorer.calls == 8 and {s.where for s in res.scored} == {"memory"}
    # the ranking and Pareto set against a brute force over the recorded scores
    avg = {s.candidate.id: sum(s.scores.values()) / 2 for s in res.scored}
    assert [s.candidate.id for s in res.ranking] == sorted(avg, key=lambda c: -avg[c])
    front = {s.candidate.id for s in res.scored
             if not any(all(o.scores[t] >= s.scores[t] for t in s.scores)
                        and any(o.scores[t] > s.scores[t] for t in s.scores) for o in res.scored)}
    assert {s.candidate.id for s in res.pareto} == front
    assert pareto([{"a": 1, "b": 1}, {"a": 1, "b": 1}, {"a": 0, "b": 2}, {"a": 0, "b": 1}]) == [0, 1, 2]
    # each kept checkpoint: the bytes `rlmerge merge` writes for the candidate alone; its provenance names the sweep
    for rank, (path, s) in enumerate(zip(res.kept, res.ranking), 1):
        c = s.candidate
        alone = rlmerge.merge(base, agents, tmp_path / f"alone{rank}", method=c.method, params=dict(c.params),
                              seed=c.seed)
        names = sorted(p.name for p in path.iterdir())
        assert names == sorted(p.name for p in alone.output.iterdir())
        for n in names:
            if n not in ("rlmerge.json", "README.md"):  # provenance: the sweep's recipe is recorded
                assert (path / n).read_bytes() == (alone.output / n).read_bytes(), n
        prov = json.loads((path / "rlmerge.json").read_text())
        assert prov["recipe"]["sweep"]["candidate"]["id"] == c.id and prov["recipe"]["sweep"]["rank"] == rank
        # the tensors the scorer saw in memory are the checkpoint's
        assert_same_tensors(load_output(path), scorer.seen[c.id])
    doc = json.loads((tmp_path / "sweep" / "results.json").read_text())
    assert [c["id"] for c in doc["candidates"]] == [s.candidate.id for s in res.scored]
    assert doc["kept"] == {"best-1": res.ranking[0].candidate.id, "best-2": res.ranking[1].candidate.id}
    report = (tmp_path / "sweep" / "report.md").read_text()
    for s in res.scored:
        assert f"`{s.candidate.label}`" in report
    assert "Pareto" in report and "average" in report
    assert (tmp_path / "sweep" / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_candidate_built_on_disk_scores_what_it_scores_in_memory(example, tmp_path: Path) -> None:
    base, agents = example
    grid = ["ties density=0.3", "dare_ties density=0.5 seed=0,1"]
    mem = rlmerge.sweep(base, agents, candidates=grid, scorer=Distance(agents), memory="always")
    disk_scorer = Distance(agents)
    disk = rlmerge.sweep(base, agents, tmp_path / "sweep", candidates=grid, scorer=disk_scorer, memory="never")
    assert {s.where for s in disk.scored} == {"disk"}
    assert [s.scores for s in mem.scored] == [s.scores for s in disk.scored]
    assert mem.scored[1].scores != mem.scored[2].scores  # the seed is part of the candidate
    # a scored candidate's folder is removed once scored: the sweep folder holds results, report, cache only
    assert not list((tmp_path / "sweep").glob("candidate-*"))


class Stop(KeyboardInterrupt):
    """A sweep stopped (Ctrl-C) while scoring: a scorer's other exceptions are the candidate's outcome instead."""


def test_resume_scores_only_what_a_stopped_sweep_did_not_finish(example, tmp_path: Path) -> None:
    base, agents = example
    full = rlmerge.sweep(base, agents, candidates=GRIDS, scorer=Distance(agents), memory="always")

    class Stopping(Distance):
        def __call__(self, built: rlmerge.Built) -> dict[str, float]:
            if self.calls == 3:
                raise Stop
            return super().__call__(built)

    with pytest.raises(Stop):
        rlmerge.sweep(base, agents, tmp_path / "sweep", candidates=GRIDS, scorer=Stopping(agents), memory="always")
    with pytest.raises(OutputError, match="--resume"):  # a stopped sweep's folder is not overwritten silently
        rlmerge.sweep(base, agents, tmp_path / "sweep", candidates=GRIDS, scorer=Distance(agents))
    rest = Distance(agents)
    res = rlmerge.sweep(base, agents, tmp_path / "sweep", candidates=GRIDS, scorer=rest, memory="always",
                        resume=True)
    assert rest.calls == 8 - 3
    assert [s.scores for s in res.scored] == [s.scores for s in full.scored]
    with pytest.raises(OutputError, match="other inputs or with other scoring settings"):
        rlmerge.sweep(base, agents, tmp_path / "sweep", candidates=GRIDS, scorer=rest, resume=True,
                      settings={"tasks": ["other"]})


class Failing(Distance):
    """Raises on the candidates whose label contains ``on`` (a scorer that cannot score some models)."""

    def __init__(self, agents: list[Path], on: str) -> None:
        super().__init__(agents)
        self.on = on

    def __call__(self, built: rlmerge.Built) -> dict[str, float]:
        if self.on in built.candidate.label:
            raise RuntimeError(f"cannot score {built.candidate.label}")
        return super().__call__(built)


def test_a_scorer_failure_is_recorded_on_its_candidate_and_the_sweep_goes_on(example, tmp_path: Path) -> None:
    """The sweep used to die with the scorer's exception. Now it is the candidate's outcome: its message in
    results.json and report.md, ranked last, never kept (keep=3 keeps the two that scored), and --resume scores
    it again (and only it)."""
    base, agents = example
    grid = ["task_arithmetic scaling=0.5,1", "ties density=0.2"]
    res = rlmerge.sweep(base, agents, tmp_path / "sweep", candidates=grid, scorer=Failing(agents, "scaling=0.5"),
                        keep=3, memory="always")
    (bad,) = res.failed
    assert bad.candidate.label == "task_arithmetic scaling=0.5" and bad.scores == {}
    assert bad.error == "RuntimeError: cannot score task_arithmetic scaling=0.5"
    assert res.ranking[-1] is bad and all(s.scores for s in res.ranking[:-1])
    assert [p.name for p in res.kept] == ["best-1", "best-2"]
    doc = json.loads((tmp_path / "sweep" / "results.json").read_text())
    rec = next(c for c in doc["candidates"] if c["id"] == bad.candidate.id)
    assert rec["error"] == bad.error and rec["average"] is None
    assert bad.candidate.id not in doc["kept"].values() and doc["ranking"][-1] == bad.candidate.id
    report = (tmp_path / "sweep" / "report.md").read_text()
    assert "2 of 3 scored, 1 failed" in report and f"`{bad.candidate.label}`: {bad.error}" in report
    again = Distance(agents)
    res = rlmerge.sweep(base, agents, tmp_path / "sweep", candidates=grid, scorer=again, keep=3, memory="always",
                        resume=True)
    assert again.calls == 1 and not res.failed and len(res.kept) == 3


def test_a_scorer_failing_on_every_candidate_ends_the_sweep_with_its_message(example, tmp_path: Path) -> None:
    base, agents = example
    with pytest.raises(InputError, match="failed on every candidate .2., so nothing could be scored: "
                                         "RuntimeError: cannot score task_arithmetic") as info:
        rlmerge.sweep(base, agents, tmp_path / "sweep", candidates=["task_arithmetic scaling=0.5,1"],
                      scorer=Failing(agents, "task_arithmetic"), keep=1)
    assert info.value.file == str(tmp_path / "sweep" / "results.json")
    doc = json.loads((tmp_path / "sweep" / "results.json").read_text())
    assert [c["error"] for c in doc["candidates"]] == [f"RuntimeError: cannot score task_arithmetic scaling={v}"
                                                       for v in ("0.5", "1")]
    assert doc["kept"] == {} and not list((tmp_path / "sweep").glob("best-*"))


def test_a_scorer_that_returns_no_tasks_fails_on_that_candidate(example, tmp_path: Path) -> None:
    """A Python scorer returning {} gave candidates with no scores and no error, and the first was kept as best-1
    (found by a QA pass, 2026-12-07); the cmd: and py: scorers already refused an empty result."""
    base, agents = example
    near = Distance(agents)
    res = rlmerge.sweep(base, agents, tmp_path / "sweep", candidates=["task_arithmetic scaling=0.5,1"],
                        scorer=lambda b: {} if "0.5" in b.candidate.label else near(b), keep=2, memory="always")
    (bad,) = res.failed
    assert bad.candidate.label == "task_arithmetic scaling=0.5" and bad.scores == {}
    assert "returned no tasks" in (bad.error or "") and [p.name for p in res.kept] == ["best-1"]
    with pytest.raises(InputError, match="failed on every candidate .2.*returned no tasks"):
        rlmerge.sweep(base, agents, tmp_path / "none", candidates=["task_arithmetic scaling=0.5,1"],
                      scorer=lambda b: {}, keep=1, memory="always")
    assert not list((tmp_path / "none").glob("best-*"))


def test_a_candidate_scored_on_fewer_tasks_than_the_others_is_a_failure(example, tmp_path: Path) -> None:
    """A scorer that leaves a task out for some candidates (a command whose evaluation failed) had those ranked by
    an average over other tasks: {a: 50} ranked above {a: 50, b: 0}, and kept, though the other beats it on the
    Pareto front. Now each candidate lacking a task another was scored on is a failure naming the task (never
    kept, ranked last), and --resume scores it again."""
    base, agents = example
    grid = ["task_arithmetic scaling=0.5,1,1.5"]

    def partial(b: rlmerge.Built) -> dict[str, float]:
        return {"a": 50.0} if "1.5" not in b.candidate.label else {"a": 50.0, "b": 0.0}

    res = rlmerge.sweep(base, agents, tmp_path / "sweep", candidates=grid, scorer=partial, keep=3, memory="always")
    assert [s.candidate.label for s in res.failed] == ["task_arithmetic scaling=0.5", "task_arithmetic scaling=1"]
    for s in res.failed:
        assert s.scores == {} and s.error == ("scored on 1 of the 2 tasks other candidates were scored on: no score "
                                              "for 'b' (it gave a=50); candidates are ranked only on the same tasks")
    assert res.ranking[0].candidate.label == "task_arithmetic scaling=1.5" and res.ranking[1:] == res.failed
    assert [p.name for p in res.kept] == ["best-1"] and [s.candidate.label for s in res.pareto] == [
        "task_arithmetic scaling=1.5"]
    doc = json.loads((tmp_path / "sweep" / "results.json").read_text())
    assert [c.get("error") is not None for c in doc["candidates"]] == [True, True, False]
    calls = []
    res = rlmerge.sweep(base, agents, tmp_path / "sweep", candidates=grid, keep=3, memory="always", resume=True,
                        scorer=lambda b: calls.append(b.candidate.label) or {"a": 40.0, "b": 10.0})
    assert sorted(calls) == ["task_arithmetic scaling=0.5", "task_arithmetic scaling=1"] and not res.failed
    assert len(res.kept) == 3


@pytest.mark.parametrize("where", ["best-1/notes.txt", "best-3/notes.txt"])
def test_resume_refuses_a_checkpoint_folder_holding_a_users_file_before_any_work(example, tmp_path: Path,
                                                                               where: str) -> None:
    """A user's file in a kept best-N (or a best-N of the user's, with no rlmerge.json) let --resume claim the folder,
    merge and score the new candidates, then fail at the end while keeping, with a message about --force (found by a
    QA pass, 2026-12-07). The folder is now refused when claimed: nothing merged or scored, the file left as it is."""
    base, agents = example
    grid = ["task_arithmetic scaling=0.5,1"]
    rlmerge.sweep(base, agents, tmp_path / "sweep", candidates=grid, scorer=Distance(agents), keep=2,
                  memory="always")
    user = tmp_path / "sweep" / where
    user.parent.mkdir(exist_ok=True)
    user.write_text("mine")
    calls = []
    with pytest.raises(OutputError, match=f"the sweep folder holds {where.split('/')[0]}, which holds notes.txt"):
        rlmerge.sweep(base, agents, tmp_path / "sweep", candidates=[*grid, "ties density=0.2"], keep=1,
                      memory="always", resume=True, scorer=lambda b: calls.append(b) or {"a": 1.0})
    assert calls == [] and user.read_text() == "mine"


def test_resume_redoes_a_record_it_cannot_read_back(example, tmp_path: Path) -> None:
    """Beyond the issue: results.json records an older rlmerge (or an edit) left unreadable (a field missing, a score
    that is text), with the folder's manifest updated to match, were a KeyError or a TypeError on --resume; such a
    candidate is merged and scored again, the others are kept."""
    import zlib

    base, agents = example
    grid = ["task_arithmetic scaling=0.5,1", "ties density=0.2"]
    first = rlmerge.sweep(base, agents, tmp_path / "sweep", candidates=grid, scorer=Distance(agents))
    results, manifest = tmp_path / "sweep" / "results.json", tmp_path / "sweep" / "rlmerge-sweep.json"
    doc = json.loads(results.read_text())
    del doc["candidates"][0]["where"]
    doc["candidates"][1]["scores"] = {"near1": "high"}
    data = json.dumps(doc).encode()
    results.write_bytes(data)
    listing = json.loads(manifest.read_text())
    listing["files"]["results.json"] = {"bytes": len(data), "crc32": zlib.crc32(data)}
    manifest.write_text(json.dumps(listing))
    again = Distance(agents)
    res = rlmerge.sweep(base, agents, tmp_path / "sweep", candidates=grid, scorer=again, resume=True)
    assert again.calls == 2
    assert [s.scores for s in res.scored] == [s.scores for s in first.scored]


@pytest.fixture(scope="module")
def lab_agents(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    """A tiny lab model and two 'fine-tunes' of it (the base plus small perturbations)."""
    return lab_checkpoints(tmp_path_factory.mktemp("lab"))


def test_cli_sweep_on_lab_agents_scores_with_the_labs_own_scorer(lab_agents, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from rlmerge.cli import main
    from rlmerge.lab.evaluate import load_checkpoint, score_examples
    from rlmerge.lab.tasks import make_family, make_split

    base, agents = lab_agents
    out = tmp_path / "sweep"
    rc = main(["sweep", str(base), *map(str, agents), "-o", str(out), "--candidate", "task_arithmetic scaling=0.5,1",
               "--candidate", "ram+ r=0.1", "--tasks", "lab:memory,lab:tool_use", "--limit", "3", "--keep", "1",
               "-q"])
    assert rc == 0
    doc = json.loads((out / "results.json").read_text())
    assert len(doc["candidates"]) == 3 and doc["tasks"] == ["lab:memory", "lab:tool_use"]
    best = next(c for c in doc["candidates"] if c["id"] == doc["kept"]["best-1"])
    assert best["where"] == "memory"
    # the lab's public scorer on the kept checkpoint, loaded from disk, gives what the sweep recorded in memory
    model, tok = load_checkpoint(out / "best-1")
    for fam in ("memory", "tool_use"):
        want = 100.0 * score_examples(model, tok, make_split(make_family(fam), "val", 3, 0))
        assert best["scores"][f"lab:{fam}"] == pytest.approx(want, abs=1e-9)
    assert (out / "report.md").is_file()


def test_cli_recipe_and_a_resume_with_nothing_left(example, tmp_path: Path, capsys) -> None:
    from rlmerge.cli import main

    base, agents = example
    recipe = tmp_path / "sweep.yaml"
    recipe.write_text(f"base_model: {base}\nmodels:\n  - model: {agents[0]}\n  - model: {agents[1]}\n"
                      "candidates:\n  - ram+ r=0.1,0.2\n  - method: ties\n"
                      "    parameters: {density: [0.2, 0.4], scaling: 1.0}\nkeep: 1\n")
    out = tmp_path / "out"
    assert main(["sweep", "--recipe", str(recipe), "-o", str(out), "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert len(first["ranking"]) == 4 and first["statistics_passes"] == 1 and first["merge_passes"] == 4
    report = (out / "report.md").read_bytes()
    assert main(["sweep", "--recipe", str(recipe), "-o", str(out), "--resume", "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["ranking"] == first["ranking"] and (out / "report.md").read_bytes() == report
    assert main(["sweep", "--recipe", str(recipe), "-o", str(out), "--json"]) == 4  # neither --resume nor --force


def test_cli_the_live_table_appears_with_the_first_candidate_not_before_the_checks(example, tmp_path: Path,
                                                                                   capsys) -> None:
    from rlmerge.cli import main

    base, agents = example
    args = ["sweep", str(base), str(agents[0]), "--candidate", "task_arithmetic scaling=0.5,1"]
    assert main([*args[:3], str(tmp_path / "missing"), *args[3:], "-o", str(tmp_path / "bad")]) == 3
    refused = capsys.readouterr().err
    assert "missing" in refused and "candidate(s) scored" not in refused
    assert main([*args, "-o", str(tmp_path / "ok")]) == 0
    assert "rlmerge sweep: 2 candidate(s) scored" in capsys.readouterr().err


def test_cli_a_lab_task_over_models_without_a_tokenizer_fails_per_candidate(tmp_path: Path, capsys) -> None:
    """`lab:coding` over models without tokenizer files merged, then died with an IndexError from `generate`
    (AutoTokenizer builds an empty tokenizer from config.json alone), `--resume` the same. Now each candidate's
    failure is recorded, the sweep ends with the message and exit 3; with the tokenizer back, --resume scores them."""
    pytest.importorskip("transformers")
    from rlmerge.cli import main

    base, agents = lab_checkpoints(tmp_path / "in")
    tokenizer = {p.name: p.read_bytes() for p in base.iterdir() if p.name.startswith("tokenizer")}
    for folder in (base, *agents):
        for name in tokenizer:
            (folder / name).unlink()
    out = tmp_path / "sweep"
    args = ["sweep", str(base), *map(str, agents), "-o", str(out), "--candidate", "task_arithmetic scaling=0.5,1",
            "--tasks", "lab:coding", "--limit", "2", "--keep", "1", "-q"]
    for extra in ([], ["--resume"]):
        assert main([*args, *extra]) == 3
        err = capsys.readouterr().err
        assert "the scorer failed on every candidate (2)" in err and "no tokenizer files" in err, err
        assert "Traceback" not in err and str(base) in err
        doc = json.loads((out / "results.json").read_text())
        assert all("no tokenizer files" in c["error"] for c in doc["candidates"]) and doc["kept"] == {}
        assert (out / "report.md").read_text().count("no tokenizer files") == 2
    for name, data in tokenizer.items():
        (base / name).write_bytes(data)
    assert main([*args, "--resume"]) == 0
    doc = json.loads((out / "results.json").read_text())
    assert not any("error" in c for c in doc["candidates"]) and list(doc["kept"]) == ["best-1"]


def test_cli_the_first_sweep_over_the_demos_models_scores(tmp_path: Path, capsys) -> None:
    """`rlmerge demo`, then a sweep over its models with --tasks lab:tool_use: the demo's tokenizer has no padding
    token and transformers refused to pad ("tokenizer does not have a padding token"); generation pads with eos."""
    pytest.importorskip("transformers")
    from rlmerge.cli import main

    assert main(["demo", "--workdir", str(tmp_path / "demo")]) == 0
    inputs = tmp_path / "demo" / "inputs"
    rc = main(["sweep", str(inputs / "base"), *(str(inputs / a) for a in ("coder", "tool-use", "memory")), "-o",
               str(tmp_path / "sweep"), "--candidate", "ram+", "--tasks", "lab:tool_use", "--limit", "2", "--json"])
    err = capsys.readouterr().err
    assert rc == 0, err
    doc = json.loads((tmp_path / "sweep" / "results.json").read_text())
    assert "error" not in doc["candidates"][0] and doc["candidates"][0]["scores"]["lab:tool_use"] >= 0


def test_cli_lab_view_chat_scores_as_the_lab_scores_an_instruct_model(tmp_path: Path) -> None:
    """``--lab-view chat`` (an instruct model such as SmolLM2) reaches the scorer: the kept checkpoint, scored by the
    lab's own scorer through the chat view from disk, gives what the sweep recorded."""
    pytest.importorskip("transformers")
    from rlmerge.cli import main
    from rlmerge.lab.evaluate import load_checkpoint, score_examples
    from rlmerge.lab.tasks import make_family, make_split

    base, agents = lab_checkpoints(tmp_path / "in", chat_template=CHAT_TEMPLATE)
    out = tmp_path / "sweep"
    assert main(["sweep", str(base), *map(str, agents), "-o", str(out), "--candidate", "task_arithmetic scaling=1",
                 "--tasks", "lab:coding", "--limit", "3", "--keep", "1", "--lab-view", "chat", "-q"]) == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["settings"]["kind"] == "chat"
    model, tok = load_checkpoint(out / "best-1")
    want = 100.0 * score_examples(model, tok, make_split(make_family("coding"), "val", 3, 0), "chat")
    assert doc["candidates"][0]["scores"]["lab:coding"] == pytest.approx(want, abs=1e-9)
    assert main(["sweep", str(base), str(agents[0]), "-o", str(tmp_path / "x"), "--candidate", "ram r=1",
                 "--tasks", "lab:coding", "--lab-view", "voice"]) == 2


def test_cli_coding_scores_are_refused_before_any_merge_where_code_cannot_be_isolated(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    from rlmerge.cli import main
    from rlmerge.sandbox import BWRAP_ENV, UNSAFE_ENV

    base, agents = lab_checkpoints(tmp_path / "in")
    monkeypatch.setenv(BWRAP_ENV, str(tmp_path / "no-such-bwrap"))  # as on a machine without bubblewrap
    monkeypatch.setenv(UNSAFE_ENV, "0")  # (restored after the test: the flag sets it for the whole process)
    args = ["sweep", str(base), *map(str, agents), "--candidate", "task_arithmetic scaling=1", "--tasks",
            "lab:memory,lab:coding", "--limit", "2", "-q"]
    assert main([*args, "-o", str(tmp_path / "refused")]) == 2
    assert "apt-get install bubblewrap" in " ".join(capsys.readouterr().err.split())
    assert not (tmp_path / "refused").exists()  # refused before anything was merged or written
    with pytest.warns(RuntimeWarning, match="WITHOUT isolation"):
        assert main([*args, "-o", str(tmp_path / "opted-in"), "--unsafe-unisolated-code"]) == 0
    scores = json.loads((tmp_path / "opted-in" / "results.json").read_text())["candidates"][0]["scores"]
    assert set(scores) == {"lab:memory", "lab:coding"}


def test_long_candidate_labels_are_cut_on_the_plot_only() -> None:
    # Labels with side-input paths are long: whole on the plot's axis they squeezed the bars to nothing
    # (matplotlib: "constrained_layout not applied because axes sizes collapsed to zero").
    import warnings

    from rlmerge.report import sweep as report

    long = "fisher fisher=" + ",".join(f"/some/long/path/to/fisher/side-input-{i}" for i in range(3))
    cands = [{"id": i, "label": f"{long} {i}", "average": 0.1 * i, "scores": {"a": 0.1 * i, "b": 0.2},
              "where": "memory", "merge_seconds": 1.0, "score_seconds": 1.0, "passes": ["merge"], "read_bytes": 0}
             for i in range(3)]
    doc = {"base": "b", "agents": ["x", "y"], "tasks": ["a", "b"], "candidates": cands, "ranking": [2, 1, 0],
           "pareto": [2]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        files = report.render_report(doc)
        ticks = [t.get_text() for t in report.figure(doc).axes[0].get_yticklabels()]
    assert files["plot.png"].startswith(b"\x89PNG")
    assert ticks == [report._short(f"{long} {i}") for i in (2, 1, 0)]
    assert all(len(t) <= report.PLOT_LABEL for t in ticks)
    assert all(f"`{long} {i}`" in files["report.md"].decode() for i in range(3))  # whole in the report
