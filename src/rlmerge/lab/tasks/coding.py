"""Coding: write a one-line Python program whose printed output a checker verifies by running it.

The request names an operation on a literal ("print the largest number in [3, 9, 2]"). Any program is
accepted whose stdout, run in the sandbox (``rlmerge.sandbox``: OS isolation), equals the expected output: the
checker runs the code, it does not compare text with the gold program.

Before running, an answer that imports, names a dunder or a builtin that reaches files or the interpreter is
refused (``static_check``): a friendly early refusal that saves a sandbox start and that the reward can rely on
("no imports" is part of the task), not the security boundary; the sandbox is.
"""

from __future__ import annotations

import ast
import functools
import random
from collections.abc import Callable

from rlmerge.lab.tasks.base import Example, answer_part
from rlmerge.sandbox import run_python

WORDS = ["cat", "moon", "tree", "river", "stone", "bird", "cloud", "lamp"]

# operation -> (request templates, gold program template, expected-output function). {0} is the literal.
OPS: dict[str, tuple[list[str], str, Callable[[list[int] | str], str]]] = {
    "max": (
        ["print the largest number in {0}", "print the maximum of {0}"],
        "print(max({0}))",
        lambda v: str(max(v)),
    ),
    "min": (
        ["print the smallest number in {0}", "print the minimum of {0}"],
        "print(min({0}))",
        lambda v: str(min(v)),
    ),
    "sum": (["print the sum of {0}", "print the total of {0}"], "print(sum({0}))", lambda v: str(sum(v))),
    "sorted": (
        ["print {0} sorted", "print {0} in increasing order"],
        "print(sorted({0}))",
        lambda v: str(sorted(v)),
    ),
    "len": (
        ["print how many numbers are in {0}", "print the length of {0}"],
        "print(len({0}))",
        lambda v: str(len(v)),
    ),
    "upper": (
        ["print the word {0} in capitals", "print {0} in upper case"],
        "print({0}.upper())",
        lambda v: str(v).upper(),
    ),
    "reverse": (
        ["print the word {0} backwards", "print {0} reversed"],
        "print({0}[::-1])",
        lambda v: str(v)[::-1],
    ),
}
STRING_OPS = {"upper", "reverse"}

FORBIDDEN_NAMES = frozenset({"open", "exec", "eval", "compile", "__import__", "globals", "locals", "vars", "getattr",
                             "setattr", "delattr", "input", "breakpoint", "help", "exit", "quit", "memoryview",
                             "classmethod", "type", "object"})


def static_check(code: str) -> str | None:
    """Why an answer is refused before running, or None when it may run. Not a sandbox: a ban-list cannot be made
    complete (tests/test_sandbox.py runs code that passes it and reaches ``__import__``)."""
    try:
        tree = ast.parse(code)
    except SyntaxError as err:
        return f"syntax error: {err.msg}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            return "import"
        if isinstance(node, ast.Name) and node.id in FORBIDDEN_NAMES:
            return f"forbidden name {node.id}"
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            return f"private attribute {node.attr}"
        if isinstance(node, ast.Name) and node.id.startswith("__"):
            return f"dunder name {node.id}"
    return None


@functools.lru_cache(maxsize=4096)
def _run_cached(code: str, timeout_s: float) -> tuple[bool, str]:
    # The programs are deterministic (no input, no clock, no randomness without imports), and a GRPO group
    # often holds the same program several times: one sandbox run per distinct program is enough.
    if static_check(code) is not None:
        return False, ""
    result = run_python(code, timeout_s=timeout_s)
    return result.ok, result.stdout.strip()


class Coding:
    name = "coding"

    def __init__(self, timeout_s: float = 2.0) -> None:
        self.timeout_s = timeout_s

    def sample(self, rng: random.Random) -> Example:
        op = rng.choice(sorted(OPS))
        templates, program, expected = OPS[op]
        if op in STRING_OPS:
            value: list[int] | str = rng.choice(WORDS)
            literal = f'"{value}"'
        else:
            value = [rng.randint(0, 9) for _ in range(rng.randint(3, 5))]
            literal = str(value)
        prompt = f"task: {rng.choice(templates).format(literal)}\ncode:"
        return Example(self.name, prompt, " " + program.format(literal), {"stdout": expected(value)}, stratum=op)

    def _run(self, completion: str) -> tuple[bool, str]:
        code = answer_part(completion)
        if not code:
            return False, ""
        return _run_cached(code, self.timeout_s)

    def reward(self, completion: str, example: Example) -> float:
        ran, out = self._run(completion)
        # Partial credit for a program that runs and prints something: it teaches the output format.
        return 0.0 if not ran else (1.0 if out == example.check["stdout"] else 0.2 * bool(out))

    def score(self, completion: str, example: Example) -> float:
        ran, out = self._run(completion)
        return float(ran and out == example.check["stdout"])

    def words(self) -> list[str]:
        words = set(WORDS) | {"task", "code", "print", "max", "min", "sum", "sorted", "len", "upper"}
        for templates, _, _ in OPS.values():
            words |= {w for t in templates for w in t.replace("{0}", " ").split()}
        return sorted(words)
