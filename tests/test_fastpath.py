"""The fused fast path (kernels.py, fastpath.py) writes the same bytes as the torch path, on every method it
serves, both output dtypes, odd block sizes and hand-picked edge values; its statistics are the same counts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import rlmerge
from conftest import TINY, load_output
from rlmerge import kernels
from rlmerge.errors import InputError
from rlmerge.stats import TensorStats
from rlmerge.stream import fast as fastpath
from rlmerge.synthetic import config, make_example

pytestmark = pytest.mark.skipif(not kernels.HAVE_NUMBA, reason="numba not installed: no fast path to test")

CASES = [
    ("ram", {}, None, None),
    ("ram+", {"preset": "paper"}, None, 777),  # a block size that splits tiles and threads unevenly
    ("ram+", {"preset": "tensor-local"}, "float32", None),
    ("ram+", {"preset": "official"}, None, 4096),
    ("task_arithmetic", {"scaling": 0.3, "weights": [0.5, 1.2, 0.7], "normalize": True}, None, 1000),
    ("task_arithmetic", {}, "float32", None),
    ("linear", {"weights": [0.5, 1.2, 0.7]}, None, None),
    ("linear", {}, "float32", 999),
    ("model_stock", {}, None, 777),
    ("model_stock", {}, "float32", None),
]


def _merge_both(base: Path, agents: list[Path], tmp: Path, monkeypatch: pytest.MonkeyPatch, method: str,
                params: dict, dtype: str | None, block: int | None) -> tuple[Path, Path, int]:
    calls = []
    real = kernels.fused_range

    def spy(*args: object) -> bool:
        calls.append(1)
        return real(*args)

    kw = {"block_size": block} if block else {}
    monkeypatch.setenv("RLMERGE_FAST", "0")
    rlmerge.merge(base, agents, tmp / "torch", method=method, params=params, dtype=dtype, **kw)
    monkeypatch.setenv("RLMERGE_FAST", "1")
    monkeypatch.setattr(kernels, "fused_range", spy)
    rlmerge.merge(base, agents, tmp / "fast", method=method, params=params, dtype=dtype, **kw)
    return tmp / "torch", tmp / "fast", len(calls)


def same_counts(slow: rlmerge.MergeResult, fast: rlmerge.MergeResult) -> None:
    """Both merges counted the same k-of-N, overlaps and sign agreements for every tensor."""
    assert slow.statistics.tensors.keys() == fast.statistics.tensors.keys()
    for name, s in slow.statistics.tensors.items():
        f = fast.statistics.tensors[name]
        for attr in ("kofn", "overlap", "sign_agree"):
            np.testing.assert_array_equal(getattr(s, attr), getattr(f, attr), err_msg=f"{name}.{attr}")


def _same_bytes(a: Path, b: Path) -> None:
    files = sorted(p.name for p in a.glob("*.safetensors"))
    assert files and files == sorted(p.name for p in b.glob("*.safetensors"))
    for f in files:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f


@pytest.mark.parametrize(("method", "params", "dtype", "block"), CASES)
def test_fast_path_writes_the_torch_paths_bytes(example, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str,
                                                params: dict, dtype: str | None, block: int | None) -> None:
    base, agents = example
    slow, fast, calls = _merge_both(base, agents, tmp_path, monkeypatch, method, params, dtype, block)
    assert calls > 0, "the fast path did not run"
    _same_bytes(slow, fast)
    assert json.loads((slow / "rlmerge.json").read_text()).get("lambdas") == \
        json.loads((fast / "rlmerge.json").read_text()).get("lambdas")


def _edge_models(root: Path, dtype: torch.dtype) -> tuple[Path, list[Path]]:
    """Hand-picked values: ±0 bases, τ exactly at and one ulp around ε, cancelling agents, ties when rounding
    the mean to bf16, subnormals and large magnitudes; plus random filler so every stage runs in tiles."""
    eps = np.float32(1e-5)
    up, down = np.nextafter(eps, np.float32(1)), np.nextafter(eps, np.float32(0))
    b = np.array([0.0, -0.0, -0.0, 1.0, 1.0, 1.0, 0.5, -2.0, 1e-40, 3e30, 1.0, 0.25], dtype=np.float32)
    t1 = np.array([0.0, 0.0, 1e-3, eps, up, down, 0.25, 1e-3, 1e-39, 1e29, 2**-8, -0.25], dtype=np.float32)
    t2 = np.array([0.0, -0.0, -1e-3, -eps, -up, up, 0.25, 3e-3, 0.0, -1e29, 2**-7, 0.25], dtype=np.float32)
    t3 = np.array([0.0, 0.0, 0.0, 0.0, up, -down, 2**-9, 0.0, 0.0, 0.0, 2**-7 + 2**-8, 0.0], dtype=np.float32)
    rng = np.random.default_rng(0)
    filler = rng.normal(0, 0.02, (4, 3000)).astype(np.float32)
    filler[1:] *= rng.random((3, 3000)) < 0.5
    vecs = [np.concatenate([x, filler[i]]) for i, x in enumerate((b, t1, t2, t3))]
    models = [vecs[0], *(vecs[0] + v for v in vecs[1:])]
    shape = TINY
    paths = []
    for i, m in enumerate(models):
        d = root / f"m{i}"
        d.mkdir(parents=True)
        save_file({"model.embed_tokens.weight": torch.from_numpy(m).reshape(-1, 4).to(dtype).contiguous()},
                  str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps(config(shape, dtype)))
        paths.append(d)
    return paths[0], paths[1:]


@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("method", "params"), [("ram", {}), ("ram+", {"preset": "official"}),
                                                ("task_arithmetic", {"scaling": 0.7}), ("linear", {}),
                                                ("model_stock", {})])
def test_edge_values_same_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stored: torch.dtype,
                                method: str, params: dict) -> None:
    base, agents = _edge_models(tmp_path / "in", stored)
    for out_dtype in ("bfloat16", "float32"):
        slow, fast, calls = _merge_both(base, agents, tmp_path / out_dtype, monkeypatch, method, params,
                                           out_dtype, 1000)
        assert calls > 0
        _same_bytes(slow, fast)


def test_statistics_pass_same_counts(example, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base, agents = example
    monkeypatch.setenv("RLMERGE_FAST", "0")
    slow = rlmerge.merge(base, agents, tmp_path / "a", method="ram+").statistics
    monkeypatch.setenv("RLMERGE_FAST", "1")
    fast = rlmerge.merge(base, agents, tmp_path / "b", method="ram+", block_size=999).statistics
    assert slow.tensors.keys() == fast.tensors.keys()
    for name, s in slow.tensors.items():
        f = fast.tensors[name]
        for attr in ("kofn", "overlap", "sign_agree"):
            np.testing.assert_array_equal(getattr(s, attr), getattr(f, attr), err_msg=f"{name}.{attr}")
        # float32 sums over tiles of 1024, float64 across them (kernels.py): ~1e-7 relative to the torch path's
        np.testing.assert_allclose(f.dots, s.dots, rtol=2e-6, atol=1e-30)
    assert slow.rho == fast.rho


@pytest.mark.parametrize("n_agents", [1, 2, 4])
def test_pattern_histogram_equals_pairwise_counters(n_agents: int) -> None:
    """add_patterns (one 4^N histogram) gives exactly update's kofn, overlaps and sign agreements."""
    g = torch.Generator().manual_seed(n_agents)
    deltas = torch.randn(n_agents, 5000, generator=g) * (torch.rand(n_agents, 5000, generator=g) < 0.5)
    mask = deltas.abs() > 1e-5
    ref = TensorStats(5000, n_agents)
    ref.update(deltas, mask, mask.sum(0))
    code = (mask.long() << torch.arange(n_agents)[:, None]).sum(0)
    code += ((mask & (deltas < 0)).long() << (n_agents + torch.arange(n_agents))[:, None]).sum(0)
    hist = torch.bincount(code, minlength=4**n_agents).numpy()
    gram = (deltas.double() @ deltas.double().T).numpy()
    got = TensorStats(5000, n_agents)
    got.add_patterns(hist, np.triu(gram))
    for attr in ("kofn", "overlap", "sign_agree"):
        np.testing.assert_array_equal(getattr(got, attr), getattr(ref, attr), err_msg=attr)
    np.testing.assert_allclose(got.dots, ref.dots, rtol=1e-12)


