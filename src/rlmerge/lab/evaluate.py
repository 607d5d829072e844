"""Greedy decoding on held-out examples and strict 0/1 scoring with each family's verifier."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from rlmerge.lab.tasks import Example, make_family
from rlmerge.lab.tokenizer import load_tokenizer

# Longest gold answer per family in tokens, plus slack; greedy decoding stops at EOS before this.
MAX_NEW_TOKENS = {"tool_use": 36, "coding": 24, "memory": 3}


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    max_new_tokens: int,
    batch_size: int = 64,
) -> list[str]:
    tokenizer.padding_side = "left"
    outputs: list[str] = []
    for i in range(0, len(prompts), batch_size):
        enc = tokenizer(prompts[i : i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
        gen = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        outputs += tokenizer.batch_decode(gen[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    return outputs


def score_examples(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, examples: list[Example]) -> float:
    """Mean strict score (0..1) of greedy answers over examples of one family."""
    if not examples:
        raise ValueError("no examples to score")
    family = make_family(examples[0].family)
    completions = generate(model, tokenizer, [ex.prompt for ex in examples], MAX_NEW_TOKENS[family.name])
    # Coding answers run in subprocesses: two at a time keeps both cores busy without oversubscribing.
    with ThreadPoolExecutor(max_workers=2) as pool:
        scores = list(pool.map(family.score, completions, examples))
    return sum(scores) / len(scores)


def load_checkpoint(path: Path | str) -> tuple[torch.nn.Module, PreTrainedTokenizerBase]:
    """Load any HF causal-LM checkpoint for scoring, upcast to float32 (CPU bf16 matmuls are slow)."""
    # Progress bars for loading a 1 MB model are noise in a 30-checkpoint run (and corrupt --json output).
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model, load_tokenizer(path)


def score_checkpoint(path: Path | str, test_sets: dict[str, list[Example]]) -> dict[str, float]:
    model, tokenizer = load_checkpoint(path)
    return {name: score_examples(model, tokenizer, examples) for name, examples in test_sets.items()}
