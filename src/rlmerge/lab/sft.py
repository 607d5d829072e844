"""The SFT control: the same budget and precision as a GRPO agent, but supervised on correct answers.

Same base, same number of optimizer steps, same sequences per step (prompts × generations of the GRPO
settings), same constant learning rate and AdamW (TRL's defaults: β = (0.9, 0.999), no weight decay), same
precision dial. It tells whether what makes task vectors sparse or dense is RL or the optimizer regime.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from rlmerge.lab.grpo import GRPOSettings, load_for_training, round_to_bf16_
from rlmerge.lab.model import save_bf16
from rlmerge.lab.tasks import Example, make_family, make_split
from rlmerge.lab.tokenizer import load_tokenizer
from rlmerge.lab.views import Kind, TaskView, task_view


def _batch(examples: list[Example], view: TaskView, tokenizer: object) -> dict[str, torch.Tensor]:
    """Right-padded prompt + gold answer + EOS; the loss sees only the answer and EOS."""
    rows, labels = [], []
    for ex in examples:
        p = tokenizer(view.prompt(ex), add_special_tokens=False)["input_ids"]  # type: ignore[operator]
        a = tokenizer(view.target(ex), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]  # type: ignore[operator,attr-defined]
        rows.append(p + a)
        labels.append([-100] * len(p) + a)
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id  # type: ignore[attr-defined]
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    lab = torch.tensor([x + [-100] * (width - len(x)) for x in labels])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return {"input_ids": ids, "attention_mask": mask, "labels": lab}


def train_sft_agent(
    base_dir: Path, family_name: str, out_dir: Path, settings: GRPOSettings, *, seed: int = 0, kind: Kind = "word"
) -> dict[str, float]:
    """Supervised fine-tuning with GRPO's budget and precision; saves the agent in bf16."""
    tokenizer = load_tokenizer(base_dir)
    view = task_view(kind, family_name, tokenizer)
    model = load_for_training(base_dir, settings.precision)
    per_step = settings.prompts_per_step * settings.generations
    examples = make_split(make_family(family_name), "train", settings.steps * per_step, seed)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.0)
    model.train()
    losses: list[float] = []
    start = time.time()
    for step in range(settings.steps):
        batch = _batch(examples[step * per_step : (step + 1) * per_step], view, tokenizer)
        loss = model(**batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if settings.precision == "bf16-pure":
            round_to_bf16_(model)
        losses.append(loss.item())
    model.eval()
    save_bf16(model, tokenizer, out_dir)
    return {
        "train_seconds": time.time() - start,
        "steps": float(settings.steps),
        "first_loss": losses[0],
        "last_loss": losses[-1],
    }
