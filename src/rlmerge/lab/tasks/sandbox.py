"""Run untrusted, model-written Python in a subprocess with a time limit and OS resource limits.

Two layers, because either alone is too weak: a static AST check refuses imports, dunder access and the
builtins that reach the file system or the interpreter (open, exec, eval, ...); the child process then runs
isolated (`python -I -S`, empty environment, throw-away working directory, own session) under rlimits on
CPU time, memory, file size (0: no file can be written) and open files. The wall-clock timeout kills the
whole process group.
"""

from __future__ import annotations

import ast
import os
import resource
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

FORBIDDEN_NAMES = frozenset(
    {
        "open",
        "exec",
        "eval",
        "compile",
        "__import__",
        "globals",
        "locals",
        "vars",
        "getattr",
        "setattr",
        "delattr",
        "input",
        "breakpoint",
        "help",
        "exit",
        "quit",
        "memoryview",
        "classmethod",
        "type",
        "object",
    }
)


@dataclass(frozen=True)
class RunResult:
    ok: bool  # exited 0 within the limits
    stdout: str
    reason: str  # "ok", "rejected: ...", "timeout", "exit N"


def static_check(code: str) -> str | None:
    """Why `code` is refused before running, or None when it may run."""
    try:
        tree = ast.parse(code)
    except SyntaxError as err:
        return f"syntax error: {err.msg}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            return "import"
        if isinstance(node, ast.Name) and node.id in FORBIDDEN_NAMES:
            return f"forbidden name {node.id}"
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            return f"private attribute {node.attr}"
        if isinstance(node, ast.Name) and node.id.startswith("__"):
            return f"dunder name {node.id}"
    return None


def _limit_child(cpu_seconds: int, memory_bytes: int) -> None:
    # Runs in the child between fork and exec.
    os.setsid()
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds))
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (16, 16))


def run_python(code: str, *, timeout_s: float = 2.0, memory_mb: int = 256, check: bool = True) -> RunResult:
    """Run `code` sandboxed and return its stdout. `check=False` skips the static check (tests only)."""
    if check and (why := static_check(code)) is not None:
        return RunResult(False, "", f"rejected: {why}")
    cpu = max(1, int(timeout_s + 0.999))
    with tempfile.TemporaryDirectory(prefix="rlmerge-sandbox-") as workdir:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", code],
            cwd=workdir,
            env={},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=lambda: _limit_child(cpu, memory_mb * 2**20),  # noqa: PLW1509 - limits must be set in the child
        )
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return RunResult(False, "", "timeout")
    text = out.decode(errors="replace")[:10_000]
    if proc.returncode != 0:
        return RunResult(False, text, f"exit {proc.returncode}")
    return RunResult(True, text, "ok")
