"""The route is chosen once: what `rlmerge plan` says a merge will do is what the merge does.

For every kind of method on both paths, the passes the plan reports are the passes the merge runs, and the bytes
it says will be read are the bytes the merge's readers count as they read. The peak-memory estimate is checked
against the peak resident memory of real merges, on the fused path and on the torch path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import rlmerge
from conftest import TINY, as_bin, interrupt_after
from rlmerge.synthetic import Shape, make_example

CASES = [  # (method, params): every kind of route
    ("ram", {}), ("ram+", {}), ("ram+", {"preset": "tensor-local"}), ("ram+", {"preset": "arm-r"}),
    ("arm-ties", {}), ("task_arithmetic", {"scaling": 0.5}),
    ("unique", {"agent": 1}), ("model_stock", {}), ("model_stock", {"filter_wise": True}),
    ("ties", {"density": 0.3}), ("ties_global", {"density": 0.3}), ("breadcrumbs", {}),
    ("dare_ties", {"density": 0.5}), ("dare_ta", {"rescale": "l1"}), ("della", {"rescale": "l1"}),
    ("slerp", {"t": 0.3}),
]


@pytest.mark.parametrize("fast", ["1", "0"], ids=["fast", "torch"])
@pytest.mark.parametrize(("method", "params"), CASES, ids=[f"{m}-{'-'.join(map(str, p.values())) or 'default'}"
                                                          for m, p in CASES])
def test_plan_says_what_the_merge_does(example, tmp_path: Path, monkeypatch, fast: str, method: str,
                                       params: dict) -> None:
    base, agents = example
    if method == "slerp":
        agents = agents[:2]
    monkeypatch.setenv("RLMERGE_FAST", fast)
    kw = {"method": method, "params": params, "block_size": 1000}
    assert TINY.vocab * TINY.hidden > 3 * 1000  # the larger tensors span several blocks
    plan = rlmerge.dry_run(base, agents, tmp_path / "out", **kw)
    assert plan.ok, [p.render() for p in plan.problems]
    res = rlmerge.merge(base, agents, tmp_path / "out", **kw)
    assert res.passes == plan.passes
    if method in ("ties", "breadcrumbs", "arm-ties") and (fast == "0" or method == "arm-ties"):  # on torch, a
        # tensor's selection rounds stop once its
        once = sum(j.info.nbytes + sum(a.tensors[j.name].nbytes for a in plan.match.agents)  # thresholds are
                   for j in plan.match.merge_jobs)  # found
        assert 2 * once < res.read_bytes <= plan.read_bytes  # counted and merged at least; at most every round
    else:
        assert res.read_bytes == plan.read_bytes


def test_a_resumed_merge_reads_what_its_route_says(example, tmp_path: Path, monkeypatch) -> None:
    """A resumed RAM merge recounts every tensor in a statistics pass, and merges only what was not kept."""

    base, agents = example
    kw = {"method": "ram", "shard_size": "16KB", "block_size": 300}
    with monkeypatch.context() as m:
        interrupt_after(m, 2, KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt):
            rlmerge.merge(base, agents, tmp_path / "out", **kw)
    res = rlmerge.merge(base, agents, tmp_path / "out", **kw, resume=True)
    fresh = rlmerge.dry_run(base, agents, tmp_path / "other", **kw)
    assert fresh.passes == ["merge"] and res.passes == ["statistics", "merge"]
    merged = sum(j.info.nbytes + sum(a.tensors[j.name].nbytes for a in fresh.match.agents)
                 for j in fresh.match.merge_jobs)
    assert merged < res.read_bytes < fresh.read_bytes + merged  # every tensor counted, not every one merged


MEASURE = """
import json, sys
import rlmerge

def status(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))

base, agents, out, block, method = sys.argv[1], sys.argv[2:5], sys.argv[5], int(sys.argv[6]), sys.argv[7]
plan = rlmerge.dry_run(base, agents, out, method=method, block_size=block)
rlmerge.merge(base, agents, out, method=method, block_size=block)
print(json.dumps({"peak": status("VmHWM:"), "estimate": plan.memory.total}))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc for peak RSS")
@pytest.mark.parametrize(("fast", "method", "fmt"), [("0", "ram+", "st"), ("0", "ties", "st"), ("1", "ram+", "st"),
                                                     ("1", "ties", "st"), ("1", "dare_ties", "st"),
                                                     ("1", "ram+", "bin"), ("1", "ram+", "bin-base")])
def test_memory_estimate_is_within_a_quarter_of_the_measured_peak(tmp_path: Path, fast: str, method: str,
                                                                   fmt: str) -> None:
    shape = Shape("qwen2", vocab=32768, hidden=256, layers=1, heads=4, kv_heads=2, intermediate=512, tie=True)
    base, agents = make_example(tmp_path / "in", shape=shape)
    if fmt != "st":  # read by copy on the numba path, with torch loaded
        base, *rest = [as_bin(m, tmp_path / f"bin-{m.name}") for m in [base, *(agents if fmt == "bin" else [])]]
        agents = rest or agents
    block = 1 << 21  # the embedding (8 M elements) spans four blocks
    cmd = [sys.executable, "-c", MEASURE, str(base), *map(str, agents), str(tmp_path / "out"), str(block), method]
    env = {**os.environ, "RLMERGE_FAST": fast}
    m = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout)
    assert 0.75 * m["peak"] <= m["estimate"] <= 1.25 * m["peak"], m
