"""DARE on the fast path (fastdare.py, _numba_dare.py, _numba_mt.py) writes the torch path's bytes: the same
random numbers (torch's mt19937 and float conversion, replayed in numba), the same keep test, rescale and
merge rule, the L1 sums in methods/sparsify/l1.py's fixed order, whatever the block size and thread count; its
statistics are the same counts, and a non-finite τ is named as on the torch path."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import rlmerge
from conftest import interrupt_after
from rlmerge import kernels
from rlmerge.methods.sparsify import fast_random as fastdare
from rlmerge.methods.sparsify import kernels as family_kernels
from rlmerge.methods.sparsify import l1 as _l1
from rlmerge.methods.sparsify import rng as _ops
from rlmerge.methods.sparsify.presets import Combine
from rlmerge.methods.sparsify.rng import chunk_seed, uniform
from rlmerge.synthetic import Shape, make_example
from test_fastpath import _edge_models, _same_bytes, same_counts
from test_interrupt_resume import _files, _shards_done

pytestmark = pytest.mark.skipif(not kernels.HAVE_NUMBA, reason="numba not installed: no fast path to test")

CHUNK = _ops.RNG_CHUNK
# A model whose largest tensors span several random-number chunks (embed: 192,000 elements = 2.9 chunks).
WIDE = Shape("qwen2", vocab=3000, hidden=64, layers=1, heads=4, kv_heads=2, intermediate=1100, tie=True)


@pytest.fixture
def wide(tmp_path: Path) -> tuple[Path, list[Path]]:
    return make_example(tmp_path / "wide", shape=WIDE)


def plain_sum(n: int) -> tuple[np.ndarray, np.ndarray, object]:
    """The dare kernel's combine arguments (consts, agent_consts, key) for a plain sum of the pruned τ."""
    c = Combine(np.ones(n, np.float32), False, False, np.float32(1), np.float32(1))
    return (*c.program.arrays(c.values), kernels.rule_key(c.program, tau=True))

def _merge_both(base: Path, agents: list[Path], tmp: Path, monkeypatch: pytest.MonkeyPatch, method: str,
                params: dict, dtype: str | None = None, block: int | None = None, seed: int = 0,
                threads: int | None = None) -> tuple[rlmerge.MergeResult, rlmerge.MergeResult, int]:
    """The torch path (RLMERGE_FAST=0), then the fast path with ``threads`` compute threads (default: one per
    CPU); its kernel calls."""
    calls = []
    real = family_kernels.dare_merge_range

    def spy(*args: object) -> bool:
        calls.append(1)
        return real(*args)

    kw = {"block_size": block} if block else {}
    monkeypatch.setenv("RLMERGE_FAST", "0")
    slow = rlmerge.merge(base, agents, tmp / "torch", method=method, params=params, dtype=dtype, seed=seed, **kw)
    monkeypatch.setenv("RLMERGE_FAST", "1")
    if threads is not None:
        monkeypatch.setenv("RLMERGE_THREADS", str(threads))  # fastpath.compute_threads
    monkeypatch.setattr(family_kernels, "dare_merge_range", spy)
    fast = rlmerge.merge(base, agents, tmp / "fast", method=method, params=params, dtype=dtype, seed=seed, **kw)
    return slow, fast, len(calls)


def assert_fast_is_torch(base: Path, agents: list[Path], tmp: Path, monkeypatch: pytest.MonkeyPatch, method: str,
                         params: dict, dtype: str | None = None, block: int | None = None, seed: int = 0,
                         threads: int | None = None) -> None:
    """Both paths ran (the fast one through the DARE / DELLA kernel) and wrote the same shards and counts."""
    slow, fast, calls = _merge_both(base, agents, tmp, monkeypatch, method, params, dtype, block, seed, threads)
    assert calls > 0, "the fast path did not run"
    _same_bytes(tmp / "torch", tmp / "fast")
    same_counts(slow, fast)


