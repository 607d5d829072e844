"""The command line: parse, call the API, print, map errors to exit codes. No merging logic here."""

from __future__ import annotations

import sys

import typer

from ..errors import RLMergeError
from .console import err
from .demo import demo_command
from .fisher import fisher_command
from .merge import merge_command

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Merge RL-trained agents into one model: exact, streaming RAM / RAM+ and baselines.")
app.command("merge")(merge_command)
app.command("demo")(demo_command)
app.command("fisher")(fisher_command)


def main(argv: list[str] | None = None) -> int:
    """Console entry point; returns the exit code (1–4: see rlmerge.errors, 130: interrupted)."""
    try:
        app(args=argv, standalone_mode=False)
    except RLMergeError as e:
        err.print(f"[bold red]error:[/] {e.render()}", highlight=False, markup=True)
        return e.exit_code
    except KeyboardInterrupt:
        err.print("[bold red]interrupted[/]: nothing was written")
        return 130
    except typer.Exit as e:
        return e.exit_code
    except SystemExit as e:
        return int(e.code or 0)
    except Exception as e:  # click's usage errors
        import click

        if isinstance(e, click.ClickException):
            e.show()
            return e.exit_code
        raise
    return 0


def entry() -> None:
    sys.exit(main())
