"""`rlmerge eval`: the lab's scorers, and lm-evaluation-harness tasks next to them (the `eval` extra).

The lm-eval tests run offline, on a task defined by a local YAML + JSONL file and a tiny checkpoint made
here; the harness's accuracy is checked against an independent oracle: the same model's summed
log-likelihood of each choice, computed directly, argmax against the gold index.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
typer_testing = pytest.importorskip("typer.testing")

import typer  # noqa: E402 - after the importorskip

from rlmerge.cli.lab import eval_command  # noqa: E402
from rlmerge.lab import harness  # noqa: E402
from rlmerge.lab.evaluate import load_checkpoint  # noqa: E402
from rlmerge.lab.model import ModelShape, build_model, save_bf16  # noqa: E402
from rlmerge.lab.tasks.memory import CODES, KEYS  # noqa: E402
from rlmerge.lab.tokenizer import build_tokenizer  # noqa: E402

DOCS = [
    {"question": f"question: the code of {key} is", "choices": CODES[i % 5 : i % 5 + 3], "gold": i % 3}
    for i, key in enumerate(KEYS[:12])
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ckpt")
    tok = build_tokenizer()
    save_bf16(build_model(tok, ModelShape(hidden=32, layers=2, heads=2, kv_heads=1, intermediate=64), 3), tok, out)
    return out


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
    return folder


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command("eval")(eval_command)
    app.command("noop")(lambda: None)  # two commands, so typer keeps the subcommand name
    return app


def test_eval_prints_json_scores_for_requested_tasks(checkpoint: Path) -> None:
    result = typer_testing.CliRunner().invoke(
        _app(), ["eval", str(checkpoint), "--tasks", "memory,coding", "--n", "4", "--json"]
    )
    assert result.exit_code == 0, result.output
    scores = json.loads(result.output)
    assert set(scores) == {"memory", "coding"}
    assert all(0.0 <= v <= 100.0 for v in scores.values())


def test_eval_refuses_an_unknown_task(checkpoint: Path) -> None:
    result = typer_testing.CliRunner().invoke(_app(), ["eval", str(checkpoint), "--tasks", "chess"])
    assert result.exit_code != 0
    message = " ".join(result.output.split())  # rich wraps the error box
    assert "'chess'" in message and "tool_use, coding, memory" in message


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
def test_lab_and_lm_eval_tasks_in_one_list(checkpoint: Path, task_dir: Path) -> None:
    pytest.importorskip("lm_eval", reason="the eval extra (rlmerge[eval]) is not installed")
    result = typer_testing.CliRunner().invoke(
        _app(),
        ["eval", str(checkpoint), "--tasks", "memory,lab_codes", "--include-path", str(task_dir), "--n", "8", "--json"],
    )
    assert result.exit_code == 0, result.output
    scores = json.loads(result.stdout)  # lm-eval's progress bars go to stderr
    assert set(scores) == {"memory", "lab_codes"}
    assert 0.0 <= scores["memory"] <= 100.0
    acc = scores["lab_codes"]["acc,none"]
    assert acc == pytest.approx(_oracle_accuracy(checkpoint))
    assert "acc_stderr,none" in scores["lab_codes"]


@pytest.mark.slow
def test_unknown_task_is_named_and_the_available_ones_listed(checkpoint: Path, task_dir: Path) -> None:
    pytest.importorskip("lm_eval", reason="the eval extra (rlmerge[eval]) is not installed")
    result = typer_testing.CliRunner().invoke(
        _app(), ["eval", str(checkpoint), "--tasks", "memory,lab_codez", "--include-path", str(task_dir)]
    )
    assert result.exit_code != 0
    message = " ".join(result.output.split())  # rich wraps the error box
    assert "'lab_codez'" in message
    assert "lab_codes" in message  # the include-path task, offered as a close match and listed
    assert "tool_use, coding, memory" in message


def test_without_lm_eval_the_error_says_how_to_install(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` now raises ImportError
    harness._task_manager.cache_clear()
    try:
        result = typer_testing.CliRunner().invoke(_app(), ["eval", str(checkpoint), "--tasks", "hellaswag"])
    finally:
        harness._task_manager.cache_clear()
    assert result.exit_code != 0
    message = " ".join(result.output.split())
    assert "'hellaswag'" in message
    assert "pip install 'rlmerge[eval]'" in message


def test_lab_tasks_alone_need_no_lm_eval(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    result = typer_testing.CliRunner().invoke(_app(), ["eval", str(checkpoint), "--tasks", "coding", "--n", "3"])
    assert result.exit_code == 0, result.output
    assert "coding" in result.output and "(n=3)" in result.output


def test_unknown_task_through_the_console_entry_is_a_message_not_a_traceback(
    checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rlmerge.cli import main

    assert main(["eval", str(checkpoint), "--tasks", "coding,chess"]) == 2
    stderr = capsys.readouterr().err
    assert "error: --tasks:" in stderr and "'chess'" in stderr
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
    assert set(json.loads(capsys.readouterr().out)) == {"coding"}
