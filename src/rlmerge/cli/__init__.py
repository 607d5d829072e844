"""The command line: parse, call the API, print, map errors to exit codes. No merging logic here."""

from __future__ import annotations

import functools
import signal
import sys
import threading
from collections.abc import Callable
from inspect import cleandoc  # (the package's own .inspect submodule would shadow `inspect`)
from typing import Any

import typer

from ..errors import Interrupted, RLMergeError
from .console import err, escape
from .demo import demo_command
from .evaluate import eval_command
from .fisher import fisher_command
from .inspect import inspect_command
from .lab import lab_command
from .merge import merge_command
from .plan import plan_command
from .sweep import sweep_command

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Merge RL-trained agents into one model: exact, streaming RAM / RAM+ and baselines.")


def _interruptible(command: Callable[..., None]) -> Callable[..., None]:
    """Turn Ctrl-C / SIGTERM inside a command into ``Interrupted`` (exit 130) carrying what was kept.

    typer would otherwise swallow the KeyboardInterrupt into a bare exit code and lose the message.
    """

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> None:
        try:
            command(*args, **kwargs)
        except KeyboardInterrupt as e:
            raise Interrupted(f"interrupted: {getattr(e, 'rlmerge_hint', None) or 'nothing was written'}") from e
        except Exception as e:
            # An error raised while the interrupt unwound (a cleanup step that failed) must not hide it: the run
            # was still interrupted, and the user is told both.
            stop = _interrupt_behind(e)
            if stop is None:
                raise
            what = getattr(stop, "rlmerge_hint", None) or "nothing was written"
            detail = e.render() if isinstance(e, RLMergeError) else f"{type(e).__name__}: {e}"
            raise Interrupted(f"interrupted: {what} (and while stopping: {detail})") from e

    return run


def _interrupt_behind(e: BaseException) -> KeyboardInterrupt | None:
    """The KeyboardInterrupt that ``e`` was raised while handling, if any."""
    seen: set[int] = set()
    cur: BaseException | None = e.__context__
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, KeyboardInterrupt):
            return cur
        seen.add(id(cur))
        cur = cur.__context__
    return None


def _command(name: str, fn: Callable[..., None], *, interruptible: bool = True) -> None:
    """Register a command; its docstring is its help, as text (typer reads help as Rich markup)."""
    app.command(name, help=escape(cleandoc(fn.__doc__ or "")))(_interruptible(fn) if interruptible else fn)


_command("merge", merge_command)
_command("plan", plan_command, interruptible=False)
_command("demo", demo_command)
_command("fisher", fisher_command)
_command("inspect", inspect_command)
_command("lab", lab_command)
_command("eval", eval_command, interruptible=False)
_command("sweep", sweep_command)


def main(argv: list[str] | None = None) -> int:
    """Console entry point; returns the exit code (1–4: see rlmerge.errors, 130: interrupted)."""
    previous = _sigterm_as_interrupt()
    try:
        rc = app(args=argv, standalone_mode=False)
    except RLMergeError as e:
        return report_error(e)
    except KeyboardInterrupt:  # outside a command (while parsing arguments)
        err.print("[bold red]interrupted[/]: nothing was written")
        return 130
    except typer.Exit as e:
        return e.exit_code
    except SystemExit as e:
        return int(e.code or 0)
    except Exception as e:  # click's usage errors
        import click

        usage = [click.ClickException]
        try:  # typer ≥ 0.29 raises its own vendored copy of click's exceptions
            from typer._click.exceptions import ClickException as TyperClickException

            usage.append(TyperClickException)
        except ImportError:
            pass
        if isinstance(e, tuple(usage)):
            e.show()
            return e.exit_code
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return rc if isinstance(rc, int) else 0


def report_error(e: RLMergeError) -> int:
    """Print ``e`` on stderr, as text (its paths and hints, e.g. ``pip install 'rlmerge[ray]'``, are not Rich
    markup); its exit code."""
    err.print(f"[bold red]error:[/] {escape(e.render())}", highlight=False, markup=True)
    return e.exit_code


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
