"""``bfcl:CATEGORY``: the Berkeley Function Calling Leaderboard's single-turn AST categories (the RAM paper's tool-use
benchmark), from the ``bfcl-eval`` package: its data, its system prompt, its decoding of a prompted model's reply and
its own AST checker.

Install: ``pip install --no-deps bfcl-eval==2026.3.23`` (its dependencies are the API clients of the models it can
query; none is needed here). Categories: ``simple`` (its file ``simple_python``), ``multiple``, ``parallel``,
``parallel_multiple``.

For each example, as BFCL treats a prompting (not function-calling) model: each function's description gets BFCL's
"Note that the provided function is in Python 3 syntax."; BFCL's default system prompt (``formulate_system_prompt``
with ``DEFAULT_SYSTEM_PROMPT_FORMAT``: Python-call answers, function docs as JSON, put before the first turn) opens
the conversation, which the candidate answers greedily through its own chat template; the reply is decoded as
BFCL's ``default_decode_ast_prompting`` decodes it (``[f(a=1), g(b="x")]``, read with ``ast``) and checked by BFCL's
``ast_checker`` against the example's possible answers. Right is 1, anything else (no call, a wrong call, a reply
that does not parse) 0; the score is the % right.

Two pieces are ported rather than imported, because their modules import the clients of a dozen model APIs
(``bfcl_eval.model_handler.utils``): the system prompt, built from BFCL's own templates (``default_prompts``), and
the decoder, which also departs from BFCL's on purpose: where BFCL ``eval``s an arithmetic expression of the reply
(``x=2*3``), this computes it from the parsed tree (numbers only, bounded powers), since a model's text is never
executed here. tests/test_scoring_bench.py checks both against BFCL's own functions on real examples.
The checker is BFCL's module, loaded with the one name it needs from the API-client module (the model table, used
only to rename dotted functions for OpenAI-style models) answered as for a prompted model: names kept as written.
"""

from __future__ import annotations

import ast
import copy
import functools
import importlib.util
import json
import math
import operator
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..sweeping.scores import TaskScore
from .chat import chat_replies, require, subset
from .options import Options
from .subject import Subject

PACKAGE = "bfcl_eval"
INSTALL = "pip install --no-deps bfcl-eval==2026.3.23 (or: pip install 'rlmerge[bench]' then that line)"
CATEGORIES = {"simple": "simple_python", "multiple": "multiple", "parallel": "parallel",
              "parallel_multiple": "parallel_multiple"}  # our name → BFCL's test category (its file name)
PYTHON_HINT = " Note that the provided function is in Python 3 syntax."  # BFCL's, for a Python category
MAX_NEW_TOKENS = 384  # the longest ground-truth answer is 241 tokens (parallel; SmolLM2's tokenizer)
MAX_POWER = 64  # the largest exponent a reply's ``a ** b`` may have (BFCL would eval it; here it is computed)
MAX_REPEAT = 10_000  # and the longest string or list an expression may make


@dataclass(frozen=True)
class Example:
    id: str  # BFCL's, e.g. "simple_python_12"
    question: list[dict[str, str]]  # the first (only) turn's messages
    functions: list[dict[str, Any]]  # the function docs, with BFCL's Python hint
    answer: list[dict[str, Any]]  # BFCL's possible answers ("ground_truth")


def _data_dir() -> Path:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("bfcl: the bfcl-eval package is not installed", hint=INSTALL)
    return Path(next(iter(spec.submodule_search_locations))) / "data"


def _lines(path: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, ValueError) as e:
        raise ConfigError(f"bfcl: cannot read BFCL's data: {e}", file=str(path), hint=INSTALL) from e


@functools.cache
def examples(category: str) -> tuple[Example, ...]:
    """Every example of one of our categories, in BFCL's order, ready to prompt and check."""
    from bfcl_eval.constants.category_mapping import VERSION_PREFIX

    name = CATEGORIES[category]
    data = _data_dir()
    answers = {a["id"]: a["ground_truth"] for a in _lines(data / "possible_answer" / f"{VERSION_PREFIX}_{name}.json")}
    out = []
    for entry in _lines(data / f"{VERSION_PREFIX}_{name}.json"):
        functions = copy.deepcopy(entry["function"])
        for f in functions:
            f["description"] = f["description"] + PYTHON_HINT
        out.append(Example(entry["id"], copy.deepcopy(entry["question"][0]), functions, answers[entry["id"]]))
    return tuple(out)


