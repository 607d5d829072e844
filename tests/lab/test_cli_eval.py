"""`rlmerge eval`: the sweep's scorers (the lab's tasks, lm-evaluation-harness with the `eval` extra, a command of the
user's) on any checkpoint, each score with its n and standard error, several checkpoints compared with the first.

The lm-eval tests run offline, on a task defined by a local YAML + JSONL file and a tiny checkpoint made
here; the harness's accuracy is checked against an independent oracle: the same model's summed
log-likelihood of each choice, computed directly, argmax against the gold index.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from rlmerge.cli import main  # noqa: E402 - after the importorskip
from rlmerge.lab import harness  # noqa: E402
from rlmerge.lab.evaluate import load_checkpoint  # noqa: E402
from rlmerge.lab.model import ModelShape, build_model, save_bf16  # noqa: E402
from rlmerge.lab.tasks.memory import CODES, KEYS  # noqa: E402
from rlmerge.lab.tokenizer import build_tokenizer  # noqa: E402

DOCS = [
    {"question": f"question: the code of {key} is", "choices": CODES[i % 5 : i % 5 + 3], "gold": i % 3}
    for i, key in enumerate(KEYS[:12])
]


def _tiny(out: Path, seed: int) -> Path:
    tok = build_tokenizer()
    save_bf16(build_model(tok, ModelShape(hidden=32, layers=2, heads=2, kv_heads=1, intermediate=64), seed), tok, out)
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny(tmp_path_factory.mktemp("ckpt"), 3)


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A multiple-choice lm-eval task read from a local JSONL file (no hub, no network)."""
    folder = tmp_path_factory.mktemp("lm-eval-tasks")
    data = folder / "codes.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (folder / "lab_codes.yaml").write_text(
        "task: lab_codes\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        "doc_to_target: gold\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    # for the choice of index (test_an_include_path_defining_every_task_asked_is_indexed_alone): a task that
    # replaces the built-in arc_easy and carries the built-in tag ai2_arc, a group of this folder's tasks, and a
    # group with a member only the built-ins define
    (folder / "arc_easy.yaml").write_text("include: lab_codes.yaml\ntask: arc_easy\ntag: ai2_arc\n")
    (folder / "lab_group.yaml").write_text("group: lab_group\ntask:\n  - lab_codes\n  - task: arc_easy\n"
                                           "    num_fewshot: 1\n")
    (folder / "lab_mixed.yaml").write_text("group: lab_mixed\ntask:\n  - lab_codes\n  - arc_challenge\n")
    return folder


