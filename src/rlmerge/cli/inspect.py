"""`rlmerge inspect`: measure the agents' task vectors before choosing a method; nothing is merged."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..engine.anatomy import DEFAULT_THRESHOLDS, inspect
from ..errors import ConfigError
from .console import err, out


def parse_thresholds(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise ConfigError(f"--thresholds {text!r} is not a comma-separated list of numbers",
                          hint="e.g. --thresholds 1e-6,1e-4,1e-3") from None


def inspect_command(
    models: Annotated[list[str], typer.Argument(help="BASE then AGENT... (folders or hub ids)")],
    eps: Annotated[float, typer.Option("--eps", help="changed means |τ| > eps")] = 1e-5,
    thresholds: Annotated[str, typer.Option(help="other |τ| thresholds to count, comma-separated")]
    = ",".join(f"{t:g}" for t in DEFAULT_THRESHOLDS),
    json_out: Annotated[bool, typer.Option("--json", help="print the report as JSON on stdout")] = False,
    markdown: Annotated[bool, typer.Option("--markdown", help="print the report as Markdown on stdout")] = False,
    save: Annotated[Path | None, typer.Option("--save", help="also write the JSON report to this file")] = None,
    plots: Annotated[Path | None, typer.Option("--plots", help="write PNG figures into this folder")] = None,
    block_size: Annotated[int | None, typer.Option(help="elements per block (memory bound)")] = None,
    device: Annotated[str, typer.Option(help="cpu or cuda")] = "cpu",
    allow_missing: Annotated[bool, typer.Option(help="an agent missing a tensor counts as unchanged")] = False,
    count_tied_twice: Annotated[bool, typer.Option(help="count tied embeddings twice, as the authors' script")]
    = False,
    quiet: Annotated[bool, typer.Option("-q", "--quiet", help="no progress bar")] = False,
    force: Annotated[bool, typer.Option(help="replace a --save report or --plots folder rlmerge wrote earlier")]
    = False,
) -> None:
    """Show what the task vectors (AGENT − BASE) look like: density, overlap, ρ/λ, similarity, per layer."""
    if len(models) < 2:
        raise ConfigError("need BASE and at least one AGENT")
    if json_out and markdown:
        raise ConfigError("--json and --markdown both print on stdout: choose one", hint="use --save FILE for JSON")
    extra = {"block_size": block_size} if block_size is not None else {}
    rep = inspect(models[0], models[1:], epsilon=eps, thresholds=parse_thresholds(thresholds), device=device,
                  allow_missing=allow_missing, count_tied_twice=count_tied_twice,
                  quiet=quiet or json_out or markdown, save=save, plots=plots, force=force, **extra)
    for path in [save, plots]:
        if path is not None:
            err.print(f"wrote {path}", markup=False)
    if json_out:
        typer.echo(rep.to_json(), nl=False)
    elif markdown:
        typer.echo(rep.to_markdown())
    else:
        from ..report.tables import print_report

        print_report(rep.doc, out)
