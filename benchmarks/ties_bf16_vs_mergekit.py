"""TIES on bf16 agents: rlmerge vs mergekit 0.1.5, element by element, and where they differ.

    .venv/bin/python benchmarks/ties_bf16_vs_mergekit.py [WORKDIR]

Builds a 16.3 M-parameter bf16 Qwen2-shaped base and three agents (the paper's densities), merges them with
`ties` (density 0.2) through `rlmerge merge --recipe` and `mergekit-yaml` (same recipe), and counts the output
elements that differ, split into those where some agent's |τ| ties exactly with its top-k threshold (mergekit
keeps exactly k of the tied elements, chosen by argsort; rlmerge keeps them all) and the rest.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

from rlmerge.synthetic import Shape, make_example

ROOT = Path(__file__).resolve().parents[1]
SHAPE = Shape("qwen2", vocab=8192, hidden=512, layers=4, heads=8, kv_heads=2, intermediate=1536, tie=True)


def main(work: Path) -> None:
    torch.set_num_threads(1)
    base, agents = make_example(work / "in", shape=SHAPE, dtype=torch.bfloat16)
    recipe = {"merge_method": "ties", "base_model": str(base), "dtype": "float32", "out_dtype": "bfloat16",
              "models": [{"model": str(a), "parameters": {"weight": 1.0, "density": 0.2}} for a in agents]}
    (work / "ties.yml").write_text(yaml.safe_dump(recipe))
    runs = {"rlmerge": [str(ROOT / ".venv/bin/rlmerge"), "merge", "--recipe", str(work / "ties.yml"), "-o",
                        str(work / "rlmerge"), "-q", "--force"],
            "mergekit": [str(ROOT / ".venv-mergekit/bin/mergekit-yaml"), str(work / "ties.yml"),
                         str(work / "mergekit"), "--quiet", "--no-copy-tokenizer", "-j", "1"]}
    for name, cmd in runs.items():
        t = time.perf_counter()
        subprocess.run(cmd, check=True, env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
        print(f"{name}: {time.perf_counter() - t:.1f} s wall (including start-up)")
    ours, theirs = (load_file(str(work / n / "model.safetensors")) for n in ("rlmerge", "mergekit"))
    b = load_file(str(base / "model.safetensors"))
    ags = [load_file(str(a / "model.safetensors")) for a in agents]
    total = tied_diff = other_diff = 0
    for k, v in ours.items():
        diff = v != theirs[k]
        tied = torch.zeros_like(diff)
        for a in ags:
            tau = (a[k].float() - b[k].float()).abs()
            kth = tau.reshape(-1).sort(descending=True).values[max(1, int(0.2 * tau.numel())) - 1]
            tied |= (tau == kth) & (kth > 0)
        total += v.numel()
        tied_diff += int((diff & tied).sum())
        other_diff += int((diff & ~tied).sum())
    print(f"elements {total:,}; differing at a threshold tie {tied_diff:,} ({tied_diff / total:.2%}); "
          f"differing elsewhere {other_diff:,}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "bench-data/ties-bf16"))
