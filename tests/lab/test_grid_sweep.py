"""The lab's validation grids run through `rlmerge.sweep`: the same scores, pick and kept bytes as merging each
candidate alone.

Oracle: the loop the lab ran before the sweep, kept here as the reference: each candidate merged alone by
`rlmerge.merge` in float32 into its own folder, scored from disk by the lab's own `score_checkpoint` (the model
loaded by `from_pretrained`), the pick the best validation average, the first of equals. The sweep builds the
candidates in memory and scores them with `rlmerge.scoring.TaskScorer`; its per-family scores must equal the
reference's (both are 100 × the same fraction), its pick the reference's, and its kept `best-1` the reference
merge of the pick, byte for byte (bar the provenance files, which name the sweep).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("transformers")

import rlmerge  # noqa: E402 - after the importorskip
from conftest import CHAT_TEMPLATE, lab_checkpoints  # noqa: E402
from rlmerge.lab.evaluate import score_checkpoint  # noqa: E402
from rlmerge.lab.grid import evaluate_candidates, pick  # noqa: E402
from rlmerge.lab.tasks import FAMILIES, make_family, make_split  # noqa: E402
from rlmerge.scoring import TaskScorer  # noqa: E402

N_VAL = 16
PROVENANCE = ("rlmerge.json", "README.md")  # name the sweep (its candidate, rank, scores): not the merge's bytes


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    """A tiny lab base warmed up until it answers some validation examples right (coding, memory), and two
    agents: the base plus sparse perturbations, so that merges of them score differently (~3 s)."""
    return lab_checkpoints(tmp_path_factory.mktemp("lab-grid"), scale=0.01, warm_steps=150,
                           chat_template=CHAT_TEMPLATE)


def _val() -> dict[str, list[Any]]:
    return {f: make_split(make_family(f), "val", N_VAL, 0) for f in FAMILIES}


def _scorer(kind: str = "word") -> TaskScorer:
    return TaskScorer([f"lab:{f}" for f in FAMILIES], limit=N_VAL, split="val", seed=0, kind=kind)  # type: ignore


def _reference(base: Path, agents: list[Path], method: str, candidates: list[dict[str, Any]], work: Path,
               extra: Mapping[str, Any] | None = None, kind: str = "word",
               ) -> tuple[list[dict[str, float]], int, list[Path]]:
    """The loop before the sweep: merge alone (float32), score from disk, best average first of equals."""
    val, scores, paths = _val(), [], []
    for i, params in enumerate(candidates):
        out = work / f"ref-{i}"
        p = {k: v for k, v in {**params, **(extra or {})}.items() if k != "seed"}
        rlmerge.merge(base, agents, out, method=method, params=p, seed=int(params.get("seed", 0)), dtype="float32",
                      quiet=True)
        scores.append(score_checkpoint(out, val, kind))  # type: ignore[arg-type]
        paths.append(out)

    # exact: n correct answers per family (the same n for all), so equal totals are ties, whatever the float sums
    def total(s: dict[str, float]) -> Fraction:
        return sum((Fraction(round(v * N_VAL), N_VAL) for v in s.values()), Fraction(0))

    best = max(range(len(candidates)), key=lambda i: total(scores[i]))  # max keeps the first of equal keys
    return scores, best, paths


def _same_checkpoint(kept: Path, alone: Path) -> None:
    names = sorted(p.name for p in kept.iterdir())
    assert names == sorted(p.name for p in alone.iterdir())
    for n in names:
        if n not in PROVENANCE:
            assert (kept / n).read_bytes() == (alone / n).read_bytes(), n
    assert {t.dtype for t in load_file(kept / "model.safetensors").values()} == {torch.float32}  # as computed


def _check(base: Path, agents: list[Path], method: str, candidates: list[dict[str, Any]], tmp: Path,
           extra: Mapping[str, Any] | None = None, kind: str = "word") -> list[Any]:
    results = evaluate_candidates(base, agents, method, candidates, tmp / "sweep", _scorer(kind), extra=extra)
    ref_scores, ref_best, ref_paths = _reference(base, agents, method, candidates, tmp, extra, kind)
    for got, want, params in zip(results, ref_scores, candidates, strict=True):
        assert got.params == params
        assert got.val == {f"lab:{f}": 100.0 * v for f, v in want.items()}, params  # exactly: the same fraction
    chosen = pick(results)
    assert chosen is results[ref_best] and chosen.rank == 0
    assert chosen.path == tmp / "sweep" / "best-1" and [r.path for r in results].count(None) == len(results) - 1
    _same_checkpoint(chosen.path, ref_paths[ref_best])
    assert not list((tmp / "sweep").glob("candidate-*"))  # built in memory: only the pick is written
    doc = json.loads((tmp / "sweep" / "results.json").read_text())
    assert {c["where"] for c in doc["candidates"]} == {"memory"}
    return results


def test_task_arithmetic_grid_scores_picks_and_keeps_what_merging_alone_does(lab, tmp_path: Path) -> None:
    base, agents = lab
    cands = [{"scaling": s} for s in (0.5, 1.0, 3.0, 6.0, 10.0)]
    results = _check(base, agents, "task_arithmetic", cands, tmp_path)
    # the grid matters here: not every candidate scores the same, so a wrong candidate's scores would show
    assert len({tuple(r.val.values()) for r in results}) > 1


def test_ram_plus_grid_shares_one_statistics_pass_and_reports_lambda(lab, tmp_path: Path) -> None:
    from rlmerge.sweeping.cache import StatsCache

    base, agents = lab
    cands = [{"preset": "paper", "r": r, "alpha": a} for r in (0.1, 2.0) for a in (2.0, 32.0)]
    results = _check(base, agents, "ram+", cands, tmp_path)
    alone = rlmerge.merge(base, agents, tmp_path / "lambda", method="ram+", params=cands[3], dtype="float32",
                          quiet=True)
    assert results[3].info["lambdas"] == pytest.approx([float(x) for x in alone.lambdas], abs=0)
    cache = StatsCache()  # a cache shared by two rows (as run_merges shares one per seed): counted once for both
    evaluate_candidates(base, agents, "ram+", cands[:2], tmp_path / "row1", _scorer(), cache=cache)
    evaluate_candidates(base, agents, "ram+", [{"preset": "official"}], tmp_path / "row2", None, cache=cache)
    assert cache.hits["counts"] >= 2  # the second candidate, the kept merge and the second row's all reused them


def test_random_methods_keep_each_candidates_seed(lab, tmp_path: Path) -> None:
    base, agents = lab
    cands = [{"density": 0.3, "scaling": 1.5, "seed": s} for s in (0, 1, 2)]
    results = _check(base, agents, "dare_ta", cands, tmp_path)
    # each seed's scores are its own merge's (checked above), and here they differ: a sweep that dropped the seeds
    # would have scored seed 0's merge three times
    assert len({tuple(r.val.values()) for r in results}) > 1
    doc = json.loads((tmp_path / "sweep" / "results.json").read_text())
    assert [c["seed"] for c in doc["candidates"]] == [0, 1, 2]


def test_fisher_side_inputs_reach_every_candidate_and_are_not_part_of_it(lab, tmp_path: Path) -> None:
    from rlmerge.lab.merging import estimate_fishers

    base, agents = lab
    data = []
    for fam in FAMILIES[:2]:  # each agent's Fisher on its own family's (prompt, answer) pairs, as the pipeline does
        rows = make_split(make_family(fam), "train", 4, 7)
        data.append(tmp_path / f"{fam}.jsonl")
        data[-1].write_text("".join(json.dumps({"prompt": ex.prompt, "completion": ex.target}) + "\n" for ex in rows))
    extra = {"fisher": [str(p) for p in estimate_fishers(agents, data, tmp_path / "fisher", 4)]}
    cands = [{"normalize": False}, {"normalize": True}]
    results = _check(base, agents, "fisher", cands, tmp_path, extra)
    assert all("fisher" not in r.params for r in results)


def test_the_sweeps_lab_scorer_sees_the_tasks_as_the_runs_models_do(lab, tmp_path: Path) -> None:
    """SmolLM2 runs are prompted and scored through the chat view: the sweep's scorer must use it too."""
    base, agents = lab
    cands = [{"scaling": 0.5}, {"scaling": 1.0}]
    chat = _check(base, agents, "task_arithmetic", cands, tmp_path, kind="chat")
    word = evaluate_candidates(base, agents, "task_arithmetic", cands, tmp_path / "word", _scorer("word"))
    assert [r.val for r in chat] != [r.val for r in word]  # a scorer that ignored the view would score words


