"""The sandbox for model-written code (rlmerge.sandbox): real escape attempts, each of which worked against the AST
ban-list + rlimits sandbox it replaced (issue 23), and the refusal where the machine cannot isolate.

Every attempt runs as a program would come from a model; files planted outside its scratch are hashed before and
after. The tests need bubblewrap (``make test`` installs it); without it they fail, with the install hint.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlmerge.errors import SandboxUnavailable
from rlmerge.lab.tasks.coding import static_check
from rlmerge.sandbox import BWRAP_ENV, UNSAFE_ENV, UNSAFE_FLAG, isolation, run_python

SANDBOX_MODULE = "rlmerge.sandbox"  # what the helper processes below import run_python from
SECRET = "s3cr3t-" + uuid.uuid4().hex


def tree_digest(root: Path) -> dict[str, str]:
    """Every path under root with what it is: file bytes' hash, a link's target, or a folder."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = "link:" + os.readlink(p)
        elif p.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.fixture
def planted(tmp_path: Path) -> Iterator[Path]:
    """A folder outside every sandbox with a secret file in it; its tree must not change."""
    (tmp_path / "secret.txt").write_text(SECRET)
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "data.bin").write_bytes(b"\x00" * 100)
    before = tree_digest(tmp_path)
    yield tmp_path
    assert tree_digest(tmp_path) == before, "the program changed files outside its scratch"


