"""A sweep's folder: owned by rlmerge, written one file at a time, and proven rlmerge's before anything is replaced.

``rlmerge sweep -o FOLDER`` keeps its results there while it runs (``results.json``, ``report.md``, plots), the
statistics cache (``cache/*.npz``) and the kept checkpoints (``best-1/`` …, each a normal merge output with its
own ``rlmerge.json``; a candidate too large for memory is merged into ``candidate-<id>/`` to be scored, then
removed). The rules of ``partial.py`` hold here too:

- the folder never is, contains or lies inside an input, and is never reached through a link;
- ``rlmerge-sweep.json`` lists every file written here with its size and CRC-32; a file is written beside its
  name and renamed onto it, so a crash leaves the old file or the new one, never half of one. The one exception is
  a search's study (``study.journal``, Optuna's journal: sweeping/search.py), which Optuna appends to: it is created
  here (never through a link), recorded after every operation the search completes, marked ``append``, and proven
  by the prefix recorded; what follows that prefix (an operation appended just before a crash, not yet recorded)
  is cut when the sweep is resumed, which returns the study to its last recorded state;
- an existing folder is continued (``resume``) or started over (``force``) only when everything in it is
  rlmerge's: listed files unchanged, checkpoint folders that ``partial.not_ours`` proves rlmerge's; nothing else
  is ever deleted or replaced. Every manifest here (``rlmerge-sweep.json``, each checkpoint's ``rlmerge.json``)
  lists only files of its own folder (``partial.listed_problem``), or the whole sweep folder is refused;
- while a sweep runs it holds an exclusive ``flock`` on ``.lock``: a second sweep into the same folder is refused.
"""

from __future__ import annotations

import io
import json
import os
import re
import stat
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import OutputError, RLMergeError, raise_all
from .checkpoint import Checkpoint
from .partial import MANIFEST as CHECKPOINT_MANIFEST
from .partial import (
    _overlap,
    _roots,
    create_file,
    disk_error,
    file_crc32,
    listed_problem,
    not_ours,
    remove_listed,
    reopen_file,
    take_lock,
    target,
)

MANIFEST = "rlmerge-sweep.json"
SCHEMA = "rlmerge.sweep-folder"
LOCK = ".lock"
CACHE = "cache"
# checkpoint folders a sweep writes (each proven rlmerge's by its own rlmerge.json), and their partial folders
_FOLDER = re.compile(r"(best-\d+|candidate-[0-9a-f]{12})")
_PARTIAL = re.compile(r"\.(best-\d+|candidate-[0-9a-f]{12})\.rlmerge-partial")
_TMP = re.compile(r"\..+\.rlmerge-tmp")


