# Density, overlap and own-task scores of a SmolLM2 run's agents (the table in docs/lab.md, section 3).
import torch
torch.set_num_threads(1)
from pathlib import Path
from rlmerge.lab.density import task_vector_stats
from rlmerge.lab.evaluate import score_checkpoint
from rlmerge.lab.tasks import FAMILIES, make_family, make_split
root = Path('/tmp/lab3-runs/smollm2/seed0')
ag = {f: root / 'agents' / f for f in FAMILIES}
s = task_vector_stats(root / 'base', ag)
print({k: (round(v['density_pct'], 2), round(v['unique_share_pct'], 1), round(v['rho'], 2)) for k, v in s['agents'].items()})
print({k: round(v, 1) for k, v in s['count_share_pct'].items()}, {k: round(v, 3) for k, v in s['cosine'].items()})
test = {f: make_split(make_family(f), 'test', 32, 0) for f in FAMILIES}
for name, path in [('Base', root / 'base'), *ag.items()]:
    sub = test if name == 'Base' else {name: test[name]}
    print(name, {k: round(100 * v, 1) for k, v in score_checkpoint(path, sub, 'chat').items()}, flush=True)
