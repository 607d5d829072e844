"""The output's vocabulary rows as a view of each input: embeddings and lm_head remapped row by row, never copied.

When the output's tokenizer is not every input's (``--tokenizer-source base|union|AGENT``, io/tokenizer_plan.py),
row ``i`` of the merged ``embed_tokens`` / ``lm_head`` is a token that each model stores at its own row, or
lacks. ``VocabView`` wraps a model so that its vocabulary tensors have the output's rows, in the output's order:
every method and both backends then merge them as any other tensor, block by block (memory stays bounded by the
block size), and nothing downstream knows. A row a model lacks holds what mergekit's ``PermutedVocabulary`` puts
there, so that it counts as unchanged for that model (τ = 0) and does not dilute the merge:

- the base's row when the base has the token;
- otherwise the mean of the rows of the agents that have it (one agent: its own row exactly; in float32, rounded
  once to the stored dtype, where mergekit sums in the inputs' dtype); zeros when none has it.

So an agent's token that no other model has is written with the agent's row, whatever the method. Rows past
the vocabulary (padding: Qwen2.5 stores 151,936 rows for 151,665 tokens) are rows too: each model's own
padding row, merged as stored. mergekit drops them; rlmerge keeps the base's row count.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any

import numpy as np

from .._torch import torch
from .checkpoint import Checkpoint, TensorInfo

EMBEDDING_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight")
VOCAB_SUFFIXES = (*EMBEDDING_SUFFIXES, "lm_head.weight")  # tensors with one row per token


def vocab_tensors(ckpt: Checkpoint) -> list[str]:
    """The stored tensors of ``ckpt`` with one row per token (aliases left out)."""
    return [n for n, t in ckpt.tensors.items() if n.endswith(VOCAB_SUFFIXES) and t.name == n and len(t.shape) >= 1]


def embedding_rows(ckpt: Checkpoint) -> int | None:
    """Rows of the model's vocabulary tensors (its embedding's), or None when it stores none."""
    names = vocab_tensors(ckpt)
    return ckpt.tensors[names[0]].shape[0] if names else None


class RowPlan:
    """Where each of the output's ``rows`` comes from in every model: ``sources[m][i]`` is model m's row (the base
    is model 0), or -1 where it lacks that token."""

    def __init__(self, rows: int, sources: list[np.ndarray], models: list[Checkpoint]) -> None:
        self.rows = rows
        self.sources = sources  # [M] arrays [rows] int64
        self.models = models  # the unwrapped checkpoints, base first
        self._virtual: dict[tuple[str, int], torch.Tensor] = {}  # (tensor, row) → float32 row the base lacks
        self._lock = threading.Lock()

    def identity(self, m: int, stored_rows: int | None) -> bool:
        return stored_rows == self.rows and bool(np.array_equal(self.sources[m], np.arange(self.rows)))

    def base_row(self, name: str, row: int, cols: int) -> torch.Tensor:
        """Row ``row`` of the output's base (float32 [cols]): the base's own, or mergekit's stand-in."""
        src = int(self.sources[0][row])
        if src >= 0:
            return _row_f32(self.models[0], name, src, cols)
        key = (name, row)
        with self._lock:
            got = self._virtual.get(key)
        if got is None:
            got = torch.zeros(cols, dtype=torch.float32)
            count = 0
            for m in range(1, len(self.models)):
                s = int(self.sources[m][row])
                if s >= 0:
                    got = got + _row_f32(self.models[m], name, s, cols)
                    count += 1
            if count:
                got = got / count
            with self._lock:
                self._virtual[key] = got
        return got


def _row_f32(ckpt: Checkpoint, name: str, row: int, cols: int) -> torch.Tensor:
    out = torch.empty(cols, dtype=torch.float32)
    return ckpt.read_f32(name, row * cols, (row + 1) * cols, out).clone()


class VocabView(Checkpoint):
    """Model ``index`` of ``plan`` (0: the base) with its vocabulary tensors remapped to the output's rows; every
    other tensor, file and attribute is the wrapped checkpoint's. Its blocks are read by copy (not viewable)."""

    def __init__(self, inner: Checkpoint, plan: RowPlan, index: int) -> None:  # no folder to read: a view
        self.inner, self.plan, self.index = inner, plan, index
        self.path, self.label, self.revision = inner.path, inner.label, inner.revision
        self.format, self.side_dir, self.notes = inner.format, inner.side_dir, inner.notes
        self.config, self.roots, self.header_bytes = inner.config, inner.roots, inner.header_bytes
        self._local = threading.local()
        self._bin: dict[Path, Any] = {}
        self.hub_id = getattr(inner, "hub_id", None)
        self.vocab = set(vocab_tensors(inner))
        self.tensors = {n: (TensorInfo(n, t.dtype, (plan.rows, *t.shape[1:]), t.file) if n in self.vocab else t)
                        for n, t in inner.tensors.items()}

    @property
    def viewable(self) -> bool:
        return False

    @property
    def files(self) -> list[Path]:
        return self.inner.files

    def close(self) -> None:
        self.inner.close()

    def read_f32(self, name: str, start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
        info = self.tensors[name]
        if info.name not in self.vocab:
            return self.inner.read_f32(info.name, start, stop, out)
        dst = out[:stop - start]
        if stop > start:
            raw = self.read_into(name, start, stop, self.scratch((stop - start) * info.dtype.itemsize))
            dst.copy_(torch.frombuffer(raw, dtype=info.dtype.torch, count=stop - start))
        return dst

    def read_raw(self, name: str, start: int, stop: int) -> memoryview:
        info = self.tensors[name]
        if info.name not in self.vocab:
            return self.inner.read_raw(info.name, start, stop)
        return self.read_into(name, start, stop, self.scratch((stop - start) * info.dtype.itemsize))

    def read_into(self, name: str, start: int, stop: int, buf: memoryview) -> memoryview:
        """Stored bytes of flat elements [start, stop) of the remapped tensor: runs of rows the model stores in
        order are read in one piece; a row it lacks is the output base's row in this model's dtype."""
        info = self.tensors[name]
        if info.name not in self.vocab:
            return self.inner.read_into(info.name, start, stop, buf)
        cols = math.prod(info.shape[1:]) or 1
        size = info.dtype.itemsize
        out = buf[:(stop - start) * size]
        src = self.plan.sources[self.index]
        pos = start
        while pos < stop:
            row = pos // cols
            s = int(src[row])
            end_row = row + 1
            if s >= 0:  # a run of consecutive source rows: one read
                while end_row * cols < stop and int(src[end_row]) == s + (end_row - row):
                    end_row += 1
            hi = min(stop, end_row * cols)
            piece = out[(pos - start) * size:(hi - start) * size]
            if s >= 0:
                off = s * cols + (pos - row * cols)
                self.inner.read_into(info.name, off, off + (hi - pos), piece)
            else:
                value = self.plan.base_row(info.name, row, cols).to(info.dtype.torch)
                raw = memoryview(value.view(torch.uint8).numpy()).cast("B")
                piece[:] = raw[(pos - row * cols) * size:(hi - row * cols) * size]
            pos = hi
        return out
