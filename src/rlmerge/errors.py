"""Typed errors. Each names the file and the tensor it is about and says what to do.

The CLI maps each class to its own exit code (see ``exit_code``).
"""

from __future__ import annotations

from collections.abc import Iterable


class RLMergeError(Exception):
    """Base class: a problem the user can act on. ``exit_code`` is what the CLI returns."""

    exit_code = 1

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None,
                 hint: str | None = None) -> None:
        self.message = message
        self.file = file
        self.tensor = tensor
        self.hint = hint
        super().__init__(self.render())

    def render(self) -> str:
        where = []
        if self.file:
            where.append(f"file {self.file}")
        if self.tensor:
            where.append(f"tensor {self.tensor!r}")
        text = self.message
        if where:
            text = f"{text} ({', '.join(where)})"
        if self.hint:
            text = f"{text}\n  -> {self.hint}"
        return text


class ConfigError(RLMergeError):
    """Unknown method or preset, parameter out of range, bad recipe."""

    exit_code = 2


class InputError(RLMergeError):
    """A checkpoint cannot be read, or base and agents do not match."""

    exit_code = 3


class OutputError(RLMergeError):
    """The output folder exists, is not writable, or the disk filled up."""

    exit_code = 4


class SandboxUnavailable(ConfigError):
    """Model-written code would have to run, and this machine cannot isolate it (``rlmerge.sandbox``)."""


class ScorerError(RLMergeError):
    """A scorer could not score a candidate: a command's exit status, output that is not a score, a time-out, a
    number that is not finite. ``stderr`` is the tail of a command's standard error (also in the message)."""

    exit_code = 5

    def __init__(self, message: str, *, file: str | None = None, hint: str | None = None,
                 stderr: str = "") -> None:
        self.stderr = stderr
        super().__init__(message, file=file, hint=hint)


class Interrupted(RLMergeError):
    """Ctrl-C or SIGTERM stopped a command (the CLI's form of KeyboardInterrupt)."""

    exit_code = 130


class ProblemsError(RLMergeError):
    """Several problems found together (validation collects them all before failing)."""

    def __init__(self, problems: Iterable[RLMergeError]) -> None:
        self.problems = list(problems)
        # The most specific exit code among the problems: all of one kind → that kind's code.
        codes = {p.exit_code for p in self.problems}
        self.exit_code = codes.pop() if len(codes) == 1 else 1
        lines = [f"{len(self.problems)} problem(s) found; nothing was written:"]
        lines += [f"- {p.render()}" for p in self.problems]
        super().__init__("\n".join(lines))

    def render(self) -> str:
        return self.message


def raise_all(problems: list[RLMergeError]) -> None:
    """Raise the single problem as itself, several together, or nothing."""
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise ProblemsError(problems)
