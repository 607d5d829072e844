"""`rlmerge demo`: build a tiny base and three RL-like sparse agents, merge them with RAM+, show ρ and λ."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..engine.merge import merge
from ..io.partial import check_output
from .console import out
from .merge import print_result


def demo_command(
    workdir: Annotated[Path, typer.Option(help="where the example models and the merge go")] = Path("demo-output"),
) -> None:
    """Merge a built-in example: agents with the paper's densities (3.2 / 46.2 / 54.3 %)."""
    from ..synthetic import PAPER_DENSITIES, make_example  # torch builds the example: imported when it runs

    out.print(f"building a tiny Qwen2 base and 3 agents with densities "
              f"{', '.join(f'{d:.1%}' for d in PAPER_DENSITIES)} in {workdir}/ …", markup=False)
    # before the example is (re)written; the hints name --workdir, the option that named these folders
    check_output(workdir / "merged-ram+", [], force=True, option="--workdir")
    base, agents = make_example(workdir / "inputs", owned=True, option="--workdir")  # replaces only an earlier demo's
    res = merge(base, agents, workdir / "merged-ram+", method="ram+", params={"preset": "paper"}, force=True,
                quiet=False)
    print_result(res)
    out.print(f"model card: {res.output / 'README.md'}; provenance: {res.output / 'rlmerge.json'}", markup=False)
