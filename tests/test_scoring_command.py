"""Scorers users bring: ``cmd:COMMAND`` (any program) and ``py:MODULE:FUNCTION`` (a Python function).

Oracles: a sweep over the demo's models scored by a command whose score is known from the weights (distance of the
merge's task vector to the agents' sum: task arithmetic at scaling 1 is the best, and the order of the others is
|scaling - 1|) must rank by it and keep that candidate; the folder the command saw must be a loadable checkpoint
that is gone afterwards; each failure (exit status, no JSON, NaN, time-out) must raise ScorerError carrying the end
of the command's stderr, and a time-out must leave none of its processes alive.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import textwrap
import time
from pathlib import Path

import pytest

import rlmerge
from rlmerge.errors import ConfigError, ScorerError
from rlmerge.scoring import TaskScorer, split_task_list
from rlmerge.scoring.subject import Subject
from rlmerge.sweeping.build import Built
from rlmerge.sweeping.candidates import Candidate
from rlmerge.synthetic import make_example

PY = shlex.quote(sys.executable)

# Reads safetensors by hand (numpy only: the command starts fast), bf16 included.
DISTANCE = textwrap.dedent('''
    import json, os, struct, sys
    from pathlib import Path
    import numpy as np

    def tensors(folder):
        raw = (Path(folder) / "model.safetensors").read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        head = json.loads(raw[8:8 + n])
        out = {}
        for name, info in head.items():
            if name == "__metadata__":
                continue
            a, b = info["data_offsets"]
            buf = raw[8 + n + a:8 + n + b]
            if info["dtype"] == "BF16":
                x = (np.frombuffer(buf, np.uint16).astype(np.uint32) << 16).view(np.float32)
            else:
                x = np.frombuffer(buf, {"F32": np.float32, "F16": np.float16}[info["dtype"]]).astype(np.float32)
            out[name] = x
        return out

    model, base, agents = sys.argv[1], sys.argv[2], sys.argv[3:]
    with open(os.environ["SCORE_LOG"], "a") as log:
        log.write(json.dumps({"model": model, "files": sorted(os.listdir(model)), "cwd": os.getcwd()}) + "\\n")
    m, b = tensors(model), tensors(base)
    want = {k: sum(tensors(a)[k] - b[k] for a in agents) for k in b}
    names = sorted(b)
    per = [-float(np.linalg.norm((m[k] - b[k]) - want[k])) for k in names]
    print("loading... done")  # a log line before the JSON: the last JSON line is the one read
    print(json.dumps({"near_sum": {"samples": per, "ids": names}}))
''')


def _built(path: Path) -> Built:
    return Built(Candidate("task_arithmetic"), path, None, {}, path, None)  # type: ignore[arg-type]


def _write(folder: Path, name: str, code: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(textwrap.dedent(code))
    return folder / name


def test_a_sweep_scored_by_a_command_ranks_by_its_score_and_keeps_the_right_candidate(tmp_path: Path) -> None:
    from rlmerge.cli import main

    base, agents = make_example(tmp_path / "inputs")  # the demo's models
    tools = tmp_path / "tools"
    _write(tools, "distance.py", DISTANCE)
    log = tmp_path / "log.jsonl"
    out = tmp_path / "sweep"
    command = f"cmd:{PY} distance.py {{model}} {base} {' '.join(map(str, agents))}"
    rc = main(["sweep", str(base), *map(str, agents), "-o", str(out), "-q", "--keep", "1",
               "--candidate", "task_arithmetic scaling=0.25,0.75,1.0,1.5",
               "--tasks", command, "--cmd-cwd", str(tools), "--cmd-env", f"SCORE_LOG={log}"])
    assert rc == 0
    doc = json.loads((out / "results.json").read_text())
    by_id = {c["id"]: c for c in doc["candidates"]}
    ranked = [by_id[i]["params"]["scaling"] for i in doc["ranking"]]
    assert ranked == ["1.0", "0.75", "1.5", "0.25"]  # |scaling - 1|: 0, 0.25, 0.5, 0.75
    best = by_id[doc["kept"]["best-1"]]
    assert best["params"]["scaling"] == "1.0"
    assert json.loads((out / "best-1" / "rlmerge.json").read_text())["recipe"]["sweep"]["candidate"]["id"] == best["id"]
    # the command's per-tensor samples became the task's details, its score their mean
    for c in doc["candidates"]:
        d = c["details"]["near_sum"]
        samples = [float(x) for x in d["samples"].split(",")]
        assert d["n"] == len(samples) and c["scores"]["near_sum"] == pytest.approx(sum(samples) / len(samples))
        assert doc["examples"][d["examples"]] == sorted(doc["examples"][d["examples"]])  # tensor names, in order
    # each candidate was built in memory, written for the command as a loadable folder, and removed after
    seen = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(seen) == 4 and {s["cwd"] for s in seen} == {str(tools)}
    assert all({"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"} <= set(s["files"])
               for s in seen)
    assert all(not Path(s["model"]).exists() for s in seen)
    assert {c["where"] for c in doc["candidates"]} == {"memory"}


def test_a_candidate_written_for_a_command_loads_as_the_tensors_in_memory(example, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from conftest import load_output

    base, agents = example
    seen: dict[str, Path] = {}

    def check(built: Built) -> dict[str, float]:
        with Subject(built) as subject:
            folder = subject.folder()
            seen[built.candidate.id] = folder
            written = load_output(folder)
            assert written.keys() == built.tensors.keys()  # type: ignore[union-attr]
            assert all(written[k].equal(v) for k, v in built.tensors.items())  # type: ignore[union-attr]
            from transformers import AutoModelForCausalLM

            AutoModelForCausalLM.from_pretrained(folder)  # a normal Hugging Face folder
        return {"ok": 1.0}

    rlmerge.sweep(base, agents, candidates=["ties density=0.3"], scorer=check, memory="always")
    assert seen and not any(p.exists() for p in seen.values())


@pytest.mark.parametrize("code, needle", [
    ("import sys\nprint('step 1', file=sys.stderr)\nraise SystemExit('the eval broke: CUDA out of memory')\n",
     "exit status 1; its stderr ends:\nstep 1\nthe eval broke: CUDA out of memory"),
    ("import sys\nprint('oops', file=sys.stderr)\nprint('accuracy: 0.61')\n",
     "printed no JSON object of scores on stdout; it printed:\naccuracy: 0.61; its stderr ends:\noops"),
    ("print('{\"acc\": NaN}')\n", "'acc' score is nan"),
    ("print('{\"acc\": {\"score\": 50, \"samples\": [1, 0]}}')\n", "samples average 0.5"),
    ("print('{}')\n", "an empty JSON object"),
])
def test_a_failing_command_raises_with_the_end_of_its_stderr(tmp_path: Path, code: str, needle: str) -> None:
    script = _write(tmp_path, "eval.py", code)
    scorer = TaskScorer([f"cmd:{PY} {script} {{model}}"])
    with pytest.raises(ScorerError) as e:
        scorer(_built(tmp_path))
    assert needle in e.value.render()
    assert e.value.exit_code == 5


def test_a_command_over_its_time_is_killed_with_its_children(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    script = _write(tmp_path, "slow.py", f'''
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open({str(pids)!r}, "w").write(str(child.pid))
        print("warming up", file=sys.stderr, flush=True)
        time.sleep(60)
    ''')
    scorer = TaskScorer([f"cmd:{PY} {script} {{model}}"], cmd_timeout=1.5)
    t0 = time.monotonic()
    with pytest.raises(ScorerError, match=r"did not finish within 1\.5 s") as e:
        scorer(_built(tmp_path))
    assert time.monotonic() - t0 < 10
    assert "warming up" in e.value.stderr
    child = int(pids.read_text())
    for _ in range(50):  # the grandchild was in the command's process group: killed with it (then reaped by init)
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the command's child outlived its time-out")


def test_options_placeholders_and_the_environment_reach_the_command(tmp_path: Path) -> None:
    script = _write(tmp_path / "evals", "echo.py", '''
        import json, os, sys
        print(json.dumps({"echo": {"score": 1, "n": int(sys.argv[2]), "stderr": float(sys.argv[3])},
                          "env": 1 if os.environ["MY_FLAG"] == "a=b" and os.environ["RLMERGE_MODEL"] == sys.argv[1]
                          else 0, "cwd": 1 if os.getcwd().endswith("evals") else 0,
                          "split": {"val": 1, "test": 2}[sys.argv[4]] * (os.environ["RLMERGE_SPLIT"] == sys.argv[4])}))
    ''')
    scorer = TaskScorer([f"cmd:{PY} echo.py {{model}} {{limit}} {{seed}} {{split}}"], limit=7, seed=3,
                        cmd_env=["MY_FLAG=a=b"], cmd_cwd=str(script.parent))
    got = scorer(_built(tmp_path))
    assert got["echo"] == rlmerge.TaskScore(1.0, 7, 3.0)
    assert got["env"].score == 1.0 and got["cwd"].score == 1.0
    assert got["split"].score == 1.0 and scorer.held_out("test")(_built(tmp_path))["split"].score == 2.0  # --confirm
    assert scorer.settings()["cmd_env"] == ["MY_FLAG"]  # keys only: values may be secrets
    assert scorer.settings()["cmd_cwd"] == str(script.parent)


def test_a_command_that_writes_lm_eval_results_is_read_as_lm_eval_output(tmp_path: Path) -> None:
    """The {output} folder, read as lm-eval's own results files (lm-eval's layout and keys: a model folder holding
    results_DATE.json and, with --log_samples, samples_TASK_DATE.jsonl)."""
    results = {"results": {"arc": {"alias": "arc", "acc,none": 0.75, "acc_stderr,none": 0.25,
                                   "acc_norm,none": 0.5, "acc_norm_stderr,none": 0.2},
                           "grp": {"alias": "grp", "exact_match,strict-match": 0.5,
                                   "exact_match_stderr,strict-match": "N/A"},
                           "sub1": {"exact_match,strict-match": 0.4}, "sub2": {"exact_match,strict-match": 0.6}},
               "group_subtasks": {"grp": ["sub1", "sub2"], "arc": []},
               "n-samples": {"arc": {"original": 100, "effective": 4}, "sub1": {"original": 5, "effective": 5},
                             "sub2": {"original": 5, "effective": 5}}}
    samples = [{"doc_id": i, "filter": "none", "metrics": ["acc", "acc_norm"], "acc": float(i != 2),
                "acc_norm": float(i < 2)} for i in (3, 0, 1, 2)]
    script = _write(tmp_path, "fake_lm_eval.py", f'''
        import json, pathlib, sys
        out = pathlib.Path(sys.argv[2]) / "__tmp__model"
        out.mkdir(parents=True)
        (out / "results_2026-01-01T00-00-00.json").write_text(json.dumps({results!r}))
        (out / "samples_arc_2026-01-01T00-00-00.jsonl").write_text(
            "".join(json.dumps(s) + "\\n" for s in {samples!r}))
    ''')
    got = TaskScorer([f"cmd:{PY} {script} {{model}} {{output}}"])(_built(tmp_path))
    assert list(got) == ["arc", "grp"]  # a group's tasks are not scores of their own
    assert got["arc"] == rlmerge.TaskScore(75.0, 4, 25.0, (100.0, 100.0, 0.0, 100.0), ("0", "1", "2", "3"))
    assert got["grp"] == rlmerge.TaskScore(50.0, 10, None)  # n: the group's tasks'; "N/A" is no stderr
    empty = _write(tmp_path, "nothing.py", "import sys\n")
    with pytest.raises(ScorerError, match=r"wrote no lm-eval results"):
        TaskScorer([f"cmd:{PY} {empty} {{model}} {{output}}"])(_built(tmp_path))


def test_py_scorers_by_module_and_by_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write(tmp_path / "mods", "my_evals.py", '''
        from rlmerge import TaskScore

        def score(built):
            return {"mod": TaskScore.accuracy([1, 0], ["a", "b"]), "where": 1.0 if built.path else 0.0}

        class Suite:
            @staticmethod
            def broken(built):
                raise KeyError("no such split")
    ''')
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    path = _write(tmp_path / "other", "file_evals.py",
                  "def score(built):\n    return {'file': {'score': 2.5, 'n': 3}}\n")
    scorer = TaskScorer(["py:my_evals:score", f"py:{path}:score"])
    got = scorer(_built(tmp_path))
    assert got == {"mod": rlmerge.TaskScore.accuracy([1, 0], ["a", "b"]), "where": rlmerge.TaskScore(1.0),
                   "file": rlmerge.TaskScore(2.5, 3)}
    import pickle

    assert pickle.loads(pickle.dumps(scorer))(_built(tmp_path)) == got  # what a Ray task gets
    with pytest.raises(ScorerError, match=r"py:my_evals:Suite.broken on candidate \w+ raised KeyError"):
        TaskScorer(["py:my_evals:Suite.broken"])(_built(tmp_path))
    for bad in ("py:no_such_module_x:score", "py:my_evals:nothing", f"py:{tmp_path}/missing.py:f", "py:score"):
        with pytest.raises(ConfigError):
            TaskScorer([bad])


def test_two_scorers_giving_one_task_name_is_an_error(tmp_path: Path) -> None:
    script = _write(tmp_path, "e.py", "print('{\"acc\": 1}')\n")
    with pytest.raises(ScorerError, match="two scorers gave task 'acc'"):
        TaskScorer([f"cmd:{PY} {script} {{model}}", f"cmd:{PY} {script} {{model}} again"])(_built(tmp_path))


def test_task_lists_split_at_commas_but_a_command_keeps_its_own() -> None:
    assert split_task_list("lab:coding, bfcl:simple,humaneval") == ["lab:coding", "bfcl:simple", "humaneval"]
    assert split_task_list("lab:memory,cmd:python e.py --tasks a,b {model}") == [
        "lab:memory", "cmd:python e.py --tasks a,b {model}"]
    assert split_task_list("cmd:sh -c 'x, y' {model}") == ["cmd:sh -c 'x, y' {model}"]


@pytest.mark.parametrize("spec, needle", [
    ("cmd:python my_eval.py", "does not name the candidate's folder"),
    ("cmd:no-such-program-here {model}", "no program 'no-such-program-here' on PATH"),
    ("cmd:python 'unclosed {model}", "No closing quotation"),
    ("bfcl:live_everything", "bfcl:simple, bfcl:multiple, bfcl:parallel, bfcl:parallel_multiple"),
    ("lab:chess", "the lab's tasks are"),
])
def test_a_scorer_that_cannot_work_is_refused_before_any_merge(spec: str, needle: str) -> None:
    with pytest.raises(ConfigError, match="--tasks") as e:
        TaskScorer([spec])
    assert needle in e.value.render()
    with pytest.raises(ConfigError, match="not KEY=VALUE"):
        TaskScorer(["lab:coding"], cmd_env=["JUSTAKEY"])


def test_the_cli_refuses_a_bad_scorer_with_exit_2(example, tmp_path: Path, capsys) -> None:
    from rlmerge.cli import main

    base, agents = example
    assert main(["sweep", str(base), str(agents[0]), "-o", str(tmp_path / "s"), "--candidate", "ram r=1",
                 "--tasks", "cmd:python eval.py"]) == 2
    assert "{model}" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


def test_a_recipe_names_scorers_and_command_options(example, tmp_path: Path) -> None:
    from rlmerge.cli import main

    base, agents = example
    script = _write(tmp_path / "evals", "e.py", '''
        import json, os, sys
        print(json.dumps({"flag": float(os.environ["FLAG"]), "argc": len(sys.argv)}))
    ''')
    recipe = tmp_path / "sweep.yaml"
    recipe.write_text(f"base_model: {base}\nmodels:\n  - model: {agents[0]}\n  - model: {agents[1]}\n"
                      "candidates:\n  - task_arithmetic scaling=0.5,1\n"
                      f"tasks:\n  - 'cmd:{sys.executable} e.py {{model}} a,b c'\n"
                      f"cmd_env: {{FLAG: '2.5'}}\ncmd_cwd: {script.parent}\ncmd_timeout: 60\n")
    out = tmp_path / "out"
    assert main(["sweep", "--recipe", str(recipe), "-o", str(out), "-q"]) == 0
    doc = json.loads((out / "results.json").read_text())
    assert [c["scores"] for c in doc["candidates"]] == [{"flag": 2.5, "argc": 4.0}] * 2  # "a,b" stayed one argument
    assert doc["settings"]["tasks"] == [f"cmd:{sys.executable} e.py {{model}} a,b c"]
    assert doc["settings"]["cmd_env"] == ["FLAG"] and "2.5" not in json.dumps(doc["settings"])


def test_a_failing_command_leaves_no_copy_of_the_candidate_behind(example, tmp_path: Path) -> None:
    base, agents = example
    log = tmp_path / "seen"
    script = _write(tmp_path, "fail.py", f'''
        import sys
        open({str(log)!r}, "w").write(sys.argv[1])
        sys.exit("no GPU")
    ''')
    scorer = TaskScorer([f"cmd:{PY} {script} {{model}}"])
    with pytest.raises(rlmerge.NothingScored, match="no GPU"):
        rlmerge.sweep(base, agents, candidates=["task_arithmetic scaling=1"], scorer=scorer, memory="always")
    assert log.read_text() and not Path(log.read_text()).exists()


def test_a_command_failing_on_one_candidate_is_recorded_there_with_its_stderr_and_the_sweep_goes_on(
        example, tmp_path: Path) -> None:
    from rlmerge.sweeping.candidates import parse_grid

    base, agents = example
    doomed = parse_grid("task_arithmetic scaling=0.5")[0].id
    script = _write(tmp_path, "half.py", f'''
        import json, os, sys
        if os.environ["RLMERGE_CANDIDATE"] == {doomed!r}:
            sys.exit("CUDA out of memory on this one")
        print(json.dumps({{"t": 1.0}}))
    ''')
    out = tmp_path / "sweep"
    res = rlmerge.sweep(base, agents, out, candidates=["task_arithmetic scaling=0.5,1.0"],
                        scorer=TaskScorer([f"cmd:{PY} {script} {{model}}"]))
    assert [s.candidate.label for s in res.ranking] == ["task_arithmetic scaling=1.0", "task_arithmetic scaling=0.5"]
    doc = json.loads((out / "results.json").read_text())
    failed = [c for c in doc["candidates"] if c.get("error")]
    assert [c["id"] for c in failed] == [doomed] and "CUDA out of memory on this one" in failed[0]["error"]
    assert "CUDA out of memory on this one" in (out / "report.md").read_text()
