"""Greedy decoding on held-out examples and strict 0/1 scoring with each family's verifier."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from rlmerge.errors import InputError
from rlmerge.lab.tasks import Example
from rlmerge.lab.tokenizer import load_tokenizer
from rlmerge.lab.views import WORD_MAX_NEW_TOKENS, Kind, task_view

MAX_NEW_TOKENS = WORD_MAX_NEW_TOKENS  # the tiny lab's, kept under its old name


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    max_new_tokens: int,
    batch_size: int = 64,
) -> list[str]:
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:  # a tokenizer without one (the demo's, many base models'): pad with eos,
        if tokenizer.eos_token is None:  # which the attention mask hides, as transformers suggests
            raise InputError("the tokenizer has neither a padding nor an end-of-sequence token: batched greedy "
                             "answers cannot be generated", hint="set pad_token or eos_token in the model's "
                                                                 "tokenizer_config.json")
        tokenizer.pad_token = tokenizer.eos_token
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


def score_each(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, examples: list[Example], kind: Kind = "word"
) -> list[float]:
    """Strict 0/1 score of the greedy answer to each example (one family), in order."""
    if not examples:
        raise ValueError("no examples to score")
    view = task_view(kind, examples[0].family, tokenizer)
    completions = generate(model, tokenizer, [view.prompt(ex) for ex in examples], view.max_new_tokens)
    # Coding answers run in subprocesses: two at a time keeps both cores busy without oversubscribing.
    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(view.score, completions, examples))


def score_examples(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, examples: list[Example], kind: Kind = "word"
) -> float:
    """Mean strict score (0..1) of greedy answers over examples of one family."""
    scores = score_each(model, tokenizer, examples, kind)
    return sum(scores) / len(scores)


def load_checkpoint(path: Path | str, tokenizer_dir: Path | str | None = None
                    ) -> tuple[torch.nn.Module, PreTrainedTokenizerBase]:
    """Load any HF causal-LM checkpoint for scoring, upcast to float32 (CPU bf16 matmuls are slow); its tokenizer
    from ``tokenizer_dir`` when given (an RL checkpoint saved without one: the base's)."""
    # Progress bars for loading a 1 MB model are noise in a 30-checkpoint run (and corrupt --json output).
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model, load_tokenizer(path if tokenizer_dir is None else tokenizer_dir)


def score_checkpoint_each(
    path: Path | str, test_sets: dict[str, list[Example]], kind: Kind = "word"
) -> dict[str, list[float]]:
    """Per family, the 0/1 score of each example (for paired bootstraps over examples)."""
    model, tokenizer = load_checkpoint(path)
    return {name: score_each(model, tokenizer, examples, kind) for name, examples in test_sets.items()}


def score_checkpoint(path: Path | str, test_sets: dict[str, list[Example]], kind: Kind = "word") -> dict[str, float]:
    return {name: sum(s) / len(s) for name, s in score_checkpoint_each(path, test_sets, kind).items()}
