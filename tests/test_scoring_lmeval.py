"""``lm-eval:TASK`` through the sweep's scorer: its score, n, stderr and per-example results, in process (hf) and
read from lm-eval's own results files (a command scorer's ``{output}``); the vLLM backend.

Oracles: lm-eval's accuracy and each document's right/wrong against the model's summed log-likelihood of each
choice computed directly (tests/lab/test_cli_eval.py's oracle); its stderr against the sample standard error of the
mean written out; the files lm-eval's own EvaluationTracker writes, read back, against the in-process scores.
"""

from __future__ import annotations

import math
import shlex
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from rlmerge.errors import ConfigError  # noqa: E402
from rlmerge.lab.evaluate import load_checkpoint  # noqa: E402
from rlmerge.scoring import TaskScorer  # noqa: E402
from rlmerge.sweeping.build import Built  # noqa: E402
from rlmerge.sweeping.candidates import Candidate  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent / "lab"))
# the tiny checkpoint and the local lm-eval task of `rlmerge eval`'s tests (its fixtures, asked for by name)
from test_cli_eval import DOCS, checkpoint, oracle_each, task_dir  # noqa: E402,F401


def _built(path: Path) -> Built:
    return Built(Candidate("task_arithmetic"), path, None, {}, path, None)  # type: ignore[arg-type]


@pytest.mark.slow
def test_lm_eval_scores_carry_n_stderr_and_each_document_and_its_files_read_the_same(request, tmp_path: Path) -> None:
    pytest.importorskip("lm_eval", reason="the eval extra (rlmerge[eval]) is not installed")
    ckpt, tasks = request.getfixturevalue("checkpoint"), request.getfixturevalue("task_dir")
    got = TaskScorer(["lm-eval:lab_codes"], include_path=[str(tasks)], limit=len(DOCS))(_built(ckpt))
    s = got["lm-eval:lab_codes"]
    each = oracle_each(ckpt)
    p, n = sum(each) / len(each), len(each)
    assert s.n == n and s.ids == tuple(str(i) for i in range(n))
    assert s.samples == tuple(100.0 * x for x in each)  # document by document: the oracle's right and wrong
    assert s.score == pytest.approx(100.0 * p)
    assert s.stderr == pytest.approx(100.0 * math.sqrt(p * (1 - p) / (n - 1)))  # lm-eval's: sample sd / sqrt(n)

    # lm-eval's own writer (as its CLI saves --output_path with --log_samples), read by a command scorer's {output}
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.models.huggingface import HFLM

    from rlmerge.lab.harness import evaluate

    model, tok = load_checkpoint(ckpt)
    doc = evaluate(HFLM(pretrained=model, tokenizer=tok, batch_size=8), ["lab_codes"], include_path=[tasks],
                   limit=len(DOCS), log_samples=True)
    saved = tmp_path / "lm-eval-out"
    tracker = EvaluationTracker(output_path=str(saved))
    tracker.general_config_tracker.model_name_sanitized = "tiny"
    samples = doc.pop("samples")
    tracker.save_results_aggregated(results=doc, samples=samples)
    for task in doc["configs"]:
        tracker.save_results_samples(task_name=task, samples=samples[task])
    assert list(saved.glob("tiny/results_*.json")) and list(saved.glob("tiny/samples_lab_codes_*.jsonl"))
    copy = f"""cmd:sh -c 'cp -r "$0"/. "$1"' {shlex.quote(str(saved))} {{output}} {{model}}"""
    assert TaskScorer([copy])(_built(ckpt)) == {"lab_codes": s}


def test_the_vllm_backend_is_refused_with_the_install_hint_when_vllm_is_missing(request, monkeypatch) -> None:
    pytest.importorskip("lm_eval", reason="the eval extra (rlmerge[eval]) is not installed")
    ckpt, tasks = request.getfixturevalue("checkpoint"), request.getfixturevalue("task_dir")
    if find_spec("vllm") is None:
        with pytest.raises(ConfigError, match="vLLM is not installed") as e:
            TaskScorer(["lm-eval:lab_codes"], include_path=[str(tasks)], lm_eval_backend="vllm")
        assert "pip install vllm" in e.value.render()
    with pytest.raises(ConfigError, match="--lm-eval-backend 'tgi'"):
        TaskScorer(["lm-eval:lab_codes"], include_path=[str(tasks)], lm_eval_backend="tgi")  # type: ignore
    # past the check (as if vLLM were installed), the candidate's folder is what lm-eval's vllm model gets: here
    # its import fails, and says so the same way
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    scorer = TaskScorer(["lm-eval:lab_codes"], include_path=[str(tasks)], lm_eval_backend="vllm")
    assert scorer.parts[0].needs == "folder" and scorer.settings()["lm_eval_backend"] == "vllm"
    if find_spec("vllm") is None:
        with pytest.raises(ConfigError, match="--lm-eval-backend vllm: .*vllm"):
            scorer(_built(ckpt))


@pytest.mark.skipif(not torch.cuda.is_available() or find_spec("vllm") is None, reason="vLLM needs a CUDA GPU")
def test_vllm_scores_the_candidates_folder_as_hf_does(tmp_path: Path) -> None:  # pragma: no cover - GPU only
    """On a GPU with vLLM: the same tiny synthetic model and local task through both backends, same documents."""
    import json

    from rlmerge.synthetic import make_example

    base, _ = make_example(tmp_path / "m", densities=(0.1,), dtype=torch.float32)
    folder = tmp_path / "tasks"
    folder.mkdir()
    data = folder / "d.jsonl"
    data.write_text("".join(json.dumps({"q": f"q{i}:", "choices": ["a", "b", "c"], "gold": i % 3}) + "\n"
                            for i in range(12)))
    (folder / "t.yaml").write_text(
        f"task: tiny_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        'output_type: multiple_choice\ndoc_to_text: "{{q}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: gold\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    hf = TaskScorer(["lm-eval:tiny_mc"], include_path=[str(folder)])(_built(base))["lm-eval:tiny_mc"]
    vl = TaskScorer(["lm-eval:tiny_mc"], include_path=[str(folder)], lm_eval_backend="vllm")(_built(base))
    got = vl["lm-eval:tiny_mc"]
    assert got.n == hf.n == 12 and got.ids == hf.ids
    assert sum(a != b for a, b in zip(got.samples, hf.samples)) <= 1  # float32 both; kernels may differ on a tie