# -- the prompt ----------------------------------------------------------------------------------------------
def system_prompt(functions: list[dict[str, Any]]) -> str:
    """BFCL's default system prompt for a prompting model (``formulate_system_prompt`` at the default format)."""
    from bfcl_eval.constants import default_prompts as p

    fmt = dict(kv.split("=", 1) for kv in p.DEFAULT_SYSTEM_PROMPT_FORMAT.split("&"))
    if (fmt.get("ret_fmt"), fmt.get("tool_call_tag"), fmt.get("func_doc_fmt")) != ("python", "False", "json"):
        raise ConfigError(f"bfcl: this bfcl-eval's default prompt format is {p.DEFAULT_SYSTEM_PROMPT_FORMAT!r}; "
                          "this scorer asks for Python calls with JSON function docs", hint=INSTALL)
    style = p.PROMPT_STYLE_TEMPLATES[fmt["style"]]
    return p.PROMPT_TEMPLATE_MAPPING[fmt["prompt_fmt"]].format(
        persona=style["persona"], task=style["task"],
        tool_call_format=style["tool_call_no_tag"].format(output_format=p.OUTPUT_FORMAT_MAPPING["python"],
                                                          param_types=p.PARAM_TYPE_MAPPING["python"]),
        multiturn_behavior=style["multiturn_behavior"],
        available_tools=style["available_tools"].format(format="json", functions=json.dumps(functions, indent=4)))


def conversation(ex: Example) -> list[dict[str, str]]:
    """The messages the model answers: BFCL's system prompt first (before a system message the question has)."""
    messages = copy.deepcopy(ex.question)
    prompt = system_prompt(ex.functions)
    if messages and messages[0]["role"] == "system":
        messages[0]["content"] = prompt + "\n\n" + messages[0]["content"]
    else:
        messages.insert(0, {"role": "system", "content": prompt})
    return messages


# -- the reply -----------------------------------------------------------------------------------------------
class DecodeError(ValueError):
    """The reply is not a list of Python calls (BFCL: "Failed to decode AST")."""


def decode(reply: str) -> list[dict[str, dict[str, Any]]]:
    """``[{function: {param: value}}, …]`` from a reply, as BFCL's ``default_decode_ast_prompting`` reads a Python
    answer (without its ``eval``: see the module docstring). Raises DecodeError."""
    text = reply.strip("`\n ")
    text = ("" if text.startswith("[") else "[") + text + ("" if text.endswith("]") else "]")
    try:
        body = ast.parse(text.strip().strip("'"), mode="eval").body
        if isinstance(body, ast.Call):
            return [_call(body)]
        calls = []
        for elem in body.elts:  # type: ignore[attr-defined]  # (BFCL: an AttributeError, so a failure)
            if not isinstance(elem, ast.Call):
                raise DecodeError(f"not a call: {ast.unparse(elem)[:80]}")
            calls.append(_call(elem))
        return calls
    except DecodeError:
        raise
    except Exception as e:  # noqa: BLE001 - as BFCL's runner: any failure to decode is "Failed to decode AST"
        raise DecodeError(f"{type(e).__name__}: {e}") from None


def _call(elem: ast.Call) -> dict[str, dict[str, Any]]:
    parts, func = [], elem.func
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if isinstance(func, ast.Name):
        parts.append(func.id)
    return {".".join(reversed(parts)): {kw.arg: _value(kw.value) for kw in elem.keywords}}  # type: ignore[misc]


_ARITHMETIC: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


def _value(node: ast.AST) -> Any:
    """BFCL's ``resolve_ast_by_type``, case by case, with arithmetic computed instead of ``eval``ed."""
    if isinstance(node, ast.Constant):
        return "..." if node.value is Ellipsis else node.value
    if isinstance(node, ast.UnaryOp):  # BFCL: -operand.value, whatever the operator
        if not isinstance(node.operand, ast.Constant):
            raise DecodeError(f"unsupported operand {ast.unparse(node)[:80]}")
        return -node.operand.value
    if isinstance(node, ast.List):
        return [_value(v) for v in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise DecodeError("a ** in a dict")
        return {_value(k): _value(v) for k, v in zip(node.keys, node.values)}  # type: ignore[arg-type]
    if isinstance(node, ast.BinOp):
        return _arithmetic(node)
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Call):
        return ast.unparse(node) if not node.keywords else _call(node)
    if isinstance(node, ast.Tuple):
        return tuple(_value(v) for v in node.elts)
    if isinstance(node, ast.Subscript):
        return ast.unparse(node.value) + "[" + ast.unparse(node.slice) + "]"
    raise DecodeError(f"unsupported {type(node).__name__}")  # BFCL: "Unsupported AST type" (a Lambda fails too)


def _arithmetic(node: ast.BinOp) -> Any:
    """What BFCL's ``eval`` gives for an expression of literals: arithmetic on numbers, + and * on strings, lists
    and tuples (bounded); a name, a call or anything else is a DecodeError (``eval`` would run it)."""
    op = _ARITHMETIC.get(type(node.op))
    left, right = _operand(node.left), _operand(node.right)
    numbers = all(isinstance(x, (int, float, complex)) for x in (left, right))
    sequences = (type(node.op) is ast.Add and type(left) is type(right) and isinstance(left, (str, list, tuple))) or (
        type(node.op) is ast.Mult and {type(left), type(right)} & {str, list, tuple} and
        any(type(x) is int and abs(x) <= MAX_REPEAT for x in (left, right)))
    if op is None or not (numbers or sequences):
        raise DecodeError(f"unsupported expression {ast.unparse(node)[:80]}")
    if type(node.op) is ast.Pow and (not isinstance(right, (int, float)) or abs(right) > MAX_POWER):
        raise DecodeError(f"power too large: {ast.unparse(node)[:80]}")
    out = op(left, right)  # an ArithmeticError (1/0) fails the decoding, as in BFCL
    if (isinstance(out, float) and not math.isfinite(out)) or (isinstance(out, (str, list, tuple))
                                                               and len(out) > MAX_REPEAT):
        raise DecodeError(f"not finite, or too long: {ast.unparse(node)[:80]}")
    return out


