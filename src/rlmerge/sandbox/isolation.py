"""Whether this machine can isolate a program, and the bubblewrap command that does (probed once per bwrap).

The sandbox is bubblewrap (``bwrap``, Debian's ``bubblewrap``): its own user, PID, network, mount, IPC and UTS
namespaces; a root file system holding only the system's libraries and one Python interpreter, read-only; a private
tmpfs as the only writable place; no network (a loopback of its own); killed with its parent. When rlmerge runs as
root, bwrap itself is started as the unprivileged user ``nobody``: the sandbox's user then maps to ``nobody`` outside
too, so the kernel enforces the process limit (root is exempt from it) and no root-owned file is ever its own.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import SandboxUnavailable

BWRAP_ENV = "RLMERGE_BWRAP"  # a bwrap to use instead of the one on PATH
UNSAFE_ENV = "RLMERGE_UNSAFE_UNISOLATED_CODE"  # "1": where no isolation is available, run model code without it
UNSAFE_FLAG = "--unsafe-unisolated-code"
INSTALL_HINT = "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install bubblewrap)"
OPT_IN = (f"only for code you trust, run it without isolation instead: {UNSAFE_FLAG} on the command line, "
          f"{UNSAFE_ENV}=1 in the environment, or unsafe_unisolated=True in Python")
USERNS_HINT = ("allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1; on Ubuntu 24.04+ "
               "kernel.apparmor_restrict_unprivileged_userns=0 or an AppArmor profile for bwrap; in a container, a "
               "seccomp profile that allows unshare)")
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
INSIDE_UID = 65534  # the user the program runs as inside (its own user namespace)


@dataclass(frozen=True)
class Isolation:
    """How this machine isolates a program (see the module docstring)."""

    bwrap: str
    python: str  # the interpreter run inside; the same path inside as outside
    view: tuple[str, ...]  # bwrap arguments: the read-only file system
    run_as: tuple[int, int] | None  # (uid, gid) bwrap is started as: an unprivileged user when rlmerge is root
    sized_tmpfs: bool  # bwrap >= 0.7: the scratch tmpfs has a size cap (--size)
    disable_userns: bool  # bwrap >= 0.8: no further user namespace can be made inside

    def command(self, argv: Sequence[str], *, scratch_bytes: int, data: Sequence[tuple[int, str, bool]] = ()
                ) -> list[str]:
        """bwrap's command line running ``argv`` in /tmp (a fresh tmpfs of ``scratch_bytes``); ``data`` is
        (fd, path inside, read_only) for each file copied in from an open descriptor."""
        copies = [a for fd, dest, ro in data for a in ("--ro-bind-data" if ro else "--file", str(fd), dest)]
        return [self.bwrap, "--unshare-all", "--unshare-user", *(["--disable-userns"] * self.disable_userns),
                "--die-with-parent", "--new-session", "--as-pid-1", "--uid", str(INSIDE_UID), "--gid", str(INSIDE_UID),
                "--hostname", "sandbox", "--clearenv", "--setenv", "HOME", "/tmp",
                "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", *self.view, "--proc", "/proc", "--dev", "/dev",
                *(["--size", str(scratch_bytes)] * self.sized_tmpfs), "--tmpfs", "/tmp", "--dir", "/sandbox",
                *copies, "--remount-ro", "/", "--remount-ro", "/dev", "--chdir", "/tmp", "--", *argv]

    def popen_user(self) -> dict[str, Any]:
        """Popen's keyword arguments that start bwrap as ``run_as``."""
        if self.run_as is None:
            return {}
        return {"user": self.run_as[0], "group": self.run_as[1], "extra_groups": []}


_lock = threading.Lock()
_probed: dict[str, Isolation | tuple[str, str]] = {}


def isolation() -> Isolation:
    """This machine's isolation, probed once per bwrap (``$RLMERGE_BWRAP``, else ``bwrap`` on PATH).

    Raises ``SandboxUnavailable`` saying how to get it when bwrap is missing or cannot make the namespaces.
    """
    bwrap = os.environ.get(BWRAP_ENV) or shutil.which("bwrap") or shutil.which("bwrap", path="/usr/bin:/bin")
    with _lock:
        if (key := bwrap or "") not in _probed:
            _probed[key] = _probe(bwrap)
        found = _probed[key]
    if isinstance(found, Isolation):
        return found
    raise SandboxUnavailable(found[0], hint=found[1])


def unsafe_opted_in(unsafe_unisolated: bool | None = None) -> bool:
    """Whether the user opted in to unisolated execution: the argument, else ``$RLMERGE_UNSAFE_UNISOLATED_CODE``."""
    if unsafe_unisolated is not None:
        return unsafe_unisolated
    return os.environ.get(UNSAFE_ENV, "").strip().lower() in ("1", "true", "yes")


