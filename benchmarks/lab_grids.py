"""How long one tiny-lab seed's validation grids take: `rlmerge.lab.pipeline.run_merges` on a finished seed.

Copies a lab seed's base and agents (``SEED_DIR/base``, ``SEED_DIR/agents/*``) into ``WORK``, runs every row of the
tiny lab (its 12-point grids on 48 validation examples per task, then each pick on the test split) with whichever
rlmerge is on ``PYTHONPATH``, and writes ``WORK/../TAG.json``: wall and CPU seconds, the time spent scoring the
picks on test, the time in greedy decoding + verifiers (``evaluate.score_each``, validation and test), the load
average, and every row's pick and test scores (to compare two versions). It works with the grid loop from before
the sweep too (its ``run_merges`` took the validation sets), so both can be timed in one session:

    git archive 9e77282 src | tar -x -C /tmp/before          # the lab's own loop
    for tag in before1 after1 after2 before2; do              # ABBA, so that a drifting load cancels
      case $tag in before*) P=/tmp/before/src;; *) P=$PWD/src;; esac
      PYTHONPATH=$P .venv/bin/python benchmarks/lab_grids.py $tag SEED_DIR /tmp/bench/work-$tag
    done
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(var, "1")


def main(tag: str, seed_dir: Path, out: Path) -> dict[str, Any]:
    import torch

    import rlmerge
    from rlmerge.lab import evaluate, pipeline
    from rlmerge.lab.tasks import FAMILIES

    torch.set_num_threads(1)  # as run_lab
    seed = int(seed_dir.name.removeprefix("seed"))
    if out.exists():
        shutil.rmtree(out)
    (out / "agents").mkdir(parents=True)
    shutil.copytree(seed_dir / "base", out / "base")
    for f in FAMILIES:
        shutil.copytree(seed_dir / "agents" / f, out / "agents" / f)
    size = pipeline.SIZES["tiny"]
    test = pipeline._eval_sets(size, "test", size.n_test, seed)
    spent = {"test": 0.0, "decode": 0.0}

    def timed(key: str, fn: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[key] += time.perf_counter() - t
        return wrapper

    pipeline._score = timed("test", pipeline._score)  # the picks scored on test (the same in both versions)
    evaluate.score_each = timed("decode", evaluate.score_each)  # greedy decoding + verifiers, val and test
    res = pipeline.SeedResult(seed)
    args: list[Any] = [size, out / "base", [out / "agents" / f for f in FAMILIES], out / "merges", test]
    if "val" in inspect.signature(pipeline.run_merges).parameters:  # the loop before the sweep
        args.append(pipeline._eval_sets(size, "val", size.n_val, seed))
    load = os.getloadavg()
    t0, c0 = time.perf_counter(), time.process_time()
    pipeline.run_merges(*args, res, size.methods)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    doc = {"tag": tag, "rlmerge": rlmerge.__file__, "wall_s": wall, "cpu_s_main_process": cpu,
           "test_scoring_s": spent["test"], "decode_s": spent["decode"], "grids_s": wall - spent["test"],
           "load_before": load, "load_after": os.getloadavg(), "picks": res.picks, "scores": res.scores,
           "skipped": res.skipped}
    (out.parent / f"{tag}.json").write_text(json.dumps(doc, indent=1, default=str))
    print(f"{tag}: grids {wall - spent['test']:.1f} s (run_merges {wall:.1f} s, of which test scoring "
          f"{spent['test']:.1f} s; decoding + verifiers {spent['decode']:.1f} s), load {load[0]:.1f}", flush=True)
    shutil.rmtree(out)
    return doc


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: lab_grids.py TAG SEED_DIR WORK")
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
