"""Time and peak RSS of ``--output-format peft`` on the Qwen2.5-0.5B shape, against the full merge of the same run.

Builds (once, reused) the 0.5B-shaped synthetic set of benchmarks/dataset.py (bf16 base, "coder" and "tool-use"
agents, 3.2 % and 46.2 % of elements changed), then runs in child processes under ``/usr/bin/time -v``:

    full merge      rlmerge merge BASE coder tool-use --method M            (the baseline of this run)
    peft r=16       the same with --output-format peft --rank 16
    peft energy     … --rank energy=0.99
    peft full       … --rank full

and prints each one's peak RSS and wall time, the time over the full merge's, and for the adapters the ranks
kept, the largest relative error and the file's size. The synthetic agents' task vectors are sparse random noise,
so they are not low-rank: the errors at rank 16 are large and energy=0.99 keeps most of the rank; on real RL
agents the spectra differ (measure them with this script on your own checkpoints: --base/--agents).

    .venv/bin/python benchmarks/adapter_out.py [--workdir DIR] [--method M] [--ranks 16,energy=0.99,full]

Not part of the test suite: it writes ~4 GB of inputs and ~3 GB of outputs and takes minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from dataset import make_set  # noqa: E402


def _measure(label: str, argv: list[str]) -> tuple[float, float]:
    done = subprocess.run(["/usr/bin/time", "-v", *argv], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{label} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr).group(1)) / 2**20
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", done.stderr).group(1)
    secs = sum(float(p) * 60 ** i for i, p in enumerate(reversed(wall.split(":"))))
    return rss, secs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", type=Path, default=REPO / "bench-data" / "adapter")
    ap.add_argument("--method", default="ram+")
    ap.add_argument("--ranks", default="16,energy=0.99,full")
    ap.add_argument("--base", type=Path, help="your own base (with --agents) instead of the synthetic set")
    ap.add_argument("--agents", type=Path, nargs="*")
    args = ap.parse_args()
    root = args.workdir
    if args.base is not None:
        base, agents = args.base, list(args.agents or [])
    else:
        base, agents = make_set(root / "set", "0.5b", densities=(0.032, 0.462))
    rlmerge = str(Path(sys.executable).parent / "rlmerge")
    outs = root / "out"
    shutil.rmtree(outs, ignore_errors=True)
    outs.mkdir(parents=True)
    common = [rlmerge, "merge", str(base), *map(str, agents), "--method", args.method, "-q"]
    rss, wall = _measure("full merge", [*common, "-o", str(outs / "full")])
    size = sum(f.stat().st_size for f in (outs / "full").glob("*.safetensors")) / 2**30
    print(f"{'full merge':16s} peak RSS {rss:.2f} GiB   wall {wall:6.1f} s   output {size:.2f} GiB")
    for rank in args.ranks.split(","):
        out = outs / f"peft-{rank.replace('=', '-')}"
        r_rss, r_wall = _measure(f"peft {rank}", [*common, "--output-format", "peft", "--rank", rank, "-o", str(out)])
        doc = json.loads((out / "rlmerge.json").read_text())["adapter"]
        ranks = [m["rank"] for m in doc["matrices"].values()]
        size = (out / "adapter_model.safetensors").stat().st_size / 2**30
        print(f"{'peft ' + rank:16s} peak RSS {r_rss:.2f} GiB   wall {r_wall:6.1f} s ({r_wall / wall:.2f}x the full "
              f"merge)   {len(ranks)} matrices, rank {min(ranks)}–{max(ranks)}, largest relative error "
              f"{doc['max_relative_error']:.3f}, saved whole: {len(doc['modules_to_save'])} modules, "
              f"adapter {size:.2f} GiB")


if __name__ == "__main__":
    main()
