"""A PEFT adapter's weights file, streamed: ``adapter_model.safetensors`` written tensor by tensor, header last.

A safetensors header comes before the data and names every tensor with its offsets, but an adapter's tensors
are known only as they are computed (a factor's rank comes from its SVD; a norm is saved only if the merge
changed it). So the header's room is reserved first, at the longest the header could be (every candidate tensor
at its largest shape, offsets at the largest value they could take), the data is appended after it, and the real
header is written into that room at the end, padded with spaces (JSON whitespace, as safetensors pads its own
headers). A tensor may be taken back while it is the last one written (a norm the merge left unchanged). The file
lives in the partial folder and is recorded there (size and CRC-32) like any file rlmerge writes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

from .dtypes import DTYPES, DType
from .partial import PartialDir, disk_error, file_crc32

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def _header(entries: dict[str, dict[str, Any]]) -> bytes:
    return json.dumps({"__metadata__": {"format": "pt"}, **entries}, separators=(",", ":")).encode()


def header_room(candidates: Iterable[tuple[str, DType, tuple[int, ...]]]) -> int:
    """Bytes the header can take at most: every candidate tensor, every offset as large as the data can be."""
    cands = list(candidates)
    total = sum(d.itemsize * _numel(s) for _, d, s in cands)
    entries = {k: {"dtype": d.code, "shape": list(s), "data_offsets": [total, total]} for k, d, s in cands}
    room = len(_header(entries))
    return room + (-room % 8)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class AdapterFile:
    """``adapter_model.safetensors`` in ``partial``, with ``room`` bytes reserved for the header (``header_room``)."""

    def __init__(self, partial: PartialDir, room: int, *, fsync: bool = True) -> None:
        self.partial = partial
        self.room = room
        self.fsync = fsync
        self.entries: dict[str, dict[str, Any]] = {}
        self._fh: Any = None
        self._end = 0  # bytes of data written (after the header's room)
        self._open: tuple[str, DType, tuple[int, ...], int] | None = None  # the tensor being written

    def __enter__(self) -> AdapterFile:
        path = self.partial.tmp / ADAPTER_WEIGHTS
        try:
            self._fh = self.partial.create(ADAPTER_WEIGHTS)
            self._fh.seek(8 + self.room)
        except OSError as e:
            raise disk_error(e, path) from e
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def begin(self, key: str, dtype: DType, shape: tuple[int, ...]) -> None:
        if self._open is not None:
            raise RuntimeError(f"{self._open[0]} is not finished")
        self._open = (key, dtype, tuple(shape), self._end)

    def write(self, data: bytes | memoryview) -> None:
        try:
            self._fh.write(data)
        except OSError as e:
            raise disk_error(e, self.partial.tmp / ADAPTER_WEIGHTS) from e
        self._end += memoryview(data).nbytes

    def end(self, *, keep: bool = True) -> None:
        """The open tensor is complete: recorded, or (``keep=False``) taken back out of the file."""
        assert self._open is not None
        key, dtype, shape, start = self._open
        self._open = None
        if keep:
            if self._end - start != dtype.itemsize * _numel(shape):
                raise RuntimeError(f"{key}: {self._end - start} bytes written for {shape} {dtype.code}")
            self.entries[key] = {"dtype": dtype.code, "shape": list(shape), "data_offsets": [start, self._end]}
            return
        self._end = start
        self._fh.seek(8 + self.room + start)
        self._fh.truncate()

    def again(self, key: str, like: str) -> None:
        """Write tensor ``like``'s bytes once more under ``key`` (a tied lm_head beside its embedding)."""
        entry = self.entries[like]
        lo, hi = entry["data_offsets"]
        self.begin(key, DTYPES[entry["dtype"]], tuple(entry["shape"]))
        self._fh.flush()
        chunk = 1 << 24
        for pos in range(lo, hi, chunk):  # pread leaves the file's position (its end) where it is
            self.write(os.pread(self._fh.fileno(), min(chunk, hi - pos), 8 + self.room + pos))
        self.end()

    def close(self) -> int:
        """Write the header into its room and record the file; returns the tensors' bytes."""
        header = _header(self.entries)
        if len(header) > self.room:
            raise RuntimeError(f"the adapter's header takes {len(header)} bytes, {self.room} were reserved")
        path = self.partial.tmp / ADAPTER_WEIGHTS
        try:
            self._fh.seek(0)
            self._fh.write(self.room.to_bytes(8, "little") + header + b" " * (self.room - len(header)))
            self._fh.flush()
            if self.fsync:
                os.fsync(self._fh.fileno())
            self._fh.close()
            self._fh = None
        except OSError as e:
            raise disk_error(e, path) from e
        self.partial.note(ADAPTER_WEIGHTS, path.stat().st_size, file_crc32(path))
        return self._end
