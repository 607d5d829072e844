"""verl FSDP actor checkpoints, read in place: ``global_step_N/actor`` is the model, no conversion.

verl (0.9) saves each rank's slice of the model as ``model_world_size_W_rank_R.pt``: a state dict of DTensors
whose placements shard every tensor along its first dimension over the FSDP mesh (``Shard(0)``), possibly
replicated over a data-parallel dimension in front (mesh ``("ddp", "fsdp")``: HSDP). The full tensor is the
concatenation of the first replica's slices in mesh order, exactly what verl's own ``model_merger`` does.

- Opening: only ``model_world_size_*`` files are opened, with ``torch.load(weights_only=True, mmap=True)``
  (importing ``torch.distributed.tensor`` registers DTensor and its placements as safe globals; no code from
  the file runs). ``optim_*`` and ``extra_state_*`` are never opened. The load maps the file; the offset of
  each slice's bytes in the zip archive is then found (storage addresses against the archive's records,
  checked one to one) and the mapping is dropped.
- Reading: a block of flat elements maps through the Shard(0) layout to (rank file, byte range), read with
  ``preadv`` into a reused buffer, as for safetensors: memory is bounded by the block, never by the model.
- dtype: verl keeps float32 master weights; its model_merger exports them in bfloat16. rlmerge reads a float32
  shard rounded to bfloat16 in the same way (round to nearest even), so a merge from the shards is
  byte-identical to a merge from model_merger's folder, and every Adam step's sub-ulp drift does not count as
  a change. Shards saved in bfloat16 or float16 are read as they are.
- Refused, naming the tensor: a placement other than Shard(0) on the FSDP dimension (Partial, Replicate, a
  tensor-parallel Shard), a replica dimension that is not Replicate, slices that do not tile the tensor, a
  LoRA run's shards (``lora_`` keys: convert them with model_merger, then pass ``lora_adapter/``).
"""

from __future__ import annotations

import contextlib
import logging
import struct
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._torch import torch
from ..errors import InputError
from .checkpoint import SIDE_FILES, Checkpoint, TensorInfo, dense_dtype
from .dtypes import BF16, F32, DType, from_torch
from .layouts import VERL_RANK

CONVERT = "python -m verl.model_merger merge --backend fsdp --local_dir {actor} --target_dir MERGED"


@dataclass(frozen=True)
class Piece:
    """One rank's slice of a tensor: global rows [row0, row0 + rows), stored contiguously at ``offset``."""

    row0: int
    rows: int
    file: Path
    offset: int  # absolute byte offset in ``file``
    dtype: DType  # as stored


