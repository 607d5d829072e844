"""The only module that creates files: safetensors shards written as a stream, side files, atomic rename.

Shapes and dtypes are known from the match, so each shard's header is written before its first byte of
data and the data follows tensor by tensor, block by block: nothing is held in memory. Everything goes
into a hidden sibling folder (``partial.PartialDir``) that is renamed onto the output only when complete,
so an interrupted run never leaves a folder that looks like a finished model.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import json
import mmap
import os
import re
import sys
import zlib
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from .._threads import Workers
from ..errors import ConfigError, InputError
from .dtypes import DType
from .partial import PartialDir, disk_error


class Job(Protocol):
    """What the writer needs of a tensor to write (stream.match.Job has it): its name, shape, stored dtype, bytes."""

    @property
    def name(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def out_dtype(self) -> DType: ...
    @property
    def out_nbytes(self) -> int: ...


DEFAULT_SHARD_SIZE = 5 * 10**9  # transformers' default max_shard_size ("5GB")
WRITEBACK_CHUNK = 32 << 20  # bytes: how often the disk is asked to start writing what is buffered
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


@functools.cache
def _sync_file_range() -> Any:
    """libc's sync_file_range (Linux), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the disk to start writing [offset, offset + nbytes) of ``fd`` now, without waiting.

    A shard is fsynced when it is complete; without this, the kernel would hold the whole shard in the page
    cache until then and the fsync would wait for all of it (1 GB: ~1.5 s on the benchmark machine) after
    the last block was computed. Started early, the disk writes while the merge computes. Linux only;
    elsewhere the fsync does it all.
    """
    fn = _sync_file_range()
    if fn is not None:
        fn(fd, offset, nbytes, 2)  # SYNC_FILE_RANGE_WRITE: initiate write-out of dirty pages, do not wait


def settle(fd: int, offset: int, nbytes: int) -> None:
    """Wait until [offset, offset + nbytes) of ``fd`` is written back (its writeback started earlier), then drop its
    pages from the page cache, so that the pages of the writes that follow are these same pages, freed just now.

    Why: on a VM whose balloon reports free memory to the host (this machine's does: virtio_balloon with free page
    reporting), a page the kernel has not used for a while is given back to the host, and the first write into it
    makes the host find memory for it again. Writing 1 GiB into fresh page cache cost 1.72–8.93 s of CPU in the
    ``write`` calls here; dropping each 32 MiB chunk once written back, 0.12–0.73 s (benchmarks/write_pages.py,
    docs/benchmarks.md). The
    output then is not left in the page cache (nor does it push the inputs out of it). A shard is still fsynced
    when complete; this only waits for what ``start_writeback`` began. Linux only; elsewhere nothing.
    """
    fn = _sync_file_range()
    if fn is not None:
        fn(fd, offset, nbytes, 1 | 2 | 4)  # WAIT_BEFORE | WRITE | WAIT_AFTER: on the disk (not yet durable)
        if hasattr(os, "posix_fadvise"):  # whole pages only are dropped: the range's first one too (a dirty page
            lo = offset // mmap.PAGESIZE * mmap.PAGESIZE  # the next chunk shares at its end stays: only clean go)
            os.posix_fadvise(fd, lo, offset + nbytes - lo, os.POSIX_FADV_DONTNEED)


class Writeback:
    """How the writer hands a file it writes front to back to the disk, in one place (CheckpointWriter, and the
    benchmarks that measure a write as rlmerge does it): every WRITEBACK_CHUNK bytes their writeback is started
    (start_writeback), and the chunk before, written back by then, leaves the page cache (settle; ``drop=False``:
    it stays, as before 2026-12-06, which benchmarks/write_pages.py compares); ``durable`` at the end."""

    def __init__(self, *, drop: bool = True) -> None:
        self.drop = drop
        self.flushed = 0  # bytes handed to the disk (writeback started) …
        self.settled = 0  # … and of those, written back and dropped from the page cache

    def due(self, written: int) -> bool:
        """Whether, with ``written`` bytes of the file written, a chunk is waiting for its writeback."""
        return written - self.flushed >= WRITEBACK_CHUNK

    def advance(self, fd: int, written: int) -> None:
        """The first ``written`` bytes of ``fd`` are with the OS: start the writeback of those not yet handed over,
        and settle the chunk before them (its writeback began a chunk ago)."""
        start_writeback(fd, self.flushed, written - self.flushed)
        if self.drop and self.flushed > self.settled:
            settle(fd, self.settled, self.flushed - self.settled)
            self.settled = self.flushed
        self.flushed = written


def durable(fd: int) -> None:
    """fsync ``fd``; every page now clean, the rest of the file leaves the page cache too (see settle)."""
    os.fsync(fd)
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _reserve(fd: int, nbytes: int) -> None:
    """Allocate a shard's disk space before it is written: a full disk fails before the merge computes, and the
    writes that follow need no block allocation. A filesystem without fallocate just skips it."""
    if hasattr(os, "posix_fallocate") and nbytes > 0:
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise


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
        entries[j.name] = {"dtype": j.out_dtype.code, "shape": list(j.shape),
                           "data_offsets": [offset, offset + j.out_nbytes]}
        offset += j.out_nbytes
    body = json.dumps(entries, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return len(body).to_bytes(8, "little") + body


class SideFiles:
    """The side files of a writer that owns a ``PartialDir`` (``self.partial``): config, tokenizer, report, card.
    Shared by the shard writer and the adapter writer (engine/adapter.py): a mixin of three one-line verbs rather
    than the same lines twice."""

    partial: PartialDir

    def write_text(self, name: str, text: str) -> None:
        self.partial.write_bytes(name, text.encode())

    def write_bytes(self, name: str, data: bytes) -> None:
        self.partial.write_bytes(name, data)

    def copy_file(self, src: Path) -> None:
        """A side file (config, tokenizer …) of an input, copied whole (they are small)."""
        try:
            data = src.read_bytes()
        except OSError as e:
            raise InputError(f"cannot read: {e.strerror}", file=str(src)) from e
        self.partial.write_bytes(src.name, data)


class CheckpointWriter(SideFiles):
    """Streams shards into a claimed ``PartialDir`` and publishes it onto the output at the end.

    Each shard's CRC-32 is computed as it streams out; once complete it is fsynced and recorded in the partial
    folder's progress file, which is what ``--resume`` verifies. ``pending(jobs)`` is the jobs still to
    write: all of them, or those after the shards a resumed run kept.

    Tensors are written in job order: ``start(job)`` then its bytes, with ``write_now`` (a buffer the caller
    reuses next) or ``write_later`` (a buffer left untouched until the returned future is done). With
    ``background=True`` the writes run on one writer thread, so computing does not wait on the disk.
    """

    def __init__(self, partial: PartialDir, jobs: Sequence[Job], *, shard_size: int = DEFAULT_SHARD_SIZE,
                 metadata: dict[str, str] | None = None, fingerprint: str = "", fsync: bool = True,
                 identity: list[list[Any]] | None = None, background: bool = False,
                 shards: list[Shard] | None = None) -> None:
        self.partial = partial
        self.fsync = fsync  # False: the OS writes the shards back when it likes (see merge(fsync=))
        self.output = partial.output
        self.tmp = partial.tmp
        # ``shards``: some shards of a larger layout (a Ray worker's); their names and headers are the layout's
        self.shards = shards if shards is not None else layout_shards(jobs, shard_size)
        self.metadata = {"format": "pt", **(metadata or {})}
        self.fingerprint = fingerprint
        self.identity = identity or []  # the inputs' files (partial.input_identity), re-checked by --resume
        self._order = [j.name for s in self.shards for j in s.jobs]
        self._shard_of = {j.name: i for i, s in enumerate(self.shards) for j in s.jobs}
        self._next = 0  # index into _order of the tensor being written
        self._shard_i = -1
        self._fh: Any = None
        self._crc = 0  # CRC-32 of the current shard so far
        self._written = 0  # bytes of the current shard written so far
        self._writeback = Writeback()  # … and how far they went to the disk
        self._remaining = 0  # bytes still owed to the current tensor
        self._background = background
        self._queue: Workers | None = None  # the writer thread (background=True)
        self._last: Future[Any] | None = None
        self._notes: dict[str, Any] = {}  # tensor → what the merge noted about it (annotate)

    def __enter__(self) -> CheckpointWriter:
        kept = self.partial.start(self.fingerprint, [s.filename for s in self.shards], self.identity)
        self._next = sum(len(s.jobs) for s in self.shards[:kept])
        self._shard_i = kept - 1
        for shard in self.shards[kept:]:  # a full disk fails now, before anything is computed
            path = self.tmp / shard.filename
            try:
                with self.partial.create(shard.filename) as fh:
                    _reserve(fh.fileno(), len(shard_header(shard, self.metadata)) + shard.nbytes)
            except OSError as e:
                raise disk_error(e, path) from e
        if self._background:
            self._queue = Workers(1, "rlmerge-write", chained=True)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._queue is not None:  # an interrupted merge drops the queued writes: its output is partial anyway
            self._queue.close(abort=exc_type is not None)
            self._queue = None
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    @property
    def resumed(self) -> int:
        """Shards kept from an interrupted run (known once entered)."""
        return self.partial.resumed

    def pending(self, jobs: Sequence[Job]) -> list[Job]:
        """The jobs not yet written (a resumed run skips the shards it kept), in job order."""
        done = set(self._order[:self._next])
        return [j for j in jobs if j.name not in done]

    # -- in job order, on the writer thread when there is one ------------------------------------------
    def start(self, job: Job) -> None:
        """The next tensor begins (queued behind the writes before it)."""
        if self._queue is None:
            self.begin(job)
        else:
            self._last = self._queue.submit(self.begin, job)

    def write_now(self, data: memoryview) -> None:
        """Write bytes whose buffer the caller reuses next: everything queued goes first."""
        self.drain()
        self.write(data)

    def write_later(self, data: memoryview) -> Future[Any]:
        """Queue bytes whose buffer stays untouched until the returned future is done."""
        if self._queue is None:
            fut: Future[Any] = Future()
            self.write(data)
            fut.set_result(None)
            return fut
        self._last = self._queue.submit(self.write, data)
        return self._last

    def adopt(self, filename: str, nbytes: int, crc32: int, notes: dict[str, Any] | None = None) -> None:
        """The next shard, written into the partial folder by another process (a Ray worker, ``ShardFiles``):
        recorded as if written here. Shards are adopted in order, after any this writer kept or wrote."""
        i = self._shard_i + 1
        if self._fh is not None or self._remaining or i >= len(self.shards) or self.shards[i].filename != filename:
            raise RuntimeError(f"cannot adopt {filename} as shard {i}")
        self._notes.update(notes or {})
        self.partial.record(filename, nbytes, crc32, notes)
        self._shard_i = i
        self._next += len(self.shards[i].jobs)

    def annotate(self, name: str, value: Any) -> None:
        """A note about tensor ``name`` (JSON), kept with its shard's record: call it once the tensor is computed and
        before the next one starts, so that the note is there when the shard closes."""
        self._notes[name] = value

    def annotations(self) -> dict[str, Any]:
        """Every tensor's note: this run's, and those of the shards a resumed run kept."""
        kept = {k: v for rec in getattr(self.partial, "shards", []) for k, v in (rec.get("notes") or {}).items()}
        return {**kept, **self._notes}

    def drain(self) -> None:
        """Wait for every queued write (and raise its error, if any)."""
        if self._last is not None:
            self._last.result()

    # -- tensor data, in job order --------------------------------------------------------------------
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
        self._close_shard()
        path = self.tmp / self.shards[i].filename
        header = shard_header(self.shards[i], self.metadata)
        try:
            self._fh = self.partial.reopen(self.shards[i].filename)  # reserved in __enter__; closed with the shard
            self._fh.write(header)
        except OSError as e:
            raise disk_error(e, path) from e
        self._crc = zlib.crc32(header)
        self._written, self._writeback = len(header), Writeback()
        self._shard_i = i

    def _close_shard(self) -> None:
        """Flush, fsync (unless asked not to) and record the current shard; a resumed run re-checks its CRC-32."""
        if self._fh is None:
            return
        shard = self.shards[self._shard_i]
        path = self.tmp / shard.filename
        try:
            self._fh.flush()
            if self.fsync:
                durable(self._fh.fileno())
            self._fh.close()
        except OSError as e:
            raise disk_error(e, path) from e
        finally:
            self._fh = None
        notes = {j.name: self._notes[j.name] for j in shard.jobs if j.name in self._notes}
        self.partial.record(shard.filename, path.stat().st_size, self._crc, notes)

    def write(self, data: memoryview) -> None:
        """Append raw bytes of the current tensor (already in the output dtype)."""
        buf = data
        if buf.nbytes > self._remaining:
            raise RuntimeError("more data than the tensor holds")
        try:
            self._fh.write(buf)
        except OSError as e:
            raise disk_error(e, self.tmp / self.shards[self._shard_i].filename) from e
        self._crc = zlib.crc32(buf, self._crc)
        self._remaining -= buf.nbytes
        self._written += buf.nbytes
        if self.fsync and self._writeback.due(self._written):
            self._fh.flush()
            self._writeback.advance(self._fh.fileno(), self._written)

    # -- the final rename ------------------------------------------------------------------------------
    def complete(self) -> None:
        """Every tensor written: close (fsync, record) the last shard."""
        self.drain()
        if self._next != len(self._order) or self._remaining:
            raise RuntimeError("not every tensor was written")
        self._close_shard()

    def finish(self, manifest: dict[str, Any]) -> Path:
        """Close the last shard, write the index, and publish with ``rlmerge.json`` = ``manifest`` + file list."""
        self.complete()
        if len(self.shards) > 1:
            index = {"metadata": {"total_size": sum(s.nbytes for s in self.shards)},
                     "weight_map": {j.name: s.filename for s in self.shards for j in s.jobs}}
            self.write_text("model.safetensors.index.json", json.dumps(index, indent=2) + "\n")
        return self.partial.publish(manifest)