@pytest.mark.parametrize("n_agents", [1, 3, 7])
def test_kernel_pattern_counts_are_numpys(n_agents: int) -> None:
    """The statistics kernel's pattern counts (int32 sub-histograms, then added to the caller's int64 ones) are
    numpy's bincount of the codes, over a range starting and ending inside tiles, added to what the histogram
    held; 7 agents take the one-histogram layout (4^7 bins)."""
    from rlmerge.kernels.layout import hist_shape

    rng = np.random.default_rng(n_agents)
    size = 3 * kernels.TILE + 333
    base = (rng.standard_normal(size) * 0.02).astype(np.float32)
    agents = tuple(np.where(rng.random(size) < 0.5, base + rng.standard_normal(size).astype(np.float32) * 1e-2,
                            base).astype(np.float32) for _ in range(n_agents))
    lo, hi, eps = 100, size - 7, np.float32(1e-5)
    held = rng.integers(0, 100, hist_shape(n_agents))
    hist, gram = held.copy(), np.zeros((n_agents, n_agents))
    kernels.fused_range(None, base, agents, lo, hi, eps, np.zeros(0, np.float32), np.zeros((0, n_agents), np.float32),
                        np.empty(1, np.float32), hist, gram)
    tau = np.stack([a[lo:hi] - base[lo:hi] for a in agents])
    changed = np.abs(tau) > eps
    code = sum((changed[t] << t) + ((changed[t] & (tau[t] < 0)) << (n_agents + t)) for t in range(n_agents))
    assert ((hist - held).sum(0) == np.bincount(code, minlength=4**n_agents)).all()


