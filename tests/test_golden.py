"""The golden matrix (issue 18, "What must not change"): the SHA-256 of every file every merge writes today.

Every method and preset × output dtype {bfloat16, float32} × {one block, blocks of 777} × {fused path, torch path
(RLMERGE_FAST=0)}, on two small fixtures (a bf16 base with a tied embedding, sharded inputs, a non-float tensor and
the fast-path tests' edge values; an untied float32 base), plus sharded-output and allow-missing cases. The hashes
are in ``golden/outputs.json``; this test recomputes them all and must pass unchanged through any refactor.

The fixtures are built here from fixed integers: a splitmix64 stream, float64 additions and multiplications only
(no library RNG, no log/cos whose last bit may depend on the CPU), and a hand-written safetensors writer, so the
input bytes do not depend on numpy's, torch's or safetensors' versions. Inputs are passed as paths relative to the
fixture root (the labels in the model card and report are then the same on every machine); ``rlmerge.json`` also
stores each input's resolved absolute path, which is replaced by ``<root>`` before hashing.

Measured on the machine that recorded them (2026-12-04, x86-64 with AVX-512): the same JSON from fresh processes,
with 1 or 3 kernel threads (RLMERGE_THREADS), 1 or 2 torch threads, torch's CPU dispatch at AVX512, AVX2 or DEFAULT,
and numba compiling for haswell. Numba compiling for ``generic`` x86-64 (SSE2) changes the last digits of the fused
path's report sums (its float32 tile sums are compiled with ``reassoc``, so their order follows the vector width),
and an AMD EPYC with AVX2 (2026-12-07) changed them on both paths; nothing else. So rlmerge-report.json is hashed
with its norms and cosines rounded (``canonical_report``, which also checks that no such value lies near a
rounding boundary), and tests/conftest.py has numba compile for haswell on every x86-64 machine with AVX2.

After a change that is MEANT to change output bytes, regenerate (and say why in the commit):

    NUMBA_CPU_NAME=haswell .venv/bin/python tests/test_golden.py   # rewrites tests/golden/outputs.json
    (haswell: the target the recorded fused-path reports were compiled for; a CPU's own target may differ there)
    .venv/bin/python tests/test_golden.py OTHER.json  # writes elsewhere (e.g. to compare two runs)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

GOLDEN = Path(__file__).parent / "golden" / "outputs.json"
ONE_BLOCK = 1 << 20  # elements: more than the largest tensor (66,560), every tensor is one block
MANY_BLOCKS = 777  # odd: splits tiles, rows, threads' pieces and the DARE chunks unevenly
EPS = np.float32(1e-5)  # the methods' default ε


# -- numbers: integer arithmetic and correctly rounded float64 operations only ---------------------------------
_M64 = (1 << 64) - 1


def _uniform(seed: int, n: int) -> np.ndarray:
    """``n`` float64 in [0, 1): splitmix64 of (seed, 1 … n)."""
    z = np.arange(1, n + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(
        (seed * 0xD1B54A32D192ED03) & _M64)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53


def _normal(seed: int, n: int, std: float) -> np.ndarray:
    """Roughly N(0, std²) float32: the sum of four uniforms, centred and scaled (Irwin–Hall)."""
    u = _uniform(seed, 4 * n).reshape(4, n)
    return (((u[0] + u[1]) + (u[2] + u[3]) - 2.0) * (std * 1.7320508075688772)).astype(np.float32)


def _to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 → bfloat16 bits (uint16), rounded to nearest, ties to even (finite values only)."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + np.uint64(0x7FFF) + ((u >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)).astype(np.uint16)


def _from_bf16(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def _stored(x: np.ndarray, dtype: str) -> np.ndarray:
    """What a float32 array becomes once stored in ``dtype`` (BF16 or F32), as float32."""
    return _from_bf16(_to_bf16(x)) if dtype == "BF16" else np.asarray(x, dtype=np.float32)


# -- the fixtures ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Model:
    """One fixture family: a base, three agents, one Fisher folder per agent."""

    name: str
    arch: str  # "qwen2" (q/k/v biases) or "llama"
    dtype: str  # safetensors code of every stored float tensor: BF16 or F32
    vocab: int
    tie: bool
    hidden: int = 32
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 64
    layers: int = 2


BF16_TIED = Model("bf16-tied", "qwen2", "BF16", vocab=2080, tie=True)  # embedding: 66,560 > one DARE chunk
F32_UNTIED = Model("f32-untied", "llama", "F32", vocab=96, tie=False)
MODELS = {m.name: m for m in (BF16_TIED, F32_UNTIED)}
AGENTS = ("coder", "tool-use", "memory")
DENSITIES = (0.032, 0.462, 0.543)  # the paper's measured agent densities
EDGE = "model.edge_values.weight"
POSITIONS = "model.rotary_emb.position_ids"  # an int64 buffer: copied from the base, never merged
DROPPED = "v_head.summary.weight"  # a value head one agent stores and the base lacks: dropped, reported
MISSING = "model.layers.1.mlp.down_proj.weight"  # absent from the memory-missing agent (allow_missing cases)


def _shapes(m: Model) -> dict[str, tuple[int, ...]]:
    """HF names and shapes; a copy of synthetic.tensor_shapes on purpose: the golden inputs must not move with src/."""
    h, kv = m.hidden, m.kv_heads * (m.hidden // m.heads)
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (m.vocab, h)}
    for i in range(m.layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = (h, h)
        out[p + "self_attn.k_proj.weight"] = (kv, h)
        out[p + "self_attn.v_proj.weight"] = (kv, h)
        if m.arch == "qwen2":
            out[p + "self_attn.q_proj.bias"] = (h,)
            out[p + "self_attn.k_proj.bias"] = (kv,)
            out[p + "self_attn.v_proj.bias"] = (kv,)
        out[p + "self_attn.o_proj.weight"] = (h, h)
        out[p + "mlp.gate_proj.weight"] = (m.intermediate, h)
        out[p + "mlp.up_proj.weight"] = (m.intermediate, h)
        out[p + "mlp.down_proj.weight"] = (h, m.intermediate)
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
    out["model.norm.weight"] = (h,)
    if not m.tie:
        out["lm_head.weight"] = (m.vocab, h)
    return out


def _edge_vectors() -> list[np.ndarray]:
    """test_fastpath._edge_models' values: base, then three task vectors: ±0 bases, τ at and one ulp around ε,
    cancelling agents, ties when rounding the mean, subnormals, large magnitudes; then 3,000 random fillers."""
    up, down = np.nextafter(EPS, np.float32(1)), np.nextafter(EPS, np.float32(0))
    b = np.array([0.0, -0.0, -0.0, 1.0, 1.0, 1.0, 0.5, -2.0, 1e-40, 3e30, 1.0, 0.25], dtype=np.float32)
    t1 = np.array([0.0, 0.0, 1e-3, EPS, up, down, 0.25, 1e-3, 1e-39, 1e29, 2**-8, -0.25], dtype=np.float32)
    t2 = np.array([0.0, -0.0, -1e-3, -EPS, -up, up, 0.25, 3e-3, 0.0, -1e29, 2**-7, 0.25], dtype=np.float32)
    t3 = np.array([0.0, 0.0, 0.0, 0.0, up, -down, 2**-9, 0.0, 0.0, 0.0, 2**-7 + 2**-8, 0.0], dtype=np.float32)
    out = []
    for i, v in enumerate((b, t1, t2, t3)):
        filler = _normal(900 + i, 3000, 0.02)
        if i:
            filler *= (_uniform(950 + i, 3000) < 0.5).astype(np.float32)
        out.append(np.concatenate([v, filler]))
    return out


def _base(m: Model) -> dict[str, np.ndarray]:
    """Stored float32 values of the base's float tensors: N(0, 0.02) matrices, norms near 1."""
    out = {}
    for k, (name, shape) in enumerate(_shapes(m).items()):
        n = int(np.prod(shape))
        w = _normal(k, n, 0.05) + 1.0 if name.endswith("norm.weight") else _normal(k, n, 0.02)
        out[name] = _stored(w.astype(np.float32).reshape(shape), m.dtype)
    out[EDGE] = _stored(_edge_vectors()[0].reshape(-1, 4), m.dtype)
    return out


