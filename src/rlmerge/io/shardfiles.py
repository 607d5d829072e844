"""What a Ray worker needs of a partial folder to write some shards of a merge into it, and nothing more.

The driver holds the ``partial.PartialDir`` (its lock, progress file and manifest); a worker, on any node that
mounts the same folder, writes whole shards there through ``writer.CheckpointWriter(ShardFiles(…), shards=…)``:
each file created afresh (``partial.create_file``: never through a link, a retried task replaces its own file),
fsynced when complete, and its size and CRC-32 handed back to the driver, which records (``CheckpointWriter.
adopt``) and publishes them. A worker never writes the index, the manifest or any side file.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import OutputError
from .partial import create_file, reopen_file


class ShardFiles:
    """The partial folder ``tmp`` of ``output``, as seen by a worker that writes some of its shards."""

    resumed = 0

    def __init__(self, output: Path, tmp: Path) -> None:
        self.output, self.tmp = output, tmp
        # (file, bytes, CRC-32, notes on its tensors) of every shard completed, in order
        self.records: list[tuple[str, int, int, dict[str, Any] | None]] = []

    def start(self, fp: str, filenames: Sequence[str], identity: list[list[Any]] | None = None) -> int:
        """Check the folder is the driver's (a real folder of this user's); nothing is kept from before."""
        st = os.lstat(self.tmp) if os.path.lexists(self.tmp) else None
        if st is None or self.tmp.is_symlink() or not self.tmp.is_dir() or (
                hasattr(os, "getuid") and st.st_uid != os.getuid()):
            raise OutputError("the partial folder is missing here, or is not this user's folder", file=str(self.tmp),
                              hint="every Ray node must mount the output's folder at the same path (shared storage)")
        return 0

    def create(self, name: str) -> Any:
        return create_file(self.tmp, name)

    def reopen(self, name: str) -> Any:
        return reopen_file(self.tmp, name)

    def record(self, filename: str, nbytes: int, crc32: int, notes: dict[str, Any] | None = None) -> None:
        self.records.append((filename, nbytes, crc32, notes))