def test_a_one_point_grid_is_merged_and_kept_but_not_scored(lab, tmp_path: Path) -> None:
    base, agents = lab
    calls: list[Any] = []
    (only,) = evaluate_candidates(base, agents, "linear", [{}], tmp_path / "sweep", lambda b: calls.append(b) or {})
    assert calls == [] and only.val == {} and pick([only]) is only
    alone = rlmerge.merge(base, agents, tmp_path / "alone", method="linear", dtype="float32", quiet=True)
    _same_checkpoint(only.path, alone.output)


@pytest.mark.parametrize("failing", ["scaling=0.5", "scaling"], ids=["one candidate", "every candidate"])
def test_a_scorer_failure_stops_the_lab_row(lab, tmp_path: Path, failing: str) -> None:
    """The sweep records a scorer's failure and goes on; a lab row must not quietly pick among what scored (nor be
    skipped as a merge the engine refused): it raises, as it did before the sweep recorded failures."""
    base, agents = lab

    def score(built: rlmerge.Built) -> dict[str, float]:
        if failing in built.candidate.label:
            raise ValueError("the lab scorer broke")
        return {"x": 1.0}

    with pytest.raises(RuntimeError, match="the lab scorer broke") as info:
        evaluate_candidates(base, agents, "task_arithmetic", [{"scaling": 0.5}, {"scaling": 1.0}], tmp_path / "s",
                            score)
    assert type(info.value) is RuntimeError  # not the lab's MergeFailed (a row it skips)


def test_equal_averages_are_ties_whatever_their_float_rounding(example, tmp_path: Path) -> None:
    """3 of 48 right over three tasks averages 2.0833333333333335 % as (3, 0, 0) and 2.083333333333333 % as
    (2, 1, 0): the first candidate in grid order must win, as the lab's pick always did."""
    base, agents = example
    per = {0.5: (2, 1, 0), 1.0: (3, 0, 0), 2.0: (0, 0, 1)}

    def score(built: rlmerge.Built) -> dict[str, float]:
        return {f"t{i}": v for i, v in enumerate(_percent(per[float(dict(built.candidate.params)["scaling"])]))}

    assert sum(_percent(per[1.0])) / 3 > sum(_percent(per[0.5])) / 3  # the float sums differ …
    results = evaluate_candidates(base, agents, "task_arithmetic", [{"scaling": s} for s in per], tmp_path / "s",
                                  score)
    assert pick(results).params == {"scaling": 0.5}  # … yet the first of the two equal averages is picked
    assert [r.rank for r in results] == [0, 1, 2]


def _percent(correct: tuple[int, ...], n: int = 48) -> list[float]:
    """Per task, the lab scorer's number for `correct` of `n` right (score_examples' mean of 0/1, × 100)."""
    return [100.0 * (sum([1.0] * k + [0.0] * (n - k)) / n) for k in correct]
