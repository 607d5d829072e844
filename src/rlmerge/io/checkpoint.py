"""Lazy, validated view of a Hugging Face checkpoint folder.

Only headers are read when a checkpoint is opened. Weights are read later, a contiguous range of flat
elements at a time, straight into a reusable buffer (``read_f32``), so memory is bounded by the block
size and never by the model. safetensors headers are parsed here rather than through ``safe_open``
so that every lie a header can tell (offsets past the end, overlapping ranges, a size that does not
match the shape, duplicate names, a huge header) is caught with the file and tensor named.
``.bin`` checkpoints load with ``torch.load(weights_only=True, mmap=True)``: no pickled code runs.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._torch import torch
from ..errors import InputError
from .dtypes import DTYPES, FLOAT_DTYPES, DType, from_torch

MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit; a larger header is a memory bomb
SIDE_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
    "chat_template.jinja", "chat_template.json", "preprocessor_config.json",
)


class FilePool:
    """The input files open at once, shared by every checkpoint and thread, at most ``limit`` of them.

    A merge of many agents of a many-shard model would pass the usual limit of 1,024 open files; here the least
    recently used file that no thread is reading is closed when another must open. A file is reopened by path,
    and must then be the same file (device, inode, size) as when it was first opened, or the read fails with an
    ``InputError`` naming it: a file replaced during a merge is never read half old, half new.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._open: OrderedDict[Path, list[int]] = OrderedDict()  # file → [fd, readers now]
        self._ident: dict[Path, tuple[int, int, int]] = {}

    @contextlib.contextmanager
    def fd(self, file: Path) -> Iterator[int]:
        with self._lock:
            entry = self._open.get(file)
            if entry is None:
                entry = self._open[file] = [self._open_checked(file), 0]
                self._evict()
            self._open.move_to_end(file)
            entry[1] += 1
        try:
            yield entry[0]
        finally:
            with self._lock:
                entry[1] -= 1

    def _open_checked(self, file: Path) -> int:
        try:
            fd = os.open(file, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        except OSError as e:
            raise InputError(f"cannot open: {e.strerror}", file=str(file),
                             hint="the file vanished or became unreadable while merging") from e
        st = os.fstat(fd)
        ident = (st.st_dev, st.st_ino, st.st_size)
        if self._ident.setdefault(file, ident) != ident:
            os.close(fd)
            raise InputError("the file was replaced while merging", file=str(file),
                             hint="another program changed it; let it finish, then merge again")
        return fd

    def _evict(self) -> None:
        for file in list(self._open):
            if len(self._open) <= self.limit:
                return
            fd, readers = self._open[file]
            if readers == 0:
                os.close(fd)
                del self._open[file]

    def close(self, files: Iterable[Path]) -> None:
        """Close ``files`` (a checkpoint is done with them) and forget their identity."""
        with self._lock:
            for f in files:
                entry = self._open.get(f)
                if entry is not None and entry[1] == 0:
                    os.close(entry[0])
                    del self._open[f]
                self._ident.pop(f, None)


def descriptor_budget(most: int) -> int:
    """Descriptors one pool of open files may hold: a quarter of this process's limit, at least 8, at most
    ``most`` (the open inputs and their mappings are two such pools; Python and the libraries need the rest)."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft == resource.RLIM_INFINITY:
            soft = 1 << 20
    except (ImportError, OSError, ValueError):
        soft = 1024
    return max(8, min(most, soft // 4))


FILES = FilePool(descriptor_budget(256))


@dataclass(frozen=True)
class TensorInfo:
    """Where one stored tensor lives. ``offset`` is absolute in ``file`` (safetensors only)."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    file: Path
    offset: int = -1

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES


def read_safetensors_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str], bytes]:
    """Parse and validate one safetensors file's header; returns (tensors, metadata, raw header)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise InputError("file is shorter than a safetensors header", file=str(path),
                                 hint="the download is incomplete or the file is not safetensors")
            n = int.from_bytes(head, "little")
            if n > MAX_HEADER_BYTES or n + 8 > size:
                raise InputError(f"safetensors header claims {n} bytes but only {size - 8} follow",
                                 file=str(path), hint="the file is truncated or corrupt; download it again")
            raw = f.read(n)
    except OSError as e:
        raise InputError(f"cannot read: {e.strerror}", file=str(path)) from e

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(pairs)
        if len(out) == len(pairs):
            return out
        dup = {k for k, n in Counter(k for k, _ in pairs).items() if n > 1}
        if dup:
            raise InputError("duplicate tensor names in header", file=str(path), tensor=sorted(dup)[0],
                             hint="the file is corrupt; re-save the checkpoint")
        return out

    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise InputError(f"safetensors header is not valid JSON ({type(e).__name__})", file=str(path),
                         hint="the file is corrupt or not safetensors") from e
    if not isinstance(header, dict):
        raise InputError("safetensors header is not a JSON object", file=str(path))
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise InputError("safetensors __metadata__ is not a mapping of strings", file=str(path),
                         hint="the file is corrupt; re-save the checkpoint")
    data_start = 8 + n
    tensors: dict[str, TensorInfo] = {}
    spans = []
    for name, entry in header.items():
        try:
            dtype = DTYPES[entry["dtype"]]
            shape = tuple(_json_int(d) for d in entry["shape"])
            begin, end = (_json_int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"malformed header entry ({e!r})", file=str(path), tensor=name,
                             hint="the file is corrupt; re-save the checkpoint") from e
        info = TensorInfo(name, dtype, shape, path, data_start + begin)
        if min(shape, default=1) < 0 or begin < 0 or end - begin != info.nbytes:
            raise InputError(f"header says {end - begin} bytes for shape {list(shape)} {entry['dtype']}",
                             file=str(path), tensor=name, hint="the header lies; the file is corrupt")
        if data_start + end > size:
            raise InputError(f"tensor data ends at byte {data_start + end} but the file has {size}",
                             file=str(path), tensor=name, hint="the file is truncated; download it again")
        spans.append((begin, end, name))
        tensors[name] = info
    spans.sort()
    for (_, e0, a), (b1, _, b) in zip(spans, spans[1:]):
        if b1 < e0:
            raise InputError(f"tensors {a!r} and {b!r} overlap in the file", file=str(path), tensor=b,
                             hint="the header lies; the file is corrupt")
    return tensors, {str(k): str(v) for k, v in meta.items()}, raw


def _json_int(x: Any) -> int:
    """A JSON integer; floats and booleans in a header are lies, not sizes."""
    if type(x) is not int:
        raise TypeError(f"{x!r} is not an integer")
    return x


def _inside(path: Path, roots: list[Path]) -> bool:
    """Whether ``path`` (symlinks resolved) lies inside one of ``roots``."""
    real = path.resolve()
    return any(real == r or r in real.parents for r in roots)


class Checkpoint:
    """A model folder: its tensors (from headers only), its config and where each byte lives."""

    # ``read_into`` gives any tensor's stored bytes, and may run on a reader thread beside the other reads: the
    # numba path can read this checkpoint (False: an adapter, which supplies τ itself; io/lora.py)
    stored_bytes = True
    hub_id: str | None = None  # the Hub repository it came from (io/open.hub_id), for the model card's metadata

    @property
    def viewable(self) -> bool:
        """Its stored bytes can be viewed in place in a mapping of its files (safetensors); the others are read
        into buffers, with torch's help (``.bin``, verl shards)."""
        return self.format == "safetensors"

    def __init__(self, path: Path, *, label: str | None = None, revision: str | None = None) -> None:
        self.path = path
        self.label = label or str(path)
        self.revision = revision
        self.tensors: dict[str, TensorInfo] = {}
        self.header_bytes: dict[Path, bytes] = {}
        self.format = ""
        self.side_dir = path  # where config.json and the tokenizer files live (verl: actor/huggingface)
        self.notes: list[str] = []  # what the reader did that a user should know (the match reports them)
        self._bin: dict[Path, dict[str, torch.Tensor]] = {}
        self._local = threading.local()  # each thread's read buffer (scratch)
        self.roots = _allowed_roots(path)
        config = self._read_json("config.json")
        if config is not None and not isinstance(config, dict):
            raise InputError("config.json is not a JSON object", file=str(path / "config.json"))
        self.config: dict[str, Any] = config or {}
        for name in SIDE_FILES:  # copied into the output later: none may point outside the folder
            if (path / name).is_file():
                self.check_inside(path / name)
        self._index()

    # -- discovery -------------------------------------------------------------------------------------
    def _read_json(self, name: str) -> Any:
        p = self.path / name
        if not p.is_file():
            return None
        self.check_inside(p)
        try:
            return json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError) as e:  # ValueError: bad JSON or bad UTF-8
            raise InputError(f"cannot parse {name}: {type(e).__name__}: {e}", file=str(p)) from e

    def check_inside(self, p: Path) -> None:
        """Refuse a file that resolves (through symlinks) outside the model folder."""
        if not _inside(p, self.roots):
            raise InputError(f"{p.name} resolves outside the model folder (to {p.resolve()})", file=str(p),
                             hint="refusing to read files outside the checkpoint; copy the file into the folder")

    def _shard_files(self, index_name: str) -> list[Path]:
        index = self._read_json(index_name)
        wmap = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wmap, dict):
            raise InputError("index has no weight_map", file=str(self.path / index_name))
        names = list(wmap.values())
        if not all(isinstance(n, str) for n in names):
            raise InputError("index weight_map values must be file names", file=str(self.path / index_name))
        files = []
        for fname in dict.fromkeys(names):
            rel = Path(fname)
            if rel.is_absolute() or ".." in rel.parts or fname in ("", "."):
                raise InputError(f"index points outside the model folder: {fname!r}",
                                 file=str(self.path / index_name),
                                 hint="refusing to read files outside the checkpoint; fix the index")
            p = self.path / rel
            if not p.is_file():
                raise InputError(f"shard {fname!r} listed in the index is missing",
                                 file=str(self.path / index_name), hint="download the missing shard")
            self.check_inside(p)
            files.append(p)
        return files

    def _index(self) -> None:
        p = self.path
        if (p / "model.safetensors.index.json").is_file():
            self.format, files = "safetensors", self._shard_files("model.safetensors.index.json")
        elif (p / "model.safetensors").is_file():
            self.format, files = "safetensors", [p / "model.safetensors"]
            self.check_inside(files[0])
        elif (p / "pytorch_model.bin.index.json").is_file():
            self.format, files = "bin", self._shard_files("pytorch_model.bin.index.json")
        elif (p / "pytorch_model.bin").is_file():
            self.format, files = "bin", [p / "pytorch_model.bin"]
            self.check_inside(files[0])
        else:
            raise InputError("no model.safetensors(.index.json) or pytorch_model.bin(.index.json) found",
                             file=str(p), hint="point at a Hugging Face model folder")
        for f in files:
            found = self._safetensors_file(f) if self.format == "safetensors" else self._bin_file(f)
            for name, info in found.items():
                if name in self.tensors:
                    raise InputError(f"tensor stored twice (also in {self.tensors[name].file.name})",
                                     file=str(f), tensor=name, hint="the shards overlap; fix the index")
                self.tensors[name] = info

    def _safetensors_file(self, f: Path) -> dict[str, TensorInfo]:
        tensors, _, raw = read_safetensors_header(f)
        self.header_bytes[f] = raw
        return tensors

    def _bin_file(self, f: Path) -> dict[str, TensorInfo]:
        try:
            try:
                state = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:  # the pre-1.6 (non-zip) format cannot be memory-mapped: load it whole
                if "mmap" not in str(e):
                    raise
                state = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # pickle errors come in many types; all mean "refused"
            raise InputError(f"cannot load with weights_only=True ({type(e).__name__}: {e})", file=str(f),
                             hint="the file is corrupt or contains code; only plain tensors are loaded") from e
        if not isinstance(state, dict):
            raise InputError("pytorch_model.bin does not hold a state dict", file=str(f))
        if not all(isinstance(k, str) for k in state):
            raise InputError("the state dict has keys that are not tensor names", file=str(f),
                             hint="save the model's state_dict() (names → tensors)")
        if not any(isinstance(v, torch.Tensor) for v in state.values()):
            raise InputError("the file holds no tensors at its top level", file=str(f),
                             hint="a training checkpoint? save the model's state_dict() on its own")
        self._bin[f] = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
        return {k: TensorInfo(k, dense_dtype(f, k, v), tuple(v.shape), f) for k, v in self._bin[f].items()}

    def alias(self, name: str, stored: str) -> None:
        """Read tensor ``name`` from the stored tensor ``stored`` (a tied checkpoint's lm_head is its embedding)."""
        self.tensors[name] = self.tensors[stored]

    def same_bytes(self, a: str, b: str, *, chunk: int = 1 << 22) -> bool:
        """Whether tensors ``a`` and ``b`` hold the same shape, dtype and bytes (a tied model's lm_head stored beside
        its embedding). Two ``.bin`` tensors over one storage are, without a read (``torch.save`` of a tied
        model's state dict); others are compared by ``equal_bytes``."""
        ta, tb = (self._bin.get(i.file, {}).get(i.name) for i in (self.tensors[a], self.tensors[b]))
        if ta is not None and tb is not None and _one_view(ta, tb):
            return True
        return equal_bytes(self, a, self, b, chunk=chunk)

    @property
    def files(self) -> list[Path]:
        return list(dict.fromkeys(t.file for t in self.tensors.values()))

    @property
    def tie_word_embeddings(self) -> bool:
        # transformers' PretrainedConfig default is True; nested text configs are not considered.
        return bool(self.config.get("tie_word_embeddings", True))

    # -- reading ---------------------------------------------------------------------------------------
    def read_f32(self, name: str, start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
        """Flat elements [start, stop) of ``name`` as float32, written into ``out[: stop - start]``."""
        info = self.tensors[name]
        n = stop - start
        dst = out[:n]
        if n == 0:  # torch.frombuffer refuses empty buffers; an empty tensor has nothing to read
            return dst
        if self.format == "bin":
            dst.copy_(self._bin[info.file][info.name].reshape(-1)[start:stop])
            return dst
        dst.copy_(torch.frombuffer(self._read_bytes(info, start, stop), dtype=info.dtype.torch, count=n))
        return dst

    def read_raw(self, name: str, start: int, stop: int) -> memoryview:
        """Stored bytes of flat elements [start, stop) (valid until the next read)."""
        info = self.tensors[name]
        if self.format == "bin":
            t = self._bin[info.file][info.name].reshape(-1)[start:stop].contiguous()
            return memoryview(t.view(torch.uint8).numpy()).cast("B")
        return self._read_bytes(info, start, stop)

    def _read_bytes(self, info: TensorInfo, start: int, stop: int) -> memoryview:
        nbytes = (stop - start) * info.dtype.itemsize
        if nbytes == 0:
            return memoryview(b"")
        return self.read_into(info.name, start, stop, self.scratch(nbytes))

    def scratch(self, nbytes: int) -> memoryview:
        """The first ``nbytes`` of this checkpoint's reused read buffer for the calling thread (grown when too
        small): the numba path's reader thread reads a checkpoint while the main thread copies from it."""
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < nbytes:
            buf = self._local.buf = bytearray(nbytes)
        return memoryview(buf)[:nbytes]

    def pread(self, file: Path, offset: int, buf: memoryview, tensor: str | None = None) -> memoryview:
        """``len(buf)`` stored bytes of ``file`` from ``offset`` into ``buf``: one ``preadv`` through the shared
        descriptor pool; a short read (the file changed or was truncated) is an InputError."""
        with self.fd(file) as fd:
            got = os.preadv(fd, [buf], offset)
        if got != len(buf):
            raise InputError(f"short read: wanted {len(buf)} bytes, got {got}", file=str(file), tensor=tensor,
                             hint="the file changed or was truncated while merging")
        return buf

    def read_into(self, name: str, start: int, stop: int, buf: memoryview) -> memoryview:
        """Stored bytes of flat elements [start, stop) of ``name`` into ``buf`` (its first bytes, returned).

        safetensors: one ``preadv`` straight from the page cache into the caller's buffer: no mmap pages piling
        up in the resident set, and the GIL is released, so a reader thread overlaps it with computation.
        ``.bin``: copied from the mapped state dict.
        """
        info = self.tensors[name]
        size = info.dtype.itemsize
        out = buf[:(stop - start) * size]
        if self.format == "bin":
            if stop > start:  # torch.frombuffer refuses empty buffers
                dst = torch.frombuffer(out, dtype=info.dtype.torch, count=stop - start)
                dst.copy_(self._bin[info.file][info.name].reshape(-1)[start:stop])
            return out
        return self.pread(info.file, info.offset + start * size, out, info.name)

    def fd(self, file: Path) -> contextlib.AbstractContextManager[int]:
        """``with ckpt.fd(file) as fd:`` a descriptor of ``file`` from the shared pool (safe across threads)."""
        return FILES.fd(file)

    def close(self) -> None:
        FILES.close(self.files)
        self._local = threading.local()


_DENSE = "save the model's materialised, dense state_dict (e.g. save_pretrained) and retry"


def dense_dtype(f: Path, name: str, t: torch.Tensor, *, hint: str = _DENSE) -> DType:
    """The stored dtype of a plain, dense tensor from a torch-saved file (a ``.bin``, a verl rank file); a meta,
    sparse or complex tensor, or a dtype rlmerge does not read, is refused, naming it."""
    why = ("a meta tensor (shape only, no data)" if t.is_meta else
           f"a {t.layout} tensor, not a dense one" if t.layout != torch.strided else
           f"a {str(t.dtype).removeprefix('torch.')} tensor" if t.is_complex() else None)
    if why is None:
        try:
            return from_torch(t.dtype)
        except ValueError:
            why = f"a {str(t.dtype).removeprefix('torch.')} tensor, a dtype rlmerge does not read"
    raise InputError(f"{why}", file=str(f), tensor=name, hint=hint)


def equal_bytes(a: Checkpoint, name_a: str, b: Checkpoint, name_b: str, *, chunk: int = 1 << 22) -> bool:
    """Whether tensor ``name_a`` of ``a`` and ``name_b`` of ``b`` (the same checkpoint or two) hold the same shape,
    dtype and stored bytes, compared ``chunk`` bytes at a time so memory stays bounded; stops at the first chunk
    that differs. Reads through ``read_raw``, which every input kind has (a LoRA adapter gives its base's bytes)."""
    ia, ib = a.tensors[name_a], b.tensors[name_b]
    if ia.shape != ib.shape or ia.dtype != ib.dtype:
        return False
    step = max(1, chunk // max(ia.dtype.itemsize, 1))
    for start in range(0, ia.numel, step):
        stop = min(start + step, ia.numel)
        first = bytes(a.read_raw(name_a, start, stop))  # a copy: read_raw's view lasts until ``a``'s next read
        if first != b.read_raw(name_b, start, stop):
            return False
    return True


def _one_view(x: torch.Tensor, y: torch.Tensor) -> bool:
    """The same elements of the same storage (``torch.load`` keeps a saved tie as one storage)."""
    return (x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr() and x.dtype == y.dtype
            and x.storage_offset() == y.storage_offset() and x.shape == y.shape and x.stride() == y.stride())


def _allowed_roots(folder: Path) -> list[Path]:
    """The folder itself; for a Hugging Face cache snapshot (``models--o--n/snapshots/REV``) also the
    repository's ``blobs/``, where the cache's own symlinks point."""
    root = folder.resolve()
    roots = [root]
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith("models--"):
        roots.append(root.parent.parent / "blobs")
    return roots