def test_non_finite_delta_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base, agents = make_example(tmp_path / "in", shape=TINY)
    name = "model.layers.0.mlp.up_proj.weight"
    from safetensors.torch import load_file

    bad = load_file(str(agents[1] / "model.safetensors"))
    bad[name] = bad[name].clone()
    bad[name].view(-1)[77] = float("inf")
    save_file(bad, str(agents[1] / "model.safetensors"))
    for flag in ("0", "1"):
        monkeypatch.setenv("RLMERGE_FAST", flag)
        for method in ("ram", "ram+", "task_arithmetic", "model_stock"):
            with pytest.raises(InputError) as e:
                rlmerge.merge(base, agents, tmp_path / f"out{flag}{method}", method=method)
            assert name in str(e.value) and "77" in str(e.value) and str(agents[1]) in str(e.value)


def test_fast_path_is_optional(example, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Without numba (simulated) the torch path runs and gives the same output."""
    base, agents = example
    rlmerge.merge(base, agents, tmp_path / "a", method="ram")
    monkeypatch.setattr(kernels, "HAVE_NUMBA", False)
    assert not fastpath.enabled("cpu")
    rlmerge.merge(base, agents, tmp_path / "b", method="ram")
    _same_bytes(tmp_path / "a", tmp_path / "b")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_device_same_bytes(example, tmp_path: Path) -> None:
    base, agents = example
    for method in ("ram", "ram+", "task_arithmetic"):
        rlmerge.merge(base, agents, tmp_path / f"cpu-{method}", method=method)
        rlmerge.merge(base, agents, tmp_path / f"gpu-{method}", method=method, device="cuda")
        _same_bytes(tmp_path / f"cpu-{method}", tmp_path / f"gpu-{method}")
        assert load_output(tmp_path / f"gpu-{method}").keys() == load_output(tmp_path / f"cpu-{method}").keys()


NO_TORCH = """
import sys
from rlmerge.cli import main
rc = main(["merge", sys.argv[1], *sys.argv[2:5], "-o", sys.argv[5], "-q", "--method", sys.argv[6]])
print(rc, "torch" in sys.modules)
"""


@pytest.mark.parametrize("method", ["ram+", "task_arithmetic"])
def test_fast_path_merges_without_importing_torch(example, tmp_path: Path, method: str) -> None:
    """torch costs ~2 s to import; a merge that runs wholly on the fused kernels must not pay it."""
    import subprocess
    import sys

    base, agents = example
    cmd = [sys.executable, "-c", NO_TORCH, str(base), *map(str, agents), str(tmp_path / "out"), method]
    got = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split()
    assert got == ["0", "False"], got
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_unknown_device_is_a_config_error(example, tmp_path: Path) -> None:
    from rlmerge.errors import ConfigError

    base, agents = example
    with pytest.raises(ConfigError, match="unknown device"):
        rlmerge.merge(base, agents, tmp_path / "out", device="gpu0")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_huge_finite_delta_is_not_taken_for_an_overflow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """|τ| = 3e20: its square overflows float32, so the tile's float32 Gram sum is inf; the kernel must redo that
    tile in float64 rather than report a non-finite τ, and the statistics must stay finite and right."""
    base, agents = make_example(tmp_path / "in", shape=TINY)
    name = "model.layers.0.mlp.up_proj.weight"
    from safetensors.torch import load_file

    big = load_file(str(agents[0] / "model.safetensors"))
    big[name] = big[name].clone()
    big[name].view(-1)[5] = 3e20
    save_file(big, str(agents[0] / "model.safetensors"))
    monkeypatch.setenv("RLMERGE_FAST", "0")
    slow = rlmerge.merge(base, agents, tmp_path / "torch", method="ram").statistics.tensors[name]
    monkeypatch.setenv("RLMERGE_FAST", "1")
    fast = rlmerge.merge(base, agents, tmp_path / "fast", method="ram").statistics.tensors[name]
    _same_bytes(tmp_path / "torch", tmp_path / "fast")
    assert np.isfinite(fast.dots).all() and fast.sumsq[0] > 8e40  # (3e20 in bfloat16)²
    np.testing.assert_allclose(fast.dots, slow.dots, rtol=2e-6)


def test_report_does_not_depend_on_block_size_or_threads(example, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The statistics' float32 partial sums sit at fixed offsets of each tensor (fastpath.FastPath.block), so
    the report is the same bytes for any block size and thread count (a resumed run relies on it)."""
    base, agents = example
    reports = set()
    for i, (block, threads) in enumerate([(None, "1"), (5000, "2"), (1024, "2"), (300, "1")]):
        monkeypatch.setenv("RLMERGE_THREADS", threads)
        kw = {"block_size": block} if block else {}
        out = tmp_path / f"o{i}"
        rlmerge.merge(base, agents, out, method="ram", **kw)
        reports.add((out / "rlmerge-report.json").read_bytes())
    assert len(reports) == 1


def test_a_file_that_shrinks_under_its_mapping_is_an_input_error(example) -> None:
    """The fast path reads mapped files; a file cut short after it was mapped is reported before its bytes are
    touched (touching them would be SIGBUS), naming the file and the tensor."""
    from rlmerge.io.mapping import Mapped
    from rlmerge.io.open import open_all

    base, _ = example
    ckpt = open_all([base])[0]
    name = max(ckpt.tensors, key=lambda k: ckpt.tensors[k].numel)
    mapped = Mapped()
    view = mapped.view(ckpt, name, 0, 100)
    assert view is not None and not view.flags.writeable
    expected = view.copy()
    del view
    path = ckpt.tensors[name].file
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)
    with pytest.raises(InputError, match="shrank") as e:
        mapped.view(ckpt, name, 0, 100)
    assert str(path) in str(e.value) and name in str(e.value)
    assert expected.size == 100
    mapped.close()
    ckpt.close()


