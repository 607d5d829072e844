"""PEFT LoRA adapters as agents: τ = s·B·A per adapted matrix, computed block by block, never materialised.

An adapter folder (``adapter_config.json`` + ``adapter_model.safetensors`` or ``.bin``: PEFT's
``save_pretrained``, TRL with ``peft_config``, OpenRLHF ``--lora_rank``, verl's ``lora_adapter/``) is an agent
over the base it is merged with. Its task vector is, per base tensor W (PEFT's ``get_delta_weight``):

    τ = s · B @ A                 Linear        (A [r, in], B [out, r])
    τ = s · (B @ A)ᵀ              Conv1D        (GPT-2 style layers store W as [in, out])
    τ = s · (B @ A)ᵀ              Embedding     (lora_embedding_A [r, vocab], lora_embedding_B [dim, r])
    τ = F − W                     a full tensor the adapter saves (modules_to_save, trained biases,
                                  save_embedding_layers); added to the LoRA term when both exist
    τ = 0                         every other tensor of the base
    s = α / r  (α / √r with use_rslora); r and α per module from rank_pattern / alpha_pattern, matched as
    PEFT 0.21 matches them (``(.*\\.)?KEY$`` on the module name, first key in the file's order wins).

Linear or Conv1D is decided per layer, as PEFT decides it: by the layer's class, whatever ``fan_in_fan_out`` says
(PEFT warns and overrides the flag: False for an nn.Linear, True for a Conv1D). Without the model's code the class
comes from the base's ``config.json``: a transformers ``model_type`` names its layers' classes (``CONV1D_LAYERS``:
the few model types with Conv1D layers, by layer name; every other matrix LoRA adapts is an nn.Linear). Where the
config cannot say (no ``model_type``, or custom code via ``auto_map``), the shapes decide: W [out, in] = B@A or
its transpose; a square W is then refused rather than guessed. The shapes must agree with the class in any case.

Blocks are computed in float32 from rows of B (columns of A when transposed) in tiles of a fixed number of rows,
so an element's value never depends on the block size; memory is the block plus one tile plus the smaller
factor. The engine gets τ itself (``read_delta_f32``, through stream/blocks.read_delta), never base + τ rounded
to a storage dtype: the torch path, and the numba path, whose kernels then take every agent as τ
(stream/fast.reads_tau).

Refused with what to do: DoRA, ``lora_alpha: 0`` (a placeholder some converters write), initialisations that
rewrite the base weights (PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA), LoRA on an lm_head the base ties to its
embeddings, a rank that disagrees with the weights, and any other option rlmerge does not know to be exact.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._torch import torch
from ..errors import InputError, RLMergeError, raise_all
from .checkpoint import Checkpoint, TensorInfo
from .vocab import EMBEDDING_SUFFIXES

PREFIX = "base_model.model."
TILE = 1 << 16  # elements per tile of τ: fixed per tensor, so a value never depends on the block size
MERGE_INSTEAD = ("merge it with PEFT (PeftModel.from_pretrained(base, ADAPTER).merge_and_unload()."
                 "save_pretrained(FULL)) and pass FULL as the agent")
# config keys whose value only says how the adapter was trained or where it applies (the weights file says that)
HARMLESS = {"base_model_name_or_path", "revision", "task_type", "inference_mode", "auto_mapping", "peft_version",
            "target_modules", "exclude_modules", "layers_to_transform", "layers_pattern", "lora_dropout",
            "modules_to_save", "bias", "init_lora_weights", "fan_in_fan_out", "r", "lora_alpha", "use_rslora",
            "rank_pattern", "alpha_pattern", "peft_type", "megatron_core", "qalora_group_size",
            "ensure_weight_tying", "loftq_config", "eva_config", "corda_config", "lora_ga_config"}
REWRITE_BASE = ("pissa", "olora", "corda", "loftq", "lora_ga")  # init_lora_weights that change W at initialisation
# transformers' model types with Conv1D layers (W stored [in, out]), by layer name: `grep -rl "Conv1D(" models/` in
# transformers 5. Every other matrix LoRA adapts in a transformers model is an nn.Linear.
_GPT2_CONV1D = frozenset({"c_attn", "q_attn", "c_proj", "c_fc"})
CONV1D_LAYERS: dict[str, frozenset[str]] = {
    "gpt2": _GPT2_CONV1D, "decision_transformer": _GPT2_CONV1D, "imagegpt": _GPT2_CONV1D,
    "openai-gpt": frozenset({"c_attn", "c_proj", "c_fc"}),
    "clvp": frozenset({"c_fc", "c_proj"}), "clvp_decoder": frozenset({"c_fc", "c_proj"}),
}


@dataclass(frozen=True)
class LoraModule:
    """One adapted base tensor: τ = scale · B @ A (``transposed``: its transpose)."""

    a: TensorInfo  # [r, in] (Embedding: [r, vocab])
    b: TensorInfo  # [out, r] (Embedding: [dim, r])
    scale: float
    transposed: bool  # Embedding and Conv1D; a Linear or Conv1D layer is known once bound to the base
    embedding: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        rows, cols = self.b.shape[0], self.a.shape[1]
        return (cols, rows) if self.transposed else (rows, cols)


class LoraAdapter(Checkpoint):
    """A PEFT LoRA adapter folder; ``bind(base)`` gives it the base's tensors (τ = 0 where not adapted)."""

    stored_bytes = False  # τ = s·B@A is computed (read_delta_f32), never stored: stream/blocks.read_delta

    def _index(self) -> None:
        self.format = "lora"
        raw_cfg = self.path / "adapter_config.json"
        cfg = self._read_json("adapter_config.json")
        if not isinstance(cfg, dict):
            raise InputError("adapter_config.json is not a JSON object", file=str(raw_cfg))
        self.adapter_config = cfg
        self.header_bytes[raw_cfg] = raw_cfg.read_bytes()  # the resume fingerprint covers r, α, patterns
        weights = self.path / "adapter_model.safetensors"
        if weights.is_file():
            self.check_inside(weights)
            stored = self._safetensors_file(weights)
        else:
            weights = self.path / "adapter_model.bin"
            self.check_inside(weights)
            stored = self._bin_file(weights)
            self._bin_format = True
        self._weights = weights
        self._stored = stored
        self._modules: dict[str, LoraModule] = {}
        self._full: dict[str, TensorInfo] = {}
        raise_all(_config_problems(cfg, raw_cfg) or self._parse(stored))
        self._base: Checkpoint | None = None
        self._a_cache: tuple[str, torch.Tensor] | None = None

    @property
    def files(self) -> list[Path]:
        return [self._weights, self.path / "adapter_config.json"]

    # -- the adapter's keys → base tensors -------------------------------------------------------------
    def _parse(self, stored: dict[str, TensorInfo]) -> list[RLMergeError]:
        cfg = self.adapter_config
        problems: list[RLMergeError] = []
        pairs: dict[str, dict[str, TensorInfo]] = {}
        where = str(self._weights)
        for key, info in stored.items():
            name = key.removeprefix(PREFIX)
            name = re.sub(r"\.(lora_[AB])\.[^.]+\.weight$", r".\1.weight", name)  # "lora_A.default.weight"
            name = re.sub(r"\.(lora_embedding_[AB])\.[^.]+$", r".\1", name)
            m = re.match(r"^(.*)\.(lora_A|lora_B)\.weight$|^(.*)\.(lora_embedding_A|lora_embedding_B)$", name)
            if m:
                module = m.group(1) or m.group(3)
                part = (m.group(2) or m.group(4))[-1]
                pairs.setdefault(module, {})[part + ("e" if m.group(3) else "")] = info
            elif "lora_" in name:
                hint = ("DoRA: τ rescales W + BA by its column norms, not a LoRA product; " if "magnitude" in name
                        else "") + MERGE_INSTEAD
                problems.append(InputError("an adapter tensor rlmerge cannot turn into an exact τ", file=where,
                                           tensor=key, hint=hint))
            else:  # a full tensor (modules_to_save, a trained bias, save_embedding_layers)
                name = re.sub(r"\.modules_to_save\.[^.]+\.", ".", name).replace(".base_layer.", ".")
                self._full[name] = info
        for module, parts in sorted(pairs.items()):
            emb = "Ae" in parts or "Be" in parts
            a, b = parts.get("Ae" if emb else "A"), parts.get("Be" if emb else "B")
            if a is None or b is None or len(a.shape) != 2 or len(b.shape) != 2 or a.shape[0] != b.shape[1]:
                problems.append(InputError("LoRA A and B do not form a product (missing, or shapes "
                                           f"{a and list(a.shape)} and {b and list(b.shape)})", file=where,
                                           tensor=f"{module} lora_A/lora_B", hint="the adapter file is incomplete"))
                continue
            rank, alpha = _rank_alpha(cfg, module)
            if rank != a.shape[0]:
                problems.append(InputError(f"adapter_config.json gives rank {rank} but lora_A has {a.shape[0]} "
                                           "rows", file=where, tensor=a.name,
                                           hint="fix r / rank_pattern in adapter_config.json"))
                continue
            scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
            self._modules[module + ".weight"] = LoraModule(a, b, scale, emb, emb)
        return problems

    def bind(self, base: Checkpoint) -> list[RLMergeError]:
        """Take the base's tensors as this agent's (τ = 0 where the adapter does not touch them)."""
        if self._base is base:
            return []
        problems: list[RLMergeError] = []
        where = str(self._weights)
        oriented: dict[str, LoraModule] = {}
        for name, mod in self._modules.items():
            info = base.tensors.get(name)
            if info is None and name.endswith("lm_head.weight") and base.tie_word_embeddings:
                problems.append(InputError("the adapter changes lm_head, which the base ties to its embeddings",
                                           file=where, tensor=name,
                                           hint="merge against an untied copy of the base, or " + MERGE_INSTEAD))
                continue
            if info is None:
                problems.append(InputError("the adapter targets a tensor the base does not have", file=where,
                                           tensor=name, hint="pass the base model this adapter was trained on"))
                continue
            conv1d = mod.embedding or _is_conv1d(base.config, name, mod, info)
            if conv1d is None:
                problems.append(InputError(
                    f"cannot tell whether {name.removesuffix('.weight')} is a Linear layer (τ = s·B@A) or a Conv1D "
                    "(τ = s·(B@A)ᵀ): the base's config.json names no transformers model_type (or its code comes "
                    "with the model: auto_map) and the weight is square", file=where, tensor=name,
                    hint=MERGE_INSTEAD))
                continue
            mod = oriented[name] = dataclasses.replace(mod, transposed=conv1d)
            if info.shape != mod.shape or not info.is_float:
                problems.append(InputError(f"LoRA product is {list(mod.shape)} but the base stores "
                                           f"{list(info.shape)} {info.dtype}", file=where, tensor=name,
                                           hint="pass the base model this adapter was trained on"))
        self._drop_tied_head(base)
        for name, full in self._full.items():
            info = base.tensors.get(name)
            if name in self._modules and problems:
                continue  # already reported with its LoRA product
            if info is None or info.shape != full.shape or not (info.is_float and full.is_float):
                got = "missing from the base" if info is None else f"the base stores {list(info.shape)} {info.dtype}"
                problems.append(InputError(f"the adapter saves a full {list(full.shape)} {full.dtype} tensor; "
                                           f"{got}", file=where, tensor=full.name,
                                           hint="pass the base model this adapter was trained on (a resized "
                                                "vocabulary: resize it back)"))
        # the base's tensors even when refused: the match then reports these problems, not every tensor as missing
        self.tensors = {n: TensorInfo(n, i.dtype, i.shape, self._weights) for n, i in base.tensors.items()}
        if problems:
            return problems
        self._modules = oriented
        self._note_fan_in_fan_out()
        self._base = base
        self.config = {**base.config, **self.config}
        adapted = sum(base.tensors[n].numel for n in {*self._modules, *self._full})
        floats = sum(i.numel for i in base.tensors.values() if i.is_float) or 1
        whole = [n for n in self._full if n not in self._modules]  # (an adapted embedding may be saved whole too)
        self.notes.append(
            f"agent {self.label} is a LoRA adapter: its τ = (α/r)·B·A is dense by construction in the "
            f"{len(self._modules)} adapted matrices"
            + (f" and {len(whole)} tensor(s) it saves whole (modules_to_save, trained biases)" if whole else "")
            + f" ({adapted / floats:.1%} of the base's float elements; τ = 0 "
            "elsewhere), so RAM's shared/unique split sees every adapted element as changed: where two agents "
            "adapt the same matrices everything there is 'shared' and RAM averages, and unique elements exist "
            "only where one agent alone adapted. Recommended: task_arithmetic or ties for LoRA agents; RAM / RAM+ "
            "only where the agents adapted different modules (see the per-module densities)")
        return []

    def _drop_tied_head(self, base: Checkpoint) -> None:
        """PEFT's ``ensure_weight_tying`` over a base that ties its output head to its embeddings saves the head's
        full tensor beside the embedding's: one tensor under two names (the tie holds in PEFT's model), while the
        base stores only the embedding. The head's copy says nothing the embedding does not: it is dropped here.
        Without ``ensure_weight_tying`` the two copies are trained apart, which such a base cannot hold: refused
        below (the head is "missing from the base")."""
        if not (self.adapter_config.get("ensure_weight_tying") is True and base.tie_word_embeddings):
            return
        for name in [n for n in self._full if n.endswith("lm_head.weight") and n not in base.tensors]:
            head = self._full[name]
            twin = [e for n, e in self._full.items() if n.endswith(EMBEDDING_SUFFIXES) and n in base.tensors
                    and e.shape == head.shape and e.dtype == head.dtype]
            if len(twin) == 1:
                del self._full[name]

    def _note_fan_in_fan_out(self) -> None:
        """PEFT's warning where ``fan_in_fan_out`` disagrees with a layer's class (the class wins, as in PEFT)."""
        flag = bool(self.adapter_config.get("fan_in_fan_out"))
        odd = [n for n, m in self._modules.items() if not m.embedding and m.transposed != flag]
        if odd:
            kind = "Linear" if flag else "Conv1D"
            self.notes.append(f"agent {self.label}: adapter_config.json sets fan_in_fan_out: {str(flag).lower()}, "
                              f"but {len(odd)} adapted layer(s) are {kind} ({odd[0]}…): as PEFT does, the layer's "
                              f"class decides (τ = s·{'B@A' if flag else '(B@A)ᵀ'} there)")

    # -- reading ---------------------------------------------------------------------------------------
    def _stored_f32(self, info: TensorInfo, start: int, stop: int) -> torch.Tensor:
        """Flat elements [start, stop) of an adapter tensor as a new float32 tensor."""
        return _read_own(self, info, start, stop, torch.empty(stop - start, dtype=torch.float32))

    def read_delta_f32(self, name: str, start: int, stop: int, base_block: torch.Tensor,
                       out: torch.Tensor) -> torch.Tensor:
        """τ over flat elements [start, stop) of ``name`` in float32 into ``out``; ``base_block`` is θ₀ there."""
        n = stop - start
        dst = out[:n]
        full = self._full.get(name)
        if full is not None:
            dst.copy_(self._stored_f32(full, start, stop)).sub_(base_block[:n])
        else:
            dst.zero_()
        mod = self._modules.get(name)
        if mod is not None and n:
            self._add_product(mod, start, stop, dst)
        return dst

    def _add_product(self, mod: LoraModule, start: int, stop: int, dst: torch.Tensor) -> None:
        rows_total, row = mod.shape
        per_tile = max(1, TILE // row)
        t0 = start // row // per_tile * per_tile
        t_end = -(-stop // row)
        while t0 < t_end:
            t1 = min(t0 + per_tile, rows_total)
            tile = self._tile(mod, t0, t1)  # [t1 - t0, row]
            lo, hi = max(start, t0 * row), min(stop, t1 * row)
            dst[lo - start:hi - start].add_(tile.reshape(-1)[lo - t0 * row:hi - t0 * row])
            t0 = t1

    def _tile(self, mod: LoraModule, t0: int, t1: int) -> torch.Tensor:
        """Rows [t0, t1) of τ = s·B@A (transposed: of s·(B@A)ᵀ), float32, as PEFT: (B @ A) then × s."""
        r = mod.a.shape[0]
        if not mod.transposed:
            b = self._stored_f32(mod.b, t0 * r, t1 * r).view(t1 - t0, r)
            return torch.mm(b, self._whole(mod.a)).mul_(mod.scale)
        cols = mod.a.shape[1]
        a = torch.stack([self._stored_f32(mod.a, k * cols + t0, k * cols + t1) for k in range(r)])  # [r, t1-t0]
        return torch.mm(a.t(), self._whole(mod.b).t()).mul_(mod.scale)

    def _whole(self, info: TensorInfo) -> torch.Tensor:
        """The small factor of a product, whole, kept while one tensor is read."""
        cached = self._a_cache  # one read: the numba path's reader thread and the torch path may both be here
        if cached is None or cached[0] != info.name:
            cached = self._a_cache = (info.name, self._stored_f32(info, 0, info.numel).view(*info.shape))
        return cached[1]

    def read_f32(self, name: str, start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
        """θ = θ₀ + τ in float32 (the engine asks for τ itself: ``read_delta_f32``)."""
        base = self._bound()
        dst = base.read_f32(name, start, stop, out)
        return dst.add_(self.read_delta_f32(name, start, stop, dst, torch.empty_like(dst)))

    def read_raw(self, name: str, start: int, stop: int) -> memoryview:
        """θ's bytes in the base's dtype: the base's own bytes where the adapter does not change the tensor."""
        base = self._bound()
        if name not in self._modules and name not in self._full:
            return base.read_raw(name, start, stop)
        theta = self.read_f32(name, start, stop, torch.empty(stop - start, dtype=torch.float32))
        self._raw = theta.to(base.tensors[name].dtype.torch)
        return memoryview(self._raw.view(torch.uint8).numpy()).cast("B")

    def read_into(self, name: str, start: int, stop: int, buf: memoryview) -> memoryview:
        raise NotImplementedError("an adapter supplies τ, not stored bytes")  # stored_bytes: read_delta instead

    def _bound(self) -> Checkpoint:
        if self._base is None:
            raise InputError("a LoRA adapter is read only together with its base", file=str(self.path),
                             hint="pass the base model first, then the adapter as an agent")
        return self._base


def _read_own(ckpt: LoraAdapter, info: TensorInfo, start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
    """Stored elements of one adapter tensor (safetensors by preadv, .bin from its mapped state dict)."""
    n = stop - start
    dst = out[:n]
    if n == 0:
        return dst
    if getattr(ckpt, "_bin_format", False):
        return dst.copy_(ckpt._bin[info.file][info.name].reshape(-1)[start:stop])
    size = info.dtype.itemsize
    view = ckpt.pread(info.file, info.offset + start * size, ckpt.scratch(n * size), info.name)
    return dst.copy_(torch.frombuffer(view, dtype=info.dtype.torch, count=n))


def _is_conv1d(config: dict[str, Any], name: str, mod: LoraModule, info: TensorInfo) -> bool | None:
    """Whether the base layer ``name`` is a Conv1D (W stored [in, out]) rather than an nn.Linear, as PEFT tells
    them apart (by class): from the config's transformers model types (the model's and its sub-models'), else
    from the shapes; None when neither can say (no model type, or custom code, and a square W)."""
    types = [c.get("model_type") for c in (config, *(v for v in config.values() if isinstance(v, dict)))]
    if isinstance(config.get("model_type"), str) and not config.get("auto_map"):
        layer = name.removesuffix(".weight").rsplit(".", 1)[-1]
        return any(layer in CONV1D_LAYERS.get(t, ()) for t in types if isinstance(t, str))
    rows, cols = mod.b.shape[0], mod.a.shape[1]
    if rows == cols:
        return None
    return tuple(info.shape) == (cols, rows)


def _rank_alpha(cfg: dict[str, Any], module: str) -> tuple[int, float]:
    """r and α of one module, as PEFT 0.21's ``get_pattern_key`` picks them from rank_pattern / alpha_pattern."""
    def pick(pattern: Any, default: Any) -> Any:
        for key in (pattern or {}):
            if re.match(rf"(.*\.)?({key})$", module):
                return pattern[key]
        return default

    rank = pick(cfg.get("rank_pattern"), cfg.get("r"))
    return int(rank), float(pick(cfg.get("alpha_pattern"), cfg.get("lora_alpha")))


def _config_problems(cfg: dict[str, Any], path: Path) -> list[RLMergeError]:
    """Every option of adapter_config.json that rules out an exact τ = s·B·A, all at once."""
    where = str(path)
    out: list[RLMergeError] = []

    def refuse(message: str, hint: str = MERGE_INSTEAD) -> None:
        out.append(InputError(message, file=where, hint=hint))

    if cfg.get("peft_type", "LORA") != "LORA":
        refuse(f"peft_type {cfg.get('peft_type')!r}: rlmerge reads LoRA adapters only")
    if cfg.get("use_dora"):
        refuse("DoRA adapter (use_dora: true): its τ rescales W + B·A by column norms, not a LoRA product")
    if not _is_rank(cfg.get("r")):
        refuse(f"r = {cfg.get('r')!r} is not a positive rank", "fix r in adapter_config.json")
    alpha = cfg.get("lora_alpha")
    if alpha == 0 and not isinstance(alpha, bool):
        refuse("lora_alpha = 0: the placeholder some converters write (verl's model_merger without "
               "lora_train_meta.json), and with it τ would be 0",
               "set lora_alpha (and alpha_pattern) in adapter_config.json to the values used in training")
    elif not _is_alpha(alpha):
        refuse(f"lora_alpha = {alpha!r} is not a non-zero number", "fix lora_alpha in adapter_config.json")
    out += _pattern_problems(cfg, "rank_pattern", _is_rank, "a positive whole rank", where)
    out += _pattern_problems(cfg, "alpha_pattern", _is_alpha, "a non-zero number (0 would make τ = 0)", where)
    init = str(cfg.get("init_lora_weights", True)).lower()
    if init.startswith(REWRITE_BASE):
        refuse(f"init_lora_weights {cfg.get('init_lora_weights')!r} rewrote the base weights at initialisation: "
               "B·A is not a task vector from the original base",
               "convert it with PEFT (save_pretrained(..., path_initial_model_for_weight_conversion=INIT)), or "
               + MERGE_INSTEAD)
    if cfg.get("lora_bias"):
        refuse("lora_bias: true (a bias on lora_B) is not read")
    for key, value in cfg.items():
        if key not in HARMLESS and key not in ("use_dora", "lora_bias") and value not in (None, False, {}, [], ""):
            refuse(f"adapter_config.json sets {key} = {value!r}, which rlmerge does not know to leave τ = s·B·A")
    return out


def _is_rank(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _is_alpha(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v != 0


def _pattern_problems(cfg: dict[str, Any], key: str, ok: Any, what: str, where: str) -> list[RLMergeError]:
    """rank_pattern / alpha_pattern: a mapping of regular expressions (as PEFT matches them) to values ``ok``
    accepts; every bad entry, each named."""
    pattern = cfg.get(key)
    fix = f"fix {key} in adapter_config.json (module name pattern → value), or " + MERGE_INSTEAD
    if pattern is None:
        return []
    if not isinstance(pattern, dict):
        return [InputError(f"{key} is a {type(pattern).__name__}, not a mapping of module patterns to values",
                           file=where, hint=fix)]
    out: list[RLMergeError] = []
    for k, v in pattern.items():
        try:
            re.compile(rf"(.*\.)?({k})$")
        except re.error as e:
            out.append(InputError(f"{key} key {k!r} is not a regular expression ({e})", file=where, hint=fix))
        if not ok(v):
            out.append(InputError(f"{key}[{k!r}] = {v!r} is not {what}", file=where, hint=fix))
    return out


def bind_to_base(base: Checkpoint, agents: list[Checkpoint]) -> list[RLMergeError]:
    """Bind every LoRA agent to the base (its tensors are the base's); a LoRA adapter cannot be the base."""
    if isinstance(base, LoraAdapter):
        raise InputError("the base is a LoRA adapter", file=str(base.path),
                         hint="pass the base model first and the adapter after it, as an agent")
    return [p for a in agents if isinstance(a, LoraAdapter) for p in a.bind(base)]
