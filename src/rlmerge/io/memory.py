"""The writer's interface, filling a state dict instead of shards: a sweep candidate built in memory.

``MemoryWriter`` takes what ``writer.CheckpointWriter`` takes, in the same order (``start(job)`` then its bytes,
side files, ``finish``), so the engine cannot tell them apart. Each tensor's bytes land in one buffer of its
output dtype: the bytes a shard would hold, with no header and no file. Nothing here touches the disk.

>>> w = MemoryWriter(jobs)                                  # doctest: +SKIP
>>> with w: ...                                             # doctest: +SKIP   (the engine writes)
>>> w.tensors()["model.norm.weight"].dtype                  # doctest: +SKIP
torch.bfloat16
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InputError
from .writer import Job


class Immediate:
    """The part of ``CheckpointWriter``'s interface that a writer which consumes each block at once shares (this
    module's, and engine/adapter.AdapterWriter): nothing to resume, nothing queued, notes kept in ``self.notes``."""

    resumed = 0  # nothing survives a run
    notes: dict[str, Any]

    def pending(self, jobs: Sequence[Job]) -> list[Job]:
        return list(jobs)

    def annotate(self, name: str, value: Any) -> None:
        self.notes[name] = value

    def annotations(self) -> dict[str, Any]:
        return dict(self.notes)

    def write_now(self, data: memoryview) -> None:
        raise NotImplementedError

    def write_later(self, data: memoryview) -> Future[Any]:
        """Consumed at once (no writer thread): the caller may reuse ``data`` right away."""
        fut: Future[Any] = Future()
        self.write_now(data)
        fut.set_result(None)
        return fut

    def drain(self) -> None:
        pass


class MemoryWriter(Immediate):
    """Tensors in memory, in job order, behind ``CheckpointWriter``'s interface (see the module docstring)."""

    def __init__(self, jobs: Sequence[Job], *, metadata: dict[str, str] | None = None) -> None:
        self.jobs = list(jobs)
        self.metadata = {"format": "pt", **(metadata or {})}
        self.buffers: dict[str, np.ndarray] = {}  # name → [out_nbytes] uint8, in job order
        self.files: dict[str, bytes] = {}  # side files: config, tokenizer, report, model card
        self.manifest: dict[str, Any] | None = None  # what ``finish`` was given (provenance)
        self._next = 0
        self._cursor = 0  # bytes of the current tensor written
        self.notes: dict[str, Any] = {}  # tensor → what the merge noted about it

    @property
    def nbytes(self) -> int:
        """Bytes the tensors take once written (what this writer allocates)."""
        return sum(j.out_nbytes for j in self.jobs)

    def __enter__(self) -> MemoryWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    # -- tensor data, in job order --------------------------------------------------------------------
    def start(self, job: Job) -> None:
        if self._next >= len(self.jobs) or self.jobs[self._next].name != job.name:
            raise RuntimeError(f"writer expected {[j.name for j in self.jobs[self._next:self._next + 1]]}, "
                               f"got {job.name}")
        self._check_complete()
        self.buffers[job.name] = np.empty(job.out_nbytes, dtype=np.uint8)
        self._next += 1
        self._cursor = 0

    def _check_complete(self) -> None:
        if self._next and self._cursor != self.jobs[self._next - 1].out_nbytes:
            raise RuntimeError("previous tensor not complete")

    def write_now(self, data: memoryview) -> None:
        job = self.jobs[self._next - 1]
        buf = np.frombuffer(data, dtype=np.uint8)
        if self._cursor + buf.size > job.out_nbytes:
            raise RuntimeError("more data than the tensor holds")
        self.buffers[job.name][self._cursor:self._cursor + buf.size] = buf
        self._cursor += buf.size

    # -- side files and the end -------------------------------------------------------------------------
    def write_text(self, name: str, text: str) -> None:
        self.files[name] = text.encode()

    def write_bytes(self, name: str, data: bytes) -> None:
        self.files[name] = bytes(data)

    def copy_file(self, src: Path) -> None:
        try:
            self.files[src.name] = src.read_bytes()
        except OSError as e:
            raise InputError(f"cannot read: {e.strerror}", file=str(src)) from e

    def finish(self, manifest: dict[str, Any]) -> None:
        self._check_complete()
        if self._next != len(self.jobs):
            raise RuntimeError("not every tensor was written")
        self.manifest = manifest

    # -- what a scorer reads ----------------------------------------------------------------------------
    def tensors(self) -> dict[str, Any]:
        """name → torch tensor of its output dtype and shape, sharing this writer's buffers (no copy)."""
        import torch

        out = {}
        for job in self.jobs:
            raw = torch.from_numpy(self.buffers[job.name])
            out[job.name] = raw.view(job.out_dtype.torch).reshape(job.shape)
        return out

    def config(self) -> dict[str, Any]:
        """The merged checkpoint's config.json (the base's, with the output dtype), or {} if it has none."""
        raw = self.files.get("config.json")
        return json.loads(raw) if raw is not None else {}


def save_copy(folder: Path, tensors: dict[str, Any], files: dict[str, bytes]) -> None:
    """Write a candidate held in memory as a Hugging Face folder, for a program that reads one (a command scorer,
    vLLM): ``model.safetensors`` (safetensors' own writer) and the side files (config, tokenizer, chat template).
    ``folder`` is an empty folder the caller made and removes after: a scratch copy, not an output (no partial
    folder, no provenance), so nothing here is kept."""
    from safetensors.torch import save_file

    for name in files:
        if Path(name).name != name or name in ("", ".", ".."):
            raise InputError(f"a side file's name {name!r} is not a plain file name")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    for name, data in files.items():
        (folder / name).write_bytes(data)
