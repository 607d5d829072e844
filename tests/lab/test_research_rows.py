"""The research rows beyond the paper (issue 17, item 4): in both labs' tables with grids as large as every other
tuned row's, runnable by the installed engine, compared against TA and RAM+, and measurable alone (--rows)."""

from __future__ import annotations

import pytest

from rlmerge.lab.merging import SMOLLM2_GRIDS, TINY_GRIDS, plan_skip_reason
from rlmerge.lab.paired import PAIRS

ROWS = ("ARM-R", "ARM-TIES", "RAM+ magnitude-ρ", "RAM+ sign-elect")


@pytest.mark.parametrize("plans", [TINY_GRIDS, SMOLLM2_GRIDS], ids=["tiny", "smollm2"])
def test_each_row_has_a_grid_as_large_as_the_other_tuned_rows(plans) -> None:
    by_label = {p.label: p for p in plans}
    tuned = {len(p.candidates()) for p in plans if p.grid and len(p.candidates()) > 1}
    assert len(tuned) == 1  # every tuned row: the same number of grid points
    for row in ROWS:
        assert len(by_label[row].candidates()) in tuned, row
        assert plan_skip_reason(by_label[row]) is None, row  # the engine registers the method and every point


def test_each_row_is_compared_with_ta_and_ram_plus() -> None:
    for row in ROWS:
        assert (row, "Task arithmetic") in PAIRS and (row, "RAM+") in PAIRS


def test_rows_option_refuses_an_unknown_row() -> None:
    typer_testing = pytest.importorskip("typer.testing")
    import typer

    from rlmerge.cli.lab import lab_command

    app = typer.Typer()
    app.command("lab")(lab_command)
    app.command("other")(lambda: None)  # two commands: typer keeps the subcommand name
    result = typer_testing.CliRunner().invoke(app, ["lab", "--out", "unused", "--rows", "RAM+,No such row"])
    assert result.exit_code == 2 and "No such row" in result.output and "ARM-TIES" in result.output
