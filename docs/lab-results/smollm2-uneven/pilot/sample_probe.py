"""How often SmolLM2 base samples get a tool call exactly right, and how many GRPO groups each reward leaves
without variance (4 samples for each of 16 training prompts of seed 0, at temperatures 0.7 and 0.4).

Usage: PYTHONPATH=src nice -n 19 python docs/lab-results/smollm2-uneven/pilot/sample_probe.py BASE_DIR
(BASE_DIR: a SmolLM2 base built by the lab, e.g. /work/lab-runs/uneven/seed0/base). Output: sample_probe.out.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from rlmerge.lab.evaluate import load_checkpoint
from rlmerge.lab.smollm2 import extract
from rlmerge.lab.tasks import make_family, make_split
from rlmerge.lab.views import task_view

GROUP = 4


def zero_std_groups(values: list[float]) -> int:
    return sum(len(set(values[i : i + GROUP])) == 1 for i in range(0, len(values), GROUP))


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    model, tok = load_checkpoint(sys.argv[1])
    tok.padding_side = "left"
    view = task_view("chat", "tool_use", tok)
    fam = make_family("tool_use")
    examples = make_split(fam, "train", 16, 0)
    enc = tok([view.prompt(e) for e in examples], return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(0)
    start = time.time()
    for temperature in (0.7, 0.4):
        with torch.no_grad():
            gen = model.generate(**enc, max_new_tokens=48, do_sample=True, temperature=temperature,
                                 num_return_sequences=GROUP, pad_token_id=tok.pad_token_id,
                                 eos_token_id=tok.eos_token_id)
        replies = tok.batch_decode(gen[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        pairs = [(r, examples[i // GROUP]) for i, r in enumerate(replies)]
        strict = [view.score(r, e) for r, e in pairs]
        shaped = [view.reward(r, e) for r, e in pairs]
        graded = [fam.graded_reward(extract("tool_use", r), e) for r, e in pairs]
        print(f"T={temperature}: " + "; ".join(
            f"{name} mean {sum(v) / len(v):.3f} zero-std groups {zero_std_groups(v)}/16"
            for name, v in (("strict", strict), ("shaped", shaped), ("graded", graded))
        ) + f"; {time.time() - start:.0f}s", flush=True)


if __name__ == "__main__":
    main()
