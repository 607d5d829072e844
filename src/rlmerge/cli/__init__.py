"""The command line: parse, call the API, print, map errors to exit codes. No merging logic here."""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any

import typer

from ..errors import RLMergeError
from .console import err
from .demo import demo_command
from .merge import merge_command
from .plan import plan_command

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Merge RL-trained agents into one model: exact, streaming RAM / RAM+ and baselines.")
app.command("merge")(merge_command)
app.command("plan")(plan_command)
app.command("demo")(demo_command)


def main(argv: list[str] | None = None) -> int:
    """Console entry point; returns the exit code (1–4: see rlmerge.errors, 130: interrupted)."""
    previous = _sigterm_as_interrupt()
    try:
        app(args=argv, standalone_mode=False)
    except RLMergeError as e:
        err.print(f"[bold red]error:[/] {e.render()}", highlight=False, markup=True)
        return e.exit_code
    except KeyboardInterrupt as e:
        kept = getattr(e, "rlmerge_hint", None)
        err.print(f"[bold red]interrupted[/]: {kept or 'nothing was written'}", highlight=False)
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
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 0


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _sigterm_as_interrupt() -> Any:
    """SIGTERM (kill, a job scheduler's timeout) takes Ctrl-C's path: the partial output is cleaned up
    or kept for --resume, never left looking finished. Returns the previous handler."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _interrupt)


def entry() -> None:
    sys.exit(main())
