"""Peak memory of `rlmerge inspect` on a Qwen2.5-0.5B-shaped synthetic set (base + 3 bf16 agents).

Builds the checkpoints one model at a time (each tensor from its own seed, so no whole model in float32 is ever
held), then runs `rlmerge inspect` in a child process under `/usr/bin/time -v` and prints its peak RSS, next
to the peak RSS of a process that only imports rlmerge (torch included) and the size of one model.

    .venv/bin/python benchmarks/inspect_memory.py [--workdir DIR] [--block-size N] [--keep]

Not part of the test suite: it writes ~4 GB and takes minutes on 2 cores.

glibc's malloc raises its mmap threshold as large blocks are freed, after which block-sized temporaries of
varying sizes fragment the heap and RSS grows with the number of tensors. Run once as is and once with
``MALLOC_MMAP_THRESHOLD_=1048576`` in the environment (inherited by the child) to see the difference.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

from rlmerge.synthetic import PAPER_DENSITIES, QWEN25_05B, config, perturb, tensor_shapes, write_tokenizer


def _base_tensor(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if name.endswith("norm.weight"):
        return (torch.ones(shape) + 0.05 * torch.randn(shape, generator=g)).bfloat16()
    return (0.02 * torch.randn(shape, generator=g)).bfloat16()


def build(root: Path) -> tuple[Path, list[Path]]:
    """Base and one agent per paper density, bf16, each written before the next is generated."""
    cfg = config(QWEN25_05B, torch.bfloat16)
    shapes = tensor_shapes(QWEN25_05B)
    paths = []
    for i, density in enumerate((None, *PAPER_DENSITIES)):
        path = root / ("base" if density is None else f"agent{i}")
        paths.append(path)
        if (path / "model.safetensors").exists():
            continue
        path.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for name, shape in shapes.items():
            w = _base_tensor(name, shape)
            if density is not None:
                seed = zlib.crc32(f"{i}/{name}".encode())
                w = perturb({name: w.float()}, density, seed=seed, dtype=torch.bfloat16)[name]
            tensors[name] = w
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        (path / "config.json").write_text(__import__("json").dumps(cfg, indent=2))
        write_tokenizer(path, 256)
        del tensors
    return paths[0], paths[1:]


def peak_rss(cmd: list[str]) -> tuple[int, float, str]:
    """(peak RSS in kB, wall seconds, stderr) of ``cmd`` run under /usr/bin/time -v."""
    t0 = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1))
    return kb, wall, proc.stderr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/rlmerge-inspect-bench"))
    ap.add_argument("--block-size", type=int, default=None, help="elements per block (default: rlmerge's)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints for another run")
    ap.add_argument("--merge", action="store_true", help="also measure `rlmerge merge --method ram+` for comparison")
    args = ap.parse_args()
    t0 = time.perf_counter()
    base, agents = build(args.workdir)
    print(f"built base + {len(agents)} agents in {time.perf_counter() - t0:.0f} s under {args.workdir}")
    model_bytes = (base / "model.safetensors").stat().st_size
    py = [sys.executable, "-c"]
    idle, _, _ = peak_rss([*py, "import rlmerge.cli"])
    cmd = [*py, "import sys; from rlmerge.cli import main; sys.exit(main(sys.argv[1:]))", "inspect", str(base),
           *map(str, agents), "-q", "--save", str(args.workdir / "report.json")]
    if args.block_size:
        cmd += ["--block-size", str(args.block_size)]
    kb, wall, _ = peak_rss(cmd)
    merge_kb = merge_wall = None
    if args.merge:
        out = args.workdir / "merged"
        shutil.rmtree(out, ignore_errors=True)
        merge = [*cmd[:3], "merge", str(base), *map(str, agents), "-o", str(out), "-q", "--method", "ram+"]
        merge += ["--block-size", str(args.block_size)] if args.block_size else []
        merge_kb, merge_wall, _ = peak_rss(merge)
        shutil.rmtree(out)
    elements = sum(torch.Size(s).numel() for s in tensor_shapes(QWEN25_05B).values())
    print(f"MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_', '(unset)')}")
    print(f"model: Qwen2.5-0.5B shape, {elements:,} elements, {model_bytes / 2**20:,.0f} MiB per checkpoint (bf16)")
    print(f"peak RSS, import only:        {idle / 1024:,.0f} MiB")
    block = f"block size {args.block_size:,}" if args.block_size else "default block size"
    print(f"peak RSS, rlmerge inspect:    {kb / 1024:,.0f} MiB  (1 base + {len(agents)} agents, {block}, "
          f"{wall:.0f} s wall)")
    if merge_kb is not None:
        print(f"peak RSS, rlmerge merge ram+: {merge_kb / 1024:,.0f} MiB  ({merge_wall:.0f} s wall, same inputs)")
    if not args.keep:
        shutil.rmtree(args.workdir)


if __name__ == "__main__":
    main()
