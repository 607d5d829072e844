"""DELLA on the fast path (fastdare.py with row > 0, _numba_della.py) writes the torch path's bytes: the same row
ranks (stable, ties by position), the same float32 keep probability, DARE's random numbers and rescale, the same
merge rule, whatever the block size and thread count; its statistics are the same counts, its report does not
depend on the block size, and a non-finite τ is named as on the torch path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import rlmerge
from conftest import TINY
from rlmerge import kernels
from rlmerge.methods.sparsify import fast_random as fastdare
from rlmerge.methods.sparsify import kernels as family_kernels
from rlmerge.methods.sparsify.rng import RNG_CHUNK, chunk_seed, row_ranks, uniform
from rlmerge.stream import fast as fastpath
from rlmerge.synthetic import config, make_example
from test_fastdare import WIDE, assert_fast_is_torch, plain_sum
from test_fastpath import _edge_models

pytestmark = pytest.mark.skipif(not kernels.HAVE_NUMBA, reason="numba not installed: no fast path to test")


# -- the ranks and the keep probability ----------------------------------------------------------------------
def _ranks(stored: torch.Tensor, base: torch.Tensor, row: int) -> np.ndarray:
    """kernels/della.rank_row over every row: integer ranks [n]."""
    from rlmerge.methods.sparsify.kernels.della import rank_row, scratch

    def raw(t: torch.Tensor) -> np.ndarray:
        return t.view(torch.uint16).numpy() if t.dtype == torch.bfloat16 else t.numpy()

    a, b = raw(stored), raw(base)
    out = np.empty(a.size, dtype=np.uint32)
    work, hist = scratch(row)
    for r0 in range(0, a.size, row):
        rank_row(a, b, r0, row, out, r0, work, hist, None)
    return out


def _rows(rng: np.random.Generator, row: int, nrows: int) -> np.ndarray:
    """|τ| patterns: random, few distinct values (ties), all zero, one huge outlier among many distinct values
    (the insertion sort gives up: radix), sparse, constant, and ±0."""
    kinds = []
    for k in range(nrows):
        kind = k % 7
        if kind == 0:
            v = rng.normal(0, 1e-3, row)
        elif kind == 1:
            v = rng.choice([0.0, 2.0**-8, -(2.0**-8), 2.0**-7, 3 * 2.0**-9], row)
        elif kind == 2:
            v = np.zeros(row)
        elif kind == 3:
            v = rng.normal(0, 1e-4, row) * (1 + rng.random(row))
            v[rng.integers(row)] = 1e30
        elif kind == 4:
            v = rng.normal(0, 1e-2, row) * (rng.random(row) < 0.05)
        elif kind == 5:
            v = np.full(row, -0.125)
        else:
            v = np.where(rng.random(row) < 0.5, 0.0, -0.0) + (rng.random(row) < 0.1) * 1e-38
        kinds.append(v)
    return np.concatenate(kinds)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("row", [1, 2, 7, 64, 896, 4099])
def test_rank_row_is_row_ranks(dtype: torch.dtype, row: int) -> None:
    """Integer ranks equal to a stable sort's (ties by position), and the normalised ranks to rng.row_ranks'."""
    rng = np.random.default_rng(row)
    nrows = 14 if row > 1 else 300
    base = torch.from_numpy(rng.normal(0, 0.02, row * nrows).astype(np.float32)).to(dtype)
    base[:row] = -0.0
    agent = (base.float() + torch.from_numpy(_rows(rng, row, nrows).astype(np.float32))).to(dtype)
    absd = (agent.float() - base.float()).abs()
    got = _ranks(agent, base, row)
    order = torch.sort(absd.reshape(nrows, row), dim=-1, stable=True).indices
    want = torch.empty_like(order).scatter_(-1, order, torch.arange(row).expand_as(order)).reshape(-1)
    np.testing.assert_array_equal(got, want.numpy())
    norm = np.zeros(got.size, np.float32) if row == 1 else got.astype(np.float32) / np.float32(row - 1)
    assert torch.equal(torch.from_numpy(norm), row_ranks(absd[None], row)[0])


def test_radix_fallback_sorts_stably() -> None:
    """The fallback of rank_row: a stable LSD radix sort of uint32 keys (many equal ones) with their positions."""
    from rlmerge.methods.sparsify.kernels.della import _radix

    rng = np.random.default_rng(1)
    for n in (1, 2, 300, 5000):
        for keys in (rng.integers(0, 2**31, n), rng.integers(0, 40, n) << 20, rng.integers(0, 3, n) * 0x01010101):
            sk, si = keys.astype(np.uint32), np.arange(n, dtype=np.uint32)
            _radix(sk, si, np.empty(n, np.uint32), np.empty(n, np.uint32), np.uint64(n), np.empty(257, np.uint32))
            order = np.argsort(keys, kind="stable")
            np.testing.assert_array_equal(si, order)
            np.testing.assert_array_equal(sk, keys[order])


@pytest.mark.parametrize("row", [1, 2, 3, 896, 4864, 1 << 20])
def test_probs_round_as_prune_block(row: int) -> None:
    """(density − ε) + (rank / (row − 1)) · 2ε in float32, in torch's order, for per-agent density and ε."""
    from rlmerge.methods.sparsify.kernels.della import probs

    dens = torch.tensor([[0.7], [0.31], [0.55]], dtype=torch.float32)
    eps = torch.tensor([[0.15], [0.3], [0.0123]], dtype=torch.float32)
    rng = np.random.default_rng(row)
    ranks = rng.integers(0, row, (3, 4096)).astype(np.uint32)
    ranks[:, :2] = [0, row - 1]
    norm = torch.zeros(3, 4096) if row == 1 else torch.from_numpy(ranks).to(torch.float32) / (row - 1)
    want = ((dens - eps) + norm * (2 * eps)).numpy()
    got = np.empty((3, 4096), np.float32)
    probs(ranks, np.uint64(0), np.uint64(4096), row, (dens - eps).numpy()[:, 0], (2 * eps).numpy()[:, 0], got)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_keep_is_u_strictly_below_p() -> None:
    """An element whose keep probability is exactly its drawn u is dropped (a '<' turned '<=' keeps it)."""
    name, row, seed = "t", 1000, 5
    numel = 3 * row
    tau = np.random.default_rng(0).normal(0, 1e-2, (1, numel)).astype(np.float32)
    target = 1234  # row 1, element 234
    order = np.argsort(np.abs(tau[0, row:2 * row]), kind="stable")
    q = np.float32(int(np.argsort(order)[target - row])) / np.float32(row - 1)
    u = float(uniform(seed, 0, name, numel, target, target + 1)[0])
    p2e = np.array([0.3], np.float32)
    plo = np.array([np.float32(u) - q * p2e[0]], np.float32)
    for _ in range(8):  # an ulp or two either way makes plo + q · 2ε land on u
        if plo[0] + q * p2e[0] == np.float32(u):
            break
        plo[0] = np.nextafter(plo[0], np.float32(1 if plo[0] + q * p2e[0] < u else 0))
    assert plo[0] + q * p2e[0] == np.float32(u)
    seeds = np.array([[chunk_seed(seed, 0, name, 0) & 0xFFFFFFFF]], dtype=np.uint32)
    out = np.empty(numel, np.float32)
    family_kernels.dare_merge_range(np.zeros(numel, np.float32), (tau[0],), 0, numel, 0, row, seeds, plo, p2e,
                             fastdare.RESCALE["none"], np.ones(1, np.float32), np.ones(1, np.float32), *plain_sum(1),
                             out, np.empty((1, 0), np.uint8), None)
    assert out[target] == 0.0 and tau[0, target] != 0.0
    keep = out != 0.0
    assert 0.2 < keep.mean() < 0.9  # the others are kept at about their p