# -- the random numbers ------------------------------------------------------------------------------------
def _mt_uniform(seed: int, n: int, skip: int = 0) -> np.ndarray:
    from rlmerge.methods.sparsify.kernels import mt as mt

    state = np.empty(mt.STATE, dtype=np.uint32)
    idx = mt.skip(state, mt.seed(state, np.uint32(seed & 0xFFFFFFFF)), skip)
    out = np.empty(n, dtype=np.float32)
    mt.uniform(state, idx, out, n)
    return out


def test_mt19937_replays_torch_rand() -> None:
    """Bit for bit, for 63-bit seeds (manual_seed keeps the low 32 bits), lengths around the 624-word state and
    the 65,536-element chunk, and streams entered part-way (a block that starts inside a chunk)."""
    rnd = random.Random(0)
    seeds = [0, 1, 5489, 2**32 - 1, 2**32, 2**32 + 7, 2**63 - 1, chunk_seed(3, 1, "w", 2)]
    seeds += [rnd.getrandbits(63) for _ in range(12)]
    for k, s in enumerate(seeds):
        n = [1, 7, 16, 623, 624, 625, 1247, 1248, 4097, 65535, CHUNK, 100_003][k % 12]
        want = torch.rand(n, generator=torch.Generator().manual_seed(s), dtype=torch.float32).numpy()
        for skip in sorted({0, 1, 623, 624, 625, n // 3, n - 1}):
            if skip < n:
                got = _mt_uniform(s, n - skip, skip)
                assert got.view(np.uint32).tobytes() == want[skip:].view(np.uint32).tobytes(), (s, n, skip)
    a = torch.rand(50, generator=torch.Generator().manual_seed(2**40 + 12345))
    assert torch.equal(a, torch.rand(50, generator=torch.Generator().manual_seed(12345)))  # only the low 32 bits


@pytest.mark.parametrize("rescale", ["none", "inverse", "l1"])
@pytest.mark.parametrize("block", [777, 4096, CHUNK, 100_000, 1 << 22])
def test_keep_mask_is_the_torch_paths(block: int, rescale: str) -> None:
    """The kernel's keep test (u < density) and rescale per element: the streams of each (agent, chunk),
    entered at any block start and thread cut, equal rng.uniform. One density is exactly a drawn u, which is
    dropped (a '<' turned '<=' keeps it)."""
    name, numel, seed = "model.layers.0.mlp.up_proj.weight", 3 * CHUNK + 1234, 11
    u0 = uniform(seed, 0, name, numel, 0, numel)
    dens = np.array([u0[CHUNK + 5].item(), 0.3], dtype=np.float32)  # a u that sits exactly on the density
    factor = np.array([1.5, 0.75] if rescale == "l1" else [1.0, 1.0], dtype=np.float32)  # none: × 1, exact
    seeds = np.array([[chunk_seed(seed, t, name, c) & 0xFFFFFFFF for c in range(4)] for t in range(2)],
                     dtype=np.uint32)
    tau = np.array([1.0, 2.0], dtype=np.float32)  # the output tells the two agents' masks apart
    terms = []
    for t in range(2):  # gta._merge in float32: τ · keep, then ÷ density or × factor
        kept = tau[t] * (uniform(seed, t, name, numel, 0, numel) < float(dens[t])).numpy().astype(np.float32)
        terms.append(kept / dens[t] if rescale == "inverse" else kept * factor[t] if rescale == "l1" else kept)
    want = terms[0] + terms[1]
    assert terms[0][CHUNK + 5] == 0.0
    got = np.empty(numel, dtype=np.float32)
    for start in range(0, numel, block):
        n = min(block, numel - start)
        base, agents = np.zeros(n, np.float32), np.ascontiguousarray(np.repeat(tau[:, None], n, 1))
        out = np.empty(n, np.float32)
        for lo, hi in fastdare.pieces(start, n, 3):
            family_kernels.dare_merge_range(base, agents, lo, hi, start, 0, seeds, dens, dens,
                                            fastdare.RESCALE[rescale], factor, np.ones(2, np.float32), *plain_sum(2),
                                            out, np.empty((2, 0), np.uint8), None)
        got[start:start + n] = out
    np.testing.assert_array_equal(got, want)


def test_pieces_cut_only_at_chunk_boundaries() -> None:
    for start, n, threads in [(0, 1 << 22, 2), (0, 1 << 22, 3), (777, 200_000, 4), (CHUNK - 1, 2, 2), (5, 10, 8),
                              (3 * CHUNK, CHUNK, 2), (100, 3 * CHUNK, 16)]:
        parts = fastdare.pieces(start, n, threads)
        assert parts[0][0] == 0 and parts[-1][1] == n and len(parts) <= threads
        assert all(a < b for a, b in parts) and all(p[1] == q[0] for p, q in zip(parts, parts[1:]))
        assert all((start + a) % CHUNK == 0 for a, _ in parts[1:])
    assert [b - a for a, b in fastdare.pieces(0, 1 << 22, 2)] == [1 << 21] * 2


# -- the L1 sums -------------------------------------------------------------------------------------------
def _reference_sum(v: np.ndarray) -> float:
    """methods/sparsify/l1.py's order, spelled out: per chunk 8 sequential lanes, a fixed tree, chunks in order."""
    total = 0.0
    for c0 in range(0, len(v), _l1.CHUNK):
        lanes = [0.0] * 8
        for i in range(c0, min(c0 + _l1.CHUNK, len(v))):
            lanes[i % 8] += float(v[i])
        total += ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]))
    return total


