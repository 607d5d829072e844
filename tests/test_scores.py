"""A score's uncertainty (sweeping/scores.py) and where it goes: results.json and back through --resume.

Oracles: the binomial standard error written out by hand; a scorer's values against what results.json records and
what --resume reads back (every field, every sample); plain-number scorers (the Python API's first contract) keep
working with n and stderr unknown.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import rlmerge
from rlmerge.errors import ScorerError
from rlmerge.sweeping.scores import TaskScore, details_from_json, details_json, examples_key, make


def test_accuracy_is_the_mean_with_the_binomial_standard_error() -> None:
    s = TaskScore.accuracy([1, 0, 1, 1], ["a", "b", "c", "d"])
    assert s.score == 75.0 and s.n == 4 and s.samples == (100.0, 0.0, 100.0, 100.0) and s.ids == ("a", "b", "c", "d")
    assert s.stderr == pytest.approx(100 * math.sqrt(0.75 * 0.25 / 4))
    assert TaskScore.accuracy([1, 0, 0]).score == 100.0 * (1 / 3)  # the lab's arithmetic, bit for bit
    assert TaskScore.accuracy([0, 1]).ids == ("0", "1")  # examples numbered when unnamed


def test_a_value_is_a_number_a_task_score_or_its_fields() -> None:
    assert make(61.5, task="t") == TaskScore(61.5)
    assert make("61.5", task="t") == TaskScore(61.5)  # a command's JSON may quote it
    assert make({"score": 70, "stderr": 2.5, "n": 400}, task="t") == TaskScore(70.0, 400, 2.5)
    s = make({"samples": [100, 0, 50]}, task="t")  # the score and its uncertainty follow from the samples
    assert s.score == 50.0 and s.n == 3 and s.stderr == pytest.approx(math.sqrt((2500 + 2500 + 0) / 3) / math.sqrt(3))
    given = make({"score": 50.0, "stderr": 9.0, "samples": [100, 0]}, task="t")
    assert given.stderr == 9.0  # a stderr given is kept (e.g. a clustered or bootstrap one)
    assert make(TaskScore(1.0, 2, 0.5), task="t") == TaskScore(1.0, 2, 0.5)


@pytest.mark.parametrize("value, needle", [
    (float("nan"), "nan"), (float("inf"), "inf"), (True, "not a number"), ("high", "not a number"),
    ({"score": 1, "colour": 2}, "unknown field"), ({"stderr": 1}, "no score"), ({"score": 1, "n": 0}, "n = 0"),
    ({"score": 1, "n": 2.5}, "n = 2.5"), ({"score": 1, "stderr": -1}, "stderr = -1"),
    ({"score": 50, "samples": [1, 0]}, "samples average 0.5"),  # 0/1 samples beside a % score: units disagree
    ({"score": 50, "samples": []}, "non-empty list"), ({"samples": [1, 0], "ids": ["a"]}, "list of 2 names"),
    ({"samples": [1, 0], "ids": ["a", "a"]}, "same example id twice"), ({"score": 1, "ids": ["a"]}, "without samples"),
    ({"samples": [100, 0], "n": 3}, "n = 3 and 2 samples"), ({"samples": [1, None]}, "sample 1"),
])
def test_a_bad_value_is_refused_saying_what_is_wrong(value: object, needle: str) -> None:
    with pytest.raises(ScorerError, match="'t'") as e:
        make(value, task="t", where="the scorer")
    assert needle in e.value.render()


def test_details_round_trip_through_json_and_share_their_example_lists() -> None:
    a = {"x": TaskScore.accuracy([1, 0, 1], ["q1", "q2", "q3"]), "y": TaskScore(3.5, 10, 0.25), "z": TaskScore(1.0)}
    b = {"x": TaskScore.accuracy([0, 0, 1], ["q1", "q2", "q3"])}
    examples: dict[str, list[str]] = {}
    ja, jb = details_json(a, examples), details_json(b, examples)
    key = examples_key(["q1", "q2", "q3"])
    assert examples == {key: ["q1", "q2", "q3"]}  # one list for both candidates: they are paired on it
    assert ja["x"] == {"n": 3, "stderr": a["x"].stderr, "samples": "100,0,100", "examples": key}
    assert ja["y"] == {"n": 10, "stderr": 0.25} and ja["z"] == {"n": None, "stderr": None}
    assert jb["x"]["examples"] == key
    raw = json.loads(json.dumps({"a": ja, "examples": examples}))  # through JSON text, as on disk
    back = details_from_json({k: v.score for k, v in a.items()}, raw["a"], raw["examples"])
    assert back == a
    odd = TaskScore.from_samples([0.1, 1 / 3, 2.0])  # floats other than 0/100 survive exactly
    assert details_from_json({"t": odd.score}, details_json({"t": odd}, examples), examples)["t"] == odd


class Noisy:
    """A scorer that knows its noise: task "acc" from per-example results fixed per candidate (by its label's
    length), task "plain" a bare number (n and stderr unknown)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, built: rlmerge.Built) -> dict[str, object]:
        self.calls += 1
        k = len(built.candidate.label) % 4
        return {"acc": TaskScore.accuracy([1] * k + [0] * (4 - k), ["e1", "e2", "e3", "e4"]),
                "plain": float(k), "fields": {"score": 10.0 + k, "stderr": 1.5, "n": 40}}