def test_row_step_holds_rows_and_tiles() -> None:
    """Blocks of whole rows, starting at whole tiles (so the report's partial sums do not move), for any block."""
    for shape in [(151936, 896), (4864, 896), (896, 4864), (896,), (5000,), (64, 32), (7, 1), (50, 37), (3000, 1001)]:
        numel = int(np.prod(shape))
        row = int(np.prod(shape[1:])) if len(shape) > 1 else numel
        for block in (300, 1000, 1024, 4096, 65536, 1 << 22):
            step = fastpath.row_step(shape, numel, block)
            assert step % row == 0 or step == numel, (shape, block)
            assert step >= numel or step % kernels.TILE == 0 or np.lcm(row, kernels.TILE) > fastpath.ALIGN_MAX
            assert step <= max(block, np.lcm(row, kernels.TILE), row) or step == numel


# -- whole merges --------------------------------------------------------------------------------------------
CASES = [  # method, params, output dtype, block size, seed
    ("della", {}, None, None, 0),
    ("della", {"density": 0.7, "epsilon": 0.15, "rescale": "l1"}, None, None, 1),
    ("della", {"density": 0.5, "epsilon": 0.2, "rescale": "l1"}, "float32", 300, 2),  # most tensors: two reads
    ("della", {"density": [0.3, 0.5, 0.6], "epsilon": [0.1, 0.25, 0.05], "weights": [0.3, 1.0, 0.6],
               "scaling": 0.7}, "float32", 777, 3),
    ("della", {"rescale": "none", "normalize": False, "weights": [1.0, -0.5, 2.0]}, None, 4096, 4),
    ("della", {"density": 0.6, "epsilon": 0.0}, None, 1000, 5),
    ("della_linear", {}, None, None, 0),
    ("della_linear", {"density": 0.4, "epsilon": 0.3, "rescale": "l1", "weights": [0.5, 1.2, 0.7]}, None, 1000, 6),
    ("della_linear", {"rescale": "none", "scaling": 1.3, "normalize": True}, "float32", 2048, 7),
]


