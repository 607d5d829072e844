"""The hidden folder a merge writes into: claimed under a lock, recorded shard by shard, resumable.

A run writes into ``<parent>/.<name>.rlmerge-partial`` (never into the output itself, never into an input
folder). While it runs it holds an exclusive ``flock`` on ``.lock`` inside that folder, so a second run
into the same output is refused, and a killed run's lock vanishes with its process. Each completed shard
is recorded in ``.progress.json`` with its size and CRC-32, next to a fingerprint of everything that
decides the output bytes (inputs' headers, method, parameters, shard layout). ``--resume`` checks the
fingerprint, re-checks the recorded shards and continues after the last good one; the result is
byte-identical to an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .checkpoint import Checkpoint
from .errors import OutputError

try:
    import fcntl
except ImportError:  # Windows: no flock; the partial folder's existence is the only guard there
    fcntl = None  # type: ignore[assignment]

LOCK = ".lock"
PROGRESS = ".progress.json"
_HASH_CHUNK = 1 << 24  # bytes per read when re-checking a shard on resume


def partial_path(output: Path) -> Path:
    return output.parent / f".{output.name}.rlmerge-partial"


def check_output_location(output: Path, models: Sequence[Checkpoint]) -> None:
    """Refuse an output that is, contains, or lies inside an input folder: inputs are never written to."""
    out = output.resolve()
    for m in models:
        src = m.path.resolve()
        if out == src or src in out.parents or out in src.parents:
            raise OutputError(f"the output folder overlaps the input {m.label}", file=str(output),
                              hint="write the merge to a folder outside every input model folder")


def fingerprint(models: Sequence[Checkpoint], parts: dict[str, Any]) -> str:
    """SHA-256 over what decides the output bytes: every input file's size and header, plus ``parts``."""
    inputs = []
    for m in models:
        for f in m.files:
            raw = m.header_bytes.get(f)
            st = f.stat()
            # .bin files have no cheap header: their modification time stands in.
            ident = hashlib.sha256(raw).hexdigest() if raw is not None else st.st_mtime_ns
            inputs.append([str(m.path.resolve()), f.name, st.st_size, ident])
    doc = json.dumps({"inputs": inputs, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(doc.encode()).hexdigest()


def file_crc32(path: Path) -> int:
    """CRC-32 of a file: it catches a torn or damaged shard, at ~3× the speed of SHA-256 (no adversary here:
    the partial folder is our own)."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


class PartialDir:
    """Claim the partial folder for one run; on failure keep it (resumable) or remove it.

    Kept only when at least one shard is complete and the run stopped by an interrupt (Ctrl-C, SIGTERM)
    or an output problem (disk full): the work done so far survives, and the message says how to resume.
    """

    def __init__(self, output: Path, *, force: bool = False, resume: bool = False) -> None:
        self.output = output
        self.tmp = partial_path(output)
        self.force = force
        self.resume = resume
        self.shards: list[dict[str, Any]] = []  # recorded, verified shards: {"file", "bytes", "crc32"}
        self.resumed = 0  # shards carried over from an interrupted run
        self._fingerprint = ""
        self._lock_fd: int | None = None
        self._unverified = False  # a resumable partial output we have not yet checked: never delete it

    # -- claiming --------------------------------------------------------------------------------------
    def __enter__(self) -> PartialDir:
        if self.output.exists() and not self.force:
            raise OutputError("output folder already exists", file=str(self.output),
                              hint="choose another -o, or pass --force to replace it")
        try:
            self.output.parent.mkdir(parents=True, exist_ok=True)
            self.tmp.mkdir(exist_ok=True)
            self._lock()
        except OSError as e:
            self._unlock()
            raise disk_error(e, self.tmp) from e
        old = self._read_progress()
        if old and not self.resume and not self.force:
            self._unlock()
            raise OutputError(f"an interrupted merge left {len(old.get('shards', []))} completed shard(s) in "
                              f"{self.tmp}", file=str(self.output),
                              hint="run the same command with --resume to continue it, or --force to start over")
        if not self.resume:
            self._clear()
        self._unverified = old is not None and self.resume
        return self

    def _lock(self) -> None:
        fd = os.open(self.tmp / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        self._lock_fd = fd
        if fcntl is None:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._unlock()
            raise OutputError("another rlmerge run is writing this output right now", file=str(self.output),
                              hint="wait for it to finish, or choose another -o") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = None

    def _clear(self) -> None:
        """Empty the folder, keeping the lock file we hold."""
        for p in self.tmp.iterdir():
            if p.name == LOCK:
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()

    def _read_progress(self) -> dict[str, Any] | None:
        try:
            doc = json.loads((self.tmp / PROGRESS).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(doc, dict) or not isinstance(doc.get("shards"), list) or not doc["shards"]:
            return None
        return doc

    # -- progress --------------------------------------------------------------------------------------
    def start(self, fp: str, filenames: Sequence[str]) -> int:
        """Fix the run's fingerprint; on resume, verify recorded shards and return how many to keep."""
        self._fingerprint = fp
        old = self._read_progress() if self.resume else None
        if old is not None:
            if old.get("fingerprint") != fp:
                raise OutputError("the interrupted merge in the partial folder was made from other inputs or "
                                  "settings", file=str(self.tmp),
                                  hint="resume with exactly the same command, or pass --force to start over")
            for i, rec in enumerate(old["shards"]):
                if i >= len(filenames) or not isinstance(rec, dict) or rec.get("file") != filenames[i]:
                    break
                path = self.tmp / filenames[i]
                if not path.is_file() or path.stat().st_size != rec.get("bytes"):
                    break
                if file_crc32(path) != rec.get("crc32"):
                    break
                self.shards.append(rec)
        self._unverified = False
        self.resumed = len(self.shards)
        self._write_progress()
        return self.resumed

    def record(self, filename: str, nbytes: int, crc32: int) -> None:
        """A shard is complete and on disk (fsynced by the caller): remember it."""
        self.shards.append({"file": filename, "bytes": nbytes, "crc32": crc32})
        self._write_progress()

    def _write_progress(self) -> None:
        path = self.tmp / PROGRESS
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps({"fingerprint": self._fingerprint, "shards": self.shards}, indent=1))
            os.replace(tmp, path)
        except OSError as e:
            raise disk_error(e, path) from e

    # -- the end ---------------------------------------------------------------------------------------
    def publish(self) -> Path:
        """Rename the finished folder onto the output (replacing it only with --force)."""
        if self.output.exists() and not self.force:  # appeared while we merged (another run finished first)
            raise OutputError("the output folder appeared while this run was merging", file=str(self.output),
                              hint="move it away (or add --force to replace it) and rerun with --resume")
        old = self.output.parent / f".{self.output.name}.rlmerge-old"
        try:
            if self.output.exists():
                if old.exists():
                    shutil.rmtree(old)
                os.replace(self.output, old)
            # The lock file travels with the folder and is removed after the rename, while still held:
            # no second run can claim the partial folder between our last write and the rename.
            os.replace(self.tmp, self.output)
            for name in (LOCK, PROGRESS):  # bookkeeping goes only after the rename: no window loses the work
                with contextlib.suppress(FileNotFoundError):
                    (self.output / name).unlink()
        except OSError as e:
            raise disk_error(e, self.output) from e
        shutil.rmtree(old, ignore_errors=True)
        self._unlock()
        return self.output

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self._unlock()
            return
        if self._unverified:  # e.g. resumed with other settings: the earlier run's work stays as it was
            self._unlock()
            return
        keep = bool(self.shards) and issubclass(exc_type, (KeyboardInterrupt, OutputError)) and self.tmp.exists()
        if keep:
            hint = (f"{len(self.shards)} completed shard(s) are kept in {self.tmp}: run the same command with "
                    f"--resume to continue, or delete that folder")
            if isinstance(exc, OutputError):
                exc.hint = f"{exc.hint}; {hint}" if exc.hint else hint
            else:
                exc.rlmerge_hint = hint
        elif exc_type is not None and self._lock_fd is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
        self._unlock()


def disk_error(e: OSError, path: Path) -> OutputError:
    if e.errno == errno.ENOSPC:
        return OutputError("the disk is full", file=str(path), hint="free space or write elsewhere (-o)")
    if e.errno in (errno.EACCES, errno.EROFS, errno.EPERM):
        return OutputError(f"cannot write: {e.strerror}", file=str(path), hint="choose a writable output folder")
    return OutputError(f"cannot write: {e.strerror or e}", file=str(path))