def test_results_json_records_each_scores_uncertainty_and_resume_reads_it_back(example, tmp_path: Path) -> None:
    base, agents = example
    grids = ["task_arithmetic scaling=0.5,1.0,1.5"]
    scorer = Noisy()
    first = rlmerge.sweep(base, agents, tmp_path / "sweep", candidates=grids, scorer=scorer, memory="always")
    doc = json.loads((tmp_path / "sweep" / "results.json").read_text())
    key = examples_key(["e1", "e2", "e3", "e4"])
    assert doc["examples"] == {key: ["e1", "e2", "e3", "e4"]}
    for rec, s in zip(doc["candidates"], first.scored):
        want = scorer(rlmerge.Built(s.candidate, None, None, {}, Path("."), None))  # type: ignore[arg-type]
        assert rec["scores"] == {"acc": want["acc"].score, "plain": want["plain"], "fields": 10.0 + want["plain"]}
        assert rec["details"]["acc"] == {"n": 4, "stderr": want["acc"].stderr,
                                         "samples": ",".join("100" if x else "0" for x in want["acc"].samples),
                                         "examples": key}
        assert rec["details"]["plain"] == {"n": None, "stderr": None}
        assert rec["details"]["fields"] == {"n": 40, "stderr": 1.5}
        assert s.details["acc"] == want["acc"]
    # --resume with everything done scores nothing again, and keeps every detail
    again = Noisy()
    res = rlmerge.sweep(base, agents, tmp_path / "sweep", candidates=grids, scorer=again, memory="always",
                        resume=True)
    assert again.calls == 0
    assert [s.details for s in res.scored] == [s.details for s in first.scored]
    assert json.loads((tmp_path / "sweep" / "results.json").read_text())["candidates"] == doc["candidates"]


def test_a_scorer_returning_a_bad_value_is_that_candidates_failure_naming_it(example) -> None:
    base, agents = example
    with pytest.raises(rlmerge.NothingScored, match="task_arithmetic scaling=0.5.*'t'.*nan"):
        rlmerge.sweep(base, agents, candidates=["task_arithmetic scaling=0.5"], scorer=lambda b: {"t": math.nan})
    # beside a candidate it scores, the bad value is recorded on its own candidate, which ranks last
    res = rlmerge.sweep(base, agents, candidates=["task_arithmetic scaling=0.5,1.0"],
                        scorer=lambda b: {"t": math.nan if b.candidate.label.endswith("0.5") else 1.0})
    assert [s.candidate.label for s in res.ranking] == ["task_arithmetic scaling=1.0", "task_arithmetic scaling=0.5"]
    assert res.ranking[1].error is not None and "nan" in res.ranking[1].error and not res.ranking[1].scores