@pytest.mark.parametrize(("method", "params", "dtype", "block", "seed"), CASES)
def test_fast_della_writes_the_torch_paths_bytes(example, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 method: str, params: dict, dtype: str | None, block: int | None,
                                                 seed: int) -> None:
    assert_fast_is_torch(*example, tmp_path, monkeypatch, method, params, dtype, block, seed, threads=2)


@pytest.mark.parametrize(("method", "params", "block", "threads"), [
    ("della", {"rescale": "l1"}, None, 3),  # one block per tensor, cut between 3 threads inside rows
    ("della", {"rescale": "l1"}, 100_000, 2),  # blocks that end inside a chunk
    ("della", {"density": [0.6, 0.3, 0.75], "epsilon": 0.2}, 50_000, 2),
    ("della_linear", {"rescale": "l1"}, 65_536, 1),
])
def test_tensors_over_several_chunks_same_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str,
                                                params: dict, block: int | None, threads: int) -> None:
    assert_fast_is_torch(*make_example(tmp_path / "wide", shape=WIDE), tmp_path, monkeypatch, method, params, None,
                         block, 7, threads)


@pytest.mark.parametrize("cap", [None, 1000, 0])  # 1000 bytes: the embedding (3 · 4096 / 8) draws again
def test_l1_keep_bits_kept_or_drawn_again(example, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          cap: int | None) -> None:
    """``l1``: the merge reuses the keep bits its L1 sums stored (MASK_BYTES), or draws and ranks again for a
    tensor above the cap; both give the torch path's bytes, for tensors in one block and over several."""
    masks, real = [], family_kernels.dare_merge_range
    if cap is not None:
        monkeypatch.setattr(fastdare, "MASK_BYTES", cap)
    for method in ("della", "dare_ties"):
        for block in (1000, None):
            where = tmp_path / f"{method}{block}"
            monkeypatch.setattr(family_kernels, "dare_merge_range",
                                lambda *a: masks.append(a[-2].shape[1] > 0) or real(*a))
            assert_fast_is_torch(*example, where, monkeypatch, method, {"rescale": "l1"}, block=block, threads=2)
    assert (any(masks), all(masks)) == {None: (True, True), 1000: (True, False), 0: (False, False)}[cap]


