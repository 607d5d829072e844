"""`rlmerge lab` and `rlmerge eval` (the `lab` extra): train specialists, merge them every way, score them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer


def lab_command(
    size: Annotated[str, typer.Option(help="smoke (CI, < 3 min) or tiny (< 20 min on 2 cores).")] = "tiny",
    out: Annotated[Path, typer.Option(help="Folder for checkpoints, results.json, table.md, plot.png.")] = Path(
        "lab-output"
    ),
    seeds: Annotated[int, typer.Option(min=1, help="Repeat the whole pipeline with this many seeds.")] = 1,
    first_seed: Annotated[int, typer.Option(min=0, help="Seeds run are first_seed .. first_seed+seeds-1.")] = 0,
    grpo_steps: Annotated[int | None, typer.Option(help="Override the GRPO steps per agent.")] = None,
    warmup_steps: Annotated[int | None, typer.Option(help="Override the base model's warm-up steps.")] = None,
) -> None:
    """Train a tiny base and three GRPO agents, merge them with every method, score all on held-out tasks."""
    from rlmerge.lab import pipeline

    if size not in pipeline.SIZES:
        raise typer.BadParameter(f"unknown size {size!r}; choose from {', '.join(pipeline.SIZES)}")
    pipeline.SIZES[size] = pipeline.with_steps(pipeline.SIZES[size], grpo_steps, warmup_steps)
    summary = pipeline.run_lab(size, out, seeds=seeds, first_seed=first_seed)
    typer.echo(summary["table"])
    for res in summary["seeds"]:
        for label, reason in res["skipped"].items():
            typer.echo(f"skipped {label}: {reason}")
        for warning in res["warnings"]:
            typer.echo(f"warning (seed {res['seed']}): {warning}")
    typer.echo(
        f"\nwrote {out / 'results.json'}, {out / 'table.md'}, {out / 'plot.png'} in {summary['total_seconds']:.0f} s"
    )


def eval_command(
    model: Annotated[Path, typer.Argument(help="A Hugging Face causal-LM checkpoint folder.")],
    tasks: Annotated[str, typer.Option(help="Comma-separated families: tool_use,coding,memory.")] = (
        "tool_use,coding,memory"
    ),
    n: Annotated[int, typer.Option(min=1, help="Test examples per task.")] = 128,
    seed: Annotated[int, typer.Option(help="Test-set seed (the lab's seed-0 test set by default).")] = 0,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON instead of a line per task.")] = False,
) -> None:
    """Score any HF checkpoint with the lab's verifiable scorers on held-out test sets."""
    import torch

    from rlmerge.lab.evaluate import score_checkpoint
    from rlmerge.lab.tasks import make_family, make_split

    torch.set_num_threads(1)
    names = [t.strip() for t in tasks.split(",") if t.strip()]
    try:
        test = {name: make_split(make_family(name), "test", n, seed) for name in names}
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    scores = score_checkpoint(model, test)
    if json_out:
        typer.echo(json.dumps({k: 100.0 * v for k, v in scores.items()}))
        return
    for name, value in scores.items():
        typer.echo(f"{name:10s} {100.0 * value:5.1f} %  (n={n})")
    typer.echo(f"{'average':10s} {100.0 * sum(scores.values()) / len(scores):5.1f} %")