def _eval(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str, str]:
    code = main(["eval", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, " ".join(out.err.split())  # rich wraps an error box


@pytest.fixture(scope="module")
def other(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second checkpoint of the same shape, other weights."""
    return _tiny(tmp_path_factory.mktemp("ckpt2"), 4)


def test_eval_prints_json_scores_for_requested_tasks(checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _eval(capsys, checkpoint, "--tasks", "memory,coding", "--n", "4", "--json")
    assert code == 0, err
    doc = json.loads(out)
    (row,) = doc["models"]
    assert row["model"] == str(checkpoint) and set(row["scores"]) == {"lab:memory", "lab:coding"}
    assert all(0.0 <= v <= 100.0 for v in row["scores"].values())
    assert all(d["n"] == 4 and d["stderr"] is not None for d in row["details"].values())
    assert doc["versus_first"] == [None]
    assert doc["settings"]["split"] == "test" and doc["settings"]["limit"] == 4


def test_the_lab_scores_are_the_test_split_scored_directly(checkpoint: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Oracle: the lab's own scorer on the seed's test split, called without the command."""
    from rlmerge.lab.evaluate import score_examples
    from rlmerge.lab.tasks import make_family, make_split

    code, out, err = _eval(capsys, checkpoint, "--tasks", "memory", "--limit", "6", "--seed", "1", "--json")
    assert code == 0, err
    model, tok = load_checkpoint(checkpoint)
    want = 100.0 * score_examples(model, tok, make_split(make_family("memory"), "test", 6, 1))
    assert json.loads(out)["models"][0]["scores"]["lab:memory"] == pytest.approx(want)


def test_several_models_are_compared_with_the_first_on_the_same_examples(
        checkpoint: Path, other: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _eval(capsys, checkpoint, other, checkpoint, "--tasks", "memory,tool_use", "--n", "6",
                           "--json")
    assert code == 0, err
    doc = json.loads(out)
    first, second, again = doc["models"]
    assert again["scores"] == first["scores"]  # the same model, the same examples: the same scores
    vs = doc["versus_first"][1]
    for task in ("lab:memory", "lab:tool_use"):
        c = vs[task]
        assert c["how"] == "paired bootstrap"
        assert c["difference"] == pytest.approx(first["scores"][task] - second["scores"][task])
        assert c["low"] <= c["difference"] <= c["high"]
    assert vs["average"]["difference"] == pytest.approx(first["average"] - second["average"])
    same = doc["versus_first"][2]["average"]
    assert (same["difference"], same["low"], same["high"], same["indistinguishable"]) == (0.0, 0.0, 0.0, True)
    code, text, err = _eval(capsys, checkpoint, other, "--tasks", "memory", "--n", "6")
    assert code == 0, err
    assert "lab:memory" in text and "(n=6)" in text and "first − this" in text and "paired bootstrap" in text


def test_a_command_scores_each_model_in_its_folder(checkpoint: Path, other: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """cmd: gets the model's folder as {model} and its position as RLMERGE_CANDIDATE (model1, model2)."""
    prog = ("import json, os, sys; print(json.dumps({'files': len(os.listdir(sys.argv[1])), "
            "'position': int(os.environ['RLMERGE_CANDIDATE'].removeprefix('model'))}))")
    code, out, err = _eval(capsys, checkpoint, other, "--tasks", f'cmd:{sys.executable} -c "{prog}" {{model}}',
                           "--json")
    assert code == 0, err
    rows = json.loads(out)["models"]
    assert [r["scores"]["position"] for r in rows] == [1.0, 2.0]
    assert [r["scores"]["files"] for r in rows] == [float(len(list(p.iterdir()))) for p in (checkpoint, other)]


def test_the_table_names_a_commands_own_tasks_and_a_task_a_model_was_not_scored_on(
        checkpoint: Path, other: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without --json, a cmd: scorer's tasks (its output's keys, not the --tasks text) made a KeyError traceback
    after both models were scored (found by a QA pass, 2026-12-07). Model 2 here is scored on one task of two."""
    prog = ("import json, os; two = os.environ['RLMERGE_CANDIDATE'] == 'model2'; "
            "print(json.dumps({'t': 25.0} if two else {'t': 50.0, 'u': 75.0}))")
    code, out, err = _eval(capsys, checkpoint, other, "--tasks", f'cmd:{sys.executable} -c "{prog}" {{model}}')
    assert code == 0, err
    lines = out.splitlines()
    assert lines[:3] == ["t", f"  {checkpoint}: 50.00", f"  {other}: 25.00"]
    assert lines[3:6] == ["u", f"  {checkpoint}: 75.00", f"  {other}: not scored (its scorer gave no 'u')"]
    assert lines[6:9] == ["average", f"  {checkpoint}: 62.50", f"  {other}: 25.00"]
    assert lines[-1] == "(the averages are over different tasks: not comparable)"


def test_a_model_without_tokenizer_files_is_scored_with_the_given_tokenizer(
        checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An RL checkpoint saved without its tokenizer: refused with a hint, then scored with --tokenizer's, which gives
    the scores of the same weights beside their own tokenizer (oracle: the complete folder)."""
    import shutil

    from rlmerge.io.tokenizer import LOADABLE

    bare = tmp_path / "bare"
    shutil.copytree(checkpoint, bare)
    for name in LOADABLE:
        (bare / name).unlink(missing_ok=True)
    code, _, err = _eval(capsys, bare, "--tasks", "memory", "--n", "6")
    assert code != 0 and "no tokenizer files" in err and "--tokenizer" in err
    code, out, err = _eval(capsys, checkpoint, bare, "--tasks", "memory", "--n", "6", "--tokenizer", checkpoint,
                           "--json")
    assert code == 0, err
    whole, borrowed = json.loads(out)["models"]
    assert borrowed["scores"] == whole["scores"]
    code, _, err = _eval(capsys, bare, "--tasks", "memory", "--n", "6", "--tokenizer", tmp_path / "nowhere")
    assert code != 0 and "no tokenizer files" in err and "nowhere" in err


def test_eval_refuses_an_unknown_task(checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _eval(capsys, checkpoint, "--tasks", "lab:chess")
    assert code == 2
    assert "'lab:chess'" in err and "tool_use, coding, memory" in err


def oracle_each(checkpoint: Path) -> list[float]:
    """Per document, 1.0 when the argmax over choices of log p(" " + choice | question), summed over the choice's
    tokens, is the gold choice (also the oracle of tests/test_scoring_lmeval.py)."""
    model, tok = load_checkpoint(checkpoint)
    right = []
    for doc in DOCS:
        lls = []
        for choice in doc["choices"]:
            ctx = tok(doc["question"], add_special_tokens=False)["input_ids"]
            cont = tok(" " + choice, add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                logits = model(torch.tensor([ctx + cont])).logits[0].float()
            logp = torch.log_softmax(logits[len(ctx) - 1 : -1], dim=-1)
            lls.append(sum(logp[i, t].item() for i, t in enumerate(cont)))
        right.append(float(max(range(len(lls)), key=lls.__getitem__) == doc["gold"]))
    return right


def _oracle_accuracy(checkpoint: Path) -> float:
    return sum(oracle_each(checkpoint)) / len(DOCS)


@pytest.mark.slow
def test_lab_and_lm_eval_tasks_in_one_list(checkpoint: Path, task_dir: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("lm_eval", reason="the eval extra (rlmerge[eval]) is not installed")
    code, out, err = _eval(capsys, checkpoint, "--tasks", "memory,lab_codes", "--include-path", task_dir, "--n", "8",
                           "--json")
    assert code == 0, err
    row = json.loads(out)["models"][0]  # lm-eval's progress bars go to stderr
    assert set(row["scores"]) == {"lab:memory", "lm-eval:lab_codes"}
    assert 0.0 <= row["scores"]["lab:memory"] <= 100.0
    assert row["scores"]["lm-eval:lab_codes"] == pytest.approx(100.0 * _oracle_accuracy(checkpoint))  # acc, in %
    assert row["details"]["lm-eval:lab_codes"]["stderr"] is not None


@pytest.mark.slow
def test_unknown_task_is_named_and_the_available_ones_listed(checkpoint: Path, task_dir: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("lm_eval", reason="the eval extra (rlmerge[eval]) is not installed")
    code, _, message = _eval(capsys, checkpoint, "--tasks", "memory,lab_codez", "--include-path", task_dir)
    assert code == 2
    assert "'lab_codez'" in message
    assert "lab_codes" in message  # the include-path task, offered as a close match and listed
    assert "tool_use, coding, memory" in message


def _configs(loaded: dict) -> dict:
    """What lm-eval's ``TaskManager.load`` gave: each task's config, each group's members."""
    return {"tasks": {k: v.config.to_dict() for k, v in loaded["tasks"].items()}, "group_map": loaded["group_map"]}


@pytest.mark.slow
def test_an_include_path_defining_every_task_asked_is_indexed_alone(task_dir: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Indexing lm-eval's built-in tasks takes seconds (~7 s here, more in CI): skipped where the include path
    defines every name asked, and every member of its groups, which then load exactly as from the full index."""
    pytest.importorskip("lm_eval", reason="the eval extra (rlmerge[eval]) is not installed")
    paths = (str(task_dir),)
    alone = harness._task_manager(paths, False)
    assert harness._defined_in(["lab_codes", "lab_group", "arc_easy", "ai2_arc"], alone)
    assert not harness._defined_in(["lab_mixed"], alone)  # arc_challenge: only the built-ins define it
    assert not harness._defined_in(["hellaswag"], alone)
    assert not harness._defined_in(["lab_codez"], alone)
    asked = []
    real = harness._task_manager
    monkeypatch.setattr(harness, "_task_manager",  # called as harness calls it: one cache entry for each index
                        lambda p, *defaults: asked.append(defaults != (False,)) or real(p, *defaults))
    assert harness._manager_for(["lab_group", "lab_codes"], paths) is alone
    assert harness.split_tasks(["memory", "lab_group"], [task_dir]) == harness.TaskSplit(["memory"], ["lab_group"])
    assert asked == [False, False]  # no full index built
    harness._manager_for(["lab_mixed"], paths)
    assert asked[-1] is True
    full = real(paths)  # the oracle: the names this folder defines replace the built-ins' there too
    assert _configs(alone.load(["lab_group"])) == _configs(full.load(["lab_group"]))  # its arc_easy is the folder's
    # a tag expands to the tasks its entry names: the folder's, not the built-in's two
    assert alone.task_index["ai2_arc"].tags == full.task_index["ai2_arc"].tags == {"arc_easy"}


def test_without_lm_eval_the_error_says_how_to_install(checkpoint: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` now raises ImportError
    # an empty cache of task indexes for this test (the module's, built at ~15 s each, come back after it)
    monkeypatch.setattr(harness, "_task_manager", functools.lru_cache(harness._task_manager.__wrapped__))
    code, _, message = _eval(capsys, checkpoint, "--tasks", "hellaswag")
    assert code == 2
    assert "'hellaswag'" in message
    assert "pip install 'rlmerge[eval]'" in message


def test_lab_tasks_alone_need_no_lm_eval(checkpoint: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    code, out, err = _eval(capsys, checkpoint, "--tasks", "coding", "--n", "3")
    assert code == 0, err
    assert "lab:coding" in out and "(n=3)" in out


def test_unknown_task_through_the_console_entry_is_a_message_not_a_traceback(
    checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rlmerge.cli import main

    assert main(["eval", str(checkpoint), "--tasks", "coding,chess"]) == 2
    stderr = capsys.readouterr().err
    assert "--tasks" in stderr and "'chess'" in stderr
    assert "Traceback" not in stderr


def test_coding_is_refused_where_code_cannot_be_isolated_unless_the_user_opts_in(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from rlmerge.cli import main
    from rlmerge.sandbox import BWRAP_ENV, UNSAFE_ENV

    monkeypatch.setenv(BWRAP_ENV, str(checkpoint / "no-such-bwrap"))  # as on a machine without bubblewrap
    monkeypatch.setenv(UNSAFE_ENV, "0")  # (restored after the test: the flag sets it for the whole process)
    assert main(["eval", str(checkpoint), "--tasks", "memory,coding", "--n", "2"]) == 2
    message = " ".join(capsys.readouterr().err.split())
    assert "apt-get install bubblewrap" in message and "--unsafe-unisolated-code" in message
    assert "Traceback" not in message
    assert main(["eval", str(checkpoint), "--tasks", "memory", "--n", "2"]) == 0  # no model code to run
    capsys.readouterr()
    with pytest.warns(RuntimeWarning, match="WITHOUT isolation"):
        assert main(["eval", str(checkpoint), "--tasks", "coding", "--n", "2", "--json",
                     "--unsafe-unisolated-code"]) == 0
    assert set(json.loads(capsys.readouterr().out)["models"][0]["scores"]) == {"lab:coding"}