def _agent(m: Model, base: dict[str, np.ndarray], t: int) -> dict[str, np.ndarray]:
    """The base with a DENSITIES[t] fraction of elements moved by ~5 % (at least 1e-3), as synthetic.perturb."""
    out = {}
    for k, (name, w) in enumerate(base.items()):
        if name == EDGE:
            b, tau = _edge_vectors()[0], _edge_vectors()[1 + t]
            out[name] = _stored((b + tau).reshape(w.shape), m.dtype)  # τ added to the unrounded base, as the test
            continue
        seed = 1000 * (t + 1) + k
        u = _uniform(seed, 3 * w.size).reshape(3, *w.shape)
        step = np.maximum(np.abs(w.astype(np.float64)) * 0.05, 1e-3) * (0.5 + u[1])
        moved = w + np.where(u[2] < 0.5, -step, step)
        out[name] = _stored(np.where(u[0] < DENSITIES[t], moved, w).astype(np.float32), m.dtype)
    return out


def _encode(arr: np.ndarray, dtype: str) -> tuple[str, bytes]:
    if dtype == "BF16":
        return "BF16", _to_bf16(arr).astype("<u2").tobytes()
    if dtype == "F32":
        return "F32", np.asarray(arr, dtype="<f4").tobytes()
    return "I64", np.asarray(arr, dtype="<i8").tobytes()


