"""``--output-format peft``: the merged task vector written as a PEFT LoRA adapter of the base, tensor by tensor.

``AdapterWriter`` takes what ``io.writer.CheckpointWriter`` takes (the engine cannot tell them apart) and receives
every merged tensor in float32 (preflight widens the merged jobs to it), one block at a time:

- a linear layer's weight (a 2-D ``…weight`` that is not an embedding or lm_head) is gathered, one matrix at a
  time, and its task vector Δ = merged − base is factored: with the Gram matrix G = ΔᵀΔ (or ΔΔᵀ, the smaller, in
  float64) and its eigenvectors V (σᵢ² its eigenvalues), A = V_kᵀ and B = ΔV_k, so B·A = ΔV_kV_kᵀ, Δ's best
  rank-k approximation (Eckart–Young), whose error ‖Δ − BA‖_F is the SVD tail √(Σ_{i>k} σᵢ²); k is the rank
  asked (``--rank R|full|energy=F``: the smallest k keeping the fraction F of Σσ²). The module gets
  ``lora_alpha = r = k`` (scale 1; rank_pattern / alpha_pattern where ranks differ); Δ = 0: no module;
- any other tensor the merge changed (norms, embeddings, lm_head, biases) is streamed into the file as it comes,
  in the output dtype, and saved whole (``modules_to_save``; a bias of a LoRA module as its ``base_layer.bias``
  with ``bias: lora_only``), as PEFT saves them, or refused (``--non-linear refuse``); an unchanged one is taken
  back out of the file. A tied embedding is saved under lm_head too, with ``ensure_weight_tying``.

Memory: one matrix and its Gram matrix beside the merge's blocks (the 0.5B shape's largest: 4,864 × 896).
The factors are float32; at full rank, PEFT's ``merge_and_unload`` gives the merge back within float32 rounding.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .._torch import torch
from ..errors import ConfigError, InputError, RLMergeError, raise_all
from ..io.adapter import ADAPTER_CONFIG, AdapterFile, header_room
from ..io.checkpoint import Checkpoint
from ..io.dtypes import F32, DType
from ..io.memory import Immediate
from ..io.partial import PartialDir
from ..io.vocab import VOCAB_SUFFIXES
from ..io.writer import SideFiles
from ..stream.match import Job
from .budget import TORCH_LOADED, MemoryEstimate

PREFIX = "base_model.model."
NON_LINEAR = ("save", "refuse")


@dataclass(frozen=True)
class Ranks:
    """``--rank``: a fixed rank, ``full``, or ``energy=F`` (the smallest rank keeping the fraction F of ‖Δ‖²)."""

    kind: str  # "rank", "full" or "energy"
    value: float = 0.0

    @classmethod
    def parse(cls, text: Any) -> Ranks:
        s = str(text).strip().lower()
        if s == "full":
            return cls("full")
        if s.startswith("energy="):
            try:
                f = float(s.removeprefix("energy="))
            except ValueError:
                f = -1.0
            if 0 < f <= 1:
                return cls("energy", f)
        elif s.isdigit() and int(s) >= 1:
            return cls("rank", int(s))
        raise ConfigError(f"--rank {text!r}", hint="a rank (e.g. 16), full, or energy=0.99 (the share of ‖Δ‖² kept)")

    def __str__(self) -> str:
        return {"full": "full", "rank": f"{int(self.value)}", "energy": f"energy={self.value:g}"}[self.kind]

    def at_most(self, d: int) -> int:
        """The most a matrix of full rank ``d`` keeps, known before it is read: R (at most ``d``), else ``d``."""
        return min(int(self.value), d) if self.kind == "rank" else d

    def keep(self, sq: np.ndarray) -> int:
        """Rank to keep of a matrix whose squared singular values are ``sq`` (descending)."""
        if self.kind != "energy":
            return self.at_most(len(sq))
        total = float(sq.sum())
        share = np.cumsum(sq) / total if total > 0 else np.ones(len(sq))
        return min(len(sq), int(np.searchsorted(share, self.value * (1 - 1e-12))) + 1)


def role(job: Job) -> str:
    """How a merged tensor goes into the adapter: "lora" (a linear layer's weight) or "save" (whole, if changed)."""
    name = job.name
    if len(job.shape) == 2 and name.endswith(".weight") and not name.endswith(VOCAB_SUFFIXES):
        return "lora"
    return "save"


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    """torch on one thread while a matrix is factored. Its OpenMP threads spin between calls and fight the numba
    compute threads (and anything else on the machine) for the cores: measured on 2 loaded cores, a 4,864 × 896
    factorization took 0.25–0.36 s on one thread and 0.36–1.16 s on two, and the 0.5B rank-16 adapter 36 s with
    OMP_NUM_THREADS=1 against 103 s without."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@dataclass
class Factored:
    """One linear layer's factors: kept rank, the matrix's full rank, ‖Δ‖_F and the relative error (SVD tail)."""

    rank: int
    of: int
    norm: float
    error: float


@dataclass
class AdapterWriter(Immediate, SideFiles):
    """Writes the adapter into a claimed ``PartialDir`` (the module docstring); ``summary()`` is the report."""

    partial: PartialDir
    jobs: Sequence[Job]
    base: Checkpoint
    ranks: Ranks
    out_dtypes: Mapping[str, DType]  # the dtype each merged tensor would be written in (whole tensors use it)
    non_linear: str = "save"
    tied: Sequence[str] = ()  # embeddings that are also lm_head
    base_name: str = ""  # base_model_name_or_path
    revision: str | None = None
    fan_in_fan_out: bool = False  # GPT-2's Conv1D stores [in, out]
    fsync: bool = True
    fingerprint: str = ""
    matrices: dict[str, Factored] = field(default_factory=dict)
    saved: dict[str, str] = field(default_factory=dict)  # tensor → key in the file
    notes: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        cands: list[tuple[str, DType, tuple[int, ...]]] = []
        for j in self.jobs:
            if j.kind != "merge":
                continue
            if role(j) == "lora":
                out, inp = (j.shape[1], j.shape[0]) if self.fan_in_fan_out else j.shape
                k = min(out, inp)
                cands += [(self._key(j.name, "lora_A"), F32, (k, inp)), (self._key(j.name, "lora_B"), F32, (out, k))]
            else:
                dt = self.out_dtypes[j.name]
                cands += [(PREFIX + j.name, dt, j.shape), (PREFIX + j.name.replace(".bias", ".base_layer.bias"), dt,
                                                            j.shape)]
                if j.name.endswith(".bias"):  # a bias alone: its module's weight saved beside it
                    w = j.name[:-len("bias")] + "weight"
                    if w in self.base.tensors:
                        cands.append((PREFIX + w, self.out_dtypes.get(w, self.base.tensors[w].dtype),
                                      self.base.tensors[w].shape))
        cands += [(PREFIX + "lm_head.weight", self.out_dtypes[t], self.base.tensors[t].shape) for t in self.tied]
        self._file = AdapterFile(self.partial, header_room(cands), fsync=self.fsync)
        self._job: Job | None = None
        self._buf: np.ndarray | None = None
        self._pos = 0
        self._changed = False
        self._pending_bias: list[str] = []

    @staticmethod
    def _key(name: str, part: str) -> str:
        return f"{PREFIX}{name.removesuffix('.weight')}.{part}.weight"

    # -- the writer's interface --------------------------------------------------------------------------------
    def __enter__(self) -> AdapterWriter:
        self.partial.start(self.fingerprint, [])
        self._file.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._file.__exit__(*exc)

    def start(self, job: Job) -> None:
        self._end_tensor()
        self._job, self._pos, self._changed = job, 0, False
        if job.kind != "merge":
            return
        if job.out_dtype != F32:
            raise RuntimeError(f"{job.name}: the adapter needs the merged values in float32")
        if role(job) == "lora":
            self._buf = np.empty(job.numel, dtype=np.float32)
        else:
            self._file.begin(PREFIX + job.name, self.out_dtypes[job.name], job.shape)

    def write_now(self, data: memoryview) -> None:
        job = self._job
        assert job is not None
        if job.kind != "merge":
            return
        merged = np.frombuffer(data, dtype=np.float32)
        lo, hi = self._pos, self._pos + merged.size
        if self._buf is not None:
            self._buf[lo:hi] = merged
        else:
            base = self.base.read_f32(job.name, lo, hi, torch.empty(hi - lo, dtype=torch.float32))
            values = torch.from_numpy(merged.copy())
            self._changed = self._changed or not torch.equal(values, base)
            out = values.to(self.out_dtypes[job.name].torch)
            self._file.write(memoryview(out.view(torch.uint8).numpy()))
        self._pos = hi

    # -- each tensor, once complete ----------------------------------------------------------------------------
    def _end_tensor(self) -> None:
        job, self._job = self._job, None
        if job is None or job.kind != "merge":
            return
        if self._buf is not None:
            buf, self._buf = self._buf, None
            self._factor(job, buf)
            return
        if not self._changed:
            self._file.end(keep=False)
            return
        if self.non_linear == "refuse":
            raise ConfigError(f"the merge changed {job.name}, which a LoRA adapter cannot hold (--non-linear "
                              "refuse)", tensor=job.name, hint="--non-linear save puts it in modules_to_save (PEFT "
                                                               "loads it; vLLM takes modules_to_save only for "
                                                               "embed_tokens and lm_head)")
        if len(job.shape) > 2 or not job.name.endswith((".weight", ".bias")):
            raise InputError(f"the merge changed {job.name} ({list(job.shape)}), which a PEFT adapter cannot save",
                             tensor=job.name, hint="write a full model (--output-format hf)")
        self._file.end(keep=True)
        self.saved[job.name] = PREFIX + job.name
        if job.name.endswith(".bias"):
            self._pending_bias.append(job.name)

    def _factor(self, job: Job, buf: np.ndarray) -> None:
        """Δ's best rank-k factors from its Gram matrix (module docstring), written A then B."""
        with _one_torch_thread():
            self._factor_now(job, buf)

    def _factor_now(self, job: Job, buf: np.ndarray) -> None:
        base = self.base.read_f32(job.name, 0, job.numel, torch.empty(job.numel, dtype=torch.float32))
        delta = (torch.from_numpy(buf) - base).view(job.shape).double()
        if self.fan_in_fan_out:
            delta = delta.t()
        if not bool(delta.any()):
            return  # unchanged: no module
        out, inp = delta.shape
        tall = inp <= out
        lam, vec = torch.linalg.eigh(delta.t() @ delta if tall else delta @ delta.t())
        sq = lam.flip(0).clamp(min=0).numpy()  # σᵢ², descending
        vec = vec.flip(1)
        k = self.ranks.keep(sq)
        if tall:  # A = V_kᵀ, B = Δ V_k
            a, b = vec[:, :k].t(), delta @ vec[:, :k]
        else:  # B = U_k, A = U_kᵀ Δ
            a, b = vec[:, :k].t() @ delta, vec[:, :k]
        total = float(sq.sum())
        self.matrices[job.name] = Factored(k, len(sq), math.sqrt(total),
                                           math.sqrt(float(sq[k:].sum()) / total) if total > 0 else 0.0)
        for key, t in ((self._key(job.name, "lora_A"), a), (self._key(job.name, "lora_B"), b)):
            t32 = t.float().contiguous()
            self._file.begin(key, F32, tuple(t32.shape))
            self._file.write(memoryview(t32.view(torch.uint8).numpy()))
            self._file.end()

    # -- the end ---------------------------------------------------------------------------------------------
    def _modules(self) -> list[str]:
        return [n.removesuffix(".weight") for n in self.matrices]

    def complete(self) -> None:
        """Every tensor written: biases placed (a LoRA module's as its base_layer.bias, another's module saved
        whole), a tied embedding also saved as lm_head, the header written."""
        self._end_tensor()
        targets = set(self._modules())
        for name in self._pending_bias:
            module = name.removesuffix(".bias")
            if module in targets:
                self._file.entries[PREFIX + module + ".base_layer.bias"] = self._file.entries.pop(PREFIX + name)
                self.saved[name] = PREFIX + module + ".base_layer.bias"
            elif module + ".weight" in self.base.tensors and module + ".weight" not in self.saved:
                self._save_base(module + ".weight")
        for t in self.tied:
            if t in self.saved:
                self._file.again(PREFIX + "lm_head.weight", self.saved[t])
        self.bytes = self._file.close()

    def _save_base(self, name: str) -> None:
        """The base's own ``name``, saved whole (the weight of a module whose bias alone changed)."""
        info = self.base.tensors[name]
        dt = self.out_dtypes.get(name, info.dtype)
        self._file.begin(PREFIX + name, dt, info.shape)
        step = 1 << 22
        for lo in range(0, info.numel, step):
            hi = min(info.numel, lo + step)
            vals = self.base.read_f32(name, lo, hi, torch.empty(hi - lo, dtype=torch.float32)).to(dt.torch)
            self._file.write(memoryview(vals.view(torch.uint8).numpy()))
        self._file.end()
        self.saved[name] = PREFIX + name

    def config(self) -> dict[str, Any]:
        """adapter_config.json: what PEFT (and vLLM) read."""
        ranks = {m: self.matrices[m + ".weight"].rank for m in self._modules()}
        r = max(set(ranks.values()), key=list(ranks.values()).count) if ranks else 1
        pattern = {m: k for m, k in ranks.items() if k != r}
        tied_head = PREFIX + "lm_head.weight" if any(t in self.saved for t in self.tied) else None
        whole = [k.removeprefix(PREFIX) for k in self._file.entries if ".lora_" not in k
                 and not k.endswith(".base_layer.bias") and k != tied_head]  # PEFT lists a tied head's embedding
        modules = sorted({n.rsplit(".", 1)[0] for n in whole})
        return {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": self.base_name,
            "revision": self.revision, "r": r, "lora_alpha": r, "rank_pattern": pattern, "alpha_pattern": pattern,
            "target_modules": sorted(ranks), "modules_to_save": modules or None,
            "bias": "lora_only" if any(k.endswith(".base_layer.bias") for k in self._file.entries) else "none",
            "fan_in_fan_out": self.fan_in_fan_out, "use_rslora": False, "use_dora": False,
            "init_lora_weights": True, "lora_dropout": 0.0, "inference_mode": True,
            "ensure_weight_tying": any(t in self.saved for t in self.tied),
        }

    def summary(self) -> dict[str, Any]:
        """What rlmerge.json and the card say: the rank asked, each matrix's kept rank and relative error."""
        errors = [f.error for f in self.matrices.values()]
        return {"rank": str(self.ranks), "non_linear": self.non_linear,
                "matrices": {n: {"rank": f.rank, "of": f.of, "relative_error": f.error, "norm": f.norm}
                             for n, f in self.matrices.items()},
                "modules_to_save": self.config()["modules_to_save"] or [],
                "saved_tensors": sorted(self.saved), "max_relative_error": max(errors, default=0.0),
                "parameters": sum(f.rank * sum(self.base.tensors[n].shape) for n, f in self.matrices.items())}

    def finish(self, manifest: dict[str, Any]) -> Path:
        self.write_text(ADAPTER_CONFIG, json.dumps(self.config(), indent=2) + "\n")
        return self.partial.publish({**manifest, "adapter": self.summary()})


@dataclass(frozen=True)
class AdapterOptions:
    """``--output-format peft``'s choices, checked by ``parse``."""

    ranks: Ranks
    non_linear: str = "save"

    @classmethod
    def parse(cls, rank: Any = "full", non_linear: str = "save") -> AdapterOptions:
        """Both options checked, both problems said at once."""
        problems: list[RLMergeError] = []
        ranks = None
        try:
            ranks = Ranks.parse(rank)
        except RLMergeError as e:
            problems.append(e)
        if non_linear not in NON_LINEAR:
            problems.append(ConfigError(f"--non-linear {non_linear!r}", hint="save (into modules_to_save) or refuse"))
        raise_all(problems)
        assert ranks is not None
        return cls(ranks, non_linear)


def _lora_shapes(match: Any) -> list[tuple[int, int]]:
    """(rows, columns) of every linear layer's weight the adapter factors."""
    return [(j.shape[0], j.shape[1]) for j in match.merge_jobs if role(j) == "lora"]


def adapter_write_bytes(match: Any, ranks: Ranks, out_dtypes: Mapping[str, DType]) -> int:
    """At most the tensor bytes the adapter holds, from headers (``rlmerge plan``): each linear layer's factors in
    float32, ``A`` (k × n) and ``B`` (m × k), k its kept rank (exact for ``--rank R`` where every matrix changed;
    an energy share keeps at most the full rank), and every other merged tensor whole in its output dtype (only
    those the merge changes are saved), a tied embedding twice (also as lm_head, ``AdapterWriter.complete``)."""
    lora = sum(4 * (m + n) * ranks.at_most(min(m, n)) for m, n in _lora_shapes(match))
    saved = sum(j.numel * out_dtypes[j.name].itemsize * (2 if j.name in match.tied else 1)
                for j in match.merge_jobs if role(j) == "save")
    return lora + saved


def adapter_memory(match: Any, ranks: Ranks) -> int:
    """Bytes the adapter writer adds to the merge's peak (``_factor_now``, one matrix of e = m·n elements at a
    time): the gathered float32 values, the base's, their difference and its float64 copy (20·e); the Gram matrix
    and its eigenvectors in float64 (16·d², d = min(m, n)); the factor B = ΔV_k in float64 and float32 (12·k·max(m,
    n)). With torch's own share where the merge's path does not load it (``with_adapter``): for the 0.5B shape
    (largest matrix 4,864 × 896) + 0.28 GiB at rank 16 and + 0.33 GiB at full rank, where docs/shipping.md measured
    the merge's peak + 0.27 and + 0.32 GiB."""
    return max((20 * m * n + 16 * min(m, n) ** 2 + 12 * ranks.at_most(min(m, n)) * max(m, n)
                for m, n in _lora_shapes(match)), default=0)


def with_adapter(memory: MemoryEstimate, match: Any, ranks: Ranks) -> MemoryEstimate:
    """The merge's estimate (``route``) with the adapter writer's share on top: its matrices (``adapter_memory``)
    and torch, which the factorization needs, where the merge's path runs without it (the numba path over
    inputs viewed in place)."""
    torch_too = 0 if memory.torch else TORCH_LOADED
    return dataclasses.replace(memory, work=memory.work + adapter_memory(match, ranks),
                               baseline=memory.baseline + torch_too, torch=True)


def widen_to_f32(match: Any) -> tuple[dict[str, DType], list[Any]]:
    """The merged jobs written in float32 for the adapter writer (Δ = merged − base exactly): (the dtype each would
    have been written in, the problems that rule out an adapter of the base)."""
    problems: list[Any] = []
    head = match.base.tensors.get("lm_head.weight")
    if match.untied_output and head is not None and head.name != "lm_head.weight":  # the base ties, the output not
        problems.append(ConfigError("the merge unties lm_head from the embeddings (an agent trained its own head), "
                                    "which an adapter of the tied base cannot express",
                                    hint="write a full model (--output-format hf)"))
    plan = match.tokenizer
    if plan is not None and plan.vocab_size is not None:
        problems.append(ConfigError(f"tokenizer_source {plan.source} gives the output {plan.vocab_size} vocabulary "
                                    "rows, and an adapter's base keeps its own",
                                    hint="write a full model (--output-format hf), or keep the base's vocabulary"))
    out = {j.name: j.out_dtype for j in match.jobs}
    match.jobs = [dataclasses.replace(j, out_dtype=F32) if j.kind == "merge" else j for j in match.jobs]
    return out, problems


def adapter_writer(partial: PartialDir, match: Any, opts: AdapterOptions, out_dtypes: Mapping[str, DType], *,
                   fingerprint: str, fsync: bool) -> AdapterWriter:
    base = match.base
    return AdapterWriter(partial, match.jobs, base, opts.ranks, out_dtypes, non_linear=opts.non_linear,
                         tied=list(match.tied), base_name=base.hub_id or str(base.path.resolve()),
                         revision=base.revision, fan_in_fan_out=base.config.get("model_type") == "gpt2",
                         fsync=fsync, fingerprint=fingerprint)