class SweepDir:
    """Claim a sweep folder (see the module docstring); ``write`` files into it, ``checkpoint`` names a folder for
    a merge to write."""

    def __init__(self, output: str | os.PathLike[str], *, inputs: Sequence[Checkpoint | Path] = (),
                 resume: bool = False, force: bool = False) -> None:
        self.path = target(output)
        self.inputs, self.resume, self.force = list(inputs), resume, force
        self.files: dict[str, dict[str, int]] = {}  # name (cache/x.npz for the cache) → {"bytes", "crc32"}
        self._lock_fd: int | None = None
        self._cut: dict[str, int] = {}  # append-only files proven by a prefix: name → the recorded size

    # -- claiming -------------------------------------------------------------------------------------------
    def problems(self) -> list[RLMergeError]:
        """Every reason not to use the folder, before any work."""
        out = self.path
        if not out.name:
            return [OutputError("the sweep's output must name a folder", file=str(out))]
        found = _overlap(out, _roots(self.inputs), "the sweep folder")
        if found or not os.path.lexists(out):
            return found
        if out.is_symlink() or not out.is_dir():
            return [OutputError("the sweep's output exists and is not a folder (or is a link)", file=str(out),
                                hint="choose another -o; rlmerge never writes through a link it did not create")]
        with os.scandir(out) as it:
            names = sorted(e.name for e in it)
        if not names:
            return []
        why = self._foreign(names)
        if why is not None:
            return [OutputError(f"the sweep folder {why}", file=str(out),
                                hint="choose another -o, or move it away: rlmerge never replaces what it did "
                                     "not write")]
        if not (self.resume or self.force):
            return [OutputError("the sweep folder already holds a sweep", file=str(out),
                                hint="pass --resume to continue it, or --force to start over")]
        return []

    def _foreign(self, names: list[str]) -> str | None:
        """Why the folder's entries cannot all be proven rlmerge's (None when they can)."""
        doc = _read_json(self.path / MANIFEST)
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or not isinstance(doc.get("files"), dict):
            return f"holds {', '.join(names[:5])} and no {MANIFEST}, so rlmerge did not write it"
        listed: dict[str, Any] = doc["files"]
        why = listed_problem(self.path, listed, nested=(CACHE,))
        if why is not None:
            return f"has a {MANIFEST} that {why}"
        foreign, changed = [], []
        for name in names:
            p = self.path / name
            if name in (MANIFEST, LOCK) or _TMP.fullmatch(name):
                continue
            if name == CACHE and p.is_dir() and not p.is_symlink():
                with os.scandir(p) as it:
                    inner = [f"{CACHE}/{e.name}" for e in it]
                foreign += [n for n in inner if n not in listed and not _TMP.fullmatch(n.split("/")[1])]
                changed += [n for n in inner if n in listed and not _same(self.path / n, listed[n])]
            elif _FOLDER.fullmatch(name) and p.is_dir() and not p.is_symlink():
                # a checkpoint: proven now by what its manifest lists and the files' sizes (partial.not_ours without
                # the CRC-32s, which would read every kept checkpoint whole), so that a lie there or a file of
                # someone else's refuses the sweep before any work; proven with the CRC-32s too before it is
                # replaced or removed
                why = not_ours(p, checksums=False)
                if why is not None:
                    return f"holds {name}, which {why}"
            elif _PARTIAL.fullmatch(name) and p.is_dir() and not p.is_symlink():
                continue  # an interrupted checkpoint: partial.py's rules decide before it is reused
            elif name in listed and not p.is_symlink() and p.is_file():
                rec = listed[name]
                if _same(p, rec):
                    continue
                if isinstance(rec, dict) and rec.get("append") and _same_prefix(p, rec):
                    self._cut[name] = int(rec["bytes"])  # appended after its last record: cut on resume
                else:
                    changed.append(name)
            else:
                foreign.append(name)
        if foreign:
            return f"holds {', '.join(foreign[:5])}, which rlmerge did not write"
        if changed:
            return f"holds {', '.join(changed[:5])}, changed since rlmerge wrote it"
        self.files = {k: v for k, v in listed.items() if isinstance(v, dict)}
        return None

    def __enter__(self) -> SweepDir:
        raise_all(self.problems())
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._lock()
            if self.force:
                self._start_over()
            else:
                for name, size in self._cut.items():  # proven by their recorded prefix (``_foreign``)
                    with reopen_file(self.path, name) as fh:
                        fh.truncate(size)
            (self.path / CACHE).mkdir(exist_ok=True)
        except OSError as e:
            self._unlock()
            raise disk_error(e, self.path) from e
        except BaseException:
            self._unlock()
            raise
        self._save_manifest()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._unlock()

    def _lock(self) -> None:
        self._lock_fd = take_lock(self.path / LOCK, "another rlmerge sweep is writing this folder right now", self.path)

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _start_over(self) -> None:
        """--force: remove what an earlier sweep wrote here, after proving every checkpoint folder rlmerge's."""
        folders = [p for p in self.path.iterdir() if _FOLDER.fullmatch(p.name)]
        for p in folders:
            why = not_ours(p)
            if why is not None:
                raise OutputError(f"--force replaces only what rlmerge wrote, and {p.name} {why}", file=str(p),
                                  hint="move it away, then rerun")
        for p in folders:  # proven above
            doc = _read_json(p / CHECKPOINT_MANIFEST) or {}
            remove_listed(p, [*doc.get("files", {}), CHECKPOINT_MANIFEST])
        # the sweep's own files (checked by ``_foreign`` when the folder was claimed); never the lock we hold
        remove_listed(self.path, [n for n in self.files if n not in (MANIFEST, LOCK)], nested=(CACHE,), rmdir=False)
        self.files = {}

    # -- files ----------------------------------------------------------------------------------------------
    def write(self, name: str, data: bytes) -> Path:
        """Write ``name`` (a plain name, or ``cache/NAME``) whole: beside it first, then renamed onto it."""
        dest = _replace(self.path / name, data)
        self.files[name] = {"bytes": len(data), "crc32": zlib.crc32(data)}
        self._save_manifest()
        return dest

    def appended(self, name: str) -> Path:
        """A file that another writer appends to here (Optuna's journal), created empty when missing (never through a
        link) and recorded; call ``adopt`` after each complete append."""
        if name not in self.files or not os.path.lexists(self.path / name):  # new, or lost since: started afresh
            with create_file(self.path, name):
                pass
        self.adopt(name)
        return self.path / name

    def adopt(self, name: str) -> None:
        """Record ``name`` (see ``appended``) as it is now: its size and CRC-32, marked append-only."""
        p = self.path / name
        try:
            size = p.lstat().st_size
            crc = file_crc32(p)
        except OSError as e:
            raise disk_error(e, p) from e
        self.files[name] = {"bytes": size, "crc32": crc, "append": True}
        self._save_manifest()

    def read(self, name: str) -> bytes | None:
        """A file this folder's manifest lists, unchanged since rlmerge wrote it; else None."""
        rec = self.files.get(name)
        p = self.path / name
        if rec is None or p.is_symlink() or not p.is_file() or not _same(p, rec):
            return None
        return p.read_bytes()

    def _save_manifest(self) -> None:
        doc = {"schema": SCHEMA, "version": 1, "files": dict(sorted(self.files.items()))}
        _replace(self.path / MANIFEST, (json.dumps(doc, indent=1) + "\n").encode())

    def checkpoint(self, name: str) -> Path:
        """Where a merge writes checkpoint ``name`` (``best-1``, ``candidate-<id>``): a folder it proves its own."""
        if not _FOLDER.fullmatch(name):
            raise ValueError(f"not a sweep checkpoint name: {name!r}")
        return self.path / name

    def kept(self) -> list[str]:
        """The ``best-N`` checkpoint folders in the sweep folder (real folders, not links), by name."""
        return sorted(p.name for p in self.path.iterdir()
                      if _FOLDER.fullmatch(p.name) and p.name.startswith("best-") and p.is_dir() and not p.is_symlink())

    def remove_checkpoint(self, name: str) -> None:
        """Delete checkpoint ``name`` (its listed files only), once proven rlmerge's; anything else stays."""
        self.remove_written(self.checkpoint(name))

    @staticmethod
    def proven(folder: Path) -> bool:
        """Whether ``folder`` is a checkpoint folder rlmerge wrote (its rlmerge.json lists everything in it)."""
        return folder.is_dir() and not folder.is_symlink() and not_ours(folder) is None

    @staticmethod
    def remove_written(folder: Path) -> None:
        """Delete a checkpoint folder rlmerge wrote (its listed files, then the folder if that empties it)."""
        if not folder.is_dir() or folder.is_symlink():
            return
        why = not_ours(folder)
        if why is not None:
            raise OutputError(f"{folder.name} {why}: it is left as it is", file=str(folder))
        doc = _read_json(folder / CHECKPOINT_MANIFEST) or {}
        remove_listed(folder, [*doc.get("files", {}), CHECKPOINT_MANIFEST])

    # -- the statistics cache's store (sweeping/cache.Store) -----------------------------------------------------
    def read_arrays(self, name: str) -> dict[str, np.ndarray] | None:
        data = self.read(f"{CACHE}/{name}.npz")
        if data is None:
            return None
        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as z:
                return {k: z[k] for k in z.files}
        except (OSError, ValueError):
            return None

    def write_arrays(self, name: str, arrays: dict[str, np.ndarray]) -> None:
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        self.write(f"{CACHE}/{name}.npz", buf.getvalue())

    def names(self, prefix: str) -> list[str]:
        return sorted(n[len(CACHE) + 1:-4] for n in self.files
                      if n.startswith(f"{CACHE}/{prefix}") and n.endswith(".npz"))