def test_l1_sums_follow_the_documented_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """LaneSum (torch path, whole chunks GROUP at a time) and the L1 kernel + fold (fast path) give the
    reference order's float64 sums, for any block size; magnitudes spread over 40 decades make every other
    order give other bits."""
    from rlmerge.methods.sparsify.kernels.dare import fold, l1_range

    assert _l1.CHUNK == _ops.RNG_CHUNK == CHUNK
    rng = np.random.default_rng(0)
    numel, name, seed = 4 * CHUNK + 3001, "t", 4
    tau = (rng.standard_normal((2, numel)) * 10.0 ** rng.uniform(-30, 10, (2, numel))).astype(np.float32)
    tau[1, 4 * CHUNK:] = 0.0  # the last chunk's lanes: 2^53, then 1 in each other lane; only the documented
    tau[1, 4 * CHUNK:4 * CHUNK + 8] = [2.0**53] + [1.0] * 7  # tree gives 2^53 + 6 (a chain gives 2^53 + 4)
    tau[0, CHUNK:] = 0.0  # later chunks add 0, 3/8 ulp, 3/8 ulp, 0 to chunk 0's sum (in [2^42, 2^43)):
    tau[0, [2 * CHUNK, 3 * CHUNK]] = 3 * 2.0**-13  # one by one nothing changes, as a pair they add one ulp
    big = int(np.abs(tau[0, :CHUNK]).argmax())  # the density is the u drawn for agent 0's largest |τ|: dropped
    dens = np.array([uniform(seed, 0, name, numel, 0, numel)[big].item(), 0.9], dtype=np.float32)
    keep = torch.stack([uniform(seed, t, name, numel, 0, numel) < float(dens[t]) for t in range(2)]).numpy()
    absd, kept = np.abs(tau), np.abs(tau) * keep
    want = np.array([[_reference_sum(r) for r in absd], [_reference_sum(r) for r in kept]])
    assert float(np.sum(absd[0].astype(np.float64))) != want[0, 0]  # the order matters for this data
    assert 2.0**42 <= _reference_sum(absd[0, :CHUNK]) == want[0, 0] < 2.0**43
    seeds = np.array([[chunk_seed(seed, t, name, c) & 0xFFFFFFFF for c in range(5)] for t in range(2)],
                     dtype=np.uint32)
    monkeypatch.setattr(_l1, "GROUP", 2)  # groups after the first must add to the total chunk by chunk
    for block in (777, 8192, CHUNK, 100_000, numel):
        lanes = _l1.LaneSum(4)
        total, carry = np.zeros((2, 2)), np.zeros((2, 2, 8))
        for start in range(0, numel, block):
            stop = min(start + block, numel)
            lanes.add(torch.from_numpy(np.concatenate([absd[:, start:stop], kept[:, start:stop]])), start, numel)
            part = np.empty((2, 2, (stop - 1) // CHUNK - start // CHUNK + 1, 8))
            for lo, hi in fastdare.pieces(start, stop - start, 3):
                l1_range(np.zeros(stop - start, np.float32), np.ascontiguousarray(tau[:, start:stop]), lo, hi, start,
                         0, seeds, dens, dens, carry, part, np.empty((2, 0), np.uint8), None)
            fold(part, carry, total, start, stop, numel)
        np.testing.assert_array_equal(lanes.total.reshape(2, 2), want, err_msg=f"torch path, block {block}")
        np.testing.assert_array_equal(total, want, err_msg=f"fast path, block {block}")


# -- whole merges --------------------------------------------------------------------------------------------
CASES = [  # method, params, output dtype, block size, seed
    ("dare_ta", {"density": 0.3}, None, None, 0),
    ("dare_ta", {"p": 0.4, "rescale": "none"}, "float32", 4096, 1),
    ("dare_ta", {"density": 0.5, "rescale": "l1", "weights": [0.3, 1.0, 0.6], "scaling": 0.7, "normalize": True},
     None, 777, 2),
    ("dare_ties", {"density": 0.5, "rescale": "l1"}, None, None, 0),
    ("dare_ties", {"density": 0.5, "rescale": "l1"}, "float32", 1000, 3),  # most tensors span blocks: two reads
    ("dare_ties", {"density": [0.2, 0.5, 0.9], "weights": [0.3, 1.0, 0.6], "scaling": 0.7}, "float32", 777, 4),
    ("dare_ties", {"p": [0.1, 0.5, 0.0], "rescale": "l1", "normalize": False}, None, 4096, 5),
    ("dare_ties", {"density": 1.0, "rescale": "none", "weights": [1.0, -0.5, 2.0]}, None, None, 6),
]


@pytest.mark.parametrize(("method", "params", "dtype", "block", "seed"), CASES)
def test_fast_dare_writes_the_torch_paths_bytes(example, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                method: str, params: dict, dtype: str | None, block: int | None,
                                                seed: int) -> None:
    assert_fast_is_torch(*example, tmp_path, monkeypatch, method, params, dtype, block, seed)


@pytest.mark.parametrize(("method", "params", "block", "threads"), [
    ("dare_ties", {"density": 0.4, "rescale": "l1"}, None, 3),  # one block per tensor, cut between 3 threads
    ("dare_ties", {"density": 0.4, "rescale": "l1"}, 100_000, 2),  # blocks that end inside a chunk
    ("dare_ta", {"density": [0.6, 0.3, 0.8], "rescale": "inverse", "scaling": 1.3}, 50_000, 2),
    ("dare_ta", {"density": 0.7, "rescale": "l1"}, 65_536, 1),
])
def test_tensors_over_several_chunks_same_bytes(wide, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str,
                                                params: dict, block: int | None, threads: int) -> None:
    assert_fast_is_torch(*wide, tmp_path, monkeypatch, method, params, None, block, 7, threads)


@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("method", "params"), [("dare_ties", {"density": 0.6, "rescale": "l1"}),
                                                ("dare_ties", {"density": 0.5}),
                                                ("dare_ta", {"density": 0.8, "rescale": "l1", "normalize": True})])
def test_edge_values_same_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stored: torch.dtype, method: str,
                                params: dict) -> None:
    """±0 bases, zero and cancelling τ (the elected sign at a zero sum), subnormals, large magnitudes."""
    base, agents = _edge_models(tmp_path / "in", stored)
    for out_dtype in ("bfloat16", "float32"):
        for block in (1000, 1 << 20):  # several blocks (two reads for l1) and one block (one read)
            where = tmp_path / f"{out_dtype}{block}"
            _, _, calls = _merge_both(base, agents, where, monkeypatch, method, params, out_dtype, block)
            assert calls > 0
            _same_bytes(where / "torch", where / "fast")