def _tie_models(root: Path, dtype: torch.dtype) -> tuple[Path, list[Path]]:
    """Rows with many ties (few distinct τ), all-zero rows, a huge outlier, rows of one element, odd row
    lengths (blocks that start inside a byte of l1's keep bits), and a 1-D tensor larger than the small blocks."""
    rng = np.random.default_rng(3)
    shapes = {"model.layers.0.mlp.up_proj.weight": (96, 64), "model.layers.0.mlp.down_proj.weight": (64, 96),
              "model.norm.weight": (5000,), "model.layers.0.self_attn.q_proj.bias": (7, 1),
              "model.layers.0.self_attn.o_proj.weight": (50, 37),
              "model.layers.0.mlp.gate_proj.weight": (3, 1025)}  # lcm(row, TILE) > ALIGN_MAX: blocks of one row
    base = {k: rng.normal(0, 0.05, s).astype(np.float32) for k, s in shapes.items()}
    models = [base]
    for t in range(3):
        agent = {}
        for k, b in base.items():
            row = int(np.prod(b.shape[1:])) if b.ndim > 1 else b.size
            tau = _rows(rng, row, b.size // row).reshape(b.shape)
            tau *= rng.random(b.shape) < (0.2, 0.5, 0.9)[t]
            agent[k] = b + tau.astype(np.float32)
        models.append(agent)
    paths = []
    for i, m in enumerate(models):
        d = root / f"m{i}"
        d.mkdir(parents=True)
        save_file({k: torch.from_numpy(v).to(dtype).contiguous() for k, v in m.items()}, str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps(config(TINY, dtype)))
        paths.append(d)
    return paths[0], paths[1:]


@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("method", "params"), [("della", {"rescale": "l1"}), ("della", {}),
                                                ("della_linear", {"density": [0.3, 0.5, 0.7], "rescale": "none"})])
def test_ties_zero_rows_and_edge_values_same_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   stored: torch.dtype, method: str, params: dict) -> None:
    """Rows of ties and of zeros, rows of one element, a 1-D tensor over several blocks; and fastpath's edge
    values (±0 bases, cancelling τ, subnormals, large magnitudes)."""
    for models in ("ties", "edge"):
        base, agents = (_tie_models if models == "ties" else _edge_models)(tmp_path / models, stored)
        for out_dtype in ("bfloat16", "float32"):
            for block in (1000, 1 << 20):  # several blocks (two reads for l1) and one block (one read)
                assert_fast_is_torch(base, agents, tmp_path / f"{models}{out_dtype}{block}", monkeypatch, method,
                                     params, out_dtype, block, threads=2)


def test_report_does_not_depend_on_block_size_or_threads(example, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Row-cut blocks still start at whole tiles (fastpath.row_step): the report is the same bytes."""
    base, agents = example
    reports, outputs = set(), set()
    for i, (block, threads) in enumerate([(None, "1"), (5000, "2"), (1024, "2"), (300, "1"), (777, "3")]):
        monkeypatch.setenv("RLMERGE_THREADS", threads)
        kw = {"block_size": block} if block else {}
        out = tmp_path / f"o{i}"
        rlmerge.merge(base, agents, out, method="della", params={"rescale": "l1"}, **kw)
        reports.add((out / "rlmerge-report.json").read_bytes())
        outputs.add((out / "model.safetensors").read_bytes())
    assert len(reports) == 1 and len(outputs) == 1


NO_TORCH = """
import sys
from rlmerge.cli import main
rc = main(["merge", *sys.argv[1:5], "-o", sys.argv[5], "-q", *sys.argv[6:]])
print(rc, "torch" in sys.modules)
"""


@pytest.mark.parametrize("args", [["--method", "della"], ["--method", "della", "--param", "rescale=l1"],
                                  ["--method", "della_linear", "--param", "rescale=none"]])
def test_fast_della_merges_without_importing_torch(example, tmp_path: Path, args: list[str]) -> None:
    base, agents = example
    cmd = [sys.executable, "-c", NO_TORCH, str(base), *map(str, agents), str(tmp_path / "out"), *args]
    got = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split()
    assert got == ["0", "False"], got
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_chunk_constant_is_shared() -> None:
    from rlmerge.methods.sparsify.kernels import dare as _numba_dare

    assert _numba_dare.CHUNK == RNG_CHUNK
