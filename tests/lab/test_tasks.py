"""Scorers as oracles: hand-written right and wrong answers for each family."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlmerge.lab.tasks import FAMILIES, Example, make_family, make_split
from rlmerge.lab.tasks.coding import Coding, static_check
from rlmerge.lab.tasks.memory import CODES, Memory
from rlmerge.lab.tasks.tool_use import ToolUse

WEATHER = Example(
    "tool_use",
    "tools: search(query) | get_weather(city) | call(person)\nrequest: is it raining in oslo\ncall:",
    ' {"name": "get_weather", "arguments": {"city": "oslo"}}',
    {"call": {"name": "get_weather", "arguments": {"city": "oslo"}}},
)


@pytest.mark.parametrize(
    ("answer", "score", "reward"),
    [
        ('{"name": "get_weather", "arguments": {"city": "oslo"}}', 1.0, 1.0),
        (
            ' {"arguments": {"city": "oslo"}, "name": "get_weather"}\ntrailing text',
            1.0,
            1.0,
        ),  # key order free
        ('{"name": "get_weather", "arguments": {"city": "rome"}}', 0.0, 0.5),  # right tool, wrong value
        ('{"name": "search", "arguments": {"query": "oslo"}}', 0.0, 0.2),  # wrong tool, well formed
        ('{"name": "get_weather", "arguments": {"city": "oslo"}', 0.0, 0.0),  # unbalanced JSON
        ('{"name": "get_weather", "arguments": {"town": "oslo"}}', 0.0, 0.5),  # wrong argument name
        ('{"name": "get_weather", "arguments": {"city": "oslo"}, "x": 1}', 0.0, 0.0),  # extra key
        ("get_weather(city=oslo)", 0.0, 0.0),
        ("", 0.0, 0.0),
    ],
)
def test_tool_use_scorer(answer: str, score: float, reward: float) -> None:
    assert ToolUse().score(answer, WEATHER) == score
    assert ToolUse().reward(answer, WEATHER) == pytest.approx(reward)


def test_tool_use_numbers_match_as_strings() -> None:
    ex = Example("tool_use", "", "", {"call": {"name": "set_timer", "arguments": {"minutes": 12}}})
    assert ToolUse().score('{"name": "set_timer", "arguments": {"minutes": "12"}}', ex) == 1.0


MAX_EX = Example(
    "coding", "task: print the largest number in [3, 9, 2]\ncode:", " print(max([3, 9, 2]))", {"stdout": "9"}
)


@pytest.mark.parametrize(
    ("answer", "score"),
    [
        ("print(max([3, 9, 2]))", 1.0),
        ("print(9)", 1.0),  # the checker runs code, any correct program passes
        ("print(sorted([3, 9, 2])[-1])", 1.0),
        ("print(min([3, 9, 2]))", 0.0),
        ("print(max([3, 9, 2])", 0.0),  # syntax error
        ("import os; print(9)", 0.0),  # refused by the sandbox
        ("while True: pass", 0.0),  # times out
        ("", 0.0),
    ],
)
def test_coding_scorer(answer: str, score: float) -> None:
    assert Coding(timeout_s=1.0).score(answer, MAX_EX) == score


@pytest.mark.parametrize(
    "code",
    [
        "import os\nos.system('touch /tmp/pwned')",
        "from subprocess import run",
        "open('/etc/passwd').read()",
        "__import__('os').system('id')",
        "().__class__.__base__.__subclasses__()",
        "eval('1+1')",
        "exec('x=1')",
        "getattr(print, '__self__')",
    ],
)
def test_answers_that_reach_for_the_system_are_refused_before_running(code: str) -> None:
    # The lab's friendly early refusal (one-line answers need none of this); the sandbox is the boundary.
    assert static_check(code) is not None
    assert Coding().score(code, MAX_EX) == 0.0


def test_answers_run_isolated(tmp_path: Path) -> None:
    # Passes the ban-list (no import, no underscore attribute) and creates a folder: the answer runs (and is right),
    # but the folder is made in its own scratch (/tmp inside is a private tmpfs), never on this machine.
    made = tmp_path / "made-by-an-answer"
    answer = f"b = (x for x in []).gi_frame.f_builtins; b['__im' + 'port__']('os').makedirs({str(made)!r}); print(9)"
    assert static_check(answer) is None
    assert Coding().score(answer, MAX_EX) == 1.0
    assert not made.exists()


def test_coding_reward_gives_partial_credit_for_running_code() -> None:
    assert Coding().reward("print(1)", MAX_EX) == pytest.approx(0.2)
    assert Coding().reward("print(", MAX_EX) == 0.0


MEM_EX = Example("memory", "", " teal", {"answer": "teal", "codes": ["teal", "red", "navy"]})


@pytest.mark.parametrize(
    ("answer", "score", "reward"),
    [(" teal", 1.0, 1.0), ("teal\nred", 1.0, 1.0), ("red", 0.0, 0.1), ("tea", 0.0, 0.0), ("", 0.0, 0.0)],
)
def test_memory_scorer(answer: str, score: float, reward: float) -> None:
    assert Memory().score(answer, MEM_EX) == score
    assert Memory().reward(answer, MEM_EX) == pytest.approx(reward)


@pytest.mark.parametrize("name", FAMILIES)
def test_gold_targets_score_one_and_splits_are_deterministic(name: str) -> None:
    family = make_family(name)
    examples = make_split(family, "test", 20, seed=3)
    assert examples == make_split(family, "test", 20, seed=3)
    assert examples != make_split(family, "val", 20, seed=3)
    for ex in examples:
        assert family.score(ex.target, ex) == 1.0
        json.dumps(ex.check)  # must travel through a datasets column


def test_memory_answer_is_in_the_context_once() -> None:
    for ex in make_split(Memory(), "test", 50):
        key = ex.prompt.split("question: the code of ")[1].split(" is")[0]
        assert ex.prompt.count(f"the code of {key} is {ex.check['answer']} .") == 1
        # The fact is the only code word in the notes: filler never contains one.
        notes = ex.prompt.split("\n")[0].replace(".", " ").split()
        assert [w for w in notes if w in CODES] == [ex.check["answer"]]


def test_memory_with_several_facts_asks_about_one_of_them() -> None:
    for ex in make_split(Memory(n_facts=4, n_filler=2), "test", 30):
        assert len(ex.check["codes"]) == 4 and ex.check["answer"] in ex.check["codes"]
        assert ex.prompt.count("the code of") == 5  # four facts and the question


def test_unknown_family_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown task family"):
        make_family("chess")
