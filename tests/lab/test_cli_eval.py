"""`rlmerge eval` on a freshly built (untrained) checkpoint: real numbers for every requested task."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
typer_testing = pytest.importorskip("typer.testing")

import typer  # noqa: E402 - after the importorskip

from rlmerge.cli.lab import eval_command  # noqa: E402
from rlmerge.lab.model import ModelShape, build_model, save_bf16  # noqa: E402
from rlmerge.lab.tokenizer import build_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ckpt")
    tok = build_tokenizer()
    save_bf16(build_model(tok, ModelShape(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64), 0), tok, out)
    return out


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
    assert "unknown task family" in result.output
