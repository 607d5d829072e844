"""Run one Python program in the sandbox: a wall-clock limit that holds, output read through a bounded buffer.

The program starts under a small launcher (``LAUNCHER``) that sets the rlimits from inside, where they bind the
program and not bubblewrap: CPU seconds, address space, file size, open files, processes (the process limit counts
the sandbox's own user only, so it is set there), no core files. The launcher first writes one NUL byte to stdout;
a run whose output lacks it never reached the program (the sandbox failed to start), which is an error, never a
silent wrong answer.
"""

from __future__ import annotations

import math
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from contextlib import ExitStack, suppress
from dataclasses import dataclass
from pathlib import Path

from ..errors import SandboxUnavailable
from .isolation import Isolation, ensure_isolation

LAUNCHER = """\
import os, resource, sys, types
os.write(1, b"\\0")
limits = (resource.RLIMIT_CORE, resource.RLIMIT_CPU, resource.RLIMIT_AS, resource.RLIMIT_FSIZE,
          resource.RLIMIT_NOFILE, resource.RLIMIT_NPROC)
for which, value in zip(limits, map(int, sys.argv[1:7])):
    if value >= 0:
        resource.setrlimit(which, (value, value))
path = sys.argv[7]
sys.argv = [path]
main = types.ModuleType("__main__")
main.__file__ = path
sys.modules["__main__"] = main
with open(path, "rb") as f:
    code = compile(f.read(), path, "exec")
del os, resource, types, limits, which, value, f
exec(code, main.__dict__)
"""
MAIN = "/sandbox/main.py"  # the program, read-only, inside the sandbox
SCRATCH = "/tmp"  # the working folder inside: a fresh tmpfs, the only writable place
OPEN_FILES = 32
STOP_WAIT = 5.0  # seconds to wait for a killed sandbox to be reaped; the call never blocks longer


@dataclass(frozen=True)
class RunResult:
    ok: bool  # exited 0 within every limit
    stdout: str  # at most max_output bytes of it
    reason: str  # "ok", "timeout", "output limit" or "exit N"
    stderr: str = ""  # at most max_output bytes of it
    isolated: bool = True  # False only where the user opted in to running without isolation


def run_python(code: str, *, stdin: str | bytes | None = None, files: Mapping[str, str | bytes] | None = None,
               timeout_s: float = 2.0, memory_mb: int = 256, scratch_mb: int = 16, max_processes: int = 16,
               max_output: int = 64 * 1024, unsafe_unisolated: bool | None = None) -> RunResult:
    """Run ``code`` (a Python program) isolated, and return what it printed.

    ``stdin`` is its standard input; ``files`` ({name: content}) are copied into its working folder first (a test
    file next to a solution, say). It has ``timeout_s`` seconds of wall-clock time (the call returns within about
    that), ``memory_mb`` of address space per process, ``scratch_mb`` of writable scratch (also the largest file it
    may write), ``max_processes`` processes and threads, and ``max_output`` bytes of stdout and of stderr: past
    that it is stopped ("output limit"). Where this machine cannot isolate it, ``SandboxUnavailable`` says how to
    get isolation, unless ``unsafe_unisolated`` (default: ``$RLMERGE_UNSAFE_UNISOLATED_CODE``) opts in to running it
    without isolation.

    >>> run_python("print(sum(range(4)))").stdout
    '6\\n'
    """
    for name in files or {}:
        if not name or "/" in name or name in (".", "..") or "\0" in name:
            raise ValueError(f"files: {name!r} is not a plain file name")
    iso = ensure_isolation(unsafe_unisolated)
    # The wall-clock limit is the time limit; the CPU rlimit is a backstop one second past it. Equal to it, a
    # program that spins from its first instant reached its CPU seconds as the wall clock ran out and the kernel's
    # SIGKILL raced the timer: on a quiet machine it was reported "exit 137", not "timeout".
    cpu = math.ceil(timeout_s) + 1
    limits = [0, cpu, memory_mb << 20, scratch_mb << 20, OPEN_FILES, max_processes if iso is not None else -1]
    with ExitStack() as stack:
        stdin_fd = subprocess.DEVNULL if stdin is None else _data_fd(stack, "stdin", stdin, read_only=True)
        if iso is not None:
            proc = _start_isolated(stack, iso, code, files or {}, limits, stdin_fd, scratch_mb << 20)
        else:
            proc = _start_unisolated(stack, code, files or {}, limits, stdin_fd)
        try:
            out, err, why = _collect(proc, timeout_s, max_output)
        finally:
            _stop(proc, isolated=iso is not None)
    if why is None and not out.startswith(b"\0"):
        raise SandboxUnavailable(f"the sandbox did not start the program: {err.decode(errors='replace').strip()}",
                                 hint="rerun; if it persists, check `bwrap --version` and the hint of a failed probe")
    stdout, stderr = out[1:].decode(errors="replace"), err.decode(errors="replace")
    if why is None and proc.returncode != 0:
        why = f"exit {proc.returncode}"
    return RunResult(why is None, stdout, why or "ok", stderr, iso is not None)


