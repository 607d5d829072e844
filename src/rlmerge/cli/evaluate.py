"""`rlmerge eval`: score checkpoints on the sweep's scorers, and compare each with the first on the same examples."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Any

import typer

from ..errors import InputError
from ..io.open import checked_model_folder
from ..io.tokenizer import LOADABLE, loadable_tokenizer
from . import options as o

LAB_TASKS = "lab:tool_use,lab:coding,lab:memory"


def eval_command(
    models: Annotated[list[Path], typer.Argument(
        help="Hugging Face checkpoint folders; with several, each is compared with the first, task by task, on "
             "the same examples (a paired bootstrap where the scorer gives each example's result)")],
    tasks: o.Tasks = None,
    limit: Annotated[int | None, typer.Option("--limit", "--n", min=1, help="examples per task (default 128)")]
    = None,
    split: Annotated[str, typer.Option(help="the lab tasks' split: test (default) or val")] = "test",
    seed: Annotated[int, typer.Option(help="the examples' seed (the lab's seed-0 test set by default) and the "
                                           "bootstrap's")] = 0,
    lab_view: o.LabView = None,
    include_path: o.IncludePath = None,
    num_fewshot: o.NumFewshot = None,
    batch_size: o.BatchSize = None,
    lm_eval_backend: o.LmEvalBackend = None,
    cmd_timeout: o.CmdTimeout = None,
    cmd_env: o.CmdEnv = None,
    cmd_cwd: o.CmdCwd = None,
    tokenizer: Annotated[Path | None, typer.Option(
        "--tokenizer", help="a folder whose tokenizer scores the models saved without one (an RL checkpoint often "
                            "is): usually the base model's; a model with its own tokenizer files keeps them")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="print the scores and comparisons as JSON")] = False,
    unsafe_unisolated_code: o.UnsafeUnisolatedCode = False,
) -> None:
    """Score checkpoints on --tasks as a sweep scores candidates: the lab's three tasks by default; with
    rlmerge[eval], lm-eval tasks; bfcl, humaneval, cmd and py scorers. Each score comes with its n and standard
    error; given several checkpoints, each is compared with the first."""
    from ..sweeping.build import Reference

    if unsafe_unisolated_code:
        from ..sandbox import allow_unisolated

        allow_unisolated()
    flags = {"tasks": tasks or [LAB_TASKS], "limit": limit, "split": split, "seed": seed, "lab_view": lab_view,
             "include_path": include_path, "num_fewshot": num_fewshot, "batch_size": batch_size,
             "lm_eval_backend": lm_eval_backend, "cmd_timeout": cmd_timeout, "cmd_env": cmd_env,
             "cmd_cwd": str(cmd_cwd) if cmd_cwd is not None else None}
    # every setting is checked (and the coding scorer's isolation) before a model is read
    scorer = o.task_scorer({k: v for k, v in flags.items() if v is not None}, split="test")
    folders = [checked_model_folder(m, what="eval") for m in models]
    borrowed = _tokenizer_folder(tokenizer) if tokenizer is not None else None
    scored = [scorer(Reference("model", str(given), folder, i,
                               None if loadable_tokenizer(folder) else borrowed).built())
              for i, (given, folder) in enumerate(zip(models, folders), start=1)]
    rows = [_row(str(m), details) for m, details in zip(models, scored)]
    versus = [None, *(_versus(scored[0], d, seed) for d in scored[1:])]
    if json_out:
        typer.echo(json.dumps({"settings": scorer.settings(), "models": rows, "versus_first": versus}, indent=1))
        return
    _print(rows, versus)


def _tokenizer_folder(path: Path) -> Path:
    """--tokenizer's folder (a local folder: weights are not needed), refused unless it holds tokenizer files."""
    folder = Path(path)
    if not folder.is_dir() or not loadable_tokenizer(folder):
        raise InputError(f"no tokenizer files ({', '.join(LOADABLE)})", file=str(folder),
                         hint="give --tokenizer the folder of the model whose tokenizer the checkpoints use (the base)")
    return folder


def _row(model: str, details: dict[str, Any]) -> dict[str, Any]:
    from ..sweeping.noise import average_interval

    return {"model": model, "scores": {t: s.score for t, s in details.items()},
            "details": {t: {"n": s.n, "stderr": s.stderr} for t, s in details.items()},
            "average": math.fsum(s.score for s in details.values()) / len(details),
            "average_interval": average_interval(details)}


def _versus(first: dict[str, Any], other: dict[str, Any], seed: int) -> dict[str, Any]:
    """Per task, and for the average over tasks, the first model's score minus ``other``'s with its 95 % interval
    (sweeping.noise.compare: a paired bootstrap on shared examples, else normal from the standard errors)."""
    from ..sweeping.noise import compare

    out: dict[str, Any] = {t: compare({t: first[t]}, [{t: other[t]}], seed=seed)[0] for t in first if t in other}
    out["average"] = compare(first, [other], seed=seed)[0]
    return out


def _print(rows: list[dict[str, Any]], versus: list[dict[str, Any] | None]) -> None:
    """Per task (as the scorers named them: a command's or a function's own), each model's score ± its 95 %
    half-width (n), and the first's lead over it with its interval; a task a model was not scored on says so."""
    from ..sweeping.noise import Z95

    tasks = list(dict.fromkeys(t for row in rows for t in row["scores"]))
    for task in [*tasks, "average"]:
        typer.echo(task)
        for row, vs in zip(rows, versus):
            if task != "average" and task not in row["scores"]:
                typer.echo(f"  {row['model']}: not scored (its scorer gave no {task!r})")
                continue
            if task == "average":
                iv = row["average_interval"]
                text = f"{row['average']:.2f}" + (f" ± {iv['high'] - row['average']:.2f}" if iv else "")
            else:
                d = row["details"][task]
                text = f"{row['scores'][task]:.2f}" + (f" ± {Z95 * d['stderr']:.2f}" if d["stderr"] is not None
                                                         else "")
                text += f"  (n={d['n']})" if d["n"] is not None else ""
            c = vs.get(task) if vs else None
            if c is not None:
                text += (f"   first − this: {c['difference']:+.2f} [{c['low']:+.2f}, {c['high']:+.2f}] "
                         f"({c['how']}{', cannot tell apart' if c['indistinguishable'] else ''})")
            typer.echo(f"  {row['model']}: {text}")
    if any(set(row["scores"]) != set(tasks) for row in rows):
        typer.echo("(the averages are over different tasks: not comparable)")
