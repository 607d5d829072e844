"""`rlmerge plan`: a dry run. Every problem at once, bytes to read and write, passes, peak memory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from ..engine.dryrun import DryRun, dry_run
from ..errors import ProblemsError
from . import options as o
from .console import err, escape, out
from .merge import gather, print_notes


@o.method_flags
def plan_command(
    models: o.Models = None,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="output folder to check")] = None,
    method: o.Method = None,
    recipe: o.Recipe = None,
    param: o.Param = None,
    dtype: o.Dtype = None,
    shard_size: o.ShardSize = None,
    block_size: o.BlockSize = None,
    allow_missing: o.AllowMissing = False,
    count_tied_twice: o.CountTiedTwice = False,
    tokenizer_source: o.TokenizerSource = None,
    chat_template: o.ChatTemplate = None,
    force: Annotated[bool, typer.Option(help="the merge will replace an existing output")] = False,
    resume: Annotated[bool, typer.Option(help="the merge will resume an interrupted one")] = False,
    device: Annotated[str | None, typer.Option(help="cpu or cuda (as the merge's)")] = None,
    seed: Annotated[int | None, typer.Option(help="the merge's seed (its --resume must be given the same)")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="print the report as JSON on stdout")] = False,
    output_format: o.OutputFormat = None,
    rank: o.Rank = None,
    non_linear: o.NonLinear = None,
    push_to_hub: o.PushToHub = None,
    revision: o.Revision = None,
    flags: dict[str, Any] | None = None,  # the methods' own options (options.method_flags)
) -> None:
    """Check a merge from headers only (no weight is read): report every problem and what it will cost."""
    req = gather(models, recipe, method, dtype, param, **(flags or {}))
    options = {k: v for k, v in req.options.items()
               if k in ("shard_size", "block_size", "tokenizer_source", "chat_template", "seed", "device")}
    allow_missing = allow_missing or bool(req.options.get("allow_missing", False))
    count_tied_twice = count_tied_twice or bool(req.options.get("count_tied_twice", False))
    options.update({k: v for k, v in {"shard_size": shard_size, "block_size": block_size,
                                      "tokenizer_source": tokenizer_source, "chat_template": chat_template,
                                      "output_format": output_format, "rank": rank, "non_linear": non_linear,
                                      "push_to_hub": push_to_hub, "revision": revision, "seed": seed,
                                      "device": device}.items()
                    if v is not None})
    report = dry_run(req.base, req.agents, output, method=req.method, params=req.params, dtype=req.dtype,
                     allow_missing=allow_missing, count_tied_twice=count_tied_twice, force=force, resume=resume,
                     recipe=req.raw, **options)
    if json_out:
        doc = report.to_json()
        doc["warnings"] = [*req.warnings, *doc["warnings"]]
        out.print_json(json.dumps({**doc, **({"defaults": req.defaults} if req.defaults else {})}))
    else:
        print_notes(req)
        print_report(report)
    if report.problems:
        raise ProblemsError(report.problems) if len(report.problems) > 1 else report.problems[0]


def _size(n: int | None) -> str:
    if n is None:
        return "?"
    value, unit = next((n / f, u) for f, u in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB"), (1, "B"))
                       if n >= f or f == 1)
    return f"{value:.3g} {unit}" if unit != "B" else f"{n} B"


def print_report(r: DryRun) -> None:
    if r.match is not None:
        merged = len(r.match.merge_jobs)
        out.print(f"method {escape(r.method)}: {len(r.match.jobs)} tensors ({merged} merged, "
                  f"{len(r.match.jobs) - merged} copied), {len(r.match.agents)} agents")
        if r.tokenizer is not None:
            added = r.tokenizer.added
            rows = r.tokenizer.vocab_size or "the base's"
            out.print(f"tokenizer: {escape(r.tokenizer.source)}; chat template: {escape(r.tokenizer.chat_template)}"
                      + (f"; {len(added)} token(s) added, {rows} rows" if added else ""))
        if not r.passes:  # no route: a problem below stops the merge before anything is read or written
            out.print("passes: none planned until the problems below are fixed")
        else:
            if r.write_at_most:
                written = (f"write at most {_size(r.write_bytes)} as a LoRA adapter (rank {escape(str(r.rank))}; "
                           "only the changed non-linear tensors are saved)")
            else:
                written = (f"write {_size(r.write_bytes)} in {r.shards} shard(s), merged tensors as "
                           f"{'/'.join(r.match.merged_dtypes)}")
            out.print(f"passes: {' + '.join(r.passes)}; read {_size(r.read_bytes)}, {written}")
    if r.memory is not None:
        avail = "unknown" if r.available_memory is None else f"{r.available_memory / 2**30:.2f} GiB"
        out.print(f"peak memory ≈ {r.memory.total / 2**30:.2f} GiB (blocks of {r.memory.block:,} elements; "
                  f"available {avail})" + (f"; plus {_size(r.memory.mapped)} of memory-mapped .bin files"
                                           if r.memory.mapped else ""))
    for w in r.warnings:
        err.print(f"[yellow]warning:[/] {escape(w)}")
    if r.ok:
        out.print("[green]ok[/]: no problems found")
