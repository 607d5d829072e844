"""Blocks of stored elements as numpy views of the files' pages: the numba path reads without copying.

Each file is mapped once, read-only; a finished block's pages are handed back in whole folios, the next block's
requested ahead, so the resident set is bounded by the blocks in flight. A file that shrank is an InputError
before its next block is viewed: the size is checked when a block is requested ahead (on the helper thread that
asks), or when it is viewed if it was not (docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InputError
from .checkpoint import Checkpoint, TensorInfo, descriptor_budget

PAGE = mmap.ALLOCATIONGRANULARITY


def _folio_bytes() -> int:
    """The largest folio a fault may map (the PMD size: 2 MiB on x86-64 and 4 K-page arm64)."""
    try:
        size = int(Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size").read_text())
    except (OSError, ValueError):
        size = 2 << 20
    return max(PAGE, size // PAGE * PAGE)


FOLIO = _folio_bytes()


class Mapped:
    """The read-only mappings of some checkpoints' files, opened on first use, at most ``limit`` at once.

    Each mapping holds a file descriptor of its own; the least recently used one goes when the limit is
    reached (a view still alive keeps its pages until it is dropped), so a merge of many agents of a
    many-shard model stays under the process's limit of open files.
    """

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit or descriptor_budget(64)
        self._maps: OrderedDict[Path, tuple[mmap.mmap, int]] = OrderedDict()  # file → (mapping, size)
        self._sizes: dict[Path, int] = {}  # file → its size when last checked (view, prefetch)

    def _map(self, ckpt: Checkpoint, file: Path) -> tuple[mmap.mmap, int]:
        got = self._maps.get(file)
        if got is None:
            with ckpt.fd(file) as fd:
                size = os.fstat(fd).st_size
                got = self._maps[file] = (mmap.mmap(fd, size, access=mmap.ACCESS_READ), size)
            while len(self._maps) > self.limit:
                _, (old, _) = self._maps.popitem(last=False)
                with contextlib.suppress(BufferError):  # a view still alive: the mapping goes with it
                    old.close()
        self._maps.move_to_end(file)
        return got

    def view(self, ckpt: Checkpoint, name: str, start: int, stop: int, *, checked: bool = False) -> np.ndarray | None:
        """Stored elements [start, stop) of ``name``, viewed in place; None when they cannot be (not a
        safetensors file, or bytes not aligned to the dtype: the caller reads a copy instead).

        The file's size is checked first (a file that shrank is an InputError): with ``checked``, the caller
        knows that ``prefetch`` checked it after these elements were asked for, and the size it saw is used
        (an ``fstat`` per view on the main thread, which sets up the blocks while the compute threads wait, cost
        0.33–0.48 s of a 0.5B TIES merge)."""
        info = ckpt.tensors[name]
        size = info.dtype.itemsize
        lo = info.offset + start * size
        if not ckpt.viewable or lo % size or stop <= start:
            return None
        mm, mapped_size = self._map(ckpt, info.file)
        now = self._sizes.get(info.file) if checked else None
        if now is None:
            with ckpt.fd(info.file) as fd:
                now = self._sizes[info.file] = os.fstat(fd).st_size
        if now < mapped_size:
            raise InputError("the file shrank while merging", file=str(info.file), tensor=name,
                             hint="another program changed it; let it finish, then merge again")
        return np.frombuffer(mm, dtype=info.dtype.np_storage, count=stop - start, offset=lo)

    def prefetch(self, ckpt: Checkpoint, name: str, start: int, stop: int) -> None:
        """Read the bytes of elements [start, stop) of ``name`` ahead, on a helper thread while the blocks before
        are computed: ``posix_fadvise(WILLNEED)`` on the file starts their reads (on a cold file the call itself
        takes a while: it allocates the pages, reclaiming others, and queues the reads), then, where the file is
        mapped already, ``MADV_POPULATE_READ`` maps them into this process, waiting for them (libc's madvise
        through ctypes, which releases the GIL; CPython's ``mmap.madvise`` holds it). The compute threads then
        find the pages mapped instead of faulting them in: cold 7B-shape merges took 21–65 % less system time in
        every paired run and up to 15 s less of ~58 s (TIES; docs/benchmarks.md, 2026-12-08). The file's size is
        noted for ``view``'s check. Advice only: nothing is raised."""
        info: TensorInfo = ckpt.tensors[name]
        if not ckpt.viewable or stop <= start:
            return
        size = info.dtype.itemsize
        with contextlib.suppress(OSError, InputError), ckpt.fd(info.file) as fd:
            self._sizes[info.file] = os.fstat(fd).st_size
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, info.offset + start * size, (stop - start) * size, os.POSIX_FADV_WILLNEED)
        got = self._maps.get(info.file)  # mapped by an earlier view (the helper thread maps nothing itself)
        if _MADVISE is None or got is None:
            return
        lo, hi = _span(info, start, stop, PAGE, got[1])
        if hi > lo:
            with contextlib.suppress(ValueError):  # closed meanwhile
                whole = np.frombuffer(got[0], dtype=np.uint8)  # holds the mapping open during the call
                _MADVISE(whole.ctypes.data + lo, hi - lo, POPULATE_READ)  # an error (an old kernel): advice only

    def release(self, ckpt: Checkpoint, name: str, start: int, stop: int) -> None:
        """Hand back the pages of elements [start, stop) of ``name``: ``MADV_DONTNEED`` on every folio those pages
        may sit in (a page re-faulted later is read from the page cache again). Advice only: nothing is raised,
        also when another thread closed the mapping meanwhile (the helper thread that releases, ``_map``'s
        eviction)."""
        info: TensorInfo = ckpt.tensors[name]
        got = self._maps.get(info.file)
        if not DONTNEED or got is None or not hasattr(got[0], "madvise"):
            return
        lo, hi = _span(info, start, stop, FOLIO, got[1])
        if hi > lo:
            with contextlib.suppress(OSError, ValueError):  # ValueError: closed meanwhile
                got[0].madvise(DONTNEED, lo, hi - lo)

    def close(self) -> None:
        for mm, _ in self._maps.values():
            with contextlib.suppress(BufferError):  # a view still alive: the mapping goes with it
                mm.close()
        self._maps.clear()


def _span(info: TensorInfo, start: int, stop: int, unit: int, size: int) -> tuple[int, int]:
    """The byte range [lo, hi) of a mapping of ``size`` bytes that covers elements [start, stop) of ``info``,
    widened to whole ``unit``s (pages, folios) and cut at the mapping's end."""
    itemsize = info.dtype.itemsize
    return ((info.offset + start * itemsize) // unit * unit,
            min(size, -(-(info.offset + stop * itemsize) // unit) * unit))


DONTNEED = getattr(mmap, "MADV_DONTNEED", 0)
POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)


def _libc_madvise() -> Any:
    """libc's madvise(addr, length, advice) on Linux (MADV_POPULATE_READ: Linux 5.14 and later; an older kernel
    answers EINVAL, which ``prefetch`` ignores), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        f = ctypes.CDLL(None, use_errno=True).madvise  # the process's own libc
    except (OSError, AttributeError):
        return None
    f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    f.restype = ctypes.c_int
    return f


_MADVISE = _libc_madvise()