def allow_unisolated() -> None:
    """Opt this process, and the processes it starts (Ray's local workers), in to unisolated execution where no
    isolation is available: what ``--unsafe-unisolated-code`` does."""
    os.environ[UNSAFE_ENV] = "1"


def ensure_isolation(unsafe_unisolated: bool | None = None) -> Isolation | None:
    """The isolation to run model code in; ``None`` where there is none and the user opted in to running without it
    (with a warning); else ``SandboxUnavailable``. Commands call it before any work, so a refusal comes first."""
    try:
        return isolation()
    except SandboxUnavailable as e:
        if not unsafe_opted_in(unsafe_unisolated):
            raise
        warnings.warn(f"model-written code runs WITHOUT isolation (opted in): {e.message}", RuntimeWarning,
                      stacklevel=2)
        return None


def _probe(bwrap: str | None) -> Isolation | tuple[str, str]:
    """Isolation, or (message, hint) saying why there is none."""
    fix = f"{INSTALL_HINT}; {OPT_IN}"
    if bwrap is None or not os.path.exists(bwrap):
        named = f" (${BWRAP_ENV} names {bwrap}, which does not exist)" if bwrap else ""
        return f"model-written code runs only in an OS sandbox, and bubblewrap (bwrap) is not installed{named}", fix
    try:
        usage = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=30,
                               stdin=subprocess.DEVNULL).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"bubblewrap ({bwrap}) cannot run: {e}", fix
    run_as = _unprivileged() if os.geteuid() == 0 else None
    tried = []
    for python, libs in _interpreters():
        iso = Isolation(bwrap, python, _view(python, libs), run_as, "--size" in usage, "--disable-userns" in usage)
        try:
            done = subprocess.run(iso.command([python, "-I", "-S", "-c", "print(6 * 7)"], scratch_bytes=1 << 20),
                                  capture_output=True, timeout=30, env={}, stdin=subprocess.DEVNULL,
                                  **iso.popen_user())
        except (OSError, subprocess.SubprocessError) as e:
            return f"bubblewrap ({bwrap}) cannot run: {e}", fix
        if done.returncode == 0 and done.stdout.strip() == b"42":
            return iso
        why = done.stderr.decode(errors="replace").strip() or f"exit {done.returncode}"
        if any(s in why for s in ("namespace", "uid map", "Operation not permitted", "setgroups")):
            return (f"bubblewrap ({bwrap}) cannot isolate a program on this machine: {why}",
                    f"{USERNS_HINT}; {OPT_IN}")
        tried.append(f"{python}: {why}")
    who = "the user nobody" if run_as else "the sandbox"
    return (f"no Python interpreter that {who} can run was found for the sandbox ({'; '.join(tried)})",
            f"install a system Python readable by every user (apt-get install python3-minimal); {OPT_IN}")


def _unprivileged() -> tuple[int, int]:
    import pwd

    try:
        user = pwd.getpwnam("nobody")
        return user.pw_uid, user.pw_gid
    except KeyError:
        return 65534, 65534


def _interpreters() -> list[tuple[str, tuple[str, ...]]]:
    """(interpreter, library folders it needs) to try, this process's own first, then the system's of the same
    version, then the system's python3: as root the sandbox runs as nobody, who may not reach ours (pyenv in /root)."""
    own = os.path.realpath(getattr(sys, "_base_executable", "") or sys.executable)
    found = [(own, tuple(os.path.join(p, lib) for p in {sys.base_prefix, sys.base_exec_prefix}
                         for lib in ("lib", "lib64")))]
    for name in (f"python{sys.version_info.major}.{sys.version_info.minor}", "python3"):
        for folder in ("/usr/local/bin", "/usr/bin"):
            if os.access(path := os.path.join(folder, name), os.X_OK):
                real = os.path.realpath(path)
                prefix = os.path.dirname(os.path.dirname(real))
                found.append((real, (os.path.join(prefix, "lib"), os.path.join(prefix, "lib64"))))
    first: dict[str, tuple[str, ...]] = {}
    for path, libs in found:
        first.setdefault(path, libs)
    return list(first.items())


def _view(python: str, libs: Sequence[str]) -> tuple[str, ...]:
    """The read-only file system: the system's program and library folders, plus the interpreter and its library
    folders where they live elsewhere (never a home or project folder as a whole)."""
    args: list[str] = []
    bound: list[str] = []
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
            bound.append(d)
    for path in (python, *libs):
        real = os.path.realpath(path)
        if os.path.exists(real) and not any(real == b or real.startswith(b + "/") for b in bound):
            args += ["--ro-bind", real, real]
            bound.append(real)
    return tuple(args)
