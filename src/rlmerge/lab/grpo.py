"""Train one agent from the base with on-policy RL: TRL's GRPOTrainer with the family's verifiable reward.

A small learning rate and a modest number of steps, as in real agentic RL runs: the float32 drift stays
small, and after saving in bf16 many elements round back to the base value, which is what makes RL task
vectors sparse (arXiv 2601.13572, Sec. 3.2).
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM
from trl import GRPOConfig, GRPOTrainer

from rlmerge.lab.evaluate import MAX_NEW_TOKENS
from rlmerge.lab.model import save_bf16
from rlmerge.lab.tasks import Example, make_family, make_split
from rlmerge.lab.tokenizer import load_tokenizer


@dataclass(frozen=True)
class GRPOSettings:
    steps: int = 80
    prompts_per_step: int = 8
    generations: int = 8  # group size: advantages are rewards normalised within a prompt's group
    # Larger than a 7B run's 1e-6: a 1M-parameter model needs it to move in 80 steps; 1e-4 with 4 prompts
    # per step made the tool agent worse than its base (measured), so: more prompts, smaller steps.
    lr: float = 5e-5
    temperature: float = 1.0
    beta: float = 0.0  # no KL term and so no reference model: TRL's default, and half the compute


def reward_function(family_name: str) -> Any:
    """A TRL reward function: (prompts, completions, **dataset columns) -> one float per completion."""
    family = make_family(family_name)

    def reward(prompts: list[str], completions: list[str], check: list[str], **_: Any) -> list[float]:
        examples = [Example(family_name, p, "", json.loads(c)) for p, c in zip(prompts, check, strict=True)]
        # Coding rewards wait on sandbox subprocesses: run a few at once.
        with ThreadPoolExecutor(max_workers=4) as pool:
            return list(pool.map(family.reward, completions, examples))

    reward.__name__ = f"{family_name}_reward"
    return reward


def train_agent(
    base_dir: Path, family_name: str, out_dir: Path, settings: GRPOSettings, *, seed: int = 0
) -> dict[str, float]:
    """GRPO-train a copy of the base on one family and save it in bf16. Returns timing and reward stats."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tokenizer = load_tokenizer(base_dir)
    tokenizer.padding_side = "left"
    # Train in float32 from the bf16 base values; only the saved agent is rounded back to bf16.
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    n_prompts = settings.steps * settings.prompts_per_step
    examples = make_split(make_family(family_name), "train", n_prompts, seed)
    dataset = Dataset.from_list([{"prompt": ex.prompt, "check": json.dumps(ex.check)} for ex in examples])
    config = GRPOConfig(
        output_dir=str(out_dir / "_trainer"),
        use_cpu=True,
        bf16=False,
        max_steps=settings.steps,
        per_device_train_batch_size=settings.prompts_per_step * settings.generations,
        num_generations=settings.generations,
        max_completion_length=MAX_NEW_TOKENS[family_name],
        learning_rate=settings.lr,
        lr_scheduler_type="constant",
        optim="adamw_torch",  # the fused default is meant for accelerators
        temperature=settings.temperature,
        beta=settings.beta,
        logging_steps=max(1, settings.steps // 5),
        save_strategy="no",
        report_to="none",
        seed=seed,
        disable_tqdm=True,
        dataloader_pin_memory=False,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_function(family_name),
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    start = time.time()
    trainer.train()
    seconds = time.time() - start
    rewards = [log["reward"] for log in trainer.state.log_history if "reward" in log]
    save_bf16(trainer.model, tokenizer, out_dir)
    return {
        "train_seconds": seconds,
        "steps": float(settings.steps),
        "first_reward": rewards[0] if rewards else float("nan"),
        "last_reward": rewards[-1] if rewards else float("nan"),
    }
