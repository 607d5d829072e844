"""Score a finished seed's agents with the lab's gate as it is now (pipeline._gate with the size's rule), e.g. after
the rule changed: `python docs/lab-results/smollm2-uneven/gate.py /work/lab-runs/uneven2-s0/seed0 0`.

Prints each agent's gate record (base and agent accuracy on the seed's validation split, better / worse, the sign
test's p, passed). The record is saved beside the agent as the run saves it, so the run reuses it.
"""

import json
import sys
from pathlib import Path

import torch

from rlmerge.lab import pipeline
from rlmerge.lab.sizes import SIZES

torch.set_num_threads(1)
size = SIZES["smollm2-uneven"]
out, seed = Path(sys.argv[1]), int(sys.argv[2])
for fam in ("tool_use", "coding", "memory"):
    g = pipeline._gate(size, out / "base", out / "agents" / fam, fam, seed)
    print(fam, json.dumps({k: g[k] for k in ("base", "agent", "n", "better", "worse", "p", "passed", "wall_s")}),
          flush=True)