def survivors(token: str) -> list[str]:
    """Processes (anywhere on the machine) whose command line holds token."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if token.encode() in cmdline:
                found.append(cmdline.replace(b"\0", b" ").decode(errors="replace"))
    return found


def run_helper(code: str, *, pid_namespace: bool = False) -> subprocess.CompletedProcess[str]:
    """Run code in a fresh Python (it imports run_python itself). pid_namespace: inside a PID namespace of its own,
    so that a regression that let the program signal every process could only reach this helper."""
    argv = [sys.executable, "-c", code]
    if pid_namespace:
        bwrap = shutil.which("bwrap")
        assert bwrap, "bubblewrap is needed (make test installs it)"
        argv = [bwrap, "--dev-bind", "/", "/", "--unshare-pid", "--die-with-parent", *argv]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def test_runs_a_program_with_stdin_and_files() -> None:
    result = run_python("import sys\nprint(open('data.txt').read(), sys.stdin.read(), sum([1, 2, 3]))",
                        stdin="from stdin", files={"data.txt": "from a file"})
    assert (result.ok, result.stdout, result.reason) == (True, "from a file from stdin 6\n", "ok")
    assert result.isolated


def test_failures_and_limits_are_reported() -> None:
    failed = run_python("raise SystemExit(3)")
    assert (failed.ok, failed.reason) == (False, "exit 3")
    crashed = run_python("1 / 0")
    assert not crashed.ok and "ZeroDivisionError" in crashed.stderr
    start = time.monotonic()
    looped = run_python("while True:\n    pass", timeout_s=0.5)
    assert looped.reason == "timeout" and time.monotonic() - start < 3
    hog = run_python("x = [0] * (10**9)\nprint(len(x))", memory_mb=128)
    assert not hog.ok and "MemoryError" in hog.stderr


# -- escapes that worked against the ban-list sandbox ---------------------------------------------------------------
def test_builtins_through_a_generator_frame_reach_nothing_outside(planted: Path) -> None:
    # No import, no underscore attribute, no forbidden name: the lab's ban-list lets it through.
    code = ("b = (x for x in []).gi_frame.f_builtins; o = b['__im' + 'port__']('os'); "
            f"print(b['op' + 'en']({str(planted / 'secret.txt')!r}).read()); "
            f"o.makedirs({str(planted / 'escaped')!r})")
    assert static_check(code) is None
    result = run_python(code)
    assert not result.ok and SECRET not in result.stdout + result.stderr
    assert "No such file or directory" in result.stderr  # the folder does not exist in its view at all
    assert not (planted / "escaped").exists()


@pytest.mark.parametrize("main", ["returns", "times out"])
def test_no_process_outlives_the_call(tmp_path: Path, main: str) -> None:
    # A child in a session of its own, its output closed, then exec'd into a sleeper that writes a marker later:
    # the process-group kill never reached it, and it outlived the call.
    token, marker = uuid.uuid4().hex, tmp_path / "marker"
    later = f"import time, pathlib; time.sleep(1.5); pathlib.Path({str(marker)!r}).write_text('alive')  # {token}"
    code = ("import os, sys, time\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            "    null = os.open(os.devnull, os.O_RDWR)\n"
            "    for fd in (0, 1, 2):\n"
            "        os.dup2(null, fd)\n"
            f"    os.execv(sys.executable, [sys.executable, '-c', {later!r}])\n"
            "time.sleep(0.3)\n"
            "print('main done', flush=True)\n" + ("while True:\n    pass\n" if main == "times out" else ""))
    result = run_python(code, timeout_s=1.0)
    deadline = time.monotonic() + 2.5
    while time.monotonic() < deadline:
        assert not survivors(token), "a process of the program outlived the call"
        time.sleep(0.1)
    assert not marker.exists()
    assert "main done" in result.stdout and result.reason == ("ok" if main == "returns" else "timeout")


@pytest.mark.parametrize("main", ["returns", "loops"])
def test_a_child_holding_the_output_pipes_does_not_stretch_the_time_limit(main: str) -> None:
    code = ("import os, time\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            "    time.sleep(8)\n"  # keeps stdout and stderr open
            + ("print('main done', flush=True)\n" if main == "returns" else "while True:\n    pass\n"))
    start = time.monotonic()
    result = run_python(code, timeout_s=1.0)
    assert time.monotonic() - start < 3.5
    assert result.reason == ("ok" if main == "returns" else "timeout")


def test_the_program_cannot_signal_its_caller() -> None:
    attack = ("import os, signal\n"
              "for sig in (signal.SIGTERM, signal.SIGKILL):\n"
              "    try:\n"
              "        os.kill(os.getppid(), sig)\n"
              "    except OSError:\n"
              "        pass\n"
              "try:\n"
              "    os.kill(-1, signal.SIGKILL)\n"
              "except OSError:\n"
              "    pass\n"
              "print('after the signals')\n")
    helper = (f"import json\nfrom {SANDBOX_MODULE} import run_python\n"
              f"r = run_python({attack!r})\n"
              "print(json.dumps({'reason': r.reason, 'stdout': r.stdout}))\n")
    done = run_helper(helper, pid_namespace=True)
    assert done.returncode == 0, f"the caller died: exit {done.returncode} {done.stderr[-2000:]}"
    assert json.loads(done.stdout.strip().splitlines()[-1])["reason"]  # and got a result


def test_no_network_even_to_loopback() -> None:
    abstract = f"\0rlmerge-test-{uuid.uuid4().hex}"
    with socket.socket() as server, socket.socket(socket.AF_UNIX) as local:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        local.bind(abstract)
        local.listen()
        local.setblocking(False)
        code = ("import socket\n"
                f"for family, address in ((socket.AF_INET, ('127.0.0.1', {server.getsockname()[1]})), "
                f"(socket.AF_UNIX, {abstract!r})):\n"
                "    s = socket.socket(family)\n"
                "    s.settimeout(1)\n"
                "    try:\n"
                "        s.connect(address)\n"
                "        s.sendall(b'stolen')\n"
                "        print('connected')\n"
                "    except OSError as e:\n"
                "        print('failed', e)\n")
        result = run_python(code)
        assert result.ok and result.stdout.count("failed") == 2, result.stdout
        for listener in (server, local):
            with pytest.raises(BlockingIOError):
                listener.accept()


def test_endless_output_keeps_the_callers_memory_bounded() -> None:
    helper = ("import json, resource, time\n"
              "resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))  # a regression must not eat the machine\n"
              f"from {SANDBOX_MODULE} import run_python\n"
              "def peak_kb():\n"
              "    return int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1])\n"
              "run_python('print(1)')\n"
              "before, start = peak_kb(), time.monotonic()\n"
              "r = run_python('import sys\\nwhile True:\\n    sys.stdout.write(\"x\" * 65536)', timeout_s=1.0)\n"
              "print(json.dumps({'grew_kb': peak_kb() - before, 's': time.monotonic() - start, 'reason': r.reason,\n"
              "                  'kept': len(r.stdout)}))\n")
    done = run_helper(helper)
    assert done.returncode == 0, done.stderr[-2000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    assert measured["grew_kb"] < 100_000 and measured["s"] < 3, measured
    assert measured["reason"] == "output limit" and measured["kept"] <= 64 * 1024


def test_fork_bomb_is_bounded() -> None:
    code = ("import os, time\n"
            "n = 0\n"
            "for _ in range(300):\n"
            "    try:\n"
            "        if os.fork() == 0:\n"
            "            time.sleep(10)\n"
            "            os._exit(0)\n"
            "    except OSError:\n"
            "        break\n"
            "    n += 1\n"
            "print(n)\n")
    start = time.monotonic()
    result = run_python(code, timeout_s=3.0, max_processes=16)
    assert result.ok and 0 < int(result.stdout) < 16, result
    assert time.monotonic() - start < 5


# -- the classic ones -------------------------------------------------------------------------------------------------
def test_files_outside_the_scratch_cannot_be_written(planted: Path) -> None:
    # tmp_path is under /tmp, which inside is the program's scratch: a folder there does not exist inside. So is a
    # checkout cloned under /tmp (`mktemp -d`), where making the project's folder inside makes it in the program's
    # own scratch: the home folder, never under /tmp, stands in for it then.
    project = Path(__file__).resolve().parents[1]
    if project.is_relative_to(Path(tempfile.gettempdir()).resolve()):
        project = Path.home()
    code = ("import os\n"
            "for attempt in (lambda: open(TARGET + '/new.txt', 'w').write('x'),\n"
            "                lambda: open(TARGET + '/keep/data.bin', 'wb').write(b'y'),\n"
            "                lambda: os.remove(TARGET + '/secret.txt'),\n"
            "                lambda: os.symlink('/etc/passwd', TARGET + '/link'),\n"
            "                lambda: os.makedirs(PROJECT + '/rlmerge-escaped'),\n"
            "                lambda: open('/usr/rlmerge-test', 'w'),\n"
            "                lambda: open('/rlmerge-test', 'w'),\n"
            "                lambda: open('/dev/shm/rlmerge-test', 'w')):\n"
            "    try:\n"
            "        attempt()\n"
            "        print('wrote')\n"
            "    except OSError as e:\n"
            "        print('refused', e.errno)\n"
            "open('scratch.txt', 'w').write('mine')\n"
            "print(open('scratch.txt').read())\n")
    code = code.replace("TARGET", repr(str(planted))).replace("PROJECT", repr(str(project)))
    result = run_python(code)
    assert result.ok and "wrote" not in result.stdout and result.stdout.endswith("mine\n"), result
    assert not (project / "rlmerge-escaped").exists()


def test_the_users_files_cannot_be_read(planted: Path) -> None:
    outside = ["/etc/shadow", "/etc/passwd", "/root", str(Path.home()), str(Path(__file__).resolve().parents[1]),
               str(planted), str(planted / "secret.txt")]
    code = ("import os\n"
            f"for path in {outside!r}:\n"
            "    try:\n"
            "        print(path, os.listdir(path) if os.path.isdir(path) else open(path).read())\n"
            "    except OSError as e:\n"
            "        print(path, 'refused', e.errno)\n"
            "print(sorted(p for p in os.listdir('/proc') if p.isdigit()))\n")
    result = run_python(code, unsafe_unisolated=False)
    assert result.ok and SECRET not in result.stdout
    assert result.stdout.splitlines()[:-1] == [f"{path} refused 2" for path in outside]  # ENOENT: not in its view
    assert result.stdout.splitlines()[-1] == "['1']"  # it sees its own process only (its namespace's init)


def test_the_program_has_no_privileges() -> None:
    code = ("import ctypes\n"
            "status = dict(l.split(':', 1) for l in open('/proc/self/status'))\n"
            "print({k: status[k].strip() for k in ('CapPrm', 'CapEff', 'CapBnd', 'CapAmb', 'NoNewPrivs')})\n"
            "print(ctypes.CDLL(None, use_errno=True).unshare(0x10000000))\n")  # CLONE_NEWUSER: no nested namespace
    result = run_python(code)
    zero = "0" * 16
    caps, nested = result.stdout.splitlines()
    assert caps == str({"CapPrm": zero, "CapEff": zero, "CapBnd": zero, "CapAmb": zero, "NoNewPrivs": "1"}), result
    assert nested == "-1" or not isolation().disable_userns  # bubblewrap < 0.8 cannot forbid it (docs/guarantees.md)


def test_the_environment_does_not_leak(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLMERGE_SECRET_FOR_TEST", SECRET)
    result = run_python("import os\nprint(dict(os.environ))")
    assert result.ok and SECRET not in result.stdout and "RLMERGE_SECRET_FOR_TEST" not in result.stdout


# -- no isolation: refuse, unless the user opted in ------------------------------------------------------------------
@pytest.fixture
def no_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(UNSAFE_ENV, raising=False)


@pytest.fixture
def failing_bwrap() -> Iterator[Path]:
    """A bwrap that answers --help and fails every sandbox as a kernel without user namespaces makes it fail (in a
    folder every user may read: as root the sandbox starts bwrap as nobody). It logs each call."""
    folder = Path(tempfile.mkdtemp(prefix="rlmerge-test-bwrap-"))
    try:
        folder.chmod(0o755)
        log = folder / "calls"
        log.touch(mode=0o666)
        log.chmod(0o666)
        fake = folder / "bwrap"
        fake.write_text(f'#!/bin/sh\necho "$1" >> {log}\n[ "$1" = --help ] && exit 0\n'
                        'echo "bwrap: No permissions to creating new namespace, likely because the kernel does not '
                        'allow non-privileged user namespaces." >&2\nexit 1\n')
        fake.chmod(0o755)
        yield fake
    finally:
        shutil.rmtree(folder)


def test_without_bwrap_the_code_is_refused_with_the_install_hint(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, no_opt_in: None) -> None:
    monkeypatch.setenv(BWRAP_ENV, str(tmp_path / "no-such-bwrap"))
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap") as refused:
        run_python("print(1)")
    assert UNSAFE_FLAG in refused.value.render() and refused.value.exit_code == 2


def test_a_bwrap_that_cannot_make_namespaces_is_refused_and_probed_once(
        monkeypatch: pytest.MonkeyPatch, failing_bwrap: Path, no_opt_in: None) -> None:
    monkeypatch.setenv(BWRAP_ENV, str(failing_bwrap))
    for _ in range(3):
        with pytest.raises(SandboxUnavailable, match="user namespaces") as refused:
            run_python("print(1)")
        assert "unprivileged_userns_clone" in refused.value.render() and UNSAFE_FLAG in refused.value.render()
    calls = (failing_bwrap.parent / "calls").read_text().split()
    assert calls[0] == "--help" and len(calls) == 2  # one probe: its --help and one sandbox, never again


def test_opting_in_runs_the_code_unisolated_only_where_isolation_is_missing(
        monkeypatch: pytest.MonkeyPatch, failing_bwrap: Path, no_opt_in: None) -> None:
    assert run_python("print(1)", unsafe_unisolated=True).isolated  # isolation available: used anyway
    monkeypatch.setenv(BWRAP_ENV, str(failing_bwrap))
    with pytest.warns(RuntimeWarning, match="WITHOUT isolation"):
        result = run_python("print(6 * 7)", unsafe_unisolated=True)
    assert (result.ok, result.stdout, result.isolated) == (True, "42\n", False)
    monkeypatch.setenv(UNSAFE_ENV, "1")
    with pytest.warns(RuntimeWarning):
        assert run_python("print(1)").stdout == "1\n"
    with pytest.raises(SandboxUnavailable):
        run_python("print(1)", unsafe_unisolated=False)  # the argument wins over the environment
    with pytest.warns(RuntimeWarning):  # still bounded in time and output
        assert run_python("while True:\n    print('x' * 1000)", timeout_s=0.5, max_output=1000,
                          unsafe_unisolated=True).reason == "output limit"


def test_the_program_dies_with_its_caller() -> None:
    # The caller dies (SIGKILL, no clean-up): bubblewrap's --die-with-parent takes the program with it.
    token = uuid.uuid4().hex
    sleeper = ("import os, sys\n"
               f"os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(30)  # {token}'])")
    helper = f"from {SANDBOX_MODULE} import run_python\nrun_python({sleeper!r}, timeout_s=30)\n"
    caller = subprocess.Popen([sys.executable, "-c", helper])
    try:
        deadline = time.monotonic() + 10
        while not survivors(token) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert survivors(token), "the program never started"
        os.kill(caller.pid, signal.SIGKILL)
        caller.wait()
        deadline = time.monotonic() + 3
        while survivors(token) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not survivors(token)
    finally:
        caller.kill()
