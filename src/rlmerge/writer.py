"""The only module that creates files: safetensors shards written as a stream, side files, atomic rename.

Shapes and dtypes are known from the plan, so each shard's header is written before its first byte of
data and the data follows tensor by tensor, block by block: nothing is held in memory. Everything goes
into a hidden sibling folder that is renamed onto the output only when complete, so an interrupted run
never leaves a folder that looks like a finished model.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .checkpoint import DTYPE_NAMES
from .errors import ConfigError, OutputError
from .plan import Job

DEFAULT_SHARD_SIZE = 5 * 10**9  # transformers' default max_shard_size ("5GB")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int) -> int:
    """'5GB', '500MB', '2GiB' or a number of bytes → bytes."""
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
        if not m or m.group(2).upper() not in _UNITS:
            raise ConfigError(f"cannot read size {text!r}", hint="write e.g. 5GB, 500MB or 2GiB")
        value = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if value < 1:
        raise ConfigError(f"size {text!r} must be positive")
    return value


@dataclass
class Shard:
    filename: str
    jobs: list[Job]

    @property
    def nbytes(self) -> int:
        return sum(j.out_nbytes for j in self.jobs)


def layout_shards(jobs: Sequence[Job], shard_size: int) -> list[Shard]:
    """Greedy, in job order (as transformers does): a new shard when the next tensor would not fit."""
    groups: list[list[Job]] = [[]]
    size = 0
    for j in jobs:
        if groups[-1] and size + j.out_nbytes > shard_size:
            groups.append([])
            size = 0
        groups[-1].append(j)
        size += j.out_nbytes
    if len(groups) == 1:
        return [Shard("model.safetensors", groups[0])]
    n = len(groups)
    return [Shard(f"model-{i + 1:05d}-of-{n:05d}.safetensors", g) for i, g in enumerate(groups)]


def shard_header(shard: Shard, metadata: dict[str, str]) -> bytes:
    """safetensors header (8-byte length + JSON padded with spaces to a multiple of 8)."""
    entries: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for j in shard.jobs:
        entries[j.name] = {"dtype": DTYPE_NAMES[j.out_dtype], "shape": list(j.info.shape),
                           "data_offsets": [offset, offset + j.out_nbytes]}
        offset += j.out_nbytes
    body = json.dumps(entries, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return len(body).to_bytes(8, "little") + body


def _disk_error(e: OSError, path: Path) -> OutputError:
    if e.errno == errno.ENOSPC:
        return OutputError("the disk is full", file=str(path), hint="free space or write elsewhere (-o)")
    if e.errno in (errno.EACCES, errno.EROFS, errno.EPERM):
        return OutputError(f"cannot write: {e.strerror}", file=str(path), hint="choose a writable output folder")
    return OutputError(f"cannot write: {e.strerror or e}", file=str(path))


class CheckpointWriter:
    """Streams shards into ``<parent>/.<name>.rlmerge-partial`` and renames it onto ``output`` at the end."""

    def __init__(self, output: Path, jobs: Sequence[Job], *, shard_size: int = DEFAULT_SHARD_SIZE,
                 force: bool = False, metadata: dict[str, str] | None = None) -> None:
        self.output = output
        self.force = force
        if output.exists() and not force:
            raise OutputError("output folder already exists", file=str(output),
                              hint="choose another -o, or pass --force to replace it")
        self.tmp = output.parent / f".{output.name}.rlmerge-partial"
        self.shards = layout_shards(jobs, shard_size)
        self.metadata = {"format": "pt", **(metadata or {})}
        self._order = [j.name for s in self.shards for j in s.jobs]
        self._shard_of = {j.name: i for i, s in enumerate(self.shards) for j in s.jobs}
        self._next = 0  # index into _order of the tensor being written
        self._shard_i = -1
        self._fh: Any = None
        self._remaining = 0  # bytes still owed to the current tensor
        self._lock_fd: int | None = None

    def __enter__(self) -> CheckpointWriter:
        try:
            self.output.parent.mkdir(parents=True, exist_ok=True)
            self._claim()
        except OSError as e:
            raise _disk_error(e, self.output.parent) from e
        return self

    def _claim(self) -> None:
        """Create the partial folder with a lock naming our pid; refuse if a live run holds it."""
        lock = self.tmp / ".lock"
        if self.tmp.exists():
            try:
                pid = int(lock.read_text().strip())
                os.kill(pid, 0)
                alive = pid != os.getpid()
            except (OSError, ValueError):
                alive = False
            if alive:
                raise OutputError(f"another rlmerge run (pid {pid}) is writing this output", file=str(self.output),
                                  hint="wait for it to finish, or choose another -o")
            shutil.rmtree(self.tmp)  # left by an interrupted run
        self.tmp.mkdir()
        lock.write_text(str(os.getpid()))

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)

    # -- tensor data, in plan order --------------------------------------------------------------------
    def begin(self, job: Job) -> None:
        if self._next >= len(self._order) or self._order[self._next] != job.name:
            raise RuntimeError(f"writer expected {self._order[self._next:self._next + 1]}, got {job.name}")
        if self._remaining:
            raise RuntimeError("previous tensor not complete")
        shard_i = self._shard_of[job.name]
        if shard_i != self._shard_i:
            self._open_shard(shard_i)
        self._remaining = job.out_nbytes
        self._next += 1

    def _open_shard(self, i: int) -> None:
        if self._fh is not None:
            self._fh.close()
        path = self.tmp / self.shards[i].filename
        try:
            self._fh = open(path, "wb")  # noqa: SIM115 closed when the next shard opens or on exit
            self._fh.write(shard_header(self.shards[i], self.metadata))
        except OSError as e:
            raise _disk_error(e, path) from e
        self._shard_i = i

    def write(self, data: torch.Tensor | memoryview) -> None:
        """Append data of the current tensor: a contiguous tensor in the output dtype, or raw bytes."""
        buf = memoryview(data.contiguous().view(torch.uint8).numpy()) if isinstance(data, torch.Tensor) else data
        if buf.nbytes > self._remaining:
            raise RuntimeError("more data than the tensor holds")
        try:
            self._fh.write(buf)
        except OSError as e:
            raise _disk_error(e, self.tmp / self.shards[self._shard_i].filename) from e
        self._remaining -= buf.nbytes

    # -- side files and the final rename ---------------------------------------------------------------
    def write_text(self, name: str, text: str) -> None:
        try:
            (self.tmp / name).write_text(text)
        except OSError as e:
            raise _disk_error(e, self.tmp / name) from e

    def copy_file(self, src: Path) -> None:
        try:
            shutil.copyfile(src, self.tmp / src.name)
        except OSError as e:
            raise _disk_error(e, self.tmp / src.name) from e

    def finish(self) -> Path:
        if self._next != len(self._order) or self._remaining:
            raise RuntimeError("not every tensor was written")
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if len(self.shards) > 1:
            index = {"metadata": {"total_size": sum(s.nbytes for s in self.shards)},
                     "weight_map": {j.name: s.filename for s in self.shards for j in s.jobs}}
            self.write_text("model.safetensors.index.json", json.dumps(index, indent=2) + "\n")
        (self.tmp / ".lock").unlink()
        old = self.output.parent / f".{self.output.name}.rlmerge-old"
        try:
            if self.output.exists():  # only reached with force
                if old.exists():
                    shutil.rmtree(old)
                os.replace(self.output, old)
            os.replace(self.tmp, self.output)
        except OSError as e:
            raise _disk_error(e, self.output) from e
        shutil.rmtree(old, ignore_errors=True)
        return self.output
