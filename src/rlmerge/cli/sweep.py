"""`rlmerge sweep`: candidates from --candidate grids or a YAML recipe, scored on --tasks; one call to rlmerge.sweep."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.live import Live
from rich.table import Table

from ..errors import ConfigError
from ..sweeping.candidates import load_sweep_recipe
from ..sweeping.space import parse_spaces
from ..sweeping.sweep import Scored, SweepResult, sweep
from . import options as o
from .console import err, escape, out


def sweep_command(
    models: o.Models = None,
    output: Annotated[Path, typer.Option("-o", "--output", help="the sweep's folder: results.json, report.md, "
                                                                  "plot.png, the kept checkpoints")] = ...,
    candidate: Annotated[list[str] | None, typer.Option(
        "--candidate", help='a grid, repeatable: "METHOD KEY=V1,V2 KEY=V3" (every combination is a candidate); '
                            'with --search, a space: KEY=LO..HI, KEY=LO..HI:log, KEY=a,b (several: the method is '
                            'a choice too)')]
    = None,
    search: Annotated[str | None, typer.Option(help=escape(
        "grid (default: every candidate), or random, tpe, cmaes: --trials candidates sampled by Optuna "
        "(pip install 'rlmerge[search]')"))] = None,
    trials: Annotated[int | None, typer.Option(min=1, help="--search: trials told to the study (a failed one "
                                                           "counts); --resume continues to this many")] = None,
    confirm: Annotated[str | None, typer.Option(help="score the kept candidates (--keep K, else the best 3) again "
                                                     "on this held-out split (test), beside their search score")]
    = None,
    references: Annotated[bool, typer.Option(
        "--references", help="score the base and each agent as they are, on the same tasks and examples, before the "
                             "candidates (one scoring per input; never ranked or kept): report.md then says what "
                             "the best input scored on each task and how much of it each candidate keeps")] = False,
    recipe: Annotated[Path | None, typer.Option(help="YAML: base_model, models, candidates, and any option")] = None,
    tasks: o.Tasks = None,
    limit: o.Limit = None,
    split: Annotated[str | None, typer.Option(help="the lab tasks' split: val (default) or test")] = None,
    lab_view: o.LabView = None,
    keep: Annotated[int | None, typer.Option(min=0, help="write the best K candidates as checkpoints")] = None,
    backend: Annotated[str | None, typer.Option(help=escape("local, or ray (pip install 'rlmerge[ray]')"))] = None,
    workers: Annotated[int | None, typer.Option(min=1, help="Ray: candidates scored at once")] = None,
    memory: Annotated[str | None, typer.Option(help="build candidates in memory: auto (when they fit), "
                                                    "always, never")] = None,
    resume: Annotated[bool, typer.Option(help="continue a stopped sweep; finished candidates are not redone")]
    = False,
    force: Annotated[bool, typer.Option(help="start over in a sweep folder rlmerge wrote")] = False,
    dtype: o.Dtype = None,
    block_size: o.BlockSize = None,
    device: Annotated[str | None, typer.Option(help="cpu or cuda")] = None,
    seed: Annotated[int | None, typer.Option(help="seed of random methods (a grid may give seed=0,1)")] = None,
    allow_missing: o.AllowMissing = False,
    count_tied_twice: o.CountTiedTwice = False,
    include_path: o.IncludePath = None,
    num_fewshot: o.NumFewshot = None,
    batch_size: o.BatchSize = None,
    lm_eval_backend: o.LmEvalBackend = None,
    cmd_timeout: o.CmdTimeout = None,
    cmd_env: o.CmdEnv = None,
    cmd_cwd: o.CmdCwd = None,
    quiet: Annotated[bool, typer.Option("-q", "--quiet", help="no live table")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="print results.json's ranking as JSON")] = False,
    push_to_hub: o.PushToHub = None,
    private: o.Private = False,
    revision: o.Revision = None,
    unsafe_unisolated_code: o.UnsafeUnisolatedCode = False,
) -> None:
    """Merge every candidate of BASE and AGENTs, score each on --tasks, rank them, keep the best."""
    if unsafe_unisolated_code:
        from ..sandbox import allow_unisolated

        allow_unisolated()
    flags = {"tasks": tasks, "limit": limit, "split": split, "lab_view": lab_view,
             "keep": keep, "search": search, "trials": trials, "confirm": confirm, "references": references or None,
             "backend": backend, "workers": workers, "memory": memory, "dtype": dtype, "block_size": block_size,
             "device": device, "seed": seed, "allow_missing": allow_missing or None,
             "count_tied_twice": count_tied_twice or None, "num_fewshot": num_fewshot, "batch_size": batch_size,
             "include_path": [str(p) for p in include_path] if include_path else None,
             "lm_eval_backend": lm_eval_backend, "cmd_timeout": cmd_timeout, "cmd_env": cmd_env,
             "cmd_cwd": str(cmd_cwd) if cmd_cwd is not None else None}
    base, agents, grids, s = _gather(models, recipe, candidate, {k: v for k, v in flags.items() if v is not None})
    scorer = None
    if s.get("tasks"):
        scorer = o.task_scorer(s, split="val")
    else:
        err.print("[yellow]warning:[/] no --tasks: the candidates are merged, not scored")
    held_out = None
    if s.get("confirm"):
        if scorer is None:
            raise ConfigError(f"--confirm {s['confirm']}: nothing is scored (no --tasks)")
        held_out = scorer.held_out(s["confirm"])
    table = _LiveTable(quiet=quiet or json_out)
    with table:
        res = sweep(base, agents, output, candidates=grids, scorer=scorer, keep=s.get("keep", 0), resume=resume,
                    force=force, backend=s.get("backend", "local"), workers=s.get("workers"),
                    memory=s.get("memory", "auto"), dtype=s.get("dtype"), device=s.get("device", "cpu"),
                    seed=s.get("seed", 0), allow_missing=s.get("allow_missing", False),
                    count_tied_twice=s.get("count_tied_twice", False),
                    settings=scorer.settings() if scorer is not None else {},
                    on_result=table.add, quiet=quiet or json_out, search=s.get("search", "grid"),
                    trials=s.get("trials"), confirm=held_out, push_to_hub=push_to_hub, private=private,
                    revision=revision, references=s.get("references", False),
                    **({"block_size": s["block_size"]} if s.get("block_size") else {}))
    _warn_failures(res)
    if json_out:
        out.print_json(json.dumps(_summary(res)))
    elif not quiet:
        _print_summary(res)


def _gather(models: list[str] | None, recipe: Path | None, grids: list[str] | None,
            flags: dict[str, Any]) -> tuple[str, list[str], list[Any], dict[str, Any]]:
    """Models, candidates and settings from the command line or a recipe, the recipe's values overridden by flags."""
    settings: dict[str, Any] = {}
    cands: list[Any] = list(grids or [])
    if recipe is not None:
        rec = load_sweep_recipe(recipe, search=flags.get("search"))
        if models:
            raise ConfigError("give models either on the command line or in --recipe, not both")
        base, agents = rec.base, rec.agents
        cands = [*rec.candidates, *cands]
        settings.update(rec.settings)
    else:
        if not models or len(models) < 2:
            raise ConfigError("need BASE and at least one AGENT (or --recipe)")
        base, agents = models[0], models[1:]
    if not cands:
        raise ConfigError("no candidates", hint='give --candidate "ram+ r=0.05,0.1 alpha=1,2" (repeatable)')
    settings.update(flags)
    if recipe is not None and settings.get("search", "grid") != "grid":  # a recipe's spaces, named by its file
        parse_spaces(rec.candidates, seed=settings.get("seed", 0), where=f"{recipe}: candidates")
    return base, agents, cands, settings