def _write_safetensors(path: Path, tensors: list[tuple[str, str, tuple[int, ...], bytes]]) -> None:
    """A safetensors file by hand, tensors in the given order (name, dtype code, shape, raw bytes)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, code, shape, raw in tensors:
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    path.write_bytes(len(body).to_bytes(8, "little") + body + b"".join(t[3] for t in tensors))


def _write_model(folder: Path, tensors: dict[str, tuple[np.ndarray, str]], cfg: dict[str, Any],
                 shards: list[list[str]] | None = None, *, side_files: bool = False) -> None:
    """``tensors``: name → (values, dtype code); ``shards``: names per shard file (None: one model.safetensors)."""
    folder.mkdir(parents=True)
    groups = shards or [list(tensors)]
    assert sorted(n for g in groups for n in g) == sorted(tensors)
    names = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    weight_map, total = {}, 0
    for fname, group in zip(names, groups):
        entries = []
        for name in group:
            values, code = tensors[name]
            code, raw = _encode(values, code)
            entries.append((name, code, values.shape, raw))
            weight_map[name] = fname
            total += len(raw)
        _write_safetensors(folder / fname, entries)
    if len(groups) > 1:
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True) + "\n")
    (folder / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    if side_files:
        (folder / "generation_config.json").write_text('{\n  "bos_token_id": 1,\n  "eos_token_id": 2\n}\n')
        vocab = {f"<{i}>": i for i in range(cfg["vocab_size"])}
        (folder / "tokenizer.json").write_text(json.dumps(
            {"version": "1.0", "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<0>"}}, sort_keys=True))
        (folder / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<1>", "eos_token": "<2>"}, indent=2))
        (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")


def _config(m: Model) -> dict[str, Any]:
    return {"architectures": ["Qwen2ForCausalLM" if m.arch == "qwen2" else "LlamaForCausalLM"],
            "model_type": m.arch, "vocab_size": m.vocab, "hidden_size": m.hidden, "num_hidden_layers": m.layers,
            "num_attention_heads": m.heads, "num_key_value_heads": m.kv_heads,
            "intermediate_size": m.intermediate, "tie_word_embeddings": m.tie, "rms_norm_eps": 1e-6,
            "torch_dtype": "bfloat16" if m.dtype == "BF16" else "float32"}


def _layer_split(names: list[str], cuts: list[str]) -> list[list[str]]:
    """Shards of ``names`` (in order), a new one starting at each name in ``cuts``."""
    out: list[list[str]] = [[]]
    for n in names:
        if n in cuts and out[-1]:
            out.append([])
        out[-1].append(n)
    return out


def build_fixtures(root: Path) -> None:
    """Every input folder under ``root/in``: base, agents, Fisher side inputs, for each Model."""
    for m in MODELS.values():
        where = root / "in" / m.name
        base = _base(m)
        cfg = _config(m)
        typed = {k: (v, m.dtype) for k, v in base.items()}
        if m.tie:  # an int64 buffer, copied from the base, and an interesting input layout
            typed[POSITIONS] = (np.arange(64, dtype=np.int64).reshape(1, 64), "I64")
            order = ["model.embed_tokens.weight", EDGE, POSITIONS, *(k for k in base if k.startswith("model.layers")),
                     "model.norm.weight"]
            typed = {k: typed[k] for k in order}
            shards = _layer_split(order, ["model.layers.0.self_attn.q_proj.weight",
                                          "model.layers.1.self_attn.q_proj.weight"])
            _write_model(where / "base", typed, cfg, shards, side_files=True)
        else:
            _write_model(where / "base", typed, cfg, side_files=True)
        for t, agent in enumerate(AGENTS):
            values = _agent(m, base, t)
            a_typed = {k: (v, m.dtype) for k, v in values.items()}
            shards = None
            if m.tie:
                # the base's buffer: an agent that changed a tensor rlmerge copies is refused (test_refusals.py)
                a_typed[POSITIONS] = (np.arange(64, dtype=np.int64).reshape(1, 64), "I64")
                if agent == "coder":  # sharded differently from the base, tensors in another order
                    names = sorted(a_typed, reverse=True)
                    shards = _layer_split(names, ["model.layers.0.self_attn.v_proj.weight"])
                    a_typed = {k: a_typed[k] for k in names}
                elif agent == "tool-use":  # stores a redundant lm_head while its config ties it: dropped, warned
                    a_typed["lm_head.weight"] = a_typed["model.embed_tokens.weight"]
                else:  # a value head the base lacks: dropped, warned
                    a_typed[DROPPED] = (_normal(77, m.hidden, 0.02).reshape(1, m.hidden), m.dtype)
            _write_model(where / agent, a_typed, cfg, shards)
            if m.tie and agent == "memory":
                _write_model(where / "memory-missing", {k: v for k, v in a_typed.items() if k != MISSING}, cfg)
            fisher = {}
            for k, (name, w) in enumerate(base.items()):
                u = _uniform(5000 * (t + 1) + k, w.size).reshape(w.shape)
                fisher[name] = ((u * u) * (u * u)).astype(np.float32), "BF16" if t == 2 else "F32"
            _write_model(where / "fisher" / agent, fisher, {})


def fixture_digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((root / "in").rglob("*")) if p.is_file()}


# -- the matrix --------------------------------------------------------------------------------------------------
FISHER = "<fisher>"  # replaced by the fixture's Fisher folders, in agent order
# Σ w is 1.8999999762 summed in float32, 1.9000000954 accumulated in float64 and rounded: pins which one is used
W3 = [0.3, 1.0, 0.6]


@dataclass(frozen=True)
class Variant:
    label: str
    method: str
    params: dict[str, Any] = field(default_factory=dict)
    agents: tuple[str, ...] = AGENTS
    seed: int = 0
    count_tied_twice: bool = False


VARIANTS = [
    Variant("ram", "ram"),
    Variant("ram+paper", "ram+", {"preset": "paper"}),
    Variant("ram+paper-soft", "ram+", {"preset": "paper-soft", "r": 0.3}),
    Variant("ram+official", "ram+", {"preset": "official"}),
    Variant("ram+official-R1.5", "ram+", {"preset": "official", "rescale_factor": 1.5, "epsilon": 1e-4}),
    Variant("ram+tensor-local", "ram+", {"preset": "tensor-local", "r": 0.25, "alpha": 0.5}),
    Variant("ram+paper-tied-twice", "ram+", {"preset": "paper", "r": 0.2, "alpha": 1.5}, count_tied_twice=True),
    Variant("ram+arm-r", "ram+", {"preset": "arm-r", "rescale_factor": 1.4}),
    Variant("ram+magnitude", "ram+", {"preset": "magnitude", "r": 0.15, "alpha": 3.0}),
    Variant("ram+sign-elect", "ram+", {"preset": "sign-elect", "r": 0.2, "alpha": 1.5}),
    Variant("arm-ties", "arm-ties", {"mask_rate": 0.8}),
    Variant("unique", "unique", {"agent": 1, "divide_by_n": True, "epsilon": 1e-4}),
    Variant("task_arithmetic", "task_arithmetic", {"scaling": 0.3, "weights": W3, "normalize": True}),
    Variant("linear", "linear"),
    Variant("linear-weights", "linear", {"weights": W3}),
    Variant("ties", "ties"),
    Variant("ties_global", "ties_global", {"density": 0.3, "weights": W3, "scaling": 0.7}),
    Variant("breadcrumbs", "breadcrumbs"),
    Variant("breadcrumbs_ties", "breadcrumbs_ties", {"density": 0.5, "gamma": 0.05, "weights": [1.0, 0.5, 0.25]}),
    Variant("dare_ta", "dare_ta"),
    Variant("dare_ta-l1", "dare_ta", {"density": 0.5, "rescale": "l1", "weights": W3, "scaling": 0.7,
                                      "normalize": True}, seed=2),
    Variant("dare_ties", "dare_ties", {"p": 0.4, "rescale": "none"}, seed=1),
    Variant("dare_ties-l1", "dare_ties", {"density": [0.2, 0.5, 0.9], "rescale": "l1"}, seed=3),
    Variant("della", "della"),
    Variant("della-l1", "della", {"density": [0.3, 0.5, 0.6], "epsilon": [0.1, 0.25, 0.05], "rescale": "l1",
                                  "weights": W3, "scaling": 0.7}, seed=4),
    Variant("della_linear", "della_linear"),
    Variant("della_linear-l1", "della_linear", {"density": 0.4, "epsilon": 0.3, "rescale": "l1", "weights": W3,
                                             "normalize": True}, seed=5),
    Variant("slerp", "slerp", {"t": 0.3}, agents=("tool-use",)),
    Variant("slerp-task_vectors", "slerp", {"t": 0.6, "space": "task_vectors"}, agents=("tool-use", "memory")),
    Variant("model_stock", "model_stock"),
    Variant("model_stock-filter_wise", "model_stock", {"filter_wise": True}),
    Variant("fisher", "fisher", {"fisher": FISHER}),
    Variant("fisher-normalize", "fisher", {"fisher": FISHER, "weights": [1.0, 0.6, 1.3], "normalize": True}),
]
BY_LABEL = {v.label: v for v in VARIANTS}
SHARDED_OUT = ["ram+paper", "task_arithmetic", "ties", "dare_ties-l1", "della-l1", "model_stock", "fisher-normalize"]
WITH_MISSING = ["ram+paper", "ties", "dare_ties-l1", "della"]


@dataclass(frozen=True)
class Case:
    model: str
    variant: Variant
    dtype: str  # output dtype
    block: int
    fast: bool
    shard_size: str | None = None  # None: the default (one shard here)
    missing: bool = False  # the memory agent lacks MISSING; allow_missing=True

    @property
    def id(self) -> str:
        group = self.model + ("+shards-20KB" if self.shard_size else "") + ("+allow-missing" if self.missing else "")
        blocks = "one-block" if self.block == ONE_BLOCK else f"blocks-{self.block}"
        return "/".join((group, self.variant.label, self.dtype, blocks, "fast" if self.fast else "torch"))


def cases() -> list[Case]:
    out = []
    for model in MODELS:
        for v in VARIANTS:
            for dtype in ("bfloat16", "float32"):
                for block in (ONE_BLOCK, MANY_BLOCKS):
                    out += [Case(model, v, dtype, block, fast) for fast in (True, False)]
    for label in SHARDED_OUT:
        for dtype in ("bfloat16", "float32"):
            out += [Case(BF16_TIED.name, BY_LABEL[label], dtype, MANY_BLOCKS, fast, shard_size="20KB")
                    for fast in (True, False)]
    for label in WITH_MISSING:
        out += [Case(BF16_TIED.name, BY_LABEL[label], "bfloat16", MANY_BLOCKS, fast, missing=True)
                for fast in (True, False)]
    return out


@contextlib.contextmanager
def _setting(root: Path, fast: bool) -> Iterator[None]:
    """cwd = the fixture root (inputs are passed as relative paths); RLMERGE_FAST as asked; both restored."""
    cwd, old = Path.cwd(), os.environ.get("RLMERGE_FAST")
    os.chdir(root)
    os.environ["RLMERGE_FAST"] = "1" if fast else "0"
    try:
        yield
    finally:
        os.chdir(cwd)
        if old is None:
            del os.environ["RLMERGE_FAST"]
        else:
            os.environ["RLMERGE_FAST"] = old


def run_case(case: Case, root: Path) -> dict[str, str]:
    """Merge one case under ``root`` (built by build_fixtures); file name → SHA-256 of every file it wrote."""
    import rlmerge

    src = Path("in") / case.model
    agents = [src / ("memory-missing" if case.missing and a == "memory" else a) for a in case.variant.agents]
    params = dict(case.variant.params)
    if params.get("fisher") == FISHER:
        params["fisher"] = [str(src / "fisher" / a) for a in case.variant.agents]
    out = Path("out") / re.sub(r"[^A-Za-z0-9.+-]", "_", case.id)
    kw: dict[str, Any] = {"shard_size": case.shard_size} if case.shard_size else {}
    with _setting(root, case.fast):
        rlmerge.merge(src / "base", agents, out, method=case.variant.method, params=params, dtype=case.dtype,
                      block_size=case.block, seed=case.variant.seed, count_tied_twice=case.variant.count_tied_twice,
                      allow_missing=case.missing, fsync=False, **kw)
    return hash_folder(root / out, root)


# rlmerge-report.json's float sums (report/data.py writes them with 10 significant digits): their last digits follow
# the order of float32 and float64 additions, which differs between the two paths and between CPUs (measured
# 2026-12-07: on an AMD EPYC with AVX2 every report but slerp's differed from the ones an Intel CPU with AVX-512
# recorded, on both paths, while every other file was the same). They are hashed rounded: a norm to NORM_DIGITS
# significant digits, a cosine to COSINE_DECIMALS decimals (a cosine of disjoint task vectors is 0 give or take
# 1e-31, of either sign). Everything else in the report (counts, densities, ρ, λ, labels) is hashed as written.
NORM_DIGITS = 5
COSINE_DECIMALS = 5
MARGIN = 0.01  # a rounded value must lie this far (in its last kept digit) from a rounding boundary, or the
# hash could flip on another CPU: then change the fixture or the rounding, not the tolerance


def _rounded(x: float, key: str, where: str) -> float:
    """``x`` as the golden hash sees it (see NORM_DIGITS), checked to be far from a rounding boundary."""
    if key == "norm":
        if x == 0 or not math.isfinite(x):
            return x
        unit = 10.0 ** (math.floor(math.log10(abs(x))) - (NORM_DIGITS - 1))
    else:
        unit = 10.0 ** -COSINE_DECIMALS
    scaled = x / unit
    if abs(scaled - math.floor(scaled) - 0.5) < MARGIN:
        raise AssertionError(f"{where}: {key} = {x!r} lies within {MARGIN} of a unit of {unit:g} from a rounding "
                             "boundary, so its golden hash could differ between CPUs: see NORM_DIGITS")
    return round(scaled) * unit + 0.0  # (+ 0.0: -0.0 becomes 0.0)


def canonical_report(data: bytes, where: str) -> bytes:
    """rlmerge-report.json with its float sums rounded (``_rounded``), as the golden matrix hashes it."""
    def walk(x: Any, key: str | None) -> Any:
        if isinstance(x, dict):
            return {k: walk(v, k) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v, key) for v in x]
        if isinstance(x, float) and key in ("norm", "cosine", "mean_cosine"):
            return _rounded(x, "norm" if key == "norm" else "cosine", where)
        return x
    return json.dumps(walk(json.loads(data), None), indent=2, ensure_ascii=False).encode()


def hash_folder(folder: Path, root: Path) -> dict[str, str]:
    """SHA-256 of every file under ``folder``; in rlmerge.json, the resolved fixture root becomes ``<root>``, and
    the size and CRC-32 it lists for rlmerge-report.json (hashed on its own) are left out, so rlmerge.json is the
    same on both paths; rlmerge-report.json is hashed with its float sums rounded (``canonical_report``)."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_dir():
            continue
        data = p.read_bytes()
        if p.name == "rlmerge-report.json":
            data = canonical_report(data, str(p))
        if p.name == "rlmerge.json":
            data = data.replace(json.dumps(str(root.resolve()))[1:-1].encode(), b"<root>")
            data = re.sub(rb'\n    "rlmerge-report\.json": \{\n      "bytes": \d+,\n      "crc32": \d+\n    \},?', b"",
                          data)
        out[str(p.relative_to(folder))] = hashlib.sha256(data).hexdigest()
    return out


