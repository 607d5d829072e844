"""``cmd:COMMAND``: any program scores a candidate.

The command is split like a shell line (``shlex``) and run without a shell (write ``sh -c '…'`` for one), in its
own process group, in ``cmd_cwd`` (default: the current folder), with this process's environment plus ``cmd_env``
and ``RLMERGE_MODEL`` (the folder), ``RLMERGE_CANDIDATE`` (the candidate's id), ``RLMERGE_SPLIT`` and, when used,
``RLMERGE_OUTPUT``. In each argument ``{model}`` (required) becomes the candidate's checkpoint folder (a candidate
built in memory is written to a temporary one, removed after), ``{output}`` a fresh empty folder for the command's
files (removed after), ``{limit}`` and ``{seed}`` the sweep's, ``{split}`` the split to score (``val`` while the
sweep chooses, the held-out one under ``--confirm``: a command that ignores it scores the same data twice).

What it reports, one of:

- without ``{output}``: a JSON object on stdout (the whole of stdout, else its last line that is one), task →
  a number or ``{"score": s, "stderr": e, "n": k, "samples": [...], "ids": [...]}`` (sweeping/scores.py: samples in
  the score's units; n and stderr follow from them);
- with ``{output}``: lm-eval's results files in that folder (``--output_path {output}``), read as lm-eval's own
  output is (scoring/lmeval.py; its ``--log_samples`` files give the per-example results).

A failure raises ScorerError with the end of the command's stderr: a non-zero exit, no JSON or bad values, a run
longer than ``cmd_timeout`` seconds (its whole process group is killed; so are any processes it left behind when
it exits). stdout is read up to ``STDOUT_LIMIT`` bytes; of stderr the last ``STDERR_TAIL`` are kept.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ..errors import ConfigError, ScorerError
from ..sweeping.scores import TaskScore, make
from .lmeval import read_folder
from .options import Options
from .subject import Subject

STDOUT_LIMIT = 64 * 2**20  # bytes of stdout read: a JSON of scores with every example's result fits
STDERR_TAIL = 16 * 2**10  # bytes of stderr kept (its end: where a traceback is)
SHOWN_TAIL = 2000  # characters of that tail in the error's message
PLACEHOLDERS = ("{model}", "{output}", "{limit}", "{seed}", "{split}")


class _Reader(threading.Thread):
    """Drains one pipe: keeps its first ``limit`` bytes (``tail``: its last), counts the rest."""

    def __init__(self, pipe: IO[bytes], limit: int, *, tail: bool) -> None:
        super().__init__(daemon=True)
        self.pipe, self.limit, self.tail = pipe, limit, tail
        self.data = bytearray()
        self.dropped = 0

    def run(self) -> None:
        while chunk := self.pipe.read1(1 << 16):  # type: ignore[attr-defined]
            self.data += chunk
            extra = len(self.data) - self.limit
            if extra > 0:
                self.dropped += extra
                if self.tail:
                    del self.data[:extra]
                else:
                    del self.data[self.limit:]

    def text(self) -> str:
        return self.data.decode(errors="replace")


@dataclass
class Command:
    """One ``cmd:`` scorer (see the module docstring)."""

    command: str
    options: Options
    argv: list[str] = field(init=False)

    def __post_init__(self) -> None:
        try:
            self.argv = shlex.split(self.command)
        except ValueError as e:
            raise ConfigError(f"--tasks cmd:{self.command}: {e}") from e
        if not self.argv:
            raise ConfigError("--tasks cmd: names no command", hint="e.g. 'cmd:python my_eval.py {model}'")
        if not any("{model}" in a for a in self.argv):
            raise ConfigError(f"--tasks cmd:{self.command}: the command does not name the candidate's folder",
                              hint="put {model} where its checkpoint folder goes, e.g. 'cmd:python my_eval.py {model}'")
        cwd = self.options.cmd_cwd
        if cwd is not None and not Path(cwd).is_dir():
            raise ConfigError(f"--cmd-cwd {cwd}: no such folder")
        if self.options.cmd_timeout <= 0:
            raise ConfigError(f"--cmd-timeout {self.options.cmd_timeout}: a time limit is > 0 seconds")
        exe = self.argv[0]
        if "{" not in exe:
            found = ((Path(cwd or ".") / exe).is_file() if os.sep in exe
                     else shutil.which(exe, path=self._env({}).get("PATH")) is not None)
            if not found:
                raise ConfigError(f"--tasks cmd:{self.command}: no program {exe!r}"
                                  + (f" in {cwd or 'the current folder'}" if os.sep in exe else " on PATH"))

    @property
    def label(self) -> str:
        return "cmd:" + (self.command if len(self.command) <= 80 else self.command[:79] + "…")

    @property
    def names(self) -> None:
        return None  # the command names its tasks

    needs = "folder"

    def _env(self, extra: Mapping[str, str]) -> dict[str, str]:
        return {**os.environ, **dict(self.options.cmd_env), **extra}

    def score(self, subject: Subject) -> dict[str, TaskScore]:
        uses_output = any("{output}" in a for a in self.argv)
        output = Path(tempfile.mkdtemp(prefix=f"rlmerge-output-{subject.id}-")) if uses_output else None
        try:
            folder = subject.folder()
            values = {"{model}": str(folder), "{output}": str(output or ""), "{limit}": str(self.options.limit),
                      "{seed}": str(self.options.seed), "{split}": self.options.split}
            argv = [_substitute(a, values) for a in self.argv]
            env = self._env({"RLMERGE_MODEL": str(folder), "RLMERGE_CANDIDATE": subject.id,
                             "RLMERGE_SPLIT": self.options.split,
                             **({"RLMERGE_OUTPUT": str(output)} if output is not None else {})})
            stdout, stderr = self._run(argv, env, subject.id)
            if output is not None:
                return read_folder(output, where=f"{self.label} on candidate {subject.id}")
            return parse_stdout(stdout, where=f"{self.label} on candidate {subject.id}", stderr=stderr)
        finally:
            if output is not None:
                shutil.rmtree(output, ignore_errors=True)  # made by mkdtemp here; rmtree follows no link

    def _run(self, argv: list[str], env: dict[str, str], cid: str) -> tuple[str, str]:
        """The command's stdout and the end of its stderr; raises ScorerError on a non-zero exit or a time-out."""
        where = f"{self.label} on candidate {cid}"
        try:
            proc = subprocess.Popen(argv, cwd=self.options.cmd_cwd, env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        except OSError as e:
            raise ScorerError(f"{where} could not start: {e.strerror or e}") from e
        assert proc.stdout is not None and proc.stderr is not None
        out = _Reader(proc.stdout, STDOUT_LIMIT, tail=False)
        err = _Reader(proc.stderr, STDERR_TAIL, tail=True)
        out.start()
        err.start()
        timed_out = False
        try:
            proc.wait(timeout=self.options.cmd_timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:  # a time-out, Ctrl-C, or what the command left running: its whole group goes
            _kill_group(proc)
            out.join(5)
            err.join(5)
            proc.stdout.close()
            proc.stderr.close()
        tail = err.text()
        if timed_out:
            raise _failure(f"{where} did not finish within {self.options.cmd_timeout:g} s (its processes were "
                           "killed)", tail, hint="raise --cmd-timeout, or score fewer examples (--limit)")
        if proc.returncode != 0:
            raise _failure(f"{where} failed: exit status {proc.returncode}", tail)
        if out.dropped:
            raise _failure(f"{where} printed more than {STDOUT_LIMIT // 2**20} MiB on stdout", tail,
                           hint="print only the JSON of scores on stdout (logs go to stderr)")
        return out.text(), tail


def _substitute(arg: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        arg = arg.replace(key, value)
    return arg


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _failure(message: str, tail: str, *, hint: str | None = None) -> ScorerError:
    shown = tail[-SHOWN_TAIL:].rstrip()
    text = f"{message}; its stderr ends:\n{shown}" if shown else f"{message} (nothing on stderr)"
    return ScorerError(text, hint=hint, stderr=tail)


def parse_stdout(text: str, *, where: str, stderr: str = "") -> dict[str, TaskScore]:
    """task → TaskScore from a command's stdout: the whole of it as a JSON object, else its last line that is one."""
    doc: Any = None
    try:
        doc = json.loads(text)
    except ValueError:
        for line in reversed(text.splitlines()):
            if line.strip().startswith("{"):
                try:
                    doc = json.loads(line)
                    break
                except ValueError:
                    continue
    if not isinstance(doc, dict) or not doc:
        end = text.strip()[-SHOWN_TAIL:]
        what = "an empty JSON object" if isinstance(doc, dict) else "no JSON object of scores"
        message = f"{where} printed {what} on stdout" + (f"; it printed:\n{end}" if end else " (nothing)")
        raise _failure(message, stderr, hint='print e.g. {"my_task": 61.5} or '
                                             '{"my_task": {"score": 61.5, "stderr": 2.1, "n": 500}}')
    try:
        return {str(task): make(value, task=str(task), where=where) for task, value in doc.items()}
    except ScorerError as e:
        raise _failure(e.message, stderr, hint=e.hint) from None
