"""`rlmerge fisher`: the empirical Fisher against HF's own loss, then a Fisher merge of estimated files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import reference_baselines as ref
from conftest import TINY, load_output
from reference import load_models
from rlmerge.cli import main as cli_main
from rlmerge.engine.fisher_estimate import read_examples
from rlmerge.errors import InputError
from rlmerge.synthetic import make_example

pytest.importorskip("transformers")

ROWS = [{"text": "hello world"}, {"prompt": "Q: 2+2?", "completion": " A: 4"}, {"text": "abc def ghi"}]


def _hf_fisher(model_dir: Path, rows: list[dict]) -> dict[str, torch.Tensor]:
    """Per-example squared gradients of (−HF loss × number of targets), averaged: an independent path."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    net = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    acc: dict[str, torch.Tensor] = {}
    for row in rows:
        prompt = tok(row.get("prompt", ""), add_special_tokens=False)["input_ids"] if "prompt" in row else []
        target = tok(row.get("completion", row.get("text")), add_special_tokens=False)["input_ids"]
        ids = torch.tensor([prompt + target])
        labels = ids.clone()
        labels[0, :max(len(prompt), 1)] = -100
        net.zero_grad()
        out = net(input_ids=ids, labels=labels)
        (-out.loss * int((labels != -100).sum())).backward()
        for n, p in net.named_parameters():
            acc[n] = acc.get(n, torch.zeros_like(p)) + p.grad ** 2
    return {n: v / len(rows) for n, v in acc.items()}


def test_fisher_estimate_then_fisher_merge(tmp_path: Path) -> None:
    base, agents = make_example(tmp_path / "in", shape=TINY, dtype=torch.float32)
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    files = []
    for i, agent in enumerate(agents[:2]):
        files.append(tmp_path / f"F{i}")
        assert cli_main(["fisher", str(agent), "--data", str(data), "-o", str(files[-1]), "--examples", "3"]) == 0
    got = load_output(files[0])
    want = _hf_fisher(agents[0], ROWS)
    assert got.keys() == want.keys() == load_output(agents[0]).keys()
    for k in got:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-10)
    assert json.loads((files[0] / "fisher.json").read_text())["examples"] == 3

    code = cli_main(["merge", str(base), *map(str, agents[:2]), "-o", str(tmp_path / "m"), "-q", "--method",
                     "fisher", "--param", f"fisher={files[0]},{files[1]}"])
    assert code == 0
    b, ags = load_models(base, agents[:2])
    fs = [load_output(f) for f in files]
    merged = load_output(tmp_path / "m")
    for k, v in b.items():
        want_k = ref.fisher(v, [a[k] for a in ags], [f[k] for f in fs], [1.0, 1.0], 1e-6)
        torch.testing.assert_close(merged[k], want_k, rtol=0, atol=8 * 2 ** -23 * float(want_k.abs().max()))


def test_bad_data_lines_are_reported(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(InputError, match="line 2 is not JSON"):
        read_examples(data, 10)
    data.write_text('{"prompt": "p"}\n')
    with pytest.raises(InputError, match="no completion"):
        read_examples(data, 10)
