"""The example command scorer (examples/choice_eval.py, docs/sweep.md's guide) run as the guide runs it.

Oracles: its per-example answers against transformers' own loss (the mean negative log-likelihood of the labelled
answer tokens, times their number) on the checkpoint the sweep kept; its splits against the seeded halves (val and
test disjoint, the limit the first of the half); the sweep's record against what the script printed.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import rlmerge
from conftest import lab_checkpoints
from rlmerge.scoring import TaskScorer

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "choice_eval.py"


def _module():
    spec = importlib.util.spec_from_file_location("choice_eval", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _answers(folder: Path, rows: list[dict]) -> list[int]:
    """Each example's answer by transformers' loss: the choice with the least total NLL (the first of equals)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    for r in rows:
        nll = []
        for c in r["choices"]:
            ctx = tok(r["question"])["input_ids"]
            ans = tok(c, add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                loss = model(torch.tensor([ctx + ans]), labels=torch.tensor([[-100] * len(ctx) + ans])).loss
            nll.append(float(loss) * len(ans))
        out.append(100 if min(range(len(nll)), key=nll.__getitem__) == r["answer"] else 0)
    return out


@pytest.mark.slow  # three runs of a program that imports transformers (~15 s)
def test_the_example_command_scorer_drives_a_sweep_and_its_confirmation(tmp_path: Path) -> None:
    base, agents = lab_checkpoints(tmp_path / "m", scale=0.05)
    cmd = f"cmd:{sys.executable} {SCRIPT} {{model}} --split {{split}} --limit {{limit}} --seed {{seed}}"
    val = TaskScorer([cmd], limit=8, seed=1)
    res = rlmerge.sweep(base, agents, tmp_path / "sw", candidates=["task_arithmetic scaling=1.5"], scorer=val,
                        confirm=val.held_out("test"), keep=1, settings=val.settings(), seed=1)
    mod = _module()
    want_val, want_test = (mod.examples(mod.DATA, s, 8, 1) for s in ("val", "test"))
    assert not {r["id"] for r in want_val} & {r["id"] for r in want_test}
    assert mod.examples(mod.DATA, "val", 3, 1) == want_val[:3] and len(mod.examples(mod.DATA, "val", 99, 1)) == 20
    best = res.ranking[0]
    for s in res.scored:
        d = s.details["choice"]
        assert s.error is None and d.ids == tuple(r["id"] for r in want_val) and d.n == 8
        assert s.scores["choice"] == sum(d.samples) / 8 and set(d.samples) <= {0.0, 100.0}
    confirmed = res.confirmed[best.candidate.id].details["choice"]
    assert confirmed.ids == tuple(r["id"] for r in want_test)
    # the kept checkpoint, scored by transformers' own loss: what the script printed for it, example by example
    assert list(best.details["choice"].samples) == _answers(res.kept[0], want_val)
    assert list(confirmed.samples) == _answers(res.kept[0], want_test)
    # run by hand on the kept checkpoint, it prints what it printed for the candidate in the sweep (deterministic)
    out = subprocess.run([sys.executable, str(SCRIPT), str(res.kept[0]), "--limit", "8", "--seed", "1"],
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == {"choice": {"samples": [int(x) for x in best.details["choice"].samples],
                                              "ids": [r["id"] for r in want_val]}}