def test_a_checked_view_uses_the_size_its_prefetch_saw(example) -> None:
    """The fast path views a block its readahead thread asked for with ``checked``: the size that request noted
    is used instead of an fstat per view; a shrink it saw is the same InputError, one it did not see is caught
    by an unchecked view (which the fast path makes for a block whose request has not run)."""
    from rlmerge.io.mapping import Mapped
    from rlmerge.io.open import open_all

    base, _ = example
    ckpt = open_all([base])[0]
    name = max(ckpt.tensors, key=lambda k: ckpt.tensors[k].numel)
    path = ckpt.tensors[name].file
    mapped = Mapped()
    assert mapped.view(ckpt, name, 0, 100) is not None  # mapped at its full size
    mapped.prefetch(ckpt, name, 100, 200)  # notes the size: whole
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)
    assert mapped.view(ckpt, name, 100, 200, checked=True) is not None  # what the request saw: not yet cut
    with pytest.raises(InputError, match="shrank"):
        mapped.view(ckpt, name, 100, 200)  # an unchecked view looks itself
    mapped.prefetch(ckpt, name, 200, 300)  # a later request sees the cut ...
    with pytest.raises(InputError, match="shrank") as e:
        mapped.view(ckpt, name, 200, 300, checked=True)  # ... and a checked view reports it
    assert str(path) in str(e.value) and name in str(e.value)
    mapped.close()
    ckpt.close()