class VerlCheckpoint(Checkpoint):
    """A verl FSDP actor folder (``…/global_step_N/actor``) behind the ``Checkpoint`` view."""

    def _index(self) -> None:
        self.format = "verl"
        self.side_dir = self.path / "huggingface"
        config = self._read_json("huggingface/config.json")
        if not isinstance(config, dict):
            raise InputError("no huggingface/config.json in the verl actor folder", file=str(self.side_dir),
                             hint="verl writes it with every checkpoint; copy the base model's config.json there")
        self.config = config
        for name in SIDE_FILES:
            if (self.side_dir / name).is_file():
                self.check_inside(self.side_dir / name)
        ranks = self._first_replica()
        self._pieces: dict[str, list[Piece]] = {}
        self._stored: dict[str, DType] = {}
        self._files = [f for _, f in ranks]
        self._read_shards(ranks)
        if any(d == F32 for d in self._stored.values()):
            self.notes.append(f"{self.label}: verl's float32 master weights are read rounded to bfloat16 (round to "
                              "nearest even), as verl's model_merger exports them")

    # -- discovery -------------------------------------------------------------------------------------
    def _world_size(self) -> int:
        found = {}
        for p in self.path.iterdir():
            m = VERL_RANK.match(p.name)
            if m:
                found.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
        cfg = self._read_json("fsdp_config.json")
        declared = cfg.get("world_size") if isinstance(cfg, dict) else None
        if declared is None and len(found) != 1:
            raise InputError(f"no fsdp_config.json and shards for {len(found)} world sizes {sorted(found)}",
                             file=str(self.path), hint="keep the shards of one run only in the actor folder")
        w = int(declared) if isinstance(declared, int) else next(iter(found))
        if w < 1 or w not in found:
            raise InputError(f"fsdp_config.json says world_size {declared!r} but no model_world_size_{w}_rank_*.pt",
                             file=str(self.path / "fsdp_config.json"), hint="the checkpoint is incomplete")
        return w

    def _first_replica(self) -> list[tuple[int, Path]]:
        """(rank, file) of the first data-parallel replica, in FSDP mesh order, from rank 0's mesh."""
        w = self._world_size()
        first = self.path / f"model_world_size_{w}_rank_0.pt"
        state = self._load(first)
        mesh = next((v.device_mesh for v in state.values() if _is_dtensor(v)), None)
        if mesh is None:  # nothing sharded: a single-rank save
            ranks = [0] if w == 1 else list(range(w))
        else:
            grid = mesh.mesh.reshape(-1, mesh.mesh.shape[-1])  # [replicas, fsdp]
            ranks = [int(r) for r in grid[0].tolist()]
        del state
        out = []
        for r in ranks:
            f = self.path / f"model_world_size_{w}_rank_{r}.pt"
            if not f.is_file():
                raise InputError(f"shard of rank {r} is missing", file=str(f), hint="the checkpoint is incomplete")
            self.check_inside(f)
            out.append((r, f))
        return out

    def _load(self, f: Path) -> dict[str, Any]:
        self.check_inside(f)
        import torch.distributed.tensor  # noqa: F401  registers DTensor and its placements as safe globals

        try:
            with _quiet_device_mesh():
                state = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # pickle errors come in many types; all mean "refused"
            raise InputError(f"cannot load with weights_only=True ({type(e).__name__}: {e})", file=str(f),
                             hint="only DTensors and tensors are loaded (an FSDP1 ShardedTensor save is not): convert "
                                  f"it with {CONVERT.format(actor=self.path)} and pass MERGED") from e
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise InputError("the shard does not hold a state dict", file=str(f))
        for k, v in state.items():
            if not isinstance(v, torch.Tensor):
                raise InputError(f"the shard holds a {type(v).__name__}, not a tensor", file=str(f), tensor=k)
            dense_dtype(f, k, v._local_tensor if _is_dtensor(v) else v,  # meta, sparse, complex: refused here
                        hint=f"convert it with {CONVERT.format(actor=self.path)} and pass MERGED")
            if "lora_" in k:
                raise InputError("a verl LoRA run's shards: rlmerge reads its adapter, not the shards", file=str(f),
                                 tensor=k, hint=f"run {CONVERT.format(actor=self.path)} and pass MERGED/lora_adapter "
                                                "as the agent, over the base model")
        return state

    def _read_shards(self, ranks: list[tuple[int, Path]]) -> None:
        slices: dict[str, list[tuple[Any, Path]]] = {}
        globals_: dict[str, tuple[tuple[int, ...], DType]] = {}
        aliases: set[str] = set()
        for j, (_, f) in enumerate(ranks):
            state = self._load(f)
            offsets = _data_offsets(f, state)
            if j == 0:
                aliases = _tied_aliases(state, self.config)
            elif state.keys() != slices.keys():
                odd = sorted(set(state) ^ set(slices))[0]
                raise InputError("the shards of one checkpoint hold different tensors", file=str(f), tensor=odd)
            for name, v in state.items():
                local = v._local_tensor if _is_dtensor(v) else v
                shape = tuple(v.shape)
                _check_placement(name, v, f)
                if not local.is_contiguous():
                    raise InputError("a shard's slice is not contiguous", file=str(f), tensor=name,
                                     hint=f"convert the checkpoint: {CONVERT.format(actor=self.path)}")
                dtype = from_torch(local.dtype)
                if j == 0:
                    globals_[name] = (shape, dtype)
                elif globals_[name] != (shape, dtype):
                    raise InputError(f"rank files disagree on the tensor: {list(shape)} {dtype} vs "
                                     f"{list(globals_[name][0])} {globals_[name][1]}", file=str(f), tensor=name)
                slices.setdefault(name, []).append((local, f, offsets(local), _is_dtensor(v)))
            del state
        for name, parts in slices.items():
            if name in aliases:
                continue
            shape, dtype = globals_[name]
            self._pieces[name] = _tile(name, shape, parts)
            self._stored[name] = dtype
            shown = BF16 if dtype == F32 else dtype
            self.tensors[name] = TensorInfo(name, shown, shape, parts[0][1])

    @property
    def files(self) -> list[Path]:
        return list(self._files)

    # -- reading ---------------------------------------------------------------------------------------
    def _spans(self, name: str, start: int, stop: int) -> Iterator[tuple[Piece, int, int]]:
        """(piece, first, last) element ranges of [start, stop), relative to each overlapping piece."""
        shape = self.tensors[name].shape
        row = 1
        for d in shape[1:]:
            row *= d
        for p in self._pieces[name]:
            lo, hi = p.row0 * row, (p.row0 + p.rows) * row
            s, e = max(start, lo), min(stop, hi)
            if s < e:
                yield p, s - lo, e - lo

    def _fill(self, name: str, start: int, stop: int, dst: torch.Tensor) -> torch.Tensor:
        """Stored elements [start, stop) converted into ``dst`` (torch's casts: float32 → bf16 rounds to
        nearest even, as ``Tensor.bfloat16()`` in verl's model_merger); a piece in ``dst``'s dtype is read
        straight into it."""
        at = 0
        for p, s, e in self._spans(name, start, stop):
            n = e - s
            part, offset = dst[at:at + n], p.offset + s * p.dtype.itemsize
            if p.dtype.torch == dst.dtype:
                self.pread(p.file, offset, memoryview(part.view(torch.uint8).numpy()), name)
            else:
                raw = self.pread(p.file, offset, self.scratch(n * p.dtype.itemsize), name)
                part.copy_(torch.frombuffer(raw, dtype=p.dtype.torch, count=n))
            at += n
        return dst

    def read_f32(self, name: str, start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
        name = self.tensors[name].name  # an alias reads its stored tensor
        dst = out[:stop - start]
        if stop == start:
            return dst
        if self._stored[name] == F32:  # round through bfloat16, as model_merger exports it
            tmp = self._fill(name, start, stop, torch.empty(stop - start, dtype=torch.bfloat16))
            return dst.copy_(tmp)
        return self._fill(name, start, stop, dst)

    def read_raw(self, name: str, start: int, stop: int) -> memoryview:
        info = self.tensors[name]
        self._raw = self._fill(info.name, start, stop, torch.empty(stop - start, dtype=info.dtype.torch))
        return memoryview(self._raw.view(torch.uint8).numpy()).cast("B")

    def read_into(self, name: str, start: int, stop: int, buf: memoryview) -> memoryview:
        """The bytes ``read_raw`` gives (float32 master weights rounded to bfloat16), into ``buf``."""
        info = self.tensors[name]
        out = buf[:(stop - start) * info.dtype.itemsize]
        if stop > start:
            self._fill(info.name, start, stop, torch.frombuffer(out, dtype=info.dtype.torch, count=stop - start))
        return out


def _is_dtensor(v: Any) -> bool:
    return type(v).__name__ == "DTensor" and hasattr(v, "_local_tensor")


def _check_placement(name: str, v: Any, f: Path) -> None:
    """Shard(0) over the last mesh dimension (FSDP); Replicate over any dimension before it (DDP replicas)."""
    if not _is_dtensor(v):
        return
    from torch.distributed.tensor import Replicate, Shard

    places = tuple(v.placements)
    fsdp, replicas = places[-1], places[:-1]
    ok = isinstance(fsdp, Shard) and fsdp.dim == 0 and type(fsdp) is Shard
    ok = ok and all(isinstance(p, Replicate) for p in replicas)
    if not ok:
        names = getattr(v.device_mesh, "mesh_dim_names", None)
        raise InputError(f"placements {places} over mesh {names}: rlmerge reads Shard(0) over the FSDP dimension "
                         "(Replicate before it) only", file=str(f), tensor=name,
                         hint="convert the checkpoint with verl's model_merger (python -m verl.model_merger merge "
                              "--backend fsdp --local_dir ACTOR --target_dir MERGED) and pass MERGED")


def _tile(name: str, shape: tuple[int, ...], parts: list[tuple[Any, Path, int, bool]]) -> list[Piece]:
    """The pieces of one tensor: sharded slices stacked along dim 0 in mesh order; a plain tensor is one
    piece from the first rank (it is replicated on every rank, as verl's model_merger assumes)."""
    if not parts[0][3]:  # not a DTensor: replicated buffer
        local, f, off, _ = parts[0]
        for other, g, _, _ in parts[1:]:
            if other.shape != local.shape or not torch.equal(other, local):
                raise InputError("an unsharded tensor differs between ranks", file=str(g), tensor=name,
                                 hint="the checkpoint is inconsistent; convert it with verl's model_merger")
        return [Piece(0, shape[0] if shape else 1, f, off, from_torch(local.dtype))]
    pieces, row0 = [], 0
    for local, f, off, _ in parts:
        if tuple(local.shape[1:]) != shape[1:]:
            raise InputError(f"slice {list(local.shape)} does not match the tensor {list(shape)}", file=str(f),
                             tensor=name, hint="the checkpoint is corrupt")
        pieces.append(Piece(row0, local.shape[0], f, off, from_torch(local.dtype)))
        row0 += local.shape[0]
    if row0 != (shape[0] if shape else 1):
        raise InputError(f"the slices hold {row0} rows of {shape[0] if shape else 1}", file=str(parts[-1][1]),
                         tensor=name, hint="a shard is missing or from another run")
    return pieces


def _tied_aliases(state: dict[str, Any], config: dict[str, Any]) -> set[str]:
    """``lm_head.weight`` when the config ties it and it shares its storage with another tensor (the
    embeddings): dropped, as verl's model_merger drops tied aliases before saving (drop_tied_target_keys)."""
    if not config.get("tie_word_embeddings", False):
        return set()
    storage = {n: ((v._local_tensor if _is_dtensor(v) else v).data_ptr()) for n, v in state.items()}
    return {n for n in state if n.endswith("lm_head.weight")
            and any(storage[m] == storage[n] for m in state if m != n) and state[n].numel()}


def _data_offsets(f: Path, state: dict[str, Any]) -> Any:
    """A function: tensor (from ``state``, loaded with mmap=True) → absolute byte offset of its data in ``f``.

    torch maps the whole file once and cuts every storage from that mapping at its record's offset, so each
    storage address minus its record's offset is one constant; every storage is matched to a record of the
    same size (distinct addresses, so distinct records), or the file is refused.
    """
    records = []
    try:
        with open(f, "rb") as fh, zipfile.ZipFile(fh) as z:
            for info in z.infolist():
                parts = info.filename.split("/")
                if len(parts) == 3 and parts[1] == "data" and parts[2].isdigit():
                    if info.compress_type != zipfile.ZIP_STORED:
                        raise InputError("compressed tensor data", file=str(f), hint="re-save the checkpoint")
                    fh.seek(info.header_offset)
                    head = fh.read(30)
                    n, m = struct.unpack("<HH", head[26:30])
                    records.append((info.header_offset + 30 + n + m, info.file_size))
                elif len(parts) == 2 and parts[1] == "byteorder" and z.read(info) != b"little":
                    raise InputError("big-endian tensor data", file=str(f), hint="re-save on a little-endian machine")
    except (zipfile.BadZipFile, OSError) as e:
        raise InputError(f"not a torch zip archive ({e})", file=str(f), hint="re-save with torch.save") from e
    storages: dict[int, int] = {}
    for v in state.values():
        st = (v._local_tensor if _is_dtensor(v) else v).untyped_storage()
        if st.nbytes():
            storages[st.data_ptr()] = st.nbytes()
    recs = dict(r for r in records if r[1])  # offset → size; the archive may hold more (a DeviceMesh's ranks)
    ptrs = sorted(storages.items())
    bases = {p - o for p, _ in ptrs[:1] for o in recs}  # the first storage sits at one of the records
    found = [b for b in bases if all(recs.get(p - b) == size for p, size in ptrs)]
    if len(found) != 1:
        raise InputError("cannot locate the tensors' bytes in the archive", file=str(f),
                         hint="convert the checkpoint with verl's model_merger and pass its output")
    base = found[0]
    return lambda t: t.data_ptr() - base


@contextlib.contextmanager
def _quiet_device_mesh() -> Iterator[None]:
    """Unpickling a DeviceMesh without process groups logs a warning about torch.compile: not ours to show."""
    log = logging.getLogger("torch.distributed.device_mesh")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


