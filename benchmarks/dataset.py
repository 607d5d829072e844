"""The benchmark set, written streaming: base + agents of a real model shape, bf16, sparse planted deltas.

Whole models never sit in memory (a 7B shape is 15 GB per model): every tensor is generated a chunk of
rows at a time from a generator seeded by (seed, tensor, chunk), and each chunk is appended to all the
files at once, under a safetensors header written first. Same arguments give byte-identical files, so a
set on disk is reused when its manifest matches.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

import torch

from rlmerge.synthetic import PAPER_DENSITIES, QWEN25_05B, QWEN25_7B, Shape, config, tensor_shapes, write_tokenizer

QWEN25_15B = Shape("qwen2", 151936, 1536, 28, 12, 2, 8960, True)
SIZES: dict[str, Shape] = {"0.5b": QWEN25_05B, "1.5b": QWEN25_15B, "7b": QWEN25_7B}
NAMES = ("coder", "tool-use", "memory")
CHUNK = 1 << 22  # elements generated at a time (16 MiB of float32 per temporary)


def _header(shapes: dict[str, tuple[int, ...]]) -> bytes:
    entries: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shp in shapes.items():
        nbytes = math.prod(shp) * 2
        entries[name] = {"dtype": "BF16", "shape": list(shp), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    body = json.dumps(entries, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return len(body).to_bytes(8, "little") + body


class _Pool:
    """Random numbers drawn once; each chunk reads them at offsets drawn from its own seeded generator.

    Drawing fresh numbers for every element made a 0.5B set take minutes on two cores; sliding windows
    over a pool of 2·CHUNK keep the files deterministic and varied enough for timing at memory speed.
    """

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.normal = torch.randn(2 * CHUNK, generator=g)
        self.uniform = torch.rand(2 * CHUNK, generator=g)

    def take(self, pool: torch.Tensor, numel: int, g: torch.Generator) -> torch.Tensor:
        off = int(torch.randint(0, CHUNK, (1,), generator=g))
        return pool[off:off + numel]


def _chunk(name: str, numel: int, pool: _Pool, g: torch.Generator,
           densities: tuple[float, ...]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One chunk of the base (bf16) and of each agent: the base moved at a ``density`` fraction of elements."""
    z = pool.take(pool.normal, numel, g)
    base = (1.0 + 0.05 * z if name.endswith("norm.weight") else 0.02 * z).to(torch.bfloat16)
    stored = base.float()
    step_size = (stored.abs() * 0.05).clamp_(min=1e-3)  # relative step, survives rounding to bf16
    agents = []
    for d in densities:
        u = pool.take(pool.uniform, numel, g)
        step = step_size * (0.5 + pool.take(pool.uniform, numel, g))
        step = torch.where(u < d / 2, -step, step)  # u < d picks the element; its lower half goes down
        agents.append(torch.where(u < d, stored + step, stored).to(torch.bfloat16))
    return base, agents


def make_set(root: Path, size: str, *, seed: int = 0, densities: tuple[float, ...] = PAPER_DENSITIES,
             layers: int | None = None) -> tuple[Path, list[Path]]:
    """Write (or reuse) ``root/base`` and one folder per agent; ``layers`` trims the shape's depth."""
    shape = SIZES[size]
    if layers is not None:
        shape = Shape(shape.arch, shape.vocab, shape.hidden, layers, shape.heads, shape.kv_heads,
                      shape.intermediate, shape.tie)
    names = ["base", *(NAMES[i] if i < len(NAMES) else f"agent{i}" for i in range(len(densities)))]
    dirs = [root / n for n in names]
    manifest = {"shape": shape.__dict__, "seed": seed, "densities": list(densities), "version": 2}
    mfile = root / "manifest.json"
    if mfile.is_file() and json.loads(mfile.read_text()) == manifest:
        return dirs[0], dirs[1:]
    mfile.unlink(missing_ok=True)
    shapes = tensor_shapes(shape)
    cfg = config(shape, torch.bfloat16)
    header = _header(shapes)
    files = []
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        write_tokenizer(d, shape.vocab)
        files.append(open(d / "model.safetensors", "wb"))  # noqa: SIM115 closed below
    pool = _Pool(seed)
    try:
        for f in files:
            f.write(header)
        for ti, (name, shp) in enumerate(shapes.items()):
            numel = math.prod(shp)
            for ci, start in enumerate(range(0, numel, CHUNK)):
                g = torch.Generator().manual_seed((seed * 1_000_003 + ti) * 100_003 + ci)
                base, agents = _chunk(name, min(CHUNK, numel - start), pool, g, densities)
                for f, t in zip(files, [base, *agents]):
                    f.write(memoryview(t.view(torch.uint8).numpy()))
    finally:
        for f in files:
            f.close()
    mfile.write_text(json.dumps(manifest))
    return dirs[0], dirs[1:]


def set_arguments(ap: argparse.ArgumentParser) -> None:
    """A script's arguments for merging a set made here: the set's folder, ``--method`` and ``--params``."""
    ap.add_argument("set", type=Path, help="a benchmark set (base/ and the agents' folders)")
    ap.add_argument("--method", default="ties")
    ap.add_argument("--params", default="{}", help="the method's parameters as JSON")


def print_medians(runs: dict[Any, list[tuple[float, float]]]) -> None:
    """Per arm of an A/B, its merges' (wall s, CPU s): the median wall (min, max) and the median CPU."""
    for name, got in runs.items():
        walls = sorted(w for w, _ in got)
        print(f"{name}: wall median {statistics.median(walls):.2f} s (min {walls[0]:.2f}, max {walls[-1]:.2f}), "
              f"CPU median {statistics.median(c for _, c in got):.2f} s over {len(got)} merges")
