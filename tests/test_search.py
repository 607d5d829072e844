"""`rlmerge sweep --search random|tpe|cmaes --trials N`: spaces, exactly N trials, seeds, resume, the journal file.

Oracles: the parsed space against the syntax (ranges, log, ints from the parameter's type, lists, fixed values) and
every refusal at once before a weight is read (no sweep folder made, the scorer never called); trials against a
second run with the same seed (the same trials) and another seed (others); an interrupted study (a scorer raising
KeyboardInterrupt at trial k) resumed against the uninterrupted one: the same trials, exactly N told, trial k scored
once more; the statistics cache against a grid over the very candidates the search tried (the same cache hits and
passes); the journal against the sweep folder's rules (a changed byte refuses the resume, an unrecorded tail is cut).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import rlmerge
from conftest import load_output
from rlmerge.errors import ConfigError, OutputError, RLMergeError
from rlmerge.sweeping.candidates import Candidate
from rlmerge.sweeping.space import parse_space, parse_spaces

pytest.importorskip("optuna")

TWO = ["ram+ r=0.01..0.5:log alpha=0.5..3", "ties density=0.05..0.9 scaling=0.5..1.5"]


class Near:
    """One 'task': the negative distance of the merge to the first agent (computed from the weights). With ``stop``,
    the ``stop``-th call raises KeyboardInterrupt (as Ctrl-C in the middle of scoring a trial would)."""

    def __init__(self, agent: Path, stop: int | None = None) -> None:
        self.target = load_output(agent)
        self.calls: list[str] = []
        self.stop = stop

    def __call__(self, built: rlmerge.Built) -> dict[str, float]:
        self.calls.append(built.candidate.id)
        if len(self.calls) == self.stop:
            raise KeyboardInterrupt
        t = built.tensors if built.tensors is not None else load_output(built.path)
        return {"near": -sum(float((t[k].float() - v.float()).square().sum()) for k, v in self.target.items()
                             if v.is_floating_point() and k in t)}


def results(folder: Path) -> dict:
    return json.loads((folder / "results.json").read_text())


def test_space_syntax_ranges_logs_ints_lists_and_fixed_values() -> None:
    s = parse_space("ram+ r=0.01..0.5:log alpha=0.5..3 preset=paper")
    assert [(d.key, d.kind, d.lo, d.hi, d.log) for d in s.dims] == [
        ("r", "float", 0.01, 0.5, True), ("alpha", "float", 0.5, 3.0, False), ("preset", "fixed", 0.0, 0.0, False)]
    # an int parameter (unique's agent) and a random method's seed are sampled as ints; a list is a choice
    assert [d.kind for d in parse_space("unique agent=0..2").dims] == ["int"]
    dare = parse_space("dare_ties density=0.1..0.9 seed=0..4 rescale=inverse,l1 weights=[1,0.5,0.5],[1,1,1]")
    assert [d.kind for d in dare.dims] == ["float", "int", "choice", "choice"]
    assert dare.dims[3].values == (["1", "0.5", "0.5"], ["1", "1", "1"])
    c = dare.candidate({"density": 0.3, "seed": 2, "rescale": "l1", "weights": ["1", "1", "1"]})
    assert c.seed == 2 and dict(c.params) == {"density": 0.3, "rescale": "l1", "weights": ["1", "1", "1"]}
    # a recipe's mapping says the same
    assert parse_space({"method": "ties", "parameters": {"density": "0.05..0.9", "scaling": [0.5, 1.0]}}).dims[1] \
        .values == (0.5, 1.0)


def test_every_bad_value_is_refused_at_once_before_any_weight_is_read(example, tmp_path: Path) -> None:
    base, agents = example
    scorer = Near(agents[0])
    bad = ["ram+ r=0.5..0.01 alpha=abc..2 preset=x",       # LO ≥ HI, not a number, an unknown preset
           "ties density=0..0.5:log scaling=0.1..20 normalize=0..1",  # log from 0, out of range, a bool's range
           "unique agent=0.5..2",                          # an int parameter's fractional end
           "task_arithmetic scaling=0.5..1 seed=0..3",     # a seed for a method that draws nothing
           "ties densty=0.1..0.2"]                          # an unknown parameter
    with pytest.raises(RLMergeError) as e:
        rlmerge.sweep(base, agents, tmp_path / "sw", candidates=bad, scorer=scorer, search="tpe", trials=4)
    text = e.value.render()
    for says in ("r=0.5..0.01: a range needs LO < HI", "alpha=abc..2", "'x' is not one of",
                 "density=0..0.5:log: a log-scale range needs LO > 0", "scaling = 20.0 is out of range",
                 "normalize takes no number", "agent=0.5..2: the ends of a range are whole numbers",
                 "task_arithmetic draws nothing at random", "unknown parameter 'densty'"):
        assert says in text, (says, text)
    assert not (tmp_path / "sw").exists() and scorer.calls == []
    with pytest.raises(ConfigError, match="a range is searched, not listed in a grid"):  # a grid takes no range
        rlmerge.sweep(base, agents, tmp_path / "sw", candidates=["ram+ r=0.01..0.5"], scorer=scorer)
    with pytest.raises(ConfigError, match="--trials 3: a grid tries every candidate"):
        rlmerge.sweep(base, agents, tmp_path / "sw", candidates=["ram+ r=0.1"], scorer=scorer, trials=3)
    for trials, said in ((None, "no --trials"), (0, "--trials 0"), (2.5, "--trials 2.5")):
        with pytest.raises(ConfigError, match=f"{said}: a search runs a whole number"):
            rlmerge.sweep(base, agents, tmp_path / "sw", candidates=["ram+ r=0.01..0.5"], search="tpe",
                          trials=trials, scorer=scorer)
    with pytest.raises(ConfigError, match="at least two ranges"):  # CMA-ES adapts a covariance: ≥ 2 dimensions
        rlmerge.sweep(base, agents, tmp_path / "sw", candidates=["ram+ r=0.01..0.5 alpha=1,2"], search="cmaes",
                      trials=4, scorer=scorer)
    with pytest.raises(ConfigError, match="several --candidate"):
        rlmerge.sweep(base, agents, tmp_path / "sw", candidates=TWO, search="cmaes", trials=4, scorer=scorer)
    with pytest.raises(ConfigError, match="nothing scores the candidates"):
        rlmerge.sweep(base, agents, tmp_path / "sw", candidates=TWO, search="tpe", trials=4)
    assert not (tmp_path / "sw").exists() and scorer.calls == []


def test_tpe_runs_exactly_n_trials_over_the_method_choice_and_each_methods_own_space(example, tmp_path: Path) -> None:
    base, agents = example
    scorer = Near(agents[0])
    res = rlmerge.sweep(base, agents, tmp_path / "sw", candidates=TWO, scorer=scorer, search="tpe", trials=8, seed=2,
                        keep=1)
    doc = results(tmp_path / "sw")
    assert len(doc["trials"]) == 8 and {t["state"] for t in doc["trials"]} == {"complete"}
    assert len(scorer.calls) == len(set(scorer.calls)) == len(res.scored) <= 8  # a repeated point is not rebuilt
    spaces = {s.method: s for s in parse_spaces(TWO)}
    methods = set()
    for t in doc["trials"]:
        method = t["params"]["method"]
        methods.add(method)
        own = {k.split(".", 1)[1]: v for k, v in t["params"].items() if k != "method"}
        assert all(k.startswith(method + ".") for k in t["params"] if k != "method")  # a conditional space
        for d in spaces[method].dims:
            assert d.lo <= own[d.key] <= d.hi
        rec = next(c for c in doc["candidates"] if c["id"] == t["candidate"])
        assert rec["method"] == method and set(rec["params"]) == set(own)
        assert t["value"] == pytest.approx(rec["average"])  # Optuna is told the ranking's average
        # the label is what was merged: each float to 6 significant digits
        assert rec["params"] == {k: float(f"{v:.6g}") for k, v in own.items()}
    assert methods == {"ram+", "ties"}
    assert doc["search"] == {"kind": "tpe", "trials": 8, "seed": 2, "batch": 1, "spaces": TWO}
    best = max(res.scored, key=lambda s: s.average)
    assert res.ranking[0] is best and json.loads((res.kept[0] / "rlmerge.json").read_text())["recipe"]["sweep"][
        "candidate"]["id"] == best.candidate.id
    assert "## Search" in (tmp_path / "sw" / "report.md").read_text()


@pytest.mark.parametrize("kind", ["random", "tpe", "cmaes"])
def test_the_same_seed_gives_the_same_trials_and_an_interrupted_study_resumes_to_exactly_n(
        example, tmp_path: Path, kind: str) -> None:
    base, agents = example
    spaces = ["ties density=0.05..0.9 scaling=0.5..1.5"] if kind == "cmaes" else TWO
    n, k = 8, 4
    kw = {"candidates": spaces, "search": kind, "trials": n, "seed": 5}
    w = Near(agents[0])
    whole = rlmerge.sweep(base, agents, tmp_path / "whole", scorer=w, **kw)
    again = rlmerge.sweep(base, agents, tmp_path / "again", scorer=Near(agents[0]), **kw)
    other = rlmerge.sweep(base, agents, tmp_path / "other", scorer=Near(agents[0]), **{**kw, "seed": 6})
    trials = [(t["number"], t["candidate"], t["params"]) for t in results(tmp_path / "whole")["trials"]]
    assert len(trials) == n and [(t["number"], t["candidate"], t["params"]) for t in
                                 results(tmp_path / "again")["trials"]] == trials
    assert [t["params"] for t in results(tmp_path / "other")["trials"]] != [t[2] for t in trials]
    assert [s.scores for s in again.scored] == [s.scores for s in whole.scored]
    assert other.scored

    stopped = Near(agents[0], stop=k)
    with pytest.raises(KeyboardInterrupt):
        rlmerge.sweep(base, agents, tmp_path / "cut", scorer=stopped, **kw)
    told = [t for t in results(tmp_path / "cut")["trials"] if t["state"] != "running"]
    assert len(told) == k - 1
    resumed = Near(agents[0])
    res = rlmerge.sweep(base, agents, tmp_path / "cut", scorer=resumed, resume=True, **kw)
    doc = results(tmp_path / "cut")
    assert [(t["number"], t["candidate"], t["params"]) for t in doc["trials"]] == trials  # an uninterrupted run's
    assert {t["state"] for t in doc["trials"]} == {"complete"}
    assert resumed.calls[0] == stopped.calls[-1]  # the interrupted trial is scored first, with its own parameters
    assert sorted(stopped.calls[:-1] + resumed.calls) == sorted(w.calls)  # each candidate scored once in all
    assert [s.scores for s in res.scored] == [s.scores for s in whole.scored]
    # resumed again with more trials: it continues to the new total, asking what a longer run would have
    longer = rlmerge.sweep(base, agents, tmp_path / "longer", scorer=Near(agents[0]), **{**kw, "trials": n + 2})
    rlmerge.sweep(base, agents, tmp_path / "cut", scorer=Near(agents[0]), resume=True, **{**kw, "trials": n + 2})
    assert [t["params"] for t in results(tmp_path / "cut")["trials"]] == \
        [t["params"] for t in results(tmp_path / "longer")["trials"]]
    assert len(longer.scored) >= len(whole.scored)


def test_every_trial_shares_the_statistics_cache_as_a_grid_of_the_same_candidates_does(example,
                                                                                       tmp_path: Path) -> None:
    base, agents = example
    space = ["ram+ r=0.01..0.5:log alpha=0.5..3", "ties density=0.1,0.3 scaling=0.5..1.5"]
    found = rlmerge.sweep(base, agents, tmp_path / "search", candidates=space, scorer=Near(agents[0]),
                          search="tpe", trials=8, seed=1)
    tried = [s.candidate for s in found.scored]
    grid = rlmerge.sweep(base, agents, tmp_path / "grid", candidates=tried, scorer=Near(agents[0]))
    assert found.cache_hits == grid.cache_hits and found.statistics_passes == grid.statistics_passes
    assert [p.passes for p in found.scored] == [p.passes for p in grid.scored]
    assert sum(c.method == "ram+" for c in tried) >= 2 and found.cache_hits["counts"] >= 1  # RAM+'s counts: once
    assert [s.scores for s in found.scored] == [s.scores for s in grid.scored]


def test_a_failed_trial_is_told_and_counts_and_a_refused_combination_is_a_failed_trial(example,
                                                                                      tmp_path: Path) -> None:
    base, agents = example

    def scorer(built: rlmerge.Built) -> dict[str, float]:
        if dict(built.candidate.params)["scaling"] > 1.0:
            raise ValueError("too large")
        return {"s": dict(built.candidate.params)["scaling"]}

    # della: density ± epsilon must stay inside (0, 1), a combination only the sampled pair can break
    res = rlmerge.sweep(base, agents, tmp_path / "sw", candidates=["della density=0.1..0.9 epsilon=0.05..0.45 "
                                                                   "scaling=0.5..1.5"],
                        scorer=scorer, search="random", trials=10, seed=0)
    doc = results(tmp_path / "sw")
    states = [t["state"] for t in doc["trials"]]
    assert len(states) == 10 and "fail" in states and "complete" in states
    refused = [t for t in doc["trials"] if t["candidate"] is None]
    for t in refused:  # told failed without a merge: the pair leaves (0, 1)
        p = t["params"]
        assert t["state"] == "fail" and not (p["density"] - p["epsilon"] > 0 and p["density"] + p["epsilon"] < 1)
    for s in res.scored:
        t = next(t for t in doc["trials"] if t["candidate"] == s.candidate.id)
        assert (t["state"] == "fail") == (s.error is not None) == (dict(s.candidate.params)["scaling"] > 1.0)
    assert res.failed and all(s.error is not None for s in res.ranking[-len(res.failed):])  # ranked last
    # resumed to 12: the failed trials stay told (no retry); two more trials, exactly 12
    rlmerge.sweep(base, agents, tmp_path / "sw", candidates=["della density=0.1..0.9 epsilon=0.05..0.45 "
                                                             "scaling=0.5..1.5"],
                  scorer=scorer, search="random", trials=12, seed=0, resume=True)
    again = results(tmp_path / "sw")["trials"]
    assert len(again) == 12 and [t["state"] for t in again[:10]] == states


def test_the_study_is_a_journal_file_the_sweep_folder_proves_its_own(example, tmp_path: Path) -> None:
    base, agents = example
    kw = {"candidates": ["ties density=0.05..0.9 scaling=0.5..1.5"], "search": "tpe", "seed": 3}
    out = tmp_path / "sw"
    rlmerge.sweep(base, agents, out, scorer=Near(agents[0]), trials=3, **kw)
    journal = out / "study.journal"
    listed = json.loads((out / "rlmerge-sweep.json").read_text())["files"]["study.journal"]
    assert listed["append"] and listed["bytes"] == journal.stat().st_size
    # a crash after Optuna appended and before the folder recorded it: the unrecorded tail is cut on --resume
    recorded = journal.read_bytes()
    with open(journal, "ab") as f:
        f.write(b'{"op_code": 4, "worker_id": "x", "trial_id": 99}\n')
    rlmerge.sweep(base, agents, out, scorer=Near(agents[0]), trials=4, resume=True, **kw)
    assert journal.read_bytes().startswith(recorded) and len(results(out)["trials"]) == 4
    assert b'"trial_id": 99' not in journal.read_bytes()
    # a byte changed inside what was recorded: not rlmerge's any more, nothing is touched
    data = bytearray(journal.read_bytes())
    data[10] ^= 1
    journal.write_bytes(bytes(data))
    with pytest.raises(OutputError, match="study.journal, changed since rlmerge wrote it"):
        rlmerge.sweep(base, agents, out, scorer=Near(agents[0]), trials=5, resume=True, **kw)
    assert journal.read_bytes() == bytes(data)
    # another search in the same folder (other spaces): refused by results.json's fingerprint
    data[10] ^= 1
    journal.write_bytes(bytes(data))
    with pytest.raises(OutputError, match="other inputs or with other scoring settings"):
        rlmerge.sweep(base, agents, out, scorer=Near(agents[0]), trials=5, resume=True,
                      **{**kw, "candidates": ["ties density=0.05..0.5 scaling=0.5..1.5"]})
    rlmerge.sweep(base, agents, out, scorer=Near(agents[0]), trials=2, force=True, **kw)  # --force starts over
    assert len(results(out)["trials"]) == 2
    # a journal lost since: the study starts afresh, asks the same trials, and the scored candidates are not redone
    before = results(out)["trials"]
    journal.unlink()
    again = Near(agents[0])
    rlmerge.sweep(base, agents, out, scorer=again, trials=3, resume=True, **kw)
    after = results(out)["trials"]
    assert [t["params"] for t in after[:2]] == [t["params"] for t in before] and len(after) == 3
    assert again.calls == [after[2]["candidate"]]


def test_a_search_takes_spaces_not_candidates_and_a_recipe_holds_its_spaces(example, tmp_path: Path) -> None:
    base, agents = example
    with pytest.raises(ConfigError, match="not Candidate objects"):
        rlmerge.sweep(base, agents, None, candidates=[Candidate("ram+")], search="tpe", trials=2,
                      scorer=Near(agents[0]))
    from rlmerge.cli import main

    (tmp_path / "evals.py").write_text("def score(built):\n    return {'t': dict(built.candidate.params)['density']}\n")
    recipe = tmp_path / "sweep.yaml"
    recipe.write_text(f"base_model: {base}\nmodels: [{', '.join(map(str, agents))}]\nsearch: random\ntrials: 3\n"
                      f"tasks: 'py:{tmp_path / 'evals.py'}:score'\n"
                      "candidates:\n  - method: ties\n    parameters: {density: '0.1..0.9', scaling: [0.5, 1.0]}\n")
    assert main(["sweep", "--recipe", str(recipe), "-o", str(tmp_path / "sw"), "-q"]) == 0
    assert len(results(tmp_path / "sw")["trials"]) == 3
    recipe.write_text(recipe.read_text().replace("'0.1..0.9'", "'0.9..0.1'"))
    assert main(["sweep", "--recipe", str(recipe), "-o", str(tmp_path / "sw2"), "-q"]) == 2


def test_the_command_line_searches_confirms_and_refuses_every_bad_value_at_once(example, tmp_path: Path,
                                                                                capsys) -> None:
    from rlmerge.cli import main

    base, agents = example
    (tmp_path / "evals.py").write_text("def score(built, split='val'):\n"
                                       "    s = float(dict(built.candidate.params)['scaling'])\n"
                                       "    return {'t': s if split == 'val' else -s}\n")
    head = ["sweep", str(base), *map(str, agents), "--tasks", f"py:{tmp_path / 'evals.py'}:score"]
    args = [*head, "-o", str(tmp_path / "sw"), "--candidate", "ties density=0.1..0.9 scaling=0.5..1.5",
            "--candidate", "task_arithmetic scaling=0.5,1.0", "--search", "tpe", "--trials", "5", "--seed", "1",
            "--confirm", "test", "--keep", "1", "--json"]
    assert main(args) == 0
    printed = json.loads(capsys.readouterr().out)
    doc = results(tmp_path / "sw")
    assert len(doc["trials"]) == 5 and len(doc["confirmed"]) == 1
    best = doc["ranking"][0]
    assert printed["confirmed"][best]["average"] == -next(c for c in doc["candidates"] if c["id"] == best)["average"]
    bad = [*head, "--candidate", "ties density=0.9..0.1 scaling=x..2", "--search", "tpe", "--trials", "5",
           "-o", str(tmp_path / "sw2")]
    assert main(bad) == 2
    err = capsys.readouterr().err
    assert "density=0.9..0.1: a range needs LO < HI" in err and "scaling=x..2" in err
    assert not (tmp_path / "sw2").exists()
    assert main([*head, "--candidate", "ties density=0.1..0.5", "--search", "anneal", "--trials", "2", "-o",
                 str(tmp_path / "sw3")]) == 2
    assert "--search 'anneal'" in capsys.readouterr().err
