"""Choices that respect noise: the paired bootstrap, the candidates indistinguishable from the best, --confirm.

Oracles: the bootstrap against the lab's own loop as it was written before it moved (bit for bit on 0/1 results);
the indistinguishable set on constructed results whose answer is known (a candidate wrong on k of 100 examples the
best gets right is indistinguishable when (1 − k/100)^100 > 2.5 %, i.e. k ≤ 3, and clearly not from k = 6; the normal
interval from standard errors by hand); confirmed scores against the values the scorer gives on the held-out split.
"""

from __future__ import annotations

import json
import math
import random
import statistics
from pathlib import Path

import pytest

import rlmerge
from rlmerge.errors import ConfigError
from rlmerge.lab.paired import bootstrap_difference
from rlmerge.scoring import TaskScorer
from rlmerge.sweeping.noise import average_interval, compare, paired_bootstrap
from rlmerge.sweeping.scores import TaskScore


def lab_loop(a: dict, b: dict, draws: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """rlmerge.lab.paired.bootstrap_difference as the lab wrote it (its published intervals came from this)."""
    families = sorted(a)
    diff = [[x - y for x, y in zip(a[f], b[f], strict=True)] for f in families]
    point = 100.0 * statistics.fmean(statistics.fmean(d) for d in diff)
    rng = random.Random(seed)
    stats = sorted(100.0 * statistics.fmean([statistics.fmean(rng.choices(d, k=len(d))) for d in diff])
                   for _ in range(draws))
    return point, stats[int(0.025 * draws)], stats[int(0.975 * draws) - 1]


def test_the_bootstrap_the_lab_and_the_sweep_share_gives_the_labs_intervals_bit_for_bit() -> None:
    rng = random.Random(1)
    for seed in range(4):
        a = {f: [float(rng.random() < 0.7) for _ in range(n)] for f, n in (("tool_use", 128), ("coding", 96))}
        b = {f: [float(rng.random() < 0.6) for _ in range(len(v))] for f, v in a.items()}
        assert bootstrap_difference(a, b, seed=seed) == lab_loop(a, b, seed=seed)
    # several candidates against one share the draws: each result is that pair's alone
    c = {f: [1.0 - x for x in v] for f, v in a.items()}
    both = paired_bootstrap(a, [b, c], seed=3)
    assert both == [paired_bootstrap(a, [b], seed=3)[0], paired_bootstrap(a, [c], seed=3)[0]]
    with pytest.raises(ValueError, match="different tasks"):
        paired_bootstrap(a, [{"tool_use": a["tool_use"]}])


def acc(wrong: set[int], n: int = 100, ids: str = "q") -> TaskScore:
    return TaskScore.accuracy([0.0 if i in wrong else 1.0 for i in range(n)], [f"{ids}{i}" for i in range(n)])


def test_indistinguishable_from_the_best_on_results_with_a_known_answer() -> None:
    best = {"t": acc(set()), "u": acc(set())}
    others = [{"t": acc(set()), "u": acc(set())},                    # the same: [0, 0]
              {"t": acc({3, 50}), "u": acc(set())},                   # 2 of 100 (P(none drawn) 13 %): contains 0
              {"t": acc({1, 2, 3, 4, 5, 6}), "u": acc(set())},        # 6 of 100 (0.2 %): does not
              {"t": acc(set(range(6))), "u": acc(set(range(6)))}]     # 6 wrong on both tasks
    v = compare(best, others, seed=0)
    assert [x["how"] for x in v] == ["paired bootstrap"] * 4
    assert [x["indistinguishable"] for x in v] == [True, True, False, False]
    assert v[0]["low"] == v[0]["high"] == 0.0
    assert v[1]["difference"] == pytest.approx(1.0) and v[2]["difference"] == pytest.approx(3.0)  # averaged over 2
    assert v[2]["low"] > 0 and v[3]["low"] > v[2]["low"]
    # no pairing (other example ids) but standard errors: the normal interval, by hand
    se = math.sqrt(0.98 * 0.02 / 100) * 100
    u = compare({"t": TaskScore(60.0, 100, 2.0)}, [{"t": TaskScore(55.0, 100, 2.0)}, {"t": TaskScore(50.0, 100, 2.0)},
                                                   {"t": TaskScore(59.0)}])
    half = 1.959963984540054 * math.sqrt(8.0)
    assert u[0] == {"difference": 5.0, "low": 5.0 - half, "high": 5.0 + half, "how": "normal",
                    "indistinguishable": True}
    assert u[1]["indistinguishable"] is False and u[2] is None  # a plain number: nothing can be said
    unpaired = compare({"t": acc(set())}, [{"t": acc({1, 2}, ids="other")}])[0]
    assert unpaired["how"] == "normal" and unpaired["difference"] == pytest.approx(2.0)
    assert unpaired["high"] - unpaired["difference"] == pytest.approx(1.959963984540054 * se)
    assert average_interval({"t": TaskScore(60.0, 100, 2.0), "u": TaskScore(40.0, 100, 4.0)}) == pytest.approx(
        {"stderr": math.sqrt(20.0) / 2, "low": 50.0 - 1.959963984540054 * math.sqrt(20.0) / 2,
         "high": 50.0 + 1.959963984540054 * math.sqrt(20.0) / 2})
    assert average_interval({"t": TaskScore(60.0)}) is None


def by_scaling(built: rlmerge.Built) -> dict:
    """Per example results fixed by the candidate's scaling: 1.0 right on all 100, 0.5 wrong on 2, 1.5 on 6, and 2.0
    a plain number (no noise known)."""
    scaling = float(dict(built.candidate.params)["scaling"])
    if scaling == 2.0:
        return {"t": 10.0}
    wrong = {0.5: {7, 70}, 1.0: set(), 1.5: set(range(10, 16))}[scaling]
    return {"t": acc(wrong)}


def test_the_sweep_records_intervals_and_marks_the_candidates_indistinguishable_from_the_best(example,
                                                                                              tmp_path: Path) -> None:
    base, agents = example
    res = rlmerge.sweep(base, agents, tmp_path / "sw", candidates=["task_arithmetic scaling=0.5,1.0,1.5,2.0"],
                        scorer=by_scaling, seed=4)
    label = {s.candidate.id: dict(s.candidate.params)["scaling"] for s in res.scored}
    assert [label[s.candidate.id] for s in res.indistinguishable] == ["1.0", "0.5"]
    doc = json.loads((tmp_path / "sw" / "results.json").read_text())
    assert [label[i] for i in doc["indistinguishable"]] == ["1.0", "0.5"]
    assert doc["noise"] == {"level": 0.95, "draws": 2000, "seed": 4, "how": ["paired bootstrap"]}
    rec = {label[c["id"]]: c for c in doc["candidates"]}
    assert rec["1.0"]["vs_best"] is None and rec["2.0"]["vs_best"] is None and rec["2.0"]["interval"] is None
    assert rec["1.5"]["vs_best"]["indistinguishable"] is False and rec["1.5"]["vs_best"]["difference"] == 6.0
    assert rec["0.5"]["interval"]["low"] < 98.0 < rec["0.5"]["interval"]["high"]
    report = (tmp_path / "sw" / "report.md").read_text()
    assert "## Indistinguishable from the best" in report and report.count(" | = | ") == 2
    iv = rec["0.5"]["interval"]
    assert f"| 98.00 | [{iv['low']:.2f}, {iv['high']:.2f}] | = |" in report
    # plot.png's bars carry the same intervals as error bars (half-width 1.96 standard errors; none where unknown)
    pytest.importorskip("matplotlib")
    from matplotlib.container import BarContainer

    from rlmerge.report.sweep import figure

    bars = next(c for c in figure(doc).axes[0].containers if isinstance(c, BarContainer))
    ranked = [rec[label[i]] for i in doc["ranking"]]
    widths = [seg[1][0] - seg[0][0] for seg in bars.errorbar.lines[2][0].get_segments()]
    assert widths == pytest.approx([2 * (c["average"] - c["interval"]["low"]) if c["interval"] else 0.0
                                    for c in ranked])
    assert [b.get_hatch() for b in bars] == ["///", "///", None, None]
    # nothing known of the noise: no candidate is marked either way
    plain = rlmerge.sweep(base, agents, None, candidates=["task_arithmetic scaling=0.5,1.0"],
                          scorer=lambda b: {"t": float(dict(b.candidate.params)["scaling"])})
    assert plain.indistinguishable == []


SCORER = '''
def score(built, split="val"):
    scaling = float(dict(built.candidate.params)["scaling"])
    CALLS.append((built.candidate.id, split))
    if split == "val" and scaling in FAIL:
        raise RuntimeError("this candidate's evaluation failed")
    # chosen on val, where the largest scaling looks best; the held-out split says otherwise
    return {"t": 10 * scaling if split == "val" else 20 - 10 * scaling}

def plain(built):
    return {"t": 1.0}

CALLS = []
FAIL = set()
'''


def test_confirm_scores_the_best_again_on_the_held_out_split_beside_their_search_scores(example,
                                                                                      tmp_path: Path) -> None:
    base, agents = example
    (tmp_path / "evals.py").write_text(SCORER)
    val = TaskScorer([f"py:{tmp_path / 'evals.py'}:score"])
    test = val.held_out("test")
    calls = val.parts[0].function().__globals__["CALLS"]
    grid = ["task_arithmetic scaling=0.5,1.0,1.5"]
    res = rlmerge.sweep(base, agents, tmp_path / "sw", candidates=grid, scorer=val, confirm=test, keep=2,
                        settings=val.settings())
    top = [s.candidate for s in res.ranking[:2]]
    assert [dict(c.params)["scaling"] for c in top] == ["1.5", "1.0"]
    assert {cid: c.average for cid, c in res.confirmed.items()} == {top[0].id: 5.0, top[1].id: 10.0}
    doc = json.loads((tmp_path / "sw" / "results.json").read_text())
    assert [(r["search_average"], r["average"], r["gap"]) for r in doc["confirmed"]] == [(15.0, 5.0, 10.0),
                                                                                       (10.0, 10.0, 0.0)]
    assert doc["confirm"] == {"top": 2, "settings": test.settings()}
    assert "## Confirmed on test" in (tmp_path / "sw" / "report.md").read_text()
    assert [s for _, s in calls] == ["val", "val", "val", "test", "test"]
    # --resume reads the confirmed scores back; a different top confirms the one more
    rlmerge.sweep(base, agents, tmp_path / "sw", candidates=grid, scorer=val, confirm=test, keep=2, resume=True,
                  settings=val.settings())
    assert len(calls) == 5
    res = rlmerge.sweep(base, agents, None, candidates=grid, scorer=val, confirm=test, confirm_top=3)
    assert len(res.confirmed) == 3 and len(calls) == 5 + 3 + 3


def test_a_resume_that_scores_again_keeps_the_earlier_confirmed_scores(example, tmp_path: Path) -> None:
    """A resume that rescores a failed candidate saves results.json before it confirms: the confirmed scores are
    read from the earlier run's file before that, so they are kept, not scored again."""
    base, agents = example
    (tmp_path / "evals.py").write_text(SCORER)
    val = TaskScorer([f"py:{tmp_path / 'evals.py'}:score"])
    test = val.held_out("test")
    module = val.parts[0].function().__globals__
    calls, fail = module["CALLS"], module["FAIL"]
    grid = ["task_arithmetic scaling=0.5,1.0,1.5"]
    fail.add(0.5)
    first = rlmerge.sweep(base, agents, tmp_path / "sw", candidates=grid, scorer=val, confirm=test, keep=2,
                          settings=val.settings())
    assert len(first.failed) == 1 and len(first.confirmed) == 2 and len(calls) == 5
    fail.clear()
    again = rlmerge.sweep(base, agents, tmp_path / "sw", candidates=grid, scorer=val, confirm=test, keep=2,
                          resume=True, settings=val.settings())
    assert [s for _, s in calls[5:]] == ["val"]  # the failed candidate only; the two confirmed ones are kept
    assert {k: c.average for k, c in again.confirmed.items()} == {k: c.average for k, c in first.confirmed.items()}


def test_confirm_is_refused_where_a_scorer_has_no_held_out_split(tmp_path: Path) -> None:
    (tmp_path / "evals.py").write_text(SCORER)
    with pytest.raises(ConfigError, match="chosen on val already"):
        TaskScorer([f"py:{tmp_path / 'evals.py'}:score"]).held_out("val")
    with pytest.raises(ConfigError, match=r"py:.*evals.py:plain cannot score a held-out split"):
        TaskScorer([f"py:{tmp_path / 'evals.py'}:score", f"py:{tmp_path / 'evals.py'}:plain"]).held_out("test")
