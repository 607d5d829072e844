"""A command scorer for `rlmerge sweep`: multiple-choice accuracy by log-likelihood (how lm-eval's `acc` counts).

    rlmerge sweep BASE A1 A2 A3 -o sweep/ --candidate "ram+ r=0.01..0.5:log alpha=0.5..3" --search tpe --trials 20 \\
        --tasks 'cmd:python examples/choice_eval.py {model} --split {split} --limit {limit} --seed {seed}' \\
        --confirm test --keep 1

Each example (a JSON line: id, question, choices, answer) is answered by the choice whose tokens the model gives the
highest total log-probability after the question. The script prints one JSON object on stdout, each example's
result under its id, so that rlmerge computes the score, n and the binomial standard error and pairs candidates
example by example (logs go to stderr):

    {"choice": {"samples": [100, 0, 100, ...], "ids": ["q07", "q31", "q02", ...]}}

Deterministic: no sampling, float32, torch's deterministic algorithms, and a split's examples fixed by the seed
(``--split val`` the first half of a seeded shuffle, ``test`` the second, ``--limit`` the first of the half).
On a GPU: ``--device cuda`` uses the GPU that ``CUDA_VISIBLE_DEVICES`` leaves visible (docs/sweep.md).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

DATA = Path(__file__).with_name("choice_eval.jsonl")


def examples(path: Path, split: str, limit: int, seed: int) -> list[dict]:
    """The split's examples: the file's examples shuffled by ``seed``, val the first half, test the second."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    order = sorted(rows, key=lambda r: r["id"])
    random.Random(seed).shuffle(order)
    half = len(order) // 2
    return (order[:half] if split == "val" else order[half:])[:limit]


def choice_logprob(model, tokenizer, question: str, choice: str, device: str) -> float:
    """Σ log p(choice tokens | question): the choice's tokens after the question's, scored in one forward pass."""
    import torch

    context = tokenizer(question, add_special_tokens=True)["input_ids"]
    answer = tokenizer(choice, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([context + answer], device=device)
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    # the token at position i is predicted by the logits at i - 1
    return float(sum(logp[len(context) + j - 1, tok] for j, tok in enumerate(answer)))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="multiple-choice accuracy of a checkpoint, as JSON for rlmerge sweep")
    ap.add_argument("model", help="the candidate's folder ({model})")
    ap.add_argument("--split", choices=["val", "test"], default="val")
    ap.add_argument("--limit", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (the GPU CUDA_VISIBLE_DEVICES leaves visible)")
    a = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(a.seed)
    torch.use_deterministic_algorithms(True)
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).to(a.device).eval()
    rows = examples(a.data, a.split, a.limit, a.seed)
    samples = []
    for r in rows:
        scores = [choice_logprob(model, tokenizer, r["question"], c, a.device) for c in r["choices"]]
        picked = max(range(len(scores)), key=scores.__getitem__)  # the first of equal scores
        samples.append(100 if picked == r["answer"] else 0)
    print(f"{a.model}: {sum(samples) / len(samples):.1f} % of {len(samples)} ({a.split})", file=sys.stderr)
    print(json.dumps({"choice": {"samples": samples, "ids": [r["id"] for r in rows]}}))


if __name__ == "__main__":
    main()
