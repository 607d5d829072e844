"""Where rlmerge writes, and the proof of what it wrote: output checks, the partial folder, the final rename.

Rules, for every command that writes (merge, fisher, inspect --save / --plots, demo):
- An output never is, contains or lies inside an input, and is never reached through a symbolic link that
  rlmerge did not create. Every check runs before the first weight is read (``output_problems``).
- A folder is written as ``<parent>/.<name>.rlmerge-partial`` and renamed onto the output only when complete.
  It ends with ``rlmerge.json``, whose ``files`` lists every other file with its size and CRC-32: the proof that
  rlmerge wrote the folder. ``--force`` replaces only a folder that proof matches (``not_ours`` says why not),
  and deletes the replaced folder's listed files only, never a file it did not write. What a manifest may delete
  is decided in one place, ``listed_problem``: a listed name that is not a plain file of the folder itself
  (absolute, ``..``, through a link) makes the whole folder foreign, for every command.
- A partial folder found on disk is trusted only when it is a real folder owned by this user that holds nothing
  but files rlmerge writes there; files inside it are created afresh (``O_EXCL | O_NOFOLLOW``), so a planted
  link or hard link is never written through.
- While a run writes, it holds an exclusive ``flock`` on ``.lock`` inside the partial folder, so a second run
  into the same output is refused and a killed run's lock vanishes with its process. Each completed shard is
  recorded in ``.progress.json`` with its size and CRC-32, next to a fingerprint of everything that decides the
  output bytes and the identity of every input file; ``--resume`` checks both, re-checks the recorded shards and
  continues after the last good one, byte-identical to an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import re
import stat
import sys
import tempfile
import zlib
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import OutputError, RLMergeError, raise_all
from .checkpoint import SIDE_FILES, Checkpoint

try:
    import fcntl
except ImportError:  # Windows: no flock; the partial folder's existence is the only guard there
    fcntl = None  # type: ignore[assignment]

LOCK = ".lock"
PROGRESS = ".progress.json"
MANIFEST = "rlmerge.json"  # provenance, and the list of files rlmerge wrote beside it
_HASH_CHUNK = 1 << 24  # bytes per read when checksumming a file
# Every name rlmerge writes into a folder of its own (shards, index, side files, reports, plots, bookkeeping).
_OURS = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|rlmerge\.json"
                   r"|adapter_model\.safetensors|adapter_config\.json"
                   r"|rlmerge-report\.json|README\.md|fisher\.json|[\w-]+\.png|\.lock|\.progress\.(json|tmp)")
_BOOKKEEPING = (LOCK, PROGRESS, ".progress.tmp")


def is_our_name(name: str) -> bool:
    return name in SIDE_FILES or _OURS.fullmatch(name) is not None


def partial_path(output: Path) -> Path:
    return output.parent / f".{output.name}.rlmerge-partial"


def target(output: str | os.PathLike[str]) -> Path:
    """The output as an absolute path whose parent folders are resolved (the last component is not followed:
    a link there is refused, not written through). ``-o .`` names the current folder itself."""
    p = Path(os.path.abspath(os.fspath(output)))
    if not p.name:
        return p
    return p.parent.resolve() / p.name


# -- what is ours ---------------------------------------------------------------------------------------------
def file_crc32(path: Path) -> int:
    """CRC-32 of a file: it catches a torn or damaged shard, at ~3× the speed of SHA-256 (no adversary here:
    the partial folder is our own)."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """``rlmerge.json`` of ``folder`` when it is a regular file holding a JSON object, else None."""
    path = folder / MANIFEST
    try:
        if not stat.S_ISREG(path.lstat().st_mode):
            return None
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None


def not_ours(folder: Path, *, checksums: bool = True) -> str | None:
    """Why ``folder`` cannot be proven to be rlmerge's (None when it can): its ``rlmerge.json`` must list every
    other file in it, each a regular file of the recorded size and (``checksums``) CRC-32."""
    with os.scandir(folder) as it:
        entries = sorted(it, key=lambda e: e.name)
    if not entries:
        return None  # an empty folder: nothing in it to lose
    doc = read_manifest(folder)
    if doc is None:
        held = [e.name + ("/" if e.is_dir(follow_symlinks=False) else "") for e in entries]
        return f"holds {_list(held)} and no rlmerge.json, so rlmerge did not write it"
    files = doc.get("files")
    if not isinstance(files, dict) or not all(isinstance(v, dict) for v in files.values()):
        return "has an rlmerge.json without a list of files (written by an older rlmerge?), so it cannot be " \
               "proven that rlmerge wrote everything in it"
    why = listed_problem(folder, files)
    if why is not None:
        return f"has an rlmerge.json that {why}"
    foreign, changed = [], []
    for e in entries:
        if e.name == MANIFEST:
            continue
        rec = files.get(e.name)
        if rec is None or e.is_symlink() or not e.is_file(follow_symlinks=False):
            foreign.append(e.name + ("/" if e.is_dir(follow_symlinks=False) else ""))
        elif e.stat(follow_symlinks=False).st_size != rec.get("bytes") or (
                checksums and file_crc32(Path(e.path)) != rec.get("crc32")):
            changed.append(e.name)
    if foreign:
        return f"holds {_list(foreign)}, which rlmerge did not write"
    if changed:
        return f"holds {_list(changed)}, changed since rlmerge wrote it"
    return None


def _list(names: list[str], most: int = 5) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def listed_problem(folder: Path, names: Iterable[Any], *, nested: Collection[str] = ()) -> str | None:
    """The one rule for what a manifest may delete: why the ``names`` a manifest in ``folder`` lists are not all
    files of ``folder`` itself (None when they are), so that the folder must be treated as foreign.

    A name is a plain file name, or ``SUB/NAME`` for a sub-folder in ``nested`` (a sweep's ``cache``); never
    absolute, never empty, ``.`` or ``..``, and never reached through a symbolic link: the sub-folder must be a real
    folder and a listed entry that exists must not be a link. Every command that deletes what a manifest lists
    (``merge --force``, ``sweep --force``, a sweep's stale ``best-N`` and scored candidates) asks this first.
    """
    root = os.path.realpath(folder)
    for name in names:
        if not isinstance(name, str):
            return f"lists {name!r}, which is not a file name"
        parts = name.split("/")
        if (not name or "\0" in name or any(p in ("", ".", "..") for p in parts) or len(parts) > 2
                or (len(parts) == 2 and parts[0] not in nested)):
            return f"lists {name!r}, which is not a file inside it"
        path = folder / name
        if len(parts) == 2 and os.path.lexists(folder / parts[0]) and (
                (folder / parts[0]).is_symlink() or not (folder / parts[0]).is_dir()):
            return f"lists {name!r}, reached through {parts[0]}, which is not a real folder (a link?)"
        if path.is_symlink():
            return f"lists {name!r}, which is a symbolic link"
        if os.path.dirname(os.path.realpath(path)) != os.path.join(root, *parts[:-1]).rstrip(os.sep):
            return f"lists {name!r}, which resolves outside it"
    return None


def remove_listed(folder: Path, names: Sequence[str], *, nested: Collection[str] = (), rmdir: bool = True) -> None:
    """Unlink the files a manifest of ``folder`` lists (regular files only; ``listed_problem`` first: a name that
    is not a file of the folder refuses the whole folder and nothing is deleted), then the ``nested`` sub-folders
    and (``rmdir``) the folder itself where that left them empty."""
    why = listed_problem(folder, names, nested=nested)
    if why is not None:
        raise OutputError(f"the folder {why}, so it cannot be proven rlmerge's: nothing in it was deleted",
                          file=str(folder), hint="move it away; rlmerge never deletes what it did not write")
    for name in names:
        p = folder / name
        with contextlib.suppress(FileNotFoundError):
            if p.is_symlink() or p.is_file():
                p.unlink()
    for sub in nested:
        with contextlib.suppress(OSError):  # something else is in it: it stays
            (folder / sub).rmdir()
    if rmdir:
        with contextlib.suppress(OSError):
            folder.rmdir()


# -- checks before any work --------------------------------------------------------------------------------
def _roots(inputs: Sequence[Checkpoint | Path]) -> list[tuple[str, Path]]:
    out = []
    for m in inputs:
        if isinstance(m, Checkpoint):
            out += [(m.label, r) for r in m.roots]
        else:
            out.append((str(m), Path(m).resolve()))
    return out


def _overlap(path: Path, roots: list[tuple[str, Path]], what: str) -> list[RLMergeError]:
    for label, r in roots:
        if path == r or r in path.parents or path in r.parents:
            how = "is that folder" if path == r else "lies inside it" if r in path.parents else "contains it"
            return [OutputError(f"{what} overlaps the input {label} (it {how})", file=str(path),
                                hint="write to a folder outside every input (rlmerge never writes into an input)")]
    return []


def _partial_problems(partial: Path, *, force: bool, resume: bool, option: str = "-o") -> list[RLMergeError]:
    """A partial folder left on disk must be a real folder of this user's holding only rlmerge's files."""
    if not os.path.lexists(partial):
        return []
    if partial.is_symlink():
        return [OutputError(f"{partial} is a symbolic link that rlmerge did not create", file=str(partial),
                            hint="remove the link (rlmerge never writes through it), then rerun")]
    if not partial.is_dir():
        return [OutputError(f"{partial} exists and is not a folder", file=str(partial),
                            hint="remove or rename it, then rerun")]
    st = partial.stat()
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return [OutputError(f"{partial} belongs to another user", file=str(partial),
                            hint=f"it is not this user's interrupted run: choose another {option}")]
    with os.scandir(partial) as it:
        foreign = sorted(e.name for e in it if not is_our_name(e.name) or e.is_symlink()
                         or not e.is_file(follow_symlinks=False))
    if foreign:
        return [OutputError(f"{partial} holds {_list(foreign)}, which rlmerge does not write there",
                            file=str(partial), hint="it is not an interrupted rlmerge run: move it away, then rerun")]
    if _locked(partial / LOCK):
        return [OutputError("another rlmerge run is writing this output right now", file=str(partial),
                            hint=f"wait for it to finish, or choose another {option}")]
    n = len(_progress(partial).get("shards", []))
    if n and not (resume or force):
        return [OutputError(f"an interrupted merge left {n} completed shard(s) in {partial}", file=str(partial),
                            hint="run the same command with --resume to continue it, or --force to start over")]
    return []


def _locked(lock: Path) -> bool:
    """Whether a live run holds ``lock`` (its flock); the file is only opened for reading, never changed."""
    if fcntl is None or lock.is_symlink() or not lock.is_file():
        return False
    try:
        fd = os.open(lock, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also releases the shared lock just taken
    return False


def _progress(folder: Path) -> dict[str, Any]:
    path = folder / PROGRESS
    try:
        if path.is_symlink():
            return {}
        doc = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(doc, dict) or not isinstance(doc.get("shards"), list):
        return {}
    return doc


def output_problems(output: str | os.PathLike[str], inputs: Sequence[Checkpoint | Path], *, force: bool = False,
                    resume: bool = False, kind: str = "folder", checksums: bool = True,
                    option: str = "-o") -> list[RLMergeError]:
    """Every reason not to write ``output`` (a folder, or with ``kind="file"`` one file), before any work.

    ``inputs`` are the opened checkpoints (their folders) and any other input paths (a data file).
    ``checksums=False`` proves an earlier output rlmerge's by its files' names and sizes only (a re-check).
    ``option``: the command-line option that named the folder, for the hints ("choose another --plots").
    """
    out = target(output)
    if not out.name or out == Path(out.anchor):
        return [OutputError("the output must name a folder or file to create", file=str(output))]
    parent = next((p for p in out.parents if p.exists()), None)  # the folder the output would be created under
    if parent is not None and not parent.is_dir():  # nothing can be created under a file (mkdir: "File exists")
        return [OutputError("a file stands where the output's folder would be", file=str(parent),
                            hint=f"choose another output location, or move that file away ({out} would be inside it)")]
    roots = _roots(inputs)
    problems = _overlap(out, roots, f"the output {'file' if kind == 'file' else 'folder'}")
    if problems:
        return problems
    if os.path.lexists(out):
        problems += _existing(out, force=force, kind=kind, checksums=checksums, option=option)
    if kind == "folder":
        partial = partial_path(out)
        problems += _overlap(partial, roots, "the partial folder") or _partial_problems(
            partial, force=force, resume=resume, option=option)
    if parent is not None and not os.access(parent, os.W_OK):
        problems.append(OutputError("the output's folder is not writable", file=str(parent),
                                    hint="choose a writable output folder"))
    return problems


def _existing(out: Path, *, force: bool, kind: str, checksums: bool, option: str = "-o") -> list[RLMergeError]:
    if out.is_symlink():
        return [OutputError(f"the output is a symbolic link (to {os.readlink(out)})", file=str(out),
                            hint="rlmerge never writes through a link it did not create: remove the link, or "
                                 "name the real location")]
    if kind == "file":
        if not out.is_file():
            return [OutputError("the output exists and is not a file", file=str(out), hint="name a file to write")]
        if not force:
            return [OutputError("the output file already exists", file=str(out),
                                hint="choose another name, or pass --force to replace a report rlmerge wrote")]
        if not _is_our_report(out):
            return [OutputError("--force replaces only a report rlmerge wrote, and this file is not one",
                                file=str(out), hint="choose another name; rlmerge never replaces a file it "
                                                    "did not write")]
        return []
    if not out.is_dir():
        return [OutputError("the output exists and is a file, not a folder", file=str(out),
                            hint=f"choose another {option}; rlmerge replaces only a folder it wrote")]
    if not force:
        return [OutputError("output folder already exists", file=str(out),
                            hint=f"choose another {option}, or pass --force to replace a folder rlmerge wrote")]
    why = not_ours(out, checksums=checksums)
    if why is not None:
        return [OutputError(f"--force replaces only a folder rlmerge wrote, and this one {why}", file=str(out),
                            hint=f"move it away or choose another {option}; rlmerge never deletes what it did "
                                 "not write")]
    return []


def _is_our_report(path: Path) -> bool:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(doc, dict) and doc.get("schema") == "rlmerge.report"


def check_output(output: str | os.PathLike[str], inputs: Sequence[Checkpoint | Path], *, force: bool = False,
                 resume: bool = False, kind: str = "folder", checksums: bool = True, option: str = "-o") -> None:
    """Raise the problems ``output_problems`` finds."""
    raise_all(output_problems(output, inputs, force=force, resume=resume, kind=kind, checksums=checksums,
                              option=option))


# -- resume fingerprints -----------------------------------------------------------------------------------
def input_identity(models: Sequence[Checkpoint]) -> list[list[Any]]:
    """Per input file: path, size, device, inode, modification time (ns) and the SHA-256 of its header.

    ``--resume`` continues only when every one is unchanged: a file rewritten (retrained in place, replaced)
    changes its modification time or inode. A file rewritten with the same size, header and a restored
    modification time in the same inode is not detected (its bytes are not re-read).
    """
    rows = []
    for m in models:
        for f in m.files:
            st = f.stat()
            raw = m.header_bytes.get(f)
            rows.append([str(f.resolve()), st.st_size, st.st_dev, st.st_ino, st.st_mtime_ns,
                         hashlib.sha256(raw).hexdigest() if raw is not None else None])
    return rows


def fingerprint(models: Sequence[Checkpoint], parts: dict[str, Any]) -> str:
    """SHA-256 over what decides the output bytes: every input file's path, size and header, plus ``parts``."""
    inputs = [[str(m.path.resolve()), f.name, f.stat().st_size,
               hashlib.sha256(m.header_bytes[f]).hexdigest() if f in m.header_bytes else None]
              for m in models for f in m.files]
    doc = json.dumps({"inputs": inputs, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(doc.encode()).hexdigest()


def _changed_input(old: Any, new: list[list[Any]]) -> str | None:
    """The first input file whose identity differs between two ``input_identity`` lists, described."""
    if not isinstance(old, list):
        return "the interrupted run recorded no input identities (an older rlmerge?)"
    before = {row[0]: row for row in old if isinstance(row, list) and len(row) == 6}
    fields = ("size", "device", "inode", "modification time", "header")
    for row in new:
        was = before.get(row[0])
        if was is None:
            return f"{row[0]} was not an input of the interrupted run"
        what = [name for i, name in enumerate(fields, 1) if was[i] != row[i]]
        if what:
            return f"{row[0]} changed since the interrupted run began (its {', '.join(what)})"
    return None


def resume_problems(output: str | os.PathLike[str], fp: str, identity: list[list[Any]]) -> list[RLMergeError]:
    """Why ``--resume`` cannot continue the interrupted run kept beside ``output`` with a run whose fingerprint is
    ``fp`` (``fingerprint``) reading the inputs ``identity`` describes (``input_identity``); nothing when there is
    no kept shard. ``PartialDir.start`` refuses on the same comparison, so ``plan --resume`` reports what
    ``merge --resume`` would refuse."""
    partial = partial_path(target(output))
    old = _progress(partial)
    refused = _refusal(old, partial, fp, identity) if old.get("shards") else None
    return [refused] if refused is not None else []


def _refusal(old: dict[str, Any], partial: Path, fp: str, identity: list[list[Any]]) -> OutputError | None:
    """The refusal to resume the run ``old`` (its progress record) with other settings or changed inputs."""
    if old.get("fingerprint") != fp:
        return OutputError("the interrupted merge in the partial folder was made from other inputs or settings",
                           file=str(partial), hint="resume with exactly the same command, or pass --force to start "
                                                   "over")
    changed = _changed_input(old.get("inputs"), identity)
    if changed is not None:
        return OutputError(f"cannot resume: {changed}", file=str(partial),
                           hint="the kept shards were computed from the earlier bytes: pass --force to start over")
    return None


# -- the partial folder ------------------------------------------------------------------------------------
@dataclass
class _Seen:
    """What the output looked like when the run started (to notice a change before replacing it)."""

    exists: bool
    files: dict[str, tuple[int, int]] = field(default_factory=dict)  # name → (size, mtime_ns)


def _snapshot(out: Path) -> _Seen:
    if not out.is_dir() or out.is_symlink():
        return _Seen(os.path.lexists(out))
    with os.scandir(out) as it:
        return _Seen(True, {e.name: (st.st_size, st.st_mtime_ns) for e in it
                            for st in [e.stat(follow_symlinks=False)]})


class PartialDir:
    """Claim the partial folder for one run; on failure keep it (resumable) or remove what was written.

    Kept only when at least one shard is complete and the run stopped by an interrupt (Ctrl-C, SIGTERM)
    or an output problem (disk full): the work done so far survives, and the message says how to resume.
    """

    def __init__(self, output: str | os.PathLike[str], *, force: bool = False, resume: bool = False,
                 inputs: Sequence[Checkpoint | Path] = (), option: str = "-o") -> None:
        self.output = target(output)
        self.option = option  # the command-line option that named the folder, for the hints
        self.tmp = partial_path(self.output)
        self.force = force
        self.resume = resume
        self.inputs = list(inputs)
        self.shards: list[dict[str, Any]] = []  # recorded, verified shards: {"file", "bytes", "crc32"}
        self.resumed = 0  # shards carried over from an interrupted run
        self.written: dict[str, dict[str, int]] = {}  # files of this run: name → {"bytes", "crc32"}
        self._fingerprint = ""
        self._identity: list[list[Any]] = []
        self._lock_fd: int | None = None
        self._unverified = False  # a resumable partial output we have not yet checked: never delete it
        self._seen = _Seen(False)

    # -- claiming --------------------------------------------------------------------------------------
    def __enter__(self) -> PartialDir:
        # checked in full (with checksums) before the run; here again, cheaply, as the folder is claimed
        check_output(self.output, self.inputs, force=self.force, resume=self.resume, checksums=False,
                     option=self.option)
        self._seen = _snapshot(self.output)
        try:
            self.output.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):  # an existing one passed _partial_problems above
                self.tmp.mkdir()
            self._lock()
        except OSError as e:
            self._unlock()
            raise disk_error(e, self.tmp, self.option) from e
        old = self._read_progress()
        if not self.resume:
            self._clear()
        self._unverified = old is not None and self.resume
        return self

    def _lock(self) -> None:
        self._lock_fd = fd = take_lock(self.tmp / LOCK, "another rlmerge run is writing this output right now",
                                       self.output, self.option)
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = None

    def _names(self) -> list[str]:
        with os.scandir(self.tmp) as it:
            return [e.name for e in it]

    def _clear(self) -> None:
        """Empty the folder (it holds only rlmerge's files: checked on entry), keeping the lock we hold."""
        for name in self._names():
            if name != LOCK:
                (self.tmp / name).unlink()

    def _read_progress(self) -> dict[str, Any] | None:
        doc = _progress(self.tmp)
        return doc if doc.get("shards") else None

    # -- files -----------------------------------------------------------------------------------------
    def create(self, name: str) -> Any:
        """A new, empty file ``name`` in the partial folder, open for reading and writing (``create_file``)."""
        return create_file(self.tmp, name)

    def reopen(self, name: str) -> Any:
        """A file this run created, open for reading and writing at its start (never through a link)."""
        return reopen_file(self.tmp, name)

    def note(self, name: str, nbytes: int, crc32: int) -> None:
        """A file of this run is complete: it goes into the manifest."""
        self.written[name] = {"bytes": nbytes, "crc32": crc32}

    def write_bytes(self, name: str, data: bytes) -> None:
        try:
            with self.create(name) as fh:
                fh.write(data)
        except OSError as e:
            raise disk_error(e, self.tmp / name, self.option) from e
        self.note(name, len(data), zlib.crc32(data))

    def adopt(self) -> None:
        """Record the files a library wrote straight into the partial folder: they go into the manifest."""
        for name in sorted(self._names()):
            path = self.tmp / name
            if name in _BOOKKEEPING or name in self.written:
                continue
            if path.is_symlink() or not path.is_file():
                raise OutputError("not a plain file", file=str(path), hint="only plain files are written here")
            self.note(name, path.stat().st_size, file_crc32(path))

    # -- progress --------------------------------------------------------------------------------------
    def start(self, fp: str, filenames: Sequence[str], identity: list[list[Any]] | None = None) -> int:
        """Fix the run's fingerprint; on resume, verify recorded shards and return how many to keep."""
        self._fingerprint = fp
        self._identity = identity or []
        old = self._read_progress() if self.resume else None
        if old is not None:
            refused = _refusal(old, self.tmp, fp, self._identity)
            if refused is not None:
                raise refused
            for i, rec in enumerate(old["shards"]):
                if i >= len(filenames) or not isinstance(rec, dict) or rec.get("file") != filenames[i]:
                    break
                path = self.tmp / filenames[i]
                if path.is_symlink() or not path.is_file() or path.stat().st_size != rec.get("bytes"):
                    break
                if file_crc32(path) != rec.get("crc32"):
                    break
                self.shards.append(rec)
                self.note(rec["file"], rec["bytes"], rec["crc32"])
        self._unverified = False
        self.resumed = len(self.shards)
        self._write_progress()
        return self.resumed

    def record(self, filename: str, nbytes: int, crc32: int, notes: dict[str, Any] | None = None) -> None:
        """A shard is complete and on disk (fsynced by the caller): remember it, with what the merge noted about
        its tensors (``CheckpointWriter.annotate``), which a resumed run reads back instead of recomputing."""
        rec: dict[str, Any] = {"file": filename, "bytes": nbytes, "crc32": crc32}
        if notes:
            rec["notes"] = notes
        self.shards.append(rec)
        self.note(filename, nbytes, crc32)
        self._write_progress()

    def _write_progress(self) -> None:
        tmp = ".progress.tmp"
        doc = {"fingerprint": self._fingerprint, "inputs": self._identity, "shards": self.shards}
        try:
            with self.create(tmp) as fh:
                fh.write(json.dumps(doc, indent=1).encode())
            os.replace(self.tmp / tmp, self.tmp / PROGRESS)
        except OSError as e:
            raise disk_error(e, self.tmp / PROGRESS, self.option) from e

    # -- the end ---------------------------------------------------------------------------------------
    def publish(self, manifest: dict[str, Any]) -> Path:
        """Write ``rlmerge.json`` (``manifest`` plus the list of files written) and rename the folder onto the
        output, replacing an earlier rlmerge output only with --force."""
        doc = {**manifest, "files": {k: self.written[k] for k in sorted(self.written) if k != MANIFEST}}
        self.write_bytes(MANIFEST, (json.dumps(doc, indent=2, default=str) + "\n").encode())
        now = _snapshot(self.output)
        if now.exists and not self._seen.exists:  # appeared while we merged (another run finished first)
            raise OutputError("the output folder appeared while this run was merging", file=str(self.output),
                              hint="move it away (or add --force to replace it) and rerun with --resume")
        if now != self._seen:
            raise OutputError("the output folder changed while this run was merging", file=str(self.output),
                              hint="rlmerge replaces only the folder it checked: rerun with --resume")
        try:
            if now.exists:  # checked to be rlmerge's (force) when the run started, and unchanged since
                old = Path(tempfile.mkdtemp(prefix=f".{self.output.name}.rlmerge-old-", dir=self.output.parent))
                os.replace(self.output, old)  # onto our own empty folder
                try:
                    _rename_noreplace(self.tmp, self.output)
                except OSError:
                    os.replace(old, self.output)  # put the earlier output back
                    raise
                remove_listed(old, list(now.files))
            else:
                _rename_noreplace(self.tmp, self.output)
            for name in (LOCK, PROGRESS):  # bookkeeping goes only after the rename: no window loses the work
                with contextlib.suppress(FileNotFoundError):
                    (self.output / name).unlink()
        except OSError as e:
            raise disk_error(e, self.output, self.option) from e
        self._unlock()
        return self.output

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self._unlock()
            return
        if self._unverified:  # e.g. resumed with other settings: the earlier run's work stays as it was
            self._unlock()
            return
        keep = bool(self.shards) and issubclass(exc_type, (KeyboardInterrupt, OutputError)) and self.tmp.is_dir()
        if keep:
            hint = (f"{len(self.shards)} completed shard(s) are kept in {self.tmp}: run the same command with "
                    f"--resume to continue, or delete that folder")
            if isinstance(exc, OutputError):
                exc.hint = f"{exc.hint}; {hint}" if exc.hint else hint
            else:
                exc.rlmerge_hint = hint
        elif self._lock_fd is not None:
            with contextlib.suppress(OSError, OutputError):  # a link planted meanwhile: the folder stays
                remove_listed(self.tmp, [n for n in self._names() if n != LOCK], rmdir=False)
                (self.tmp / LOCK).unlink()
                self.tmp.rmdir()
        self._unlock()


def create_file(folder: Path, name: str) -> Any:
    """A new, empty file ``name`` in ``folder`` (one of ours), open for reading and writing (binary).

    Whatever stood at that name is unlinked first and the file is created with O_EXCL | O_NOFOLLOW: no link, hard
    link or file left there is ever written through. Mode 0o666 less the umask, as ``open()`` (and so the
    tokenizer's files a library writes beside ours) and ``write_file`` create a file.
    """
    path = folder / name
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
    return os.fdopen(os.open(path, flags, 0o666), "r+b")


def reopen_file(folder: Path, name: str) -> Any:
    """A file of ours in ``folder``, open for reading and writing at its start (never through a link)."""
    fd = os.open(folder / name, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0))
    return os.fdopen(fd, "r+b")


def take_lock(path: Path, busy: str, owner: Path, option: str = "-o") -> int:
    """An exclusive ``flock`` on ``path`` (created, never through a symlink): its descriptor, which releases the lock
    when closed. OutputError ``busy`` (naming ``owner``; ``option`` named ``owner``) when another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    if fcntl is None:
        return fd
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise OutputError(busy, file=str(owner), hint=f"wait for it to finish, or choose another {option}") from None
    return fd


def _rename_noreplace(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst``, failing if ``dst`` exists (even an empty folder, which rename would replace)."""
    fn = _renameat2()
    if fn is not None:
        if fn(-100, os.fsencode(src), -100, os.fsencode(dst), 1) == 0:  # AT_FDCWD, RENAME_NOREPLACE
            return
        err = ctypes.get_errno()
        if err not in (errno.ENOSYS, errno.EINVAL):  # EINVAL: the filesystem lacks RENAME_NOREPLACE
            raise OSError(err, os.strerror(err), str(dst))
    if os.path.lexists(dst):
        raise OSError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
    os.rename(src, dst)


_RENAMEAT2: list[Any] = []


def _renameat2() -> Any:
    if not _RENAMEAT2:
        fn = None
        if sys.platform.startswith("linux"):
            try:
                fn = ctypes.CDLL(None, use_errno=True).renameat2
                fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
            except (OSError, AttributeError):
                fn = None
        _RENAMEAT2.append(fn)
    return _RENAMEAT2[0]


@contextlib.contextmanager
def owned_folder(output: str | os.PathLike[str], manifest: dict[str, Any], *, force: bool = False,
                 inputs: Sequence[Checkpoint | Path] = (), option: str = "-o") -> Iterator[PartialDir]:
    """A folder written whole or not at all (plots, examples): write files with ``partial.write_bytes``.
    ``option``: the command-line option that names the folder, for the hints."""
    with PartialDir(output, force=force, inputs=inputs, option=option) as partial:
        partial.start("", [])
        yield partial
        partial.publish(manifest)


def write_file(path: str | os.PathLike[str], data: bytes, *, force: bool = False,
               inputs: Sequence[Checkpoint | Path] = (), option: str = "-o") -> Path:
    """Write one file whole or not at all: a hidden temporary file beside it, renamed onto it. ``option``: the
    command-line option that named it, for the hints."""
    out = target(path)
    check_output(out, inputs, force=force, kind="file", option=option)
    existed = os.path.lexists(out)  # then it is a report rlmerge wrote, and --force was given
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = _new_temp_file(out)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            if not existed:
                _rename_noreplace(Path(tmp), out)
            elif out.is_symlink() or not _is_our_report(out):
                raise OutputError("the output file changed while rlmerge was working", file=str(out),
                                  hint="rerun; rlmerge replaces only a report it wrote")
            else:
                os.replace(tmp, out)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    except OSError as e:
        raise disk_error(e, out, option) from e
    return out


def _new_temp_file(out: Path) -> tuple[int, str]:
    """A new hidden file beside ``out`` (O_EXCL | O_NOFOLLOW), open for writing: its descriptor and path.

    Created with mode 0o666, so that the kernel applies the umask (and a default ACL) exactly as it does to a
    file that ``open()`` creates; mkstemp's 0o600 would make the report private where every other output is not.
    Reading the umask instead is racy (``os.umask`` sets it, process-wide, to read it).
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
    for _ in range(100):
        tmp = str(out.parent / f".{out.name}.rlmerge-{os.urandom(6).hex()}")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(out.parent))


def disk_error(e: OSError, path: Path, option: str = "-o") -> OutputError:
    """``e`` as the OutputError it is for ``path`` (written under the folder or file the command-line ``option``
    named, for the hint)."""
    if e.errno == errno.ENOSPC:
        return OutputError("the disk is full", file=str(path), hint=f"free space or write elsewhere ({option})")
    if e.errno in (errno.EACCES, errno.EROFS, errno.EPERM):
        return OutputError(f"cannot write: {e.strerror}", file=str(path), hint="choose a writable output folder")
    return OutputError(f"cannot write: {e.strerror or e}", file=str(path))