def generate(root: Path) -> dict[str, Any]:
    build_fixtures(root)
    return {"about": "tests/test_golden.py: SHA-256 of every output file per case; regenerate only on purpose",
            "fixtures": fixture_digests(root), "cases": {c.id: run_case(c, root) for c in cases()}}


# -- the tests ---------------------------------------------------------------------------------------------------
CASES = cases()


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("golden").resolve()
    build_fixtures(where)
    return where


@pytest.fixture(scope="module")
def golden() -> dict[str, Any]:
    return json.loads(GOLDEN.read_text())


def test_fixtures_are_the_recorded_bytes(root: Path, golden: dict[str, Any]) -> None:
    """If this fails, the inputs changed (this file's builder), not the merge: fix the builder first."""
    assert fixture_digests(root) == golden["fixtures"]


def test_matrix_is_the_recorded_one(golden: dict[str, Any]) -> None:
    """Every case has a recorded answer and every recorded answer a case; every method and preset is covered."""
    from rlmerge.methods import REGISTRY
    from rlmerge.methods.ram import PRESETS

    assert sorted(golden["cases"]) == sorted(c.id for c in CASES)
    assert {v.method for v in VARIANTS} == set(REGISTRY)
    assert {v.params.get("preset") for v in VARIANTS if v.method == "ram+"} == set(PRESETS)
    for method in ("dare_ta", "dare_ties", "della", "della_linear"):
        assert any(v.method == method and v.params.get("rescale") == "l1" for v in VARIANTS), method


