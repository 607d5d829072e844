"""A seed's base and tool-use specialist on 128 tool-use validation examples (disjoint from the seed's 128 test
prompts), greedy, with the paired bootstrap of specialist − base (docs/lab.md, section 3b):

    PYTHONPATH=src HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python docs/lab-results/smollm2-uneven/val128.py \
        /work/lab-runs/uneven 0
"""

import sys
from pathlib import Path

from rlmerge.lab.evaluate import score_checkpoint_each
from rlmerge.lab.paired import bootstrap_difference
from rlmerge.lab.tasks import held_out_split

out, seed = Path(sys.argv[1]), int(sys.argv[2])
root = out / f"seed{seed}"
sets = {"tool_use": held_out_split("tool_use", "val", 128, seed, 128)}
scores = {name: score_checkpoint_each(path, sets, "chat")["tool_use"]
          for name, path in (("base", root / "base"), ("agent", root / "agents" / "tool_use"))}
print(f"seed {seed}: base {sum(scores['base']):.0f} of 128, agent {sum(scores['agent']):.0f} of 128; "
      "agent − base (points, 95 % paired bootstrap): {:+.1f} [{:+.1f}, {:+.1f}]".format(
          *bootstrap_difference({"t": scores["agent"]}, {"t": scores["base"]}, seed=0)))
