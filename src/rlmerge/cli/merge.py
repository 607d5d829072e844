"""`rlmerge merge`: base and agents from the command line or a recipe, then one call to rlmerge.merge."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from ..engine.merge import MergeResult, merge
from ..errors import ConfigError
from ..recipe import load_recipe
from . import options as o
from .console import err, escape, out


def parse_param(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"--param {text!r} is not KEY=VALUE")
    return key.strip(), value.strip()


@dataclass
class Request:
    """What the command line (or a recipe) asks to merge: models, method, parameters, run options."""

    base: str
    agents: list[str]
    method: str
    params: dict[str, Any]
    dtype: str | None
    options: dict[str, Any]
    raw: dict[str, Any] | None
    defaults: list[str] = field(default_factory=list)  # mergekit's defaults a recipe took (printed, provenance)
    warnings: list[str] = field(default_factory=list)  # what a recipe gives that is ignored, as mergekit ignores it


def gather(models: list[str] | None, recipe: Path | None, method: str | None, dtype: str | None,
           param: list[str] | None, **flags: Any) -> Request:
    """Models from the command line or a recipe, the recipe's values overridden by explicit flags."""
    from ..methods import ALIASES, REGISTRY

    params: dict[str, Any] = {}
    options: dict[str, Any] = {}
    raw = None
    defaults: list[str] = []
    warnings: list[str] = []
    if recipe is not None:
        rec = load_recipe(recipe, methods={*REGISTRY, *ALIASES})
        if models:
            raise ConfigError("give models either on the command line or in --recipe, not both")
        base, agents, raw = rec.base, rec.agents, rec.raw
        method, dtype = method or rec.method, dtype or rec.dtype
        params.update(rec.parameters)
        options.update(rec.options)
        defaults, warnings = rec.defaults, rec.warnings
    else:
        if not models or len(models) < 2:
            raise ConfigError("need BASE and at least one AGENT (or --recipe)")
        base, agents = models[0], models[1:]
    given = {k: v for k, v in flags.items() if v is not None}
    given.update(dict(parse_param(p) for p in param or []))
    params.update(given)
    defaults = [d for d in defaults if d.split(" = ")[0] not in given]  # a flag overrides a recipe's default
    return Request(base, list(agents), method or "ram+", params, dtype, options, raw, defaults, warnings)


def print_notes(req: Request) -> None:
    """The defaults a recipe took and what it gives that is ignored: said before anything runs."""
    for d in req.defaults:
        err.print(f"[cyan]default:[/] {escape(d)}")
    for w in req.warnings:
        err.print(f"[yellow]warning:[/] {escape(w)}")