def _mapped_rss(paths: set[str]) -> int:
    """Resident bytes of this process's mappings of ``paths`` (/proc/self/smaps)."""
    total, current = 0, ""
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
                current = fields[5] if len(fields) >= 6 else ""
            elif fields[0] == "Rss:" and current in paths:
                total += int(fields[1]) * 1024
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc for mapped pages")
def test_released_blocks_leave_no_mapped_pages_behind(tmp_path: Path) -> None:
    """Each block's pages are handed back in whole folios: a fault maps a folio's every page, so a block's first
    fault would re-map the tail of the block before it, and 4 % of every input used to stay resident."""
    from rlmerge.io.open import open_all
    from rlmerge.stream.match import match_models
    from rlmerge.synthetic import Shape

    shape = Shape("qwen2", vocab=4096, hidden=256, layers=2, heads=4, kv_heads=2, intermediate=1024, tie=True)
    base, agents = make_example(tmp_path / "in", shape=shape)  # 2.9 M elements: 5.8 MB per model
    models = open_all([base, *agents])
    for m in models:  # into the page cache, read the way a first merge reads them
        for f in m.files:
            f.read_bytes()
    plan = match_models(models[0], models[1:])
    fast = fastpath.FastPath(plan, 3000)  # blocks of 6 KB per file: ~1000 block boundaries per file
    files = {str(f) for m in models for f in m.files}
    total = 0
    for *_, b, agent_views in fast.blocks(plan.merge_jobs):
        total += int(b.sum()) + sum(int(a.sum()) for a in agent_views)
    del b, agent_views
    fast._ahead.submit(lambda: None).result()  # the readahead thread, which releases them, is through its queue
    # every block was released (page by page, 22.4 of the 23.5 MB stayed mapped on Linux 6.18)
    assert _mapped_rss(files) <= 0.01 * sum(Path(f).stat().st_size for f in files), _mapped_rss(files)
    assert total > 0
    fast.close()
    for m in models:
        m.close()


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc for mapped pages")
def test_a_block_asked_for_ahead_is_mapped_before_it_is_viewed(tmp_path: Path) -> None:
    """The readahead thread maps a requested block's pages into the process (MADV_POPULATE_READ) once its file is
    mapped, so the compute threads do not fault them in page by page; release hands them back."""
    from rlmerge.io.mapping import _MADVISE, PAGE, Mapped
    from rlmerge.io.open import open_all
    from rlmerge.synthetic import Shape

    if _MADVISE is None:
        pytest.skip("no libc madvise here")
    shape = Shape("qwen2", vocab=4096, hidden=256, layers=1, heads=4, kv_heads=2, intermediate=1024, tie=True)
    base, agents = make_example(tmp_path / "in", shape=shape)
    (agent,) = open_all([agents[0]])
    files = {str(f) for f in agent.files}
    for f in agent.files:  # into the page cache
        f.read_bytes()
    name = max(agent.tensors, key=lambda n: agent.tensors[n].numel)
    n = agent.tensors[name].numel
    nbytes = n * agent.tensors[name].dtype.itemsize
    mapped = Mapped()
    mapped.prefetch(agent, name, 0, n)  # the file not mapped yet: its pages are only asked for
    assert _mapped_rss(files) == 0
    view = mapped.view(agent, name, 0, 1)  # the file mapped, nothing of it touched
    assert view is not None and _mapped_rss(files) <= 2 * PAGE
    mapped.prefetch(agent, name, 0, n)
    assert _mapped_rss(files) >= nbytes  # every page of the tensor mapped, none faulted in by a read
    mapped.release(agent, name, 0, n)
    assert _mapped_rss(files) <= 2 * PAGE
    del view
    mapped.close()
    agent.close()


