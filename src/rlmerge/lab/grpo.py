"""Train one agent from the base with on-policy RL: TRL's GRPOTrainer with the family's verifiable reward.

Two dials decide how sparse the saved task vector is (docs/lab.md, "the mechanism"):
- the learning rate: Adam moves every weight that gets a gradient by about lr per step, whatever the
  gradient's size, so the total drift of a weight is ~lr × steps (less where the gradient's sign flips);
- the precision: `fp32-master` trains float32 weights and rounds only the saved agent to bf16 (what most
  RL stacks release); a change survives when the drift exceeds half a bf16 step at the weight (|w|/512
  to |w|/256, depending on where |w| sits in its binade).
  `bf16-pure` emulates bf16 parameter storage by rounding every weight to bf16 after every optimizer step
  (Adam's state stays float32): an update smaller than half a step at |w| is absorbed on the spot, each
  step, so a weight with |w| > ~256·lr never moves (PULSE, arXiv 2602.03839).
The tiny lab's default (lr 5e-5, fp32 master) gives dense task vectors; see docs/lab.md for the measured
densities at other settings.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from rlmerge.lab.model import save_bf16
from rlmerge.lab.tasks import Example, held_out_split
from rlmerge.lab.tokenizer import load_tokenizer
from rlmerge.lab.views import Kind, TaskView, task_view

Precision = Literal["fp32-master", "bf16-pure"]
# shaped: the family's partial-credit reward (well-formed answers earn some); strict: the test scorer's 0/1
# (only a verified answer earns anything); graded: the family's finer partial credit where it has one (tool
# use: per argument), for a skill the policy's samples rarely get whole.
Reward = Literal["shaped", "strict", "graded"]
ATTEMPT_SEED_STRIDE = 1000  # training seed of a retrained agent: seed + stride × attempt


@dataclass(frozen=True)
class GRPOSettings:
    steps: int = 80
    prompts_per_step: int = 8
    generations: int = 8  # group size: advantages are rewards normalised within a prompt's group
    # Large for RL (7B runs use 1e-6 to 3e-6): a 1M-parameter model needs it to move in 80 steps; 1e-4 with
    # 4 prompts per step made the tool agent worse than its base (measured), so: more prompts, smaller steps.
    lr: float = 5e-5
    temperature: float = 1.0
    beta: float = 0.0  # no KL term and so no reference model: TRL's default, and half the compute
    precision: Precision = "fp32-master"
    reward: Reward = "shaped"


@torch.no_grad()
def round_to_bf16_(model: torch.nn.Module) -> None:
    """Round every float32 parameter to the nearest bf16 value, in place (bf16 storage, emulated)."""
    for p in model.parameters():
        p.copy_(p.to(torch.bfloat16).to(p.dtype))


class Bf16Storage(TrainerCallback):
    """`bf16-pure`: after each optimizer step, parameters are rounded to bf16 as bf16 storage would."""

    def on_optimizer_step(
        self, args: Any, state: Any, control: Any, model: torch.nn.Module | None = None, **_: Any
    ) -> None:
        if model is not None:
            round_to_bf16_(model)


class DensityTrace(TrainerCallback):
    """After each optimizer step, the share of elements the saved (bf16) agent would have changed so far.

    The density the agent will have, measured as the lab measures it (|bf16(θ) − θ₀| > ε in float32, every
    parameter once, tied ones once), at every step of one run: how density grows with steps at a given lr,
    which is how per-agent lr × steps are chosen (docs/lab.md, "uneven agents"). Read-only: training is
    unchanged.
    """

    def __init__(self, model: torch.nn.Module, epsilon: float = 1e-5) -> None:
        self.base = [p.detach().to(torch.bfloat16).float() for p in model.parameters()]
        self.total = sum(b.numel() for b in self.base)
        self.epsilon = epsilon
        self.trace: list[float] = []  # density in % after step 1, 2, …

    @torch.no_grad()
    def on_optimizer_step(
        self, args: Any, state: Any, control: Any, model: torch.nn.Module | None = None, **_: Any
    ) -> None:
        if model is None:
            return
        changed = sum(
            int(((p.detach().to(torch.bfloat16).float() - b).abs() > self.epsilon).sum())
            for p, b in zip(model.parameters(), self.base, strict=True)
        )
        self.trace.append(100.0 * changed / self.total)


def reward_function(family_name: str, view: TaskView | None = None, mode: Reward = "shaped") -> Any:
    """A TRL reward function: (prompts, completions, **dataset columns) -> one float per completion.

    `mode` "strict" rewards with the family's 0/1 test scorer, "graded" with its finer partial credit.
    """
    view = view if view is not None else task_view("word", family_name, None)  # type: ignore[arg-type]
    reward_one = {"shaped": view.reward, "strict": view.score, "graded": view.graded}[mode]
    if reward_one is None:
        raise ValueError(f"GRPO reward {mode!r}: task family {family_name!r} has no graded reward; "
                         "use shaped or strict")

    def reward(prompts: list[str], completions: list[str], check: list[str], **_: Any) -> list[float]:
        examples = [Example(family_name, p, "", json.loads(c)) for p, c in zip(prompts, check, strict=True)]
        # Coding rewards wait on sandbox subprocesses: run a few at once.
        with ThreadPoolExecutor(max_workers=4) as pool:
            return list(pool.map(reward_one, completions, examples))

    reward.__name__ = f"{family_name}_reward"
    return reward


def load_for_training(base_dir: Path, precision: Precision) -> torch.nn.Module:
    """float32 weights from the bf16 base; `bf16-pure` additionally rounds after every step (callback)."""
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if precision == "bf16-pure":
        round_to_bf16_(model)  # a no-op for a bf16 base, stated for any other
    return model


def train_agent(
    base_dir: Path,
    family_name: str,
    out_dir: Path,
    settings: GRPOSettings,
    *,
    seed: int = 0,
    kind: Kind = "word",
    disjoint_from_test: int = 0,
    attempt: int = 0,
) -> dict[str, float]:
    """GRPO-train a copy of the base on one family and save it in bf16. Returns timing and reward stats.

    `disjoint_from_test` > 0: no training prompt is one of the seed's first that many test prompts.
    `attempt` k > 0 trains again on the same prompts with another training seed (seed + 1000·k: the prompt
    order and the policy's samples differ), for an agent whose first run did not learn (the lab's gate).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tokenizer = load_tokenizer(base_dir)
    tokenizer.padding_side = "left"
    view = task_view(kind, family_name, tokenizer)
    model = load_for_training(base_dir, settings.precision)
    n_prompts = settings.steps * settings.prompts_per_step
    examples = held_out_split(family_name, "train", n_prompts, seed, disjoint_from_test)
    # The reward function rebuilds each Example from the prompt TRL hands back and the `check` column.
    dataset = Dataset.from_list([{"prompt": view.prompt(ex), "check": json.dumps(ex.check)} for ex in examples])
    config = GRPOConfig(
        output_dir=str(out_dir / "_trainer"),
        use_cpu=True,
        bf16=False,
        max_steps=settings.steps,
        per_device_train_batch_size=settings.prompts_per_step * settings.generations,
        num_generations=settings.generations,
        max_completion_length=view.max_new_tokens,
        learning_rate=settings.lr,
        lr_scheduler_type="constant",
        optim="adamw_torch",  # the fused default is meant for accelerators
        gradient_checkpointing=False,  # TRL's default recomputes activations: ~25 % more compute, no memory need here
        temperature=settings.temperature,
        beta=settings.beta,
        logging_steps=max(1, settings.steps // 5),
        save_strategy="no",
        report_to="none",
        seed=seed + ATTEMPT_SEED_STRIDE * attempt,
        disable_tqdm=True,
        dataloader_pin_memory=False,
    )
    trace = DensityTrace(model)
    callbacks: list[TrainerCallback] = [Bf16Storage()] if settings.precision == "bf16-pure" else []
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_function(family_name, view, settings.reward),
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[*callbacks, trace],  # the trace last: it sees the weights after bf16-pure's rounding
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
        "rewards": rewards,  # type: ignore[dict-item] - the whole logged curve, for the record
        "density_by_step": trace.trace,  # type: ignore[dict-item] - % of elements changed after each step
    }