def _replace(dest: Path, data: bytes) -> Path:
    """Write ``dest`` whole: a new file beside it (never through a link), renamed onto it."""
    tmp = f".{dest.name}.rlmerge-tmp"
    try:
        with create_file(dest.parent, tmp) as fh:
            fh.write(data)
        os.replace(dest.parent / tmp, dest)
    except OSError as e:
        raise disk_error(e, dest) from e
    return dest


def _same(p: Path, rec: Any) -> bool:
    try:
        st = p.lstat()
    except OSError:
        return False
    return (isinstance(rec, dict) and stat.S_ISREG(st.st_mode) and st.st_size == rec.get("bytes")
            and file_crc32(p) == rec.get("crc32"))


def _same_prefix(p: Path, rec: dict[str, Any]) -> bool:
    """Whether regular file ``p`` starts with the bytes ``rec`` records (size and CRC-32) and has more."""
    size = rec.get("bytes")
    try:
        st = p.lstat()
        if not isinstance(size, int) or not stat.S_ISREG(st.st_mode) or st.st_size <= size:
            return False
        crc, left = 0, size
        with open(p, "rb") as f:
            while left and (chunk := f.read(min(left, 1 << 20))):
                crc = zlib.crc32(chunk, crc)
                left -= len(chunk)
    except OSError:
        return False
    return left == 0 and crc == rec.get("crc32")


def _read_json(p: Path) -> Any:
    try:
        if p.is_symlink() or not p.is_file():
            return None
        return json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