def _start_isolated(stack: ExitStack, iso: Isolation, code: str, files: Mapping[str, str | bytes],
                    limits: list[int], stdin_fd: int, scratch_bytes: int) -> subprocess.Popen[bytes]:
    data = [(_data_fd(stack, "main.py", code), MAIN, True)]
    data += [(_data_fd(stack, name, content), f"{SCRATCH}/{name}", False) for name, content in files.items()]
    argv = iso.command([iso.python, "-I", "-S", "-c", LAUNCHER, *map(str, limits), MAIN],
                       scratch_bytes=scratch_bytes, data=data)
    return subprocess.Popen(argv, stdin=stdin_fd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={},
                            pass_fds=[fd for fd, _, _ in data], start_new_session=True,
                            **iso.popen_user())


def _start_unisolated(stack: ExitStack, code: str, files: Mapping[str, str | bytes], limits: list[int],
                      stdin_fd: int) -> subprocess.Popen[bytes]:
    # Only the rlimits, a throw-away folder, an empty environment and a session of its own: nothing stops the
    # program from reading or writing the user's files, using the network or signalling this process.
    folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rlmerge-unisolated-")))
    (folder / "main.py").write_bytes(code.encode())
    (scratch := folder / "scratch").mkdir()
    for name, content in files.items():
        (scratch / name).write_bytes(content.encode() if isinstance(content, str) else content)
    argv = [sys.executable, "-I", "-S", "-c", LAUNCHER, *map(str, limits), str(folder / "main.py")]
    return subprocess.Popen(argv, cwd=scratch, stdin=stdin_fd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={}, start_new_session=True)


def _data_fd(stack: ExitStack, name: str, content: str | bytes, *, read_only: bool = False) -> int:
    """An anonymous in-memory file holding ``content`` (closed with ``stack``), at offset 0."""
    fd = os.memfd_create(f"rlmerge-{name}", os.MFD_CLOEXEC)
    stack.callback(os.close, fd)
    view = memoryview(content.encode() if isinstance(content, str) else content)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    if not read_only:
        return fd
    ro = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)  # the program cannot write our copy
    stack.callback(os.close, ro)
    return ro


def _collect(proc: subprocess.Popen[bytes], timeout_s: float, cap: int) -> tuple[bytes, bytes, str | None]:
    """Read stdout and stderr as they come, keeping at most ``cap`` bytes of each, until both close and the
    process ends; (stdout, stderr, why it was cut short: "timeout", "output limit" or None)."""
    assert proc.stdout is not None and proc.stderr is not None  # both are pipes (Popen above)
    deadline = time.monotonic() + timeout_s
    kept = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    room = {proc.stdout.fileno(): cap + 1, proc.stderr.fileno(): cap}  # + 1: the launcher's NUL byte
    why = None
    with selectors.DefaultSelector() as sel:
        for fd in kept:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        while why is None and sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                why = "timeout"
                break
            for key, _ in sel.select(left):
                try:
                    chunk = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                buf, limit = kept[key.fd], room[key.fd]
                if len(buf) + len(chunk) > limit:  # keep what fits, stop the program
                    buf += chunk[: limit - len(buf)]
                    why = "output limit"
                    break
                buf += chunk
    if why is None:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            why = "timeout"
    return bytes(kept[proc.stdout.fileno()]), bytes(kept[proc.stderr.fileno()]), why


def _stop(proc: subprocess.Popen[bytes], *, isolated: bool) -> None:
    """End the program and everything it started, then close the pipes. Isolated, the program is its PID
    namespace's init (bwrap --as-pid-1): killing it makes the kernel kill every descendant, and bwrap exits only
    after they are gone. Unisolated, its process group is killed (a child in a session of its own escapes that)."""
    if proc.poll() is None and isolated:
        _kill_init(proc.pid)
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=STOP_WAIT)
    if proc.poll() is None:
        for kill in (lambda: os.killpg(proc.pid, signal.SIGKILL), proc.kill):
            with suppress(ProcessLookupError, PermissionError):
                kill()
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=STOP_WAIT)
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def _kill_init(bwrap: int) -> None:
    """SIGKILL the sandbox's init: bwrap's only child (a process inside cannot make another: CLONE_PARENT is refused
    to a namespace's init). Signalled through a pidfd, checked to still be bwrap's child, so a reused pid is never hit.
    Not found (bwrap had not started it yet), bwrap's own death takes it (--die-with-parent)."""
    for pid in _children(bwrap):
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            continue
        try:
            if bwrap in _parent_of(pid):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
        except OSError:
            pass
        finally:
            os.close(fd)


def _children(parent: int) -> list[int]:
    pids = (int(entry.name) for entry in os.scandir("/proc") if entry.name.isdigit())
    return [pid for pid in pids if parent in _parent_of(pid)]


def _parent_of(pid: int) -> tuple[int, ...]:
    """(pid's parent,), or () when pid is gone. /proc/PID/stat is "pid (comm) state ppid ...", comm may hold ")"."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return (int(stat[stat.rindex(b")") + 2 :].split()[1]),)
    except (OSError, ValueError, IndexError):
        return ()