def test_density_equal_to_a_drawn_number_drops_it(example, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep means u < density, strictly: with agent 0's density set to the u drawn at one of its changed
    elements, both paths drop that element."""
    base, agents = example
    name = "model.embed_tokens.weight"
    b, a = load_file(str(base / "model.safetensors"))[name], load_file(str(agents[0] / "model.safetensors"))[name]
    changed = int((a.float() != b.float()).reshape(-1).nonzero()[0, 0])
    u = uniform(0, 0, name, b.numel(), 0, b.numel())[changed].item()
    params = {"density": [u, 0.5, 0.5], "rescale": "none"}
    _, _, calls = _merge_both(base, agents, tmp_path, monkeypatch, "dare_ta", params)
    assert calls > 0
    _same_bytes(tmp_path / "torch", tmp_path / "fast")
    merged = load_file(str(tmp_path / "fast" / "model.safetensors"))[name].reshape(-1)
    others = [load_file(str(p / "model.safetensors"))[name].float().reshape(-1) - b.float().reshape(-1)
              for p in agents[1:]]
    keeps = [bool(uniform(0, t, name, b.numel(), changed, changed + 1)[0] < 0.5) for t in (1, 2)]
    want = b.float().reshape(-1)[changed] + sum(o[changed] for o, k in zip(others, keeps) if k)
    assert merged[changed].float() == want.to(torch.bfloat16).float()  # agent 0's τ is not in it


@pytest.mark.parametrize("method", ["dare_ties", "della"])
def test_missing_tensor_takes_the_torch_path(example, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             method: str) -> None:
    """An agent without a tensor (allow_missing) sends the whole merge to the torch path: same bytes."""
    base, agents = example
    sd = load_file(str(agents[1] / "model.safetensors"))
    del sd["model.layers.1.mlp.down_proj.weight"]
    save_file(sd, str(agents[1] / "model.safetensors"))
    calls = []
    monkeypatch.setattr(family_kernels, "dare_merge_range", lambda *a: calls.append(1))
    for flag in ("0", "1"):
        monkeypatch.setenv("RLMERGE_FAST", flag)
        rlmerge.merge(base, agents, tmp_path / flag, method=method, params={"rescale": "l1"}, allow_missing=True)
    assert not calls
    _same_bytes(tmp_path / "0", tmp_path / "1")


@pytest.mark.parametrize(("method", "params"), [("dare_ties", {"density": 0.4, "rescale": "l1"}),
                                                ("della", {"epsilon": 0.2, "rescale": "l1"})])
def test_resume_is_byte_identical(example, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str,
                                  params: dict) -> None:
    """An interrupted fast dare_ties / della (l1) merge resumed with another block size gives the torch path's
    folder (della: blocks of whole rows)."""
    base, agents = example
    kw = {"method": method, "params": params, "shard_size": "16KB", "seed": 3}
    monkeypatch.setenv("RLMERGE_FAST", "0")
    rlmerge.merge(base, agents, tmp_path / "ref", **kw, block_size=300)
    monkeypatch.setenv("RLMERGE_FAST", "1")
    out = tmp_path / "out"
    with monkeypatch.context() as m:
        interrupt_after(m, 2, KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt):
            rlmerge.merge(base, agents, out, **kw, block_size=300)
    assert _shards_done(out) == 2
    calls, real = [], family_kernels.dare_merge_range
    monkeypatch.setattr(family_kernels, "dare_merge_range", lambda *a: calls.append(1) or real(*a))
    rlmerge.merge(base, agents, out, **kw, block_size=1000, resume=True)
    assert calls
    ours, ref = _files(out), _files(tmp_path / "ref")
    # norms and cosines: float32 partial sums on the fast path (kernels.py); rlmerge.json lists the report's size
    # and checksum, so it is compared without that entry
    report = "rlmerge-report.json"
    assert {k: v for k, v in ours.items() if k not in (report, "rlmerge.json")} == {
        k: v for k, v in ref.items() if k not in (report, "rlmerge.json")}
    mine, theirs = json.loads(ours["rlmerge.json"]), json.loads(ref["rlmerge.json"])
    for doc in (mine, theirs):
        del doc["files"][report]
    assert mine == theirs
    assert_reports_close(json.loads(ours[report]), json.loads(ref[report]))


def assert_reports_close(a: object, b: object, path: str = "") -> None:
    """Two report documents: the same structure, counts and strings; floats within 1e-6 relative."""
    if isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_reports_close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_reports_close(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-12), path
    else:
        assert a == b, path
