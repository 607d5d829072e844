"""Estimate an agent's diagonal Fisher for ``fisher`` merging (Matena & Raffel 2022, arXiv:2111.09832).

The empirical Fisher of the model on the given texts: for each example x (a sequence of tokens),
g = ∇_θ Σ_i log p_θ(x_i | x_<i) over its target tokens, and F = mean over examples of g ⊙ g. Targets are
the whole text, or only the completion when a line has a prompt. Each example gets its own backward pass
(per-example squares, not the square of a batch mean). Needs ``transformers`` (``pip install rlmerge[hf]``).

The result is a model folder with the model's tensor names (float32), written through the same streaming,
atomically renamed writer as a merge, plus ``fisher.json`` saying how it was computed.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._version import __version__
from ..errors import ConfigError, InputError
from ..io.checkpoint import TensorInfo
from ..io.dtypes import F32
from ..io.open import checked_model_folder
from ..io.partial import PartialDir, check_output
from ..io.writer import CheckpointWriter
from ..stream.blocks import tensor_bytes
from ..stream.match import Job


@dataclass(frozen=True)
class Example:
    prompt: str  # context: not a target
    target: str  # the tokens whose log-likelihood is differentiated


def read_examples(path: Path, limit: int) -> list[Example]:
    """JSON lines with ``text``, or ``prompt`` + ``completion`` (or ``response``); the first ``limit`` lines."""
    out: list[Example] = []
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise InputError(f"cannot read the data file: {e.strerror}", file=str(path)) from e
    for i, line in enumerate(lines, 1):
        if len(out) >= limit:
            break
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"line {i} is not JSON ({e.msg})", file=str(path)) from e
        if isinstance(row, dict) and isinstance(row.get("text"), str):
            out.append(Example("", row["text"]))
        elif isinstance(row, dict) and isinstance(row.get("prompt"), str):
            target = row.get("completion", row.get("response"))
            if not isinstance(target, str):
                raise InputError(f"line {i} has a prompt but no completion/response string", file=str(path))
            out.append(Example(row["prompt"], target))
        else:
            raise InputError(f"line {i} needs a 'text' string, or 'prompt' and 'completion'", file=str(path))
    if not out:
        raise InputError("no examples in the data file", file=str(path), hint="one JSON object per line")
    return out


def _tokens(tok: Any, ex: Example, max_length: int) -> tuple[torch.Tensor, int]:
    """(input ids [1, L], number of leading prompt tokens that are not targets)."""
    prompt = tok(ex.prompt, add_special_tokens=False)["input_ids"] if ex.prompt else []
    target = tok(ex.target, add_special_tokens=False)["input_ids"]
    ids = (prompt + target)[:max_length]
    return torch.tensor([ids], dtype=torch.long), len(prompt)


def sequence_log_likelihood(model: Any, ids: torch.Tensor, n_prompt: int) -> torch.Tensor:
    """Σ log p(x_i | x_<i) over target positions i ≥ max(1, n_prompt)."""
    logits = model(input_ids=ids).logits[0, :-1].float()  # [L-1, V]: position i predicts token i+1
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)  # [L-1]
    return logp[max(n_prompt, 1) - 1:].sum()


def estimate_fisher(model: str | os.PathLike[str], data: str | os.PathLike[str], output: str | os.PathLike[str], *,
                    examples: int = 64, max_length: int = 512, device: str = "cpu", force: bool = False) -> Path:
    """Write the empirical diagonal Fisher of ``model`` on ``data`` to the folder ``output``.

    >>> estimate_fisher("coder/", "prompts.jsonl", "fisher-coder/", examples=32)  # doctest: +SKIP
    """
    if examples < 1 or max_length < 2:
        raise ConfigError("fisher: examples must be ≥ 1 and max_length ≥ 2")
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise ConfigError("estimating a Fisher needs transformers", hint="pip install 'rlmerge[hf]'") from e
    path = checked_model_folder(model, what="fisher")  # rlmerge's input rules, before transformers reads it
    out = Path(output)
    inputs = [path, Path(data)]
    check_output(out, inputs, force=force)  # before anything is loaded
    rows = read_examples(Path(data), examples)
    tok = AutoTokenizer.from_pretrained(path)
    net = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    params = {n: p for n, p in net.named_parameters() if p.is_floating_point()}
    acc = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in params.items()}
    used = 0
    for ex in rows:
        ids, n_prompt = _tokens(tok, ex, max_length)
        if ids.shape[1] - max(n_prompt, 1) < 1:
            continue  # no target token left after truncation
        net.zero_grad(set_to_none=True)
        sequence_log_likelihood(net, ids.to(device), n_prompt).backward()
        for n, p in params.items():
            if p.grad is not None:
                acc[n].add_(p.grad.float() ** 2)
        used += 1
    if used == 0:
        raise InputError("no example has a target token", file=str(data), hint="raise --max-length")
    _write(out, acc, used, force=force, inputs=inputs,
           meta={"model": str(model), "data": str(data), "examples": used,
                 "data_sha256": hashlib.sha256(Path(data).read_bytes()).hexdigest(), "max_length": max_length,
                 "estimator": "empirical"})
    return out


def _write(out: Path, acc: dict[str, torch.Tensor], used: int, *, force: bool, meta: dict[str, Any],
           inputs: list[Path]) -> None:
    jobs = [Job(n, "merge", TensorInfo(n, F32, tuple(t.shape), Path(n)), F32, ())
            for n, t in acc.items()]
    with PartialDir(out, force=force, inputs=inputs) as partial, \
            CheckpointWriter(partial, jobs, metadata={"rlmerge_fisher": "empirical"}) as writer:
        for job in jobs:  # one shard, or greedy shards in this order: the writer's order
            writer.begin(job)
            writer.write(tensor_bytes((acc[job.name] / used).cpu()))
        writer.write_text("fisher.json", json.dumps(meta, indent=2) + "\n")
        writer.finish({"rlmerge_version": __version__, "kind": "fisher", **meta})