# Cases whose fused and torch paths write different weights: none. (Until 2026-12-04 the torch path's disjoint-mean
# divisor Σ w_t of dare_ta, della_linear and breadcrumbs with normalize=True was torch's float32 sum, whose order
# depends on the length and the CPU, while the fused path accumulated it in float64; both now use
# methods/_ops.weight_sum.)
KNOWN_DISAGREEMENTS: set[str] = set()


def test_recorded_paths_and_block_sizes_agree(golden: dict[str, Any]) -> None:
    """docs/guarantees.md §6 on the recorded answers: for one case, both paths and both block sizes write the same
    files; rlmerge-report.json's norms and cosines differ between the paths in their last bits, so the same there
    means the same once rounded as the matrix hashes it (``canonical_report``)."""
    groups: dict[str, list[dict[str, str]]] = {}
    for c in CASES:
        group = c.id.rsplit("/", 2)[0]  # without the block size and the path
        groups.setdefault(group, []).append(golden["cases"][c.id])
    assert {g for g, outs in groups.items() if any(o != outs[0] for o in outs)} == KNOWN_DISAGREEMENTS


def test_report_hash_ignores_the_last_digits_of_sums_only() -> None:
    """canonical_report: a norm or cosine moved in its last digits (as another CPU's order of additions moves it)
    hashes the same, a moved count, density or a norm changed in its fourth digit does not, and a value at a
    rounding boundary is refused rather than hashed."""
    report = {"per_agent": [{"norm": 0.9468893624, "density": 0.25, "changed": 4}],
              "pairwise": {"cosine": [[1.0, 4.867000706e-32], [-1.394518654e-31, 1.0]]},
              "recommendation": {"numbers": {"mean_cosine": -0.3333333333}}}

    def canon(r: dict[str, Any]) -> bytes:
        return canonical_report(json.dumps(r).encode(), "report")

    def edited(path: tuple[Any, ...], value: Any) -> dict[str, Any]:
        r = json.loads(json.dumps(report))
        at = r
        for k in path[:-1]:
            at = at[k]
        at[path[-1]] = value
        return r

    same = [(("per_agent", 0, "norm"), 0.9468893786), (("pairwise", "cosine", 0, 1), -2.0e-31),
            (("pairwise", "cosine", 1, 0), 0.0), (("recommendation", "numbers", "mean_cosine"), -0.3333333301)]
    for path, value in same:
        assert canon(edited(path, value)) == canon(report), path
    other = [(("per_agent", 0, "norm"), 0.9469893624), (("per_agent", 0, "density"), 0.25000001),
             (("per_agent", 0, "changed"), 5), (("pairwise", "cosine", 0, 1), 2.0e-5)]
    for path, value in other:
        assert canon(edited(path, value)) != canon(report), path
    with pytest.raises(AssertionError, match="rounding boundary"):
        canon(edited(("per_agent", 0, "norm"), 0.946885))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_output_bytes_are_the_recorded_ones(case: Case, root: Path, golden: dict[str, Any]) -> None:
    want = golden["cases"].get(case.id)
    assert want is not None, f"no recorded answer for {case.id}: regenerate with `python {Path(__file__).name}`"
    got = run_case(case, root)
    changed = sorted(k for k in want.keys() | got.keys() if want.get(k) != got.get(k))
    assert not changed, f"{case.id}: these output files changed: {changed}"


def main(argv: list[str]) -> None:
    import torch

    torch.set_num_threads(1)  # as conftest.py sets it for the test
    target = Path(argv[0]) if argv else GOLDEN
    with tempfile.TemporaryDirectory() as tmp:
        doc = generate(Path(tmp).resolve())
    target.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    print(f"{len(doc['cases'])} cases → {target}")


if __name__ == "__main__":
    main(sys.argv[1:])