class _LiveTable:
    """The candidates as they are scored, best average first (rich Live on stderr). It appears with the first
    candidate scored, so a sweep refused at its checks prints only the refusal."""

    def __init__(self, *, quiet: bool) -> None:
        self.rows: list[Scored] = []
        self.quiet = quiet
        self.live: Live | None = None

    def __enter__(self) -> _LiveTable:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.live is not None:
            self.live.stop()

    def add(self, s: Scored) -> None:
        self.rows.append(s)
        if self.quiet:
            return
        if self.live is None:
            self.live = Live(self._table(), console=err, refresh_per_second=4, transient=False)
            self.live.start()
        else:
            self.live.update(self._table())

    def _table(self) -> Table:
        tasks = list(dict.fromkeys(k for s in self.rows for k in s.scores))
        t = Table(title=f"rlmerge sweep: {len(self.rows)} candidate(s) scored")
        for col in ("candidate", *tasks, "average", "built in", "passes", "s"):
            t.add_column(col, justify="left" if col == "candidate" else "right")
        for s in sorted(self.rows, key=lambda s: -(s.average if s.average is not None else float("-inf"))):
            t.add_row(escape(s.candidate.label), *(f"{s.scores[k]:.2f}" if k in s.scores else "—" for k in tasks),
                      f"{s.average:.2f}" if s.average is not None else "failed" if s.error else "—", s.where,
                      "+".join(s.passes), f"{s.merge_seconds + s.score_seconds:.1f}")
        return t


