"""The coding checker's sandbox: time limits, static refusals and OS limits that stop escapes."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from rlmerge.lab.tasks.sandbox import run_python, static_check


def test_runs_a_plain_program() -> None:
    result = run_python("print(sum([1, 2, 3]))")
    assert result.ok and result.stdout == "6\n" and result.reason == "ok"


def test_infinite_loop_is_killed_at_the_time_limit() -> None:
    start = time.monotonic()
    result = run_python("while True:\n    pass", timeout_s=0.5)
    assert not result.ok and result.reason == "timeout"
    assert time.monotonic() - start < 5


def test_forked_sleeper_does_not_outlive_the_timeout(tmp_path: Path) -> None:
    # Static check off: even a program that forks is stopped, because the whole process group is killed.
    code = "import os, time\nif os.fork() == 0:\n    time.sleep(30)\nelse:\n    time.sleep(30)"
    start = time.monotonic()
    result = run_python(code, timeout_s=0.5, check=False)
    assert result.reason == "timeout" and time.monotonic() - start < 5


@pytest.mark.parametrize(
    "code",
    [
        "import os\nos.system('touch /tmp/pwned')",
        "from subprocess import run",
        "open('/etc/passwd').read()",
        "__import__('os').system('id')",
        "().__class__.__base__.__subclasses__()",
        "eval('1+1')",
        "exec('x=1')",
        "getattr(print, '__self__')",
    ],
)
def test_escape_attempts_are_refused_before_running(code: str) -> None:
    assert static_check(code) is not None
    result = run_python(code)
    assert not result.ok and result.reason.startswith("rejected")


def test_os_limits_block_file_writes_even_without_the_static_check(tmp_path: Path) -> None:
    target = tmp_path / "escaped.txt"
    result = run_python(f"f = open({str(target)!r}, 'w')\nf.write('x' * 100)\nf.close()", check=False)
    assert not result.ok
    assert not target.exists() or target.stat().st_size == 0


def test_environment_is_empty() -> None:
    os.environ["RLMERGE_SECRET_FOR_TEST"] = "leak"
    try:
        result = run_python("import os\nprint(sorted(os.environ))", check=False)
    finally:
        del os.environ["RLMERGE_SECRET_FOR_TEST"]
    assert result.ok and "RLMERGE_SECRET_FOR_TEST" not in result.stdout


def test_memory_hog_fails_instead_of_eating_the_machine() -> None:
    result = run_python("x = [0] * (10**9)\nprint(len(x))", memory_mb=128)
    assert not result.ok


def test_syntax_error_is_rejected() -> None:
    assert run_python("print(").reason.startswith("rejected: syntax error")