def test_the_blocks_ahead_are_requested_before_they_are_computed(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The readahead thread is asked for the next AHEAD blocks of every model before the current block is handed
    out, and for nothing further ahead; posix_fadvise gets the block's byte range in its file."""
    import os
    import threading

    from rlmerge.io.mapping import Mapped
    from rlmerge.io.open import open_all
    from rlmerge.stream.match import match_models
    from rlmerge.synthetic import Shape

    shape = Shape("qwen2", vocab=512, hidden=64, layers=1, heads=4, kv_heads=2, intermediate=128, tie=True)
    base, agents = make_example(tmp_path / "in", shape=shape)
    models = open_all([base, *agents])
    plan = match_models(models[0], models[1:])
    asked: list[tuple[str, str, int, int]] = []
    lock = threading.Lock()

    def spy(ckpt, name, start, stop):  # type: ignore[no-untyped-def]
        with lock:
            asked.append((str(ckpt.path), name, start, stop))

    monkeypatch.setattr(Mapped, "prefetch", lambda self, *a: spy(*a))
    fast = fastpath.FastPath(plan, 4096)
    job = max(plan.merge_jobs, key=lambda j: j.numel)  # several blocks
    spans = [(job.name, s, min(s + fast.step(job), job.numel)) for s in range(0, job.numel, fast.step(job))]
    assert len(spans) >= 4
    for k, (bjob, start, stop, *_rest) in enumerate(fast.blocks([job])):
        fast._ahead.submit(lambda: None).result()  # the requests made so far have run
        with lock:
            seen = {(n, s, e) for _, n, s, e in asked}
            per_model = {p for p, *_ in asked}
        assert (bjob.name, start, stop) == spans[k]
        assert set(spans[k + 1: k + 1 + fastpath.AHEAD]) <= seen  # what comes next was asked for
        assert seen <= set(spans[1: k + 1 + fastpath.AHEAD])  # and nothing further ahead
        assert per_model == {str(m.path) for m in models}
    assert {(n, s, e) for _, n, s, e in asked} == set(spans[1:])  # the first block is read at once
    fast.close()

    calls: list[tuple[int, int, int]] = []  # the real prefetch: the tensor's bytes in its file
    monkeypatch.undo()
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, length, advice: calls.append((off, length, advice)))
    info = models[0].tensors[job.name]
    Mapped().prefetch(models[0], job.name, 10, 30)
    assert calls == [(info.offset + 10 * info.dtype.itemsize, 20 * info.dtype.itemsize, os.POSIX_FADV_WILLNEED)]
    for m in models:
        m.close()