@o.method_flags
def merge_command(
    models: o.Models = None,
    output: Annotated[Path, typer.Option("-o", "--output", help="output folder (refused if it exists)")] = ...,
    method: o.Method = None,
    recipe: o.Recipe = None,
    param: o.Param = None,
    dtype: o.Dtype = None,
    shard_size: o.ShardSize = None,
    block_size: o.BlockSize = None,
    device: Annotated[str | None, typer.Option(help="cpu or cuda")] = None,
    force: Annotated[bool, typer.Option(help="replace an existing output folder")] = False,
    resume: Annotated[bool, typer.Option(help="continue an interrupted merge after its last complete shard")]
    = False,
    fsync: Annotated[bool, typer.Option(help="flush the output to disk before reporting success (--no-fsync: "
                                              "leave it to the OS, as transformers and mergekit do)")] = True,
    allow_missing: o.AllowMissing = False,
    count_tied_twice: o.CountTiedTwice = False,
    tokenizer_source: o.TokenizerSource = None,
    chat_template: o.ChatTemplate = None,
    seed: Annotated[int | None, typer.Option(help="seed for random methods")] = None,
    quiet: Annotated[bool, typer.Option("-q", "--quiet", help="no progress bars or tables")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="print the result as JSON on stdout")] = False,
    backend: Annotated[str, typer.Option(help=escape("local, or ray: the passes as Ray tasks split by output shard, "
                                                     "the same bytes (pip install 'rlmerge[ray]'; docs/scale.md)"))]
    = "local",
    workers: Annotated[int | None, typer.Option(min=1, help="--backend ray: tasks at once")] = None,
    push_to_hub: o.PushToHub = None,
    private: o.Private = False,
    revision: o.Revision = None,
    output_format: o.OutputFormat = None,
    rank: o.Rank = None,
    non_linear: o.NonLinear = None,
    flags: dict[str, Any] | None = None,  # the methods' own options (options.method_flags)
) -> None:
    """Merge AGENTs (RL fine-tunes of BASE) into one Hugging Face checkpoint (or a LoRA adapter of BASE)."""
    req = gather(models, recipe, method, dtype, param, **(flags or {}))
    options = dict(req.options)
    run = {"shard_size": shard_size, "block_size": block_size, "device": device, "seed": seed,
           "tokenizer_source": tokenizer_source, "chat_template": chat_template, "output_format": output_format,
           "rank": rank, "non_linear": non_linear}
    options.update({k: v for k, v in run.items() if v is not None})
    options["allow_missing"] = allow_missing or options.get("allow_missing", False)
    options["count_tied_twice"] = count_tied_twice or options.get("count_tied_twice", False)
    if not json_out:
        print_notes(req)
    run_merge = merge
    if backend == "ray":
        from ..engine.distributed import merge_on_ray  # Ray is imported only here

        run_merge = functools.partial(merge_on_ray, workers=workers)
    elif backend != "local":
        raise ConfigError(f"--backend {backend!r}", hint="local or ray")
    res = run_merge(req.base, req.agents, output, method=req.method, params=req.params, dtype=req.dtype, force=force,
                    quiet=quiet or json_out, recipe=req.raw, resume=resume, fsync=fsync, defaults=req.defaults,
                    notes=req.warnings, **options, **({"push_to_hub": push_to_hub, "private": private,
                                                      "revision": revision} if push_to_hub else {}))
    for w in res.warnings:
        if w not in req.warnings:  # said before the merge
            err.print(f"[yellow]warning:[/] {escape(w)}")
    if json_out:
        out.print_json(json.dumps(result_json(res)))
    elif not quiet:
        print_result(res)
    if res.adapter is not None and not (quiet or json_out):
        mats = res.adapter["matrices"]
        ranks = [m["rank"] for m in mats.values()]
        out.print(f"LoRA adapter: {len(mats)} matrices, rank {min(ranks, default=0)}–{max(ranks, default=0)} "
                  f"(--rank {res.adapter['rank']}), largest relative error {res.adapter['max_relative_error']:.3g}; "
                  f"saved whole: {', '.join(res.adapter['modules_to_save']) or 'none'}")
    if res.url is not None and not json_out:
        out.print(f"pushed to [bold]{escape(res.url)}[/]")


def result_json(res: MergeResult) -> dict[str, Any]:
    from ..report.provenance import agent_rows

    return {"output": str(res.output), "method": res.method, "agents": agent_rows(res),
            "seconds": round(res.seconds, 3), "read_bytes": res.read_bytes, "write_bytes": res.write_bytes,
            "merged_dtypes": res.merged_dtypes, "warnings": res.warnings,
            **({"defaults": res.defaults} if res.defaults else {}), **({"url": res.url} if res.url else {}),
            **({"adapter": res.adapter} if res.adapter else {})}


def print_result(res: MergeResult) -> None:
    from ..report.provenance import COLUMN, agent_rows

    rows = agent_rows(res)
    table = Table(title=escape(f"{res.method} merge of {len(rows)} agents"))
    cols = [c for c in ("agent", "density", "kept", "unique", "shared", "rho", "lambda", "lambda_kept")
            if c in rows[0]]
    for c in cols:
        table.add_column(COLUMN.get(c, c), justify="left" if c == "agent" else "right")
    for row in rows:
        row = {**row, "agent": Path(row["agent"]).name or row["agent"]}  # full paths are in rlmerge.json
        table.add_row(*(escape(_fmt(c, row[c])) for c in cols))
    out.print(table, soft_wrap=False)
    gb = (res.read_bytes + res.write_bytes) / 1e9
    out.print(f"wrote [bold]{escape(str(res.output))}[/] ({'/'.join(res.merged_dtypes)}) in {res.seconds:.1f} s "
              f"({gb:.2f} GB read + written)")


def _fmt(col: str, v: Any) -> str:
    from ..report.provenance import PERCENT

    if v is None:
        return "—"
    if col in PERCENT:
        return f"{v:.2%}"
    if isinstance(v, float):
        return f"{v:.4f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)
