"""Small, real-shaped checkpoints with planted sparse task vectors: the demo, the tests and the benchmarks.

A base is a randomly initialised Qwen2 or Llama causal LM (HF tensor names and config, loadable by
transformers). An agent is the base with a random subset of elements moved by more than ε. The masks
actually stored (after rounding to the checkpoint dtype) are returned, so callers know the truth exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

# The densities measured on the paper's Qwen2.5-7B agents (coding, tool use, memory).
PAPER_DENSITIES = (0.032, 0.462, 0.543)


@dataclass(frozen=True)
class Shape:
    """A decoder-only transformer's sizes. Defaults: a tiny Qwen2 (~0.2 M parameters)."""

    arch: str = "qwen2"  # "qwen2" (q/k/v biases) or "llama"
    vocab: int = 256
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    tie: bool = True  # lm_head shares embed_tokens (stored once)


QWEN25_05B = Shape("qwen2", 151936, 896, 24, 14, 2, 4864, True)
QWEN25_7B = Shape("qwen2", 152064, 3584, 28, 28, 4, 18944, False)


def config(shape: Shape, dtype: torch.dtype) -> dict[str, object]:
    common = {
        "vocab_size": shape.vocab, "hidden_size": shape.hidden, "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads,
        "intermediate_size": shape.intermediate, "tie_word_embeddings": shape.tie, "hidden_act": "silu",
        "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "torch_dtype": str(dtype).removeprefix("torch."), "bos_token_id": 1, "eos_token_id": 2,
    }
    if shape.arch == "qwen2":
        return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **common}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
            "mlp_bias": False, **common}


def tensor_shapes(shape: Shape) -> dict[str, tuple[int, ...]]:
    """HF names and shapes, in the order transformers stores them."""
    h, hd = shape.hidden, shape.hidden // shape.heads
    kv = shape.kv_heads * hd
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (shape.vocab, h)}
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = (h, h)
        out[p + "self_attn.k_proj.weight"] = (kv, h)
        out[p + "self_attn.v_proj.weight"] = (kv, h)
        if shape.arch == "qwen2":
            out[p + "self_attn.q_proj.bias"] = (h,)
            out[p + "self_attn.k_proj.bias"] = (kv,)
            out[p + "self_attn.v_proj.bias"] = (kv,)
        out[p + "self_attn.o_proj.weight"] = (h, h)
        out[p + "mlp.gate_proj.weight"] = (shape.intermediate, h)
        out[p + "mlp.up_proj.weight"] = (shape.intermediate, h)
        out[p + "mlp.down_proj.weight"] = (h, shape.intermediate)
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
    out["model.norm.weight"] = (h,)
    if not shape.tie:
        out["lm_head.weight"] = (shape.vocab, h)
    return out


def random_base(shape: Shape, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """float32 weights: N(0, 0.02) matrices, ones for norms, small biases."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shp in tensor_shapes(shape).items():
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shp) + 0.05 * torch.randn(shp, generator=g)
        else:
            out[name] = 0.02 * torch.randn(shp, generator=g)
    return out


def perturb(base: dict[str, torch.Tensor], density: float, *, seed: int, dtype: torch.dtype,
            scale: float = 0.05) -> dict[str, torch.Tensor]:
    """The base with a ``density`` fraction of elements moved by a relative step of ~``scale``.

    The step is relative to |θ₀| (at least 1e-3 absolute) so that it survives rounding to bf16.
    """
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, w in base.items():
        mask = torch.rand(w.shape, generator=g) < density
        step = (w.abs() * scale).clamp(min=1e-3) * (0.5 + torch.rand(w.shape, generator=g))
        sign = torch.where(torch.rand(w.shape, generator=g) < 0.5, -1.0, 1.0)
        out[name] = torch.where(mask, w + sign * step, w)
    return {k: v.to(dtype) for k, v in out.items()}


def write_checkpoint(path: Path, tensors: dict[str, torch.Tensor], cfg: dict[str, object], *,
                     tokenizer: bool = True, owned: bool = False, option: str = "-o") -> Path:
    """A model folder; ``owned``: written whole, with rlmerge.json listing its files, replacing only an earlier
    one rlmerge wrote (the demo's inputs); ``option``: the command-line option that named it, for the hints."""
    if owned:
        from ._version import __version__
        from .io.partial import owned_folder

        with owned_folder(path, {"rlmerge_version": __version__, "kind": "example"}, force=True,
                          option=option) as partial:
            write_checkpoint(partial.tmp, tensors, cfg, tokenizer=tokenizer)
            partial.adopt()
        return path
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg.get("bos_token_id"), "eos_token_id": cfg.get("eos_token_id"),
         "max_new_tokens": 16}, indent=2) + "\n")
    if tokenizer:
        write_tokenizer(path, int(cfg["vocab_size"]))  # type: ignore[call-overload]
    return path


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A byte-level word-piece-free tokenizer: one token per printable character, HF JSON format."""
    specials = ["<unk>", "<s>", "</s>"]
    chars = [chr(c) for c in range(32, 127)]
    vocab = {tok: i for i, tok in enumerate((specials + chars)[:vocab_size])}
    tok = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i, s in enumerate(specials)],
        "normalizer": None, "pre_tokenizer": {"type": "Split", "pattern": {"String": ""},
                                               "behavior": "Isolated", "invert": False},
        "post_processor": None, "decoder": {"type": "Fuse"},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }
    (path / "tokenizer.json").write_text(json.dumps(tok))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "model_max_length": 512,
        "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",
    }, indent=2))


def make_example(root: Path, *, shape: Shape = Shape(), densities: tuple[float, ...] = PAPER_DENSITIES,
                 dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                 names: tuple[str, ...] = ("coder", "tool-use", "memory"), owned: bool = False,
                 option: str = "-o") -> tuple[Path, list[Path]]:
    """Write a base and one agent per density under ``root``; returns (base, agents). ``owned``, ``option``: see
    ``write_checkpoint``."""
    cfg = config(shape, dtype)
    if owned:  # every folder is checked before any is written: all replaced, or none
        from .errors import raise_all
        from .io.partial import output_problems

        folders = [root / "base", *(root / (names[i] if i < len(names) else f"agent{i}")
                                    for i in range(len(densities)))]
        raise_all([p for f in folders for p in output_problems(f, [], force=True, option=option)])
    base32 = random_base(shape, seed=seed)
    base = write_checkpoint(root / "base", {k: v.to(dtype) for k, v in base32.items()}, cfg, owned=owned,
                            option=option)
    agents = []
    for i, d in enumerate(densities):
        name = names[i] if i < len(names) else f"agent{i}"
        # Agents are perturbations of the stored (rounded) base, as real fine-tunes are.
        stored = {k: v.to(dtype).float() for k, v in base32.items()}
        agents.append(write_checkpoint(root / name, perturb(stored, d, seed=seed + 1 + i, dtype=dtype), cfg,
                                       owned=owned, option=option))
    return base, agents
