"""Progress bars (bytes and tensors per pass) with rich, or nothing at all in quiet mode."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.progress import Progress as RichProgress


class Bar:
    def __init__(self, progress: RichProgress | None, task: Any, label: str, tensors: int) -> None:
        self._p, self._task, self._label, self._tensors, self._done = progress, task, label, tensors, 0

    def advance(self, nbytes: int) -> None:
        if self._p is not None:
            self._p.advance(self._task, nbytes)

    def tensor_done(self) -> None:
        self._done += 1
        if self._p is not None:
            self._p.update(self._task, description=f"{self._label} [{self._done}/{self._tensors} tensors]")


class Progress:
    """One bar per pass, on stderr; ``quiet=True`` shows nothing (for scripts and tests)."""

    def __init__(self, *, quiet: bool) -> None:
        self._rich: RichProgress | None = None
        if not quiet:  # rich is imported only for bars (a script's quiet merge does not pay for it)
            from rich.console import Console
            from rich.progress import BarColumn, DownloadColumn, TextColumn, TimeRemainingColumn, TransferSpeedColumn
            from rich.progress import Progress as RichProgress

            self._rich = RichProgress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                      TransferSpeedColumn(), TimeRemainingColumn(),
                                      console=Console(stderr=True), transient=False)

    def __enter__(self) -> Progress:
        if self._rich is not None:
            self._rich.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._rich is not None:
            self._rich.stop()

    @contextmanager
    def task(self, label: str, *, total: int, tensors: int) -> Iterator[Bar]:
        task = None
        if self._rich is not None:
            task = self._rich.add_task(f"{label} [0/{tensors} tensors]", total=total)
        yield Bar(self._rich, task, label, tensors)
