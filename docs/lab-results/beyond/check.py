"""After the rows' runs: (1) the rows the runs share with the issue-17 runs (Base, specialists, TA, RAM+) give the
same per-example test results, so the new rows are paired with the same numbers docs/lab.md section 1 reports;
(2) per seed, the count ρ and the magnitude ρ^|τ| of each agent, and the share of shared elements whose active
agents disagree in sign (what sign-elect changes)."""
import json, sys, tempfile
from pathlib import Path
import torch
from safetensors.torch import load_file
import rlmerge

FAMS = ("tool_use", "coding", "memory")
for run in sys.argv[1:]:
    run = Path(run)
    new = json.loads((run / "results.json").read_text())["seeds"][0]
    old = json.loads((run / "results-lab3.json").read_text())["seeds"][0]
    seed = new["seed"]
    rows = ["Base", *(f"Specialist: {f}" for f in FAMS), "Task arithmetic", "RAM+"]
    same = {r: new["examples"][r] == old["examples"][r] for r in rows}
    picks = {r: (new["picks"][r]["params"], old["picks"][r]["params"]) for r in ("Task arithmetic", "RAM+")}
    print(f"seed {seed}: same per-example results as the issue-17 run: {same}; picks new/old {picks}")
    d = run / f"seed{seed}"
    base, agents = d / "base", [d / "agents" / f for f in FAMS]
    with tempfile.TemporaryDirectory() as tmp:
        res = rlmerge.merge(base, agents, Path(tmp) / "m", method="ram+", params={"preset": "magnitude", "r": 0.0,
                            "alpha": 1e6}, dtype="float32", quiet=True)
    b = load_file(str(base / "model.safetensors"))
    ags = [load_file(str(a / "model.safetensors")) for a in agents]
    shared = disagree = 0
    for k, w in b.items():
        if not w.is_floating_point():
            continue
        tau = torch.stack([a[k].float() - w.float() for a in ags])
        m = tau.abs() > 1e-5
        c = m.sum(0)
        pos, neg = (m & (tau > 0)).any(0), (m & (tau < 0)).any(0)
        shared += int((c >= 2).sum())
        disagree += int(((c >= 2) & pos & neg).sum())
    cnt = ", ".join(f"{x:.1f}" for x in res.statistics.rho)
    mag = ", ".join(f"{x:.1f}" for x in res.rho)
    print(f"seed {seed}: ρ (counts) {cnt}; ρ^|τ| {mag}; shared elements with both signs among active agents: "
          f"{100 * disagree / shared:.1f} %")