def test_the_compute_runs_ahead_of_the_writer_by_the_output_slots_and_no_further(tmp_path: Path) -> None:
    """While the writer has not written a block, its output slot is not handed out again: OUT_SLOTS blocks are
    given out with every write still in flight (each in a slot of its own), the next only once the oldest write
    is done, and that block gets the slot the write freed."""
    import threading
    from concurrent.futures import Future

    from rlmerge.io.open import open_all
    from rlmerge.stream.match import match_models
    from rlmerge.synthetic import Shape

    shape = Shape("qwen2", vocab=512, hidden=64, layers=1, heads=4, kv_heads=2, intermediate=128, tie=True)
    base, agents = make_example(tmp_path / "in", shape=shape)
    models = open_all([base, *agents])
    plan = match_models(models[0], models[1:])
    fast = fastpath.FastPath(plan, 1024)
    job = max(plan.merge_jobs, key=lambda j: j.numel)
    assert -(-job.numel // fast.step(job)) > fastpath.OUT_SLOTS + 1
    writes: list[Future[None]] = []
    slots: list[object] = []
    given = threading.Semaphore(0)

    class Writer:  # the writer's queue, never done until the test says so
        def write_later(self, data: memoryview) -> Future[None]:
            writes.append(Future())
            return writes[-1]

    bar = type("Bar", (), {"advance": lambda self, n: None})()

    def consume() -> None:
        for _job, start, stop, slot, _base, _agents in fast.blocks([job]):
            slots.append(slot)
            fastpath.write_slot(Writer(), slot, fast.out_view(slot, job, stop - start), bar)  # type: ignore[arg-type]
            given.release()

    worker = threading.Thread(target=consume, daemon=True)
    worker.start()
    for _ in range(fastpath.OUT_SLOTS):
        assert given.acquire(timeout=30)
    assert not given.acquire(timeout=0.5)  # every slot's write in flight: the next block waits
    assert len({id(s) for s in slots}) == fastpath.OUT_SLOTS
    writes[1].set_result(None)  # not the oldest: still no slot free
    assert not given.acquire(timeout=0.5)
    writes[0].set_result(None)
    assert given.acquire(timeout=30)
    assert slots[fastpath.OUT_SLOTS] is slots[0]  # the slot whose write is done (the next may follow: [1]'s is)
    for f in writes[2:]:
        f.set_result(None)
    while worker.is_alive():  # the rest: each write done as soon as it is queued
        for f in list(writes):
            if not f.done():
                f.set_result(None)
        worker.join(timeout=0.05)
    assert len(slots) == -(-job.numel // fast.step(job))
    fast.close()
    for m in models:
        m.close()


def test_a_block_grows_by_at_most_an_eighth_to_hold_a_tensor_whole() -> None:
    from types import SimpleNamespace as NS

    def block(asked: int, *sizes: int) -> int:
        return fastpath.fast_block(NS(merge_jobs=[NS(numel=n) for n in sizes]), asked)  # type: ignore[arg-type]

    b = 4 << 20  # the default; Qwen2-0.5B's MLP matrices hold 4,358,144 elements, its embedding 136 M
    assert block(b, 4_358_144, 136_134_656) == 4_358_144 + (-4_358_144 % kernels.TILE)
    assert block(b, b + b // 8, 10 * b) == b + b // 8  # an eighth more: grown
    assert block(b, b + b // 8 + 1, 10 * b) == b  # past it: cut as asked
    assert block(b, 1000, 3000) == 3000  # never past the largest tensor
    assert block(3000, 1000, 3000) == 3000
    assert block(b // 2, b - 1, b + 1, 10 * b) == b // 2  # only a tensor within the eighth counts


def test_a_tensor_just_larger_than_the_block_is_selected_in_one_read(tmp_path: Path) -> None:
    """TIES reads a tensor that fits a block once (selected in memory), a larger one once per round and once to
    merge: a block size up to 1/8 under the largest tensor now reads like one that holds it, with the same
    bytes as every other block size."""
    from rlmerge.synthetic import Shape

    shape = Shape("qwen2", vocab=1024, hidden=64, layers=1, heads=4, kv_heads=2, intermediate=128, tie=True)
    base, agents = make_example(tmp_path / "in", shape=shape)
    kw = {"method": "ties", "params": {"density": 0.3}}
    largest = max(j.numel for j in rlmerge.dry_run(base, agents, tmp_path / "p", **kw).match.merge_jobs)
    assert largest > 20 * kernels.TILE
    runs = {}
    for name, size in (("whole", largest), ("near", int(largest * 0.95)), ("under", int(largest * 0.8))):
        runs[name] = rlmerge.merge(base, agents, tmp_path / name, block_size=size, **kw)
    assert runs["near"].read_bytes == runs["whole"].read_bytes < runs["under"].read_bytes
    outputs = {name: load_output(tmp_path / name) for name in runs}
    for key, value in outputs["whole"].items():
        for name in ("near", "under"):
            assert torch.equal(outputs[name][key], value), (name, key)


@pytest.mark.parametrize("threads", ["1", "2", "3"])
def test_a_hand_off_is_whole_tiles_in_order_on_any_free_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               threads: str) -> None:
    """FastPath.parallel cuts [0, n) into at most PARTS_PER_THREAD slices per compute thread, in order, each
    starting at a whole tile (the statistics' partial sums then do not depend on the cut); only a one-slice
    hand-off runs on the calling thread, and with more slices than threads a thread takes several."""
    import threading

    from rlmerge.io.open import open_all
    from rlmerge.kernels import TILE
    from rlmerge.stream.match import match_models
    from rlmerge.synthetic import Shape

    monkeypatch.setenv("RLMERGE_THREADS", threads)
    shape = Shape("qwen2", vocab=512, hidden=64, layers=1, heads=4, kv_heads=2, intermediate=128, tie=True)
    base, agents = make_example(tmp_path / "in", shape=shape)
    models = open_all([base, *agents])
    fast = fastpath.FastPath(match_models(models[0], models[1:]), 4096)
    parts = int(threads) * fastpath.PARTS_PER_THREAD
    assert fast.parts == parts
    gate = threading.Barrier(int(threads)) if int(threads) > 1 else None
    seen: list[tuple[int, int, int, str]] = []
    lock = threading.Lock()

    def part(k: int, lo: int, hi: int) -> int:
        with lock:
            seen.append((k, lo, hi, threading.current_thread().name))
        return k

    for n in (0, 1, TILE, TILE + 1, 3 * TILE - 5, parts * TILE, 10 * parts * TILE + 7):
        seen.clear()
        assert fast.parallel(n, part) == sorted(k for k, *_ in seen)  # results in slice order
        cuts = sorted(seen)
        assert [c[0] for c in cuts] == list(range(len(cuts))) and 1 <= len(cuts) <= parts
        assert cuts[0][1] == 0 and cuts[-1][2] == n
        assert all(a[2] == b[1] for a, b in zip(cuts, cuts[1:]))  # contiguous
        assert all(lo % TILE == 0 for _, lo, _, _ in cuts)
        assert all(hi > lo for _, lo, hi, _ in cuts[1:])  # no empty slice after the first
        names = {name for *_, name in cuts}
        if len(cuts) == 1:  # no hand-off
            assert names == {threading.current_thread().name}
        else:
            assert all(name.startswith("rlmerge-compute") for name in names)
    if gate is not None:  # the first `threads` slices wait until every compute thread holds one; the rest follow
        ran: list[str] = []

        def held(k: int, lo: int, hi: int) -> None:
            if k < int(threads):
                gate.wait(timeout=30)
            ran.append(threading.current_thread().name)

        fast.parallel(parts * TILE, held)
        assert len(ran) == parts and len(set(ran)) == int(threads)
    fast.close()
    for m in models:
        m.close()
