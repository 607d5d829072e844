"""`rlmerge fisher`: estimate a model's diagonal Fisher on a JSONL file, for `--method fisher`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .console import escape, out


def fisher_command(
    model: Annotated[str, typer.Argument(help="the agent: a model folder or hub id")],
    data: Annotated[Path, typer.Option(help="JSONL: {'text': ...} or {'prompt': ..., 'completion': ...} per line")],
    output: Annotated[Path, typer.Option("-o", "--output", help="output folder (refused if it exists)")],
    examples: Annotated[int, typer.Option(help="number of examples (the first N lines)")] = 64,
    max_length: Annotated[int, typer.Option(help="tokens per example, at most")] = 512,
    device: Annotated[str, typer.Option(help="cpu or cuda")] = "cpu",
    force: Annotated[bool, typer.Option(help="replace an existing output folder")] = False,
) -> None:
    """Write the empirical diagonal Fisher of MODEL (mean over examples of squared log-likelihood gradients)."""
    from ..engine.fisher_estimate import estimate_fisher  # torch and transformers: imported when it runs

    path = estimate_fisher(model, data, output, examples=examples, max_length=max_length, device=device, force=force)
    out.print(f"wrote [bold]{escape(str(path))}[/]: merge with --method fisher --param fisher=F1,F2,...")
