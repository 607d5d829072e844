"""Issue 6 item 2: one GRPO agent from seed 0's tiny base at another lr / step count; prints its task-vector
density and its own-task test score next to the base's. Usage (worktree root, after `rlmerge lab --size tiny
--first-seed 0 --out /tmp/labruns/s0`): PYTHONPATH=src python docs/lab-results/sparsity-probe.py 1e-5 160 memory
"""
import sys, time, json
from pathlib import Path
import torch
torch.set_num_threads(1)
from rlmerge.lab.grpo import GRPOSettings, train_agent
from rlmerge.lab.density import task_vector_stats
from rlmerge.lab.evaluate import score_checkpoint
from rlmerge.lab.tasks import make_family, make_split
lr = float(sys.argv[1]); steps = int(sys.argv[2]); fam = sys.argv[3]
base = Path("/tmp/labruns/s0/seed0/base"); out = Path(f"/tmp/sparse/{fam}-{lr}-{steps}")
t = time.time()
info = train_agent(base, fam, out, GRPOSettings(steps=steps, lr=lr), seed=0)
tv = task_vector_stats(base, {fam: out})
test = {fam: make_split(make_family(fam), "test", 128, 0)}
print(json.dumps({"lr": lr, "steps": steps, "fam": fam, "density": tv["agents"][fam]["density_pct"], "score": score_checkpoint(out, test)[fam], "base": score_checkpoint(base, test)[fam], "reward": [info["first_reward"], info["last_reward"]], "seconds": time.time() - t}))
