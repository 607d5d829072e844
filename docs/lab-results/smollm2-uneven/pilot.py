"""Pilot for the uneven SmolLM2 run (docs/lab.md, section 3b): the agents of one seed with chosen per-agent GRPO
settings, their density step by step, density / unique share / ρ / λ, and base and specialists on validation.

Usage (one thread, niced; OUT is the full run's --out, so the run reuses the pilot's base and agents when the
settings match, and retrains an agent whose settings differ):
    PYTHONPATH=src nice -n 19 python docs/lab-results/smollm2-uneven/pilot.py OUT SEED [--val N] \
        [tool_use:lr=8e-5,steps=24,reward=strict coding:lr=5e-6,steps=16 memory:lr=4e-5,steps=16]
Without agent specs: the `smollm2-uneven` size's own settings. Writes OUT/pilot-seedSEED.json and .md.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

from rlmerge.lab.pipeline import SIZES, run_pilot
from rlmerge.lab.stages import write_json
from rlmerge.lab.tasks import FAMILIES
from rlmerge.lab.workdir import claim


def _settings(spec: str, size_grpo: dict) -> tuple[str, object]:
    fam, kv = spec.split(":", 1)
    over = dict(item.split("=") for item in kv.split(","))
    casts = {"lr": float, "steps": int, "prompts_per_step": int, "generations": int, "temperature": float}
    return fam, replace(size_grpo[fam], **{k: casts.get(k, str)(v) for k, v in over.items()})


def markdown(pilot: dict) -> str:
    tv = pilot["task_vectors"]["agents"]
    lines = ["| agent | lr × steps | reward | density (%) | unique share (%) | ρ | λ (r 0.1, α 2) "
             "| validation own task: base → specialist | density after each step (%) | train wall / CPU (s) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    val = pilot["val_examples"]
    for f in FAMILIES:
        g = pilot["training"][f]["settings"]
        base, spec = sum(val["Base"][f]), sum(val[f"Specialist: {f}"][f])
        trace = ", ".join(f"{x:.1f}" for x in pilot["training"][f]["density_by_step"])
        t = pilot["training"][f]
        lines.append(f"| {f} | {g['lr']:g} × {g['steps']} | {g['reward']} | {tv[f]['density_pct']:.1f} "
                     f"| {tv[f]['unique_share_pct']:.1f} | {tv[f]['rho']:.2f} | {tv[f]['lambda_paper']:.3f} "
                     f"| {base:.0f} → {spec:.0f} of {pilot['n_val']} | {trace} "
                     f"| {t.get('wall_s', t['train_seconds']):.0f} / {t.get('cpu_s', float('nan')):.0f} |")
    counts = " / ".join(f"{v:.1f}" for v in pilot["task_vectors"]["count_share_pct"].values())
    lines += ["", f"Elements changed by 0 / 1 / 2 / 3 agents: {counts} %. Validation: {pilot['n_val']} examples "
              "per task (disjoint from the test split), greedy; all rows (each model on every task):", ""]
    lines += ["| model | " + " | ".join(FAMILIES) + " |", "|---|" + "---|" * len(FAMILIES)]
    for row, per in val.items():
        lines.append(f"| {row} | " + " | ".join(f"{sum(per[f]):.0f}" for f in FAMILIES) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    torch.set_num_threads(1)
    out, seed = Path(sys.argv[1]), int(sys.argv[2])
    n_val = int(sys.argv[sys.argv.index("--val") + 1]) if "--val" in sys.argv else 64
    size = SIZES["smollm2-uneven"]
    agents = {f: size.grpo_for(f) for f in FAMILIES}
    agents |= dict(_settings(a, agents) for a in sys.argv[3:] if ":" in a)
    size = replace(size, agent_grpo=agents)
    claim(out)
    pilot = run_pilot(size, out / f"seed{seed}", seed, n_val)
    write_json(out / f"pilot-seed{seed}.json", pilot)
    (out / f"pilot-seed{seed}.md").write_text(markdown(pilot))
    print(markdown(pilot))
    print(json.dumps(pilot["stages"], indent=1))


if __name__ == "__main__":
    main()