def _summary(res: SweepResult) -> dict[str, Any]:
    return {"output": str(res.output), "ranking": [{"label": s.candidate.label, "id": s.candidate.id,
                                                    "scores": s.scores, "average": s.average,
                                                    **({"error": s.error} if s.error else {})} for s in res.ranking],
            "pareto": [s.candidate.id for s in res.pareto], "kept": [str(p) for p in res.kept],
            "indistinguishable": [s.candidate.id for s in res.indistinguishable],
            "confirmed": {cid: {"scores": c.scores, "average": c.average, **({"error": c.error} if c.error else {})}
                          for cid, c in res.confirmed.items()},
            "references": [{"id": r.candidate.id, "name": r.candidate.label, "scores": r.scores, "average": r.average,
                            **({"error": r.error} if r.error else {})} for r in res.references],
            "statistics_passes": res.statistics_passes, "merge_passes": res.merge_passes, "url": res.url,
            "seconds": round(res.seconds, 3)}


def _print_summary(res: SweepResult) -> None:
    out.print(f"{len(res.scored)} candidates: {res.statistics_passes} statistics pass(es), "
              f"{res.merge_passes} merge pass(es), {res.seconds:.1f} s")
    if res.ranking and res.ranking[0].average is not None:
        best = res.ranking[0]
        out.print(f"best: [bold]{escape(best.candidate.label)}[/] (average {best.average:.2f})")
        if len(res.indistinguishable) > 1:
            out.print(f"{len(res.indistinguishable) - 1} other candidate(s) are indistinguishable from it (95 % "
                      "interval of the difference contains 0): see report.md")
    for cid, c in res.confirmed.items():
        s = next(x for x in res.scored if x.candidate.id == cid)
        said = f"{c.average:.2f}" if c.average is not None else f"failed ({c.error})"
        out.print(f"confirmed {escape(s.candidate.label)}: search {s.average:.2f}, held out {escape(said)}")
    for p in res.kept:
        out.print(f"kept [bold]{escape(str(p))}[/]")
    if res.url is not None:
        out.print(f"pushed {escape(str(res.kept[0]))} to [bold]{escape(res.url)}[/]")
    if res.output is not None:
        out.print(f"wrote {res.output / 'results.json'} and {res.output / 'report.md'}", markup=False)


def _warn_failures(res: SweepResult) -> None:
    """Candidates the scorer failed on (the sweep went on): how many, and each one's message."""
    for r in res.references:
        if r.error is not None:
            err.print(f"[yellow]warning:[/] the scorer failed on input {escape(r.candidate.label)} (--references; "
                      f"recorded in results.json and report.md): {escape(r.error)}")
    if res.failed:
        err.print(f"[yellow]warning:[/] the scorer failed on {len(res.failed)} of {len(res.scored)} candidate(s); "
                  "they are ranked last and never kept (recorded in results.json and report.md):")
        for s in res.failed:
            err.print(f"  {s.candidate.label}: {s.error}", markup=False)
