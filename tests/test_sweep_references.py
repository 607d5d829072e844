"""`rlmerge sweep --references`: the base and each agent scored as they are, beside the candidates.

Oracles: a scorer that returns known per-example results for each input and each candidate, so that results.json's
references, the best input per task, every share kept and the report's table are computed by hand; the paired
comparison against `noise.paired_bootstrap` run on the very pairs it should compare; call counts for --resume; the
lab's own scorer on the base's folder for the CLI.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import rlmerge
from conftest import lab_checkpoints
from rlmerge.errors import ConfigError
from rlmerge.sweeping.build import Reference
from rlmerge.sweeping.noise import paired_bootstrap

GRID = ["task_arithmetic scaling=0.5,1"]
IDS = ["q1", "q2", "q3", "q4"]
# per input (its folder's name) and per candidate (its label): each task's per-example results (0/100)
KNOWN = {
    "base": {"t1": [100, 0, 0, 0], "t2": [0, 0, 0, 0]},  # 25, 0
    "coder": {"t1": [100, 100, 100, 0], "t2": [0, 0, 100, 0]},  # 75, 25
    "tool-use": {"t1": [0, 100, 0, 0], "t2": [100, 0, 100, 0]},  # 25, 50
    "memory": {"t1": [0, 0, 0, 0], "t2": [0, 0, 0, 100]},  # 0, 25
    "task_arithmetic scaling=0.5": {"t1": [100, 100, 0, 0], "t2": [100, 0, 0, 0]},  # 50, 25: average 37.5
    "task_arithmetic scaling=1": {"t1": [100, 0, 100, 100], "t2": [100, 0, 0, 0]},  # 75, 25: average 50, the best
}


class Known:
    """Returns KNOWN's results for what it is given; counts its calls on inputs and on candidates; raises on the
    inputs and candidates named in ``fail`` (a scorer that cannot load some models)."""

    def __init__(self, fail: tuple[str, ...] = (), stop_at_candidate: int | None = None) -> None:
        self.inputs: list[str] = []
        self.candidates: list[str] = []
        self.fail, self.stop_at_candidate = fail, stop_at_candidate

    def __call__(self, built: rlmerge.Built) -> dict[str, dict[str, list]]:
        if isinstance(built.candidate, Reference):
            assert built.path == built.candidate.path and built.tensors is None  # the input's own folder, on disk
            key = built.path.name
            self.inputs.append(key)
        else:
            key = built.candidate.label
            if self.stop_at_candidate is not None and len(self.candidates) == self.stop_at_candidate:
                raise KeyboardInterrupt
            self.candidates.append(key)
        if key in self.fail:
            raise RuntimeError(f"cannot load {key}")
        return {t: {"samples": v, "ids": IDS} for t, v in KNOWN[key].items()}


def _doc(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())


def test_references_table_shares_and_paired_comparison_are_the_hand_computed_ones(example, tmp_path: Path) -> None:
    base, agents = example
    out = tmp_path / "sweep"
    scorer = Known()
    res = rlmerge.sweep(base, agents, out, candidates=GRID, scorer=scorer, keep=5, memory="always", references=True)
    assert scorer.inputs == ["base", "coder", "tool-use", "memory"]  # each input once, before the candidates
    assert scorer.candidates == ["task_arithmetic scaling=0.5", "task_arithmetic scaling=1"]
    assert [(r.candidate.id, r.scores) for r in res.references] == [
        ("base", {"t1": 25.0, "t2": 0.0}), ("agent1", {"t1": 75.0, "t2": 25.0}),
        ("agent2", {"t1": 25.0, "t2": 50.0}), ("agent3", {"t1": 0.0, "t2": 25.0})]
    # never ranked, never kept: keep=5 keeps the two candidates only
    assert [s.candidate.label for s in res.ranking] == ["task_arithmetic scaling=1", "task_arithmetic scaling=0.5"]
    assert [p.name for p in res.kept] == ["best-1", "best-2"]
    doc = _doc(out)
    assert set(doc["kept"].values()) == {c["id"] for c in doc["candidates"]} and len(doc["ranking"]) == 2
    refs = doc["references"]
    assert [(r["id"], r["name"], r["role"]) for r in refs] == [
        ("base", "base", "base"), *((f"agent{i}", str(a), "agent") for i, a in enumerate(agents, 1))]
    assert doc["agents"] == [r["name"] for r in refs[1:]]  # named as results.json names the agents
    # the same examples as the candidates: one id list, shared, so every comparison is paired
    assert len(doc["examples"]) == 1
    key = next(iter(doc["examples"]))
    for r in [*refs, *doc["candidates"]]:
        assert {t: d["examples"] for t, d in r["details"].items()} == {"t1": key, "t2": key}
    coder = refs[1]["details"]["t1"]
    assert coder["samples"] == "100,100,100,0" and coder["n"] == 4 and coder["stderr"] == pytest.approx(
        100 * (0.75 * 0.25 / 4) ** 0.5)
    # best input per task: coder on t1 (75), tool-use on t2 (50); the best candidate against it, paired
    best = KNOWN["task_arithmetic scaling=1"]
    versus = doc["versus_inputs"]
    assert versus["candidate"] == res.ranking[0].candidate.id
    for task, ref, name in (("t1", "agent1", "coder"), ("t2", "agent2", "tool-use")):
        ((d, lo, hi),) = paired_bootstrap({task: best[task]}, [{task: KNOWN[name][task]}], seed=0)
        v = versus["tasks"][task]
        assert v["input"] == ref and v["input_score"] == sum(KNOWN[name][task]) / 4
        assert (v["difference"], v["low"], v["high"], v["how"]) == (d, lo, hi, "paired bootstrap")
        assert v["verdict"] == ("indistinguishable" if lo <= 0 <= hi else "above" if lo > 0 else "below")
    report = (out / "report.md").read_text()
    t1, t2 = versus["tasks"]["t1"], versus["tasks"]["t2"]
    assert ("| t1 | 25.00 | 75.00 | 25.00 | 0.00 | `coder` | 75.00 | 100.0 % | +0.00 | "
            f"[{t1['low']:+.2f}, {t1['high']:+.2f}] | indistinguishable |") in report
    assert (f"| t2 | 0.00 | 25.00 | 50.00 | 25.00 | `tool-use` | 25.00 | 50.0 % | -25.00 | "
            f"[{t2['low']:+.2f}, {t2['high']:+.2f}] | {t2['verdict']} |") in report
    assert "| average | 12.50 | 50.00 | 37.50 | 12.50 | | 50.00 | | | | |" in report
    assert "| task | `base` | `coder` | `tool-use` | `memory` | best input |" in report
    assert f"`coder` is `{agents[0]}`" in report
    # every candidate's share of the best input's score: 75/75, 25/50; 50/75, 25/50
    assert "| `task_arithmetic scaling=1` | 100.0 % | 50.0 % | 50.0 % |" in report
    assert "| `task_arithmetic scaling=0.5` | 66.7 % | 50.0 % | 50.0 % |" in report


def test_resume_reuses_recorded_references_and_a_failed_one_is_recorded_and_scored_again(example,
                                                                                        tmp_path: Path) -> None:
    base, agents = example
    out = tmp_path / "sweep"
    first = Known(fail=("tool-use",), stop_at_candidate=1)
    with pytest.raises(KeyboardInterrupt):  # stopped after the references and one candidate
        rlmerge.sweep(base, agents, out, candidates=GRID, scorer=first, memory="always", references=True)
    assert first.inputs == ["base", "coder", "tool-use", "memory"]
    doc = _doc(out)
    assert [r.get("error") for r in doc["references"]] == [None, None, "RuntimeError: cannot load tool-use", None]
    assert doc["references"][2]["scores"] == {} and len(doc["candidates"]) == 1
    again = Known(fail=("tool-use",))
    res = rlmerge.sweep(base, agents, out, candidates=GRID, scorer=again, memory="always", references=True,
                        resume=True)
    assert again.inputs == ["tool-use"] and again.candidates == ["task_arithmetic scaling=1"]
    assert res.references[2].error == "RuntimeError: cannot load tool-use" and not res.failed  # the sweep went on
    report = (out / "report.md").read_text()
    assert "| t2 | 0.00 | 25.00 | failed | 25.00 | `coder` |" in report  # coder: first of the 25s
    assert "- `tool-use`: RuntimeError: cannot load tool-use" in report
    fixed = Known()
    rlmerge.sweep(base, agents, out, candidates=GRID, scorer=fixed, memory="always", references=True, resume=True)
    assert fixed.inputs == ["tool-use"] and fixed.candidates == []
    recorded = _doc(out)["references"]
    nothing = Known()  # the round trip: a resume with everything recorded rewrites the same records
    rlmerge.sweep(base, agents, out, candidates=GRID, scorer=nothing, memory="always", references=True, resume=True)
    assert nothing.inputs == nothing.candidates == [] and _doc(out)["references"] == recorded
    assert recorded[2]["scores"] == {"t1": 25.0, "t2": 50.0} and "error" not in recorded[2]


def test_references_are_not_trials_of_a_search(example, tmp_path: Path) -> None:
    pytest.importorskip("optuna")
    base, agents = example
    scorer = Known()

    def known(built: rlmerge.Built) -> dict:  # a trial's label is its sampled point: score it as scaling=1
        if not isinstance(built.candidate, Reference):
            return {t: {"samples": v, "ids": IDS} for t, v in KNOWN["task_arithmetic scaling=1"].items()}
        return scorer(built)

    res = rlmerge.sweep(base, agents, tmp_path / "s", candidates=["task_arithmetic scaling=0.5..1"], scorer=known,
                        search="random", trials=2, memory="always", references=True, keep=1)
    doc = _doc(tmp_path / "s")
    assert len(doc["trials"]) == 2 and len(doc["candidates"]) == 2 and len(res.references) == 4
    assert scorer.inputs == ["base", "coder", "tool-use", "memory"]


def test_references_need_a_scorer_and_refuse_a_lora_adapter_before_anything_is_written(example,
                                                                                        tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    base, agents = example
    with pytest.raises(ConfigError, match="--references scores the inputs beside the candidates, and nothing"):
        rlmerge.sweep(base, agents, tmp_path / "a", candidates=GRID, references=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(tmp_path / "lora")
    rlmerge.sweep(base, [agents[0], tmp_path / "lora"], candidates=GRID, memory="always")  # merged without
    with pytest.raises(ConfigError, match=r"is a LoRA adapter, not a model a scorer can load") as info:
        rlmerge.sweep(base, [agents[0], tmp_path / "lora"], tmp_path / "b", candidates=GRID, scorer=Known(),
                      references=True)
    assert info.value.file == str(tmp_path / "lora") and "merge_and_unload" in info.value.render()
    assert not (tmp_path / "b").exists()


def test_cli_references_score_the_inputs_with_the_labs_own_scorer(tmp_path: Path, capsys) -> None:
    pytest.importorskip("transformers")
    from rlmerge.cli import main
    from rlmerge.lab.evaluate import load_checkpoint, score_examples
    from rlmerge.lab.tasks import make_family, make_split
    from rlmerge.sweeping.candidates import load_sweep_recipe

    base, agents = lab_checkpoints(tmp_path / "in")
    out = tmp_path / "sweep"
    assert main(["sweep", str(base), *map(str, agents), "-o", str(out), "--candidate", "task_arithmetic scaling=1",
                 "--tasks", "lab:tool_use", "--limit", "3", "--references", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    doc = _doc(out)
    assert [r["id"] for r in printed["references"]] == [r["id"] for r in doc["references"]] == [
        "base", "agent1", "agent2"]
    for rec, folder in zip(doc["references"], [base, *agents]):
        model, tok = load_checkpoint(folder)
        want = 100.0 * score_examples(model, tok, make_split(make_family("tool_use"), "val", 3, 0))
        assert rec["scores"]["lab:tool_use"] == pytest.approx(want, abs=1e-9)
        assert rec["details"]["lab:tool_use"]["examples"] == doc["candidates"][0]["details"]["lab:tool_use"][
            "examples"]
    assert "## Against the inputs" in (out / "report.md").read_text()
    recipe = tmp_path / "sweep.yaml"
    recipe.write_text(f"base_model: {base}\nmodels: [{agents[0]}]\ncandidates: [ties]\nreferences: true\n")
    assert load_sweep_recipe(recipe).settings["references"] is True


def test_an_agent_saved_without_tokenizer_files_is_scored_with_the_bases(tmp_path: Path, capsys) -> None:
    """RL checkpoints are often saved without tokenizer files; the merge writes the base's, and --references now
    scores such an agent with the base's too (it failed with "no tokenizer files"). Oracle: the lab's scorer on the
    agent's weights with the base's tokenizer, loaded directly; the record says whose tokenizer it read."""
    pytest.importorskip("transformers")
    from rlmerge.cli import main
    from rlmerge.io.tokenizer import TOKENIZER_FILES
    from rlmerge.lab.evaluate import load_checkpoint, score_examples
    from rlmerge.lab.tasks import make_family, make_split

    base, agents = lab_checkpoints(tmp_path / "in")
    for name in TOKENIZER_FILES:
        (agents[1] / name).unlink(missing_ok=True)
    # a file that names special tokens but builds no tokenizer: still read with the base's (the loader's rule)
    (agents[1] / "special_tokens_map.json").write_text('{"eos_token": "<eos>"}')
    out = tmp_path / "sweep"
    assert main(["sweep", str(base), *map(str, agents), "-o", str(out), "--candidate", "task_arithmetic scaling=1",
                 "--tasks", "lab:tool_use", "--limit", "3", "--references", "-q"]) == 0
    capsys.readouterr()
    refs = {r["id"]: r for r in _doc(out)["references"]}
    assert refs["agent2"].get("error") is None and refs["agent2"]["tokenizer"] == str(base)
    assert "tokenizer" not in refs["agent1"] and "tokenizer" not in refs["base"]
    model, tok = load_checkpoint(agents[1], base)
    want = 100.0 * score_examples(model, tok, make_split(make_family("tool_use"), "val", 3, 0))
    assert refs["agent2"]["scores"]["lab:tool_use"] == pytest.approx(want, abs=1e-9)


def test_confirm_scores_the_references_on_the_held_out_split_once(example, tmp_path: Path) -> None:
    base, agents = example
    out = tmp_path / "sweep"

    class HeldOut(Known):  # the held-out split: every input and candidate gets the first example wrong
        def __call__(self, built: rlmerge.Built) -> dict[str, dict[str, list]]:
            return {t: {"samples": [0, *d["samples"][1:]], "ids": IDS} for t, d in super().__call__(built).items()}

    held = HeldOut()
    res = rlmerge.sweep(base, agents, out, candidates=GRID, scorer=Known(), confirm=held, keep=1, memory="always",
                        references=True)
    assert held.inputs == ["base", "coder", "tool-use", "memory"] and len(held.candidates) == 1
    assert {k: r.scores for k, r in res.references_confirmed.items()} == {
        "base": {"t1": 0.0, "t2": 0.0}, "agent1": {"t1": 50.0, "t2": 25.0}, "agent2": {"t1": 25.0, "t2": 25.0},
        "agent3": {"t1": 0.0, "t2": 25.0}}
    doc = _doc(out)
    assert doc["references"][1]["confirmed"]["average"] == 37.5
    # coder on the held-out split: t1 50 ± 25, t2 25 ± 21.65 (binomial); average 37.5 ± 1.96 · 16.54; gap 12.5
    assert "| `coder` (input) | 50.00 | 37.50 | [5.09, 69.91] | 12.50 |" in (out / "report.md").read_text()
    again = HeldOut()
    rlmerge.sweep(base, agents, out, candidates=GRID, scorer=Known(), confirm=again, keep=1, memory="always",
                  references=True, resume=True)
    assert again.inputs == [] and again.candidates == []
    assert _doc(out)["references"] == doc["references"]


def test_the_report_names_agents_by_folder_only_where_that_is_unambiguous() -> None:
    from rlmerge.report.sweep import short_names

    def refs(*agents: str) -> list[dict]:
        return [{"id": "base", "name": "base", "role": "base"},
                *({"id": f"agent{i}", "name": a, "role": "agent"} for i, a in enumerate(agents, 1))]

    assert short_names(refs("runs/a/coder", "runs/b/memory/")) == {"base": "base", "agent1": "coder",
                                                                  "agent2": "memory"}
    for same in (refs("runs/a/coder", "runs/b/coder"), refs("x/base", "y/coder")):  # two coders; an agent "base"
        assert short_names(same) == {r["id"]: r["name"] for r in same}