def _operand(node: ast.AST) -> Any:
    """An operand of an expression, as ``eval`` reads it: a literal, a signed one, or another expression."""
    if isinstance(node, ast.BinOp):
        return _arithmetic(node)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _operand(node.operand)
        if not isinstance(v, (int, float, complex)):
            raise DecodeError(f"unsupported operand {ast.unparse(node)[:80]}")
        return -v if isinstance(node.op, ast.USub) else +v
    if isinstance(node, (ast.Constant, ast.List, ast.Tuple, ast.Dict, ast.Set)):
        return ast.literal_eval(node)  # a ValueError on anything but literals
    raise DecodeError(f"unsupported operand {ast.unparse(node)[:80]}")


def is_calls(decoded: Any) -> bool:
    """BFCL's ``is_function_calling_format_output``: a list of one-key dicts whose value is a dict."""
    return isinstance(decoded, list) and all(
        isinstance(x, dict) and len(x) == 1 and isinstance(next(iter(x.values())), dict) for x in decoded)


# -- the checker ---------------------------------------------------------------------------------------------
class _PromptingModels(dict):  # type: ignore[type-arg]
    """Stands in for BFCL's model table while its checker loads: every model a prompted one (dotted names kept)."""

    def __missing__(self, key: str) -> Any:
        return types.SimpleNamespace(underscore_to_dot=False)


@functools.cache
def checker() -> tuple[Callable[..., dict[str, Any]], Any]:
    """(BFCL's ``ast_checker``, its ``Language.PYTHON``), loaded as a private copy of its module."""
    table = "bfcl_eval.constants.model_config"
    spec = importlib.util.find_spec("bfcl_eval.eval_checker.ast_eval.ast_checker")
    if spec is None or spec.origin is None:
        raise ConfigError("bfcl: bfcl-eval has no eval_checker/ast_eval/ast_checker.py", hint=INSTALL)
    private = importlib.util.spec_from_file_location("rlmerge_bfcl_ast_checker", spec.origin)
    assert private is not None and private.loader is not None
    module = importlib.util.module_from_spec(private)
    shim = types.ModuleType(table)
    shim.MODEL_CONFIG_MAPPING = _PromptingModels()  # type: ignore[attr-defined]
    saved = sys.modules.get(table)
    sys.modules[table] = shim
    try:
        private.loader.exec_module(module)
    finally:
        if saved is None:
            sys.modules.pop(table, None)
        else:
            sys.modules[table] = saved
    from bfcl_eval.constants.enums import Language

    return module.ast_checker, Language.PYTHON


def correct(ex: Example, reply: str, category: str) -> bool:
    """Whether ``reply`` answers ``ex`` (BFCL's decoding and AST check; see the module docstring)."""
    try:
        decoded = decode(reply)
    except DecodeError:
        return False
    if not is_calls(decoded):
        return False
    check, python = checker()
    try:
        return bool(check(ex.functions, decoded, ex.answer, python, CATEGORIES[category], "rlmerge")["valid"])
    except Exception:  # noqa: BLE001 - BFCL's checker raising on an odd answer (a value of a type it never met): wrong
        return False


@dataclass
class Bfcl:
    """The scorer of one category (``bfcl:CATEGORY``)."""

    category: str
    options: Options
    max_new_tokens: int = MAX_NEW_TOKENS

    def __post_init__(self) -> None:
        if self.category not in CATEGORIES:
            raise ConfigError(f"--tasks: bfcl:{self.category}: BFCL's categories here are "
                              + ", ".join(f"bfcl:{c}" for c in CATEGORIES))
        require(PACKAGE, INSTALL, f"bfcl:{self.category}")

    @property
    def names(self) -> list[str]:
        return [f"bfcl:{self.category}"]

    def chosen(self) -> list[Example]:
        exs = examples(self.category)
        o = self.options
        return [exs[i] for i in subset(len(exs), limit=o.limit, seed=o.seed, split=o.split,
                                       name=f"bfcl:{self.category}")]

    def check(self, exs: list[Example], replies: list[str]) -> TaskScore:
        """Right (100) or wrong (0) of each reply, by BFCL's checker."""
        right = [1.0 if correct(ex, r, self.category) else 0.0 for ex, r in zip(exs, replies, strict=True)]
        return TaskScore.accuracy(right, [ex.id for ex in exs])

    needs = "model"

    def score(self, subject: Subject) -> dict[str, TaskScore]:
        model, tokenizer = subject.model()
        exs = self.chosen()
        replies = chat_replies(model, tokenizer, [conversation(ex) for ex in exs],
                               max_new_tokens=self.max_new_tokens, batch_size=self.options.batch_size)
        return {self.names[0]: self.check(exs, replies)}
