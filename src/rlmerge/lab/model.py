"""The lab's base model: a small Qwen2 causal LM built from a config, given task-format competence by a
short supervised warm-up on generated data, and saved in bf16 like a released checkpoint."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase, Qwen2Config, Qwen2ForCausalLM

from rlmerge.lab.tasks import Example, make_split
from rlmerge.lab.tasks.coding import Coding
from rlmerge.lab.tasks.demonstrator import demonstrate
from rlmerge.lab.tasks.memory import Memory
from rlmerge.lab.tasks.tool_use import ToolUse


@dataclass(frozen=True)
class ModelShape:
    hidden: int = 128  # d_model; 128 keeps a GRPO step well under a second on 2 CPU cores
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2  # grouped-query attention, as in Qwen2 itself
    intermediate: int = 384
    max_positions: int = 512  # longest prompt (memory) + completion is ~260 tokens


def build_model(tokenizer: PreTrainedTokenizerBase, shape: ModelShape, seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        intermediate_size=shape.intermediate,
        max_position_embeddings=shape.max_positions,
        # Untied, like Qwen2.5-7B: lm_head and embed_tokens are separate tensors in the task vectors.
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    return Qwen2ForCausalLM(config)


def warmup_pool(n: int, seed: int, demonstrator_error: float = 0.7) -> list[Example]:
    """Warm-up data: the three families at equal shares, answered by an imperfect demonstrator.

    The demonstrator (`rlmerge.lab.tasks.demonstrator`) is wrong inside one blind spot per family: the
    gap a verifier-rewarded RL phase exists to close.
    """
    unit = n // 3 + 1
    pool = [ex for family in (ToolUse(), Coding(), Memory()) for ex in make_split(family, "warmup", unit, seed)]
    return demonstrate(pool, demonstrator_error, seed)


def _batch(examples: list[Example], tokenizer: PreTrainedTokenizerBase) -> dict[str, torch.Tensor]:
    """Right-padded prompt+answer+EOS sequences; the loss sees only the answer and EOS."""
    rows, labels = [], []
    for ex in examples:
        p = tokenizer(ex.prompt, add_special_tokens=False)["input_ids"]
        a = tokenizer(ex.target, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(p + a)
        labels.append([-100] * len(p) + a)
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    lab = torch.tensor([x + [-100] * (width - len(x)) for x in labels])
    return {"input_ids": ids, "attention_mask": (ids != pad).long(), "labels": lab}


def warm_up(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerBase,
    *,
    steps: int,
    batch_size: int = 32,
    lr: float = 2e-3,
    seed: int = 0,
    log_every: int = 50,
) -> list[float]:
    """Supervised warm-up on a mix of the three families. Returns the loss curve.

    Deliberately short: the base should know the formats and be partly right, leaving the RL agents
    room to improve on their own family.
    """
    pool = warmup_pool(steps * batch_size, seed)
    rng = random.Random(seed)
    rng.shuffle(pool)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    model.train()
    losses: list[float] = []
    start = time.time()
    for step in range(steps):
        batch = _batch(pool[step * batch_size : (step + 1) * batch_size], tokenizer)
        loss = model(**batch).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if log_every and (step + 1) % log_every == 0:
            print(
                f"  warm-up step {step + 1}/{steps} loss {sum(losses[-log_every:]) / log_every:.3f} "
                f"({time.time() - start:.0f} s)",
                flush=True,
            )
    model.eval()
    return losses


def save_bf16(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, out_dir: Path) -> None:
    """Save as a bf16 safetensors checkpoint (what RL runs release), with the tokenizer beside it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    model.to(torch.float32)
