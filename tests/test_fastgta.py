"""TIES and Breadcrumbs on the fast path (fastgta.py, _numba_gta.py) write the torch path's bytes: same
thresholds (exact k-th largest |τ| per tensor or per model), same merge rule, same rounding, whatever the
block size; their statistics are the same counts, and a non-finite τ is named as on the torch path."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import rlmerge
from conftest import TINY
from rlmerge import kernels
from rlmerge.errors import InputError
from rlmerge.methods._select import BINS, KthLargest
from rlmerge.methods.sparsify import kernels as family_kernels
from rlmerge.synthetic import make_example
from test_fastpath import _edge_models, _same_bytes, same_counts

pytestmark = pytest.mark.skipif(not kernels.HAVE_NUMBA, reason="numba not installed: no fast path to test")

CASES = [
    ("ties", {"density": 0.3}, None, None),
    ("ties", {"density": 0.5}, None, 1000),  # most tensors span several blocks: three reads each
    ("ties", {"density": 0.5, "weights": [0.3, 1.0, 0.6], "scaling": 0.7}, "float32", 777),
    ("ties", {"density": [0.1, 0.9, 1.0], "normalize": False}, None, 4096),
    ("ties_global", {"density": 0.2}, None, None),
    ("ties_global", {"density": 0.4}, "float32", 999),
    ("breadcrumbs", {}, None, 1000),
    ("breadcrumbs_ties", {"density": 0.5, "gamma": 0.05}, None, None),
    ("breadcrumbs", {"density": 0.6, "gamma": 0.1, "normalize": True, "weights": [1.0, 0.5, 0.25]}, None, 3333),
]


def _merge_both(base: Path, agents: list[Path], tmp: Path, monkeypatch: pytest.MonkeyPatch, method: str,
                params: dict, dtype: str | None, block: int | None) -> tuple[rlmerge.MergeResult, rlmerge.MergeResult,
                                                                            int]:
    calls = []
    real = family_kernels.select_merge_range

    def spy(*args: object) -> None:
        calls.append(1)
        real(*args)

    kw = {"block_size": block} if block else {}
    monkeypatch.setenv("RLMERGE_FAST", "0")
    slow = rlmerge.merge(base, agents, tmp / "torch", method=method, params=params, dtype=dtype, **kw)
    monkeypatch.setenv("RLMERGE_FAST", "1")
    monkeypatch.setattr(family_kernels, "select_merge_range", spy)
    fast = rlmerge.merge(base, agents, tmp / "fast", method=method, params=params, dtype=dtype, **kw)
    return slow, fast, len(calls)


@pytest.mark.parametrize(("method", "params", "dtype", "block"), CASES)
def test_fast_gta_writes_the_torch_paths_bytes(example, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str,
                                               params: dict, dtype: str | None, block: int | None) -> None:
    base, agents = example
    slow, fast, calls = _merge_both(base, agents, tmp_path, monkeypatch, method, params, dtype, block)
    assert calls > 0, "the fast path did not run"
    _same_bytes(tmp_path / "torch", tmp_path / "fast")
    same_counts(slow, fast)


@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("method", "params"), [("ties", {"density": 0.4}), ("ties_global", {"density": 0.7}),
                                                ("breadcrumbs_ties", {"density": 0.8, "gamma": 0.01})])
def test_edge_values_same_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stored: torch.dtype, method: str,
                                params: dict) -> None:
    """±0 bases, cancelling agents (the elected sign at a zero sum), ties at the threshold, subnormals."""
    base, agents = _edge_models(tmp_path / "in", stored)
    for out_dtype in ("bfloat16", "float32"):
        for block in (1000, 1 << 20):  # several blocks (three reads) and one block (selection in memory)
            _, _, calls = _merge_both(base, agents, tmp_path / f"{out_dtype}{block}", monkeypatch, method, params,
                                      out_dtype, block)
            assert calls > 0
            _same_bytes(tmp_path / f"{out_dtype}{block}" / "torch", tmp_path / f"{out_dtype}{block}" / "fast")


def test_thresholds_are_the_exact_kth_largest(tmp_path: Path) -> None:
    """An oracle independent of both paths: each agent's kept count per tensor is exactly k = ⌊density·numel⌋
    when |τ| has no ties (float32 agents with distinct random deltas)."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(64, 80, generator=g)
    root = tmp_path / "in"
    paths = []
    for i in range(4):
        d = root / f"m{i}"
        d.mkdir(parents=True)
        w = base if i == 0 else base + torch.randn(64, 80, generator=g) * 1e-2
        save_file({"model.embed_tokens.weight": w.contiguous()}, str(d / "model.safetensors"))
        (d / "config.json").write_text('{"model_type": "llama", "tie_word_embeddings": false}')
        paths.append(d)
    out = tmp_path / "out"
    rlmerge.merge(paths[0], paths[1:2], out, method="ties", params={"density": 0.25}, dtype="float32",
                  block_size=1000)
    merged = load_file(str(out / "model.safetensors"))["model.embed_tokens.weight"]
    assert int((merged != base).sum()) == int(0.25 * base.numel())


def test_non_finite_delta_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A NaN τ on the fast TIES, DARE and DELLA paths is reported with file, tensor and index; nothing is left
    behind."""
    base, agents = make_example(tmp_path / "in", shape=TINY)
    name = "model.layers.0.mlp.up_proj.weight"
    bad = load_file(str(agents[2] / "model.safetensors"))
    bad[name] = bad[name].clone()
    bad[name].view(-1)[123] = float("nan")
    save_file(bad, str(agents[2] / "model.safetensors"))
    monkeypatch.setenv("RLMERGE_FAST", "1")
    cases = [("ties", {}), ("ties_global", {}), ("dare_ties", {"rescale": "l1"}), ("dare_ta", {"rescale": "inverse"}),
             ("della", {}), ("della", {"rescale": "l1"}), ("della_linear", {"rescale": "none"})]
    for method, params in cases:
        for block in (100, 1 << 20):
            out = tmp_path / f"out-{method}-{block}"
            with pytest.raises(InputError) as e:
                rlmerge.merge(base, agents, out, method=method, params=params, block_size=block)
            assert name in str(e.value) and "123" in str(e.value) and str(agents[2]) in str(e.value)
            assert not out.exists()


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7])
def test_round_zero_counts_are_numpys(n: int) -> None:
    """hist_first counts every agent's |τ| keys (bits 30–20, exact zeros in the last column) as numpy does, for any
    number of agents (counted three at a time, then a pair or one), over a range that starts and ends inside
    tiles, added to what ``hist`` held; runs of zeros (spread over spare columns) and non-finite τ included."""
    rng = np.random.default_rng(n)
    size = 3 * 1024 + 517
    base = (rng.standard_normal(size) * 0.02).astype(np.float32)
    agents = []
    for t in range(n):
        moved = base + rng.standard_normal(size).astype(np.float32) * np.float32(10.0 ** -(2 + t % 3))
        moved[: 1500 * (t % 2)] = base[: 1500 * (t % 2)]  # every other agent sparse: a long run of τ = 0
        agents.append(moved)
    agents[-1][400] = np.inf
    b16 = (base.view(np.uint32) >> 16).astype(np.uint16)
    a16 = tuple((a.view(np.uint32) >> 16).astype(np.uint16) for a in agents)
    lo, hi = 300, size - 5
    held = rng.integers(0, 1000, (n, BINS[0] + 1))
    hist = held.copy()
    family_kernels.hist_first(b16, a16, lo, hi, hist, None)
    dec = lambda x: (x.astype(np.uint32) << 16).view(np.float32)  # noqa: E731
    for t in range(n):
        with np.errstate(invalid="ignore", over="ignore"):
            bits = (dec(a16[t][lo:hi]) - dec(b16[lo:hi])).view(np.uint32) & np.uint32(0x7FFFFFFF)
        keys = np.where(bits == 0, BINS[0], bits >> 20)
        assert (hist[t] - held[t] == np.bincount(keys, minlength=BINS[0] + 1)).all(), t
    assert hist[n - 1, 0x7F8] - held[n - 1, 0x7F8] == 1  # the inf: at kernels.NONFINITE_BIN


@pytest.mark.parametrize("form", ["stored", "tau"])
def test_histogram_counts_equal_fed_values(form: str) -> None:
    """KthLargest fed by kernel histograms (the fast path) answers as when fed the values (the torch path), from
    stored bfloat16 bits, or from the agents' float32 τ (``tau``: a LoRA adapter among them)."""
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(5000, generator=g) * 0.02).to(torch.bfloat16)
    agents = torch.stack([(base.float() + torch.randn(5000, generator=g) * 1e-3).to(torch.bfloat16)
                          for _ in range(2)])
    agents[0, :4000] = base[:4000]  # a sparse agent: a long run of τ = 0 (one digit, many sub-histograms)
    tau = agents.float() - base.float()
    fed, counted = (KthLargest(n_streams=2, streams=[0, 1, 1, 0]) for _ in range(2))
    b16 = base.view(torch.int16).numpy().view(np.uint16)
    a16 = tuple(a.view(torch.int16).numpy().view(np.uint16) for a in agents)
    if form == "tau":
        a16 = tuple(np.ascontiguousarray(t.numpy()) for t in tau)
    flag = True if form == "tau" else None
    ranks = [10, 1, 4000, 4500]  # the last one falls among agent 0's zeros: answered after round 0
    while not counted.done:
        fed.feed(tau)
        if counted.round == 0:
            hist = np.zeros((2, BINS[0] + 1), dtype=np.int64)
            family_kernels.hist_first(b16, a16, 0, 5000, hist, flag)
            counted.add_counts(hist)
        else:
            hist = np.zeros((4, BINS[counted.round] + 8), dtype=np.int64)
            family_kernels.hist_next(b16, a16, 0, 5000, counted.streams, counted.prefix, counted.active,
                                  *counted.digit, hist, flag)
            counted.add_counts(hist[:, :BINS[counted.round]])
        for sel in (fed, counted):
            sel.next_round(ranks if sel.round == 0 else None)
        assert not counted.active[3]
    assert fed.done
    want = [torch.sort(tau[t].abs(), descending=True).values[k - 1].item() for t, k in zip((0, 1, 1, 0), ranks)]
    assert want[3] == 0.0
    assert fed.values().tolist() == counted.values().tolist() == want


@pytest.mark.parametrize("after", [1, 2])
@pytest.mark.parametrize("kth", ["numpy", "numba"])
def test_gathered_bin_ends_the_selection_exactly(after: int, kth: str) -> None:
    """KthLargest.finish, given the values in each query's bin after ``after`` rounds (as gather_bin finds them),
    answers as every round would, with numpy's partition or the fast path's digit counts (its _Gather): the
    k-th largest, how many values exceed it and how many equal it (an oracle from a sort), for a sparse agent,
    heavy ties (τ of bfloat16 values repeat) and a rank among the zeros."""
    g = torch.Generator().manual_seed(after)
    base = (torch.randn(6000, generator=g) * 0.02).to(torch.bfloat16)
    agents = torch.stack([(base.float() + torch.randn(6000, generator=g) * 1e-3).to(torch.bfloat16)
                          for _ in range(2)])
    agents[0, :4500] = base[:4500]
    tau = agents.float() - base.float()
    b16 = base.view(torch.int16).numpy().view(np.uint16)
    a16 = tuple(a.view(torch.int16).numpy().view(np.uint16) for a in agents)
    streams, ranks = [0, 1, 1, 0], [7, 1, 3000, 5000]
    sel = KthLargest(n_streams=2, streams=streams)
    for r in range(after):
        sel.feed(tau)
        sel.next_round(ranks if r == 0 else None)
    from types import SimpleNamespace

    from rlmerge.methods._select import GatheredBins
    from rlmerge.methods.sparsify.fast_select import _Gather

    fast = SimpleNamespace(threads=2, run_parts=lambda parts, fn: [fn(*p) for p in parts])
    g = _Gather.of(sel.in_bin, fast)
    assert g is not None
    for k, (lo, hi) in enumerate(((0, 2500), (2500, 6000))):  # two parts, as two compute threads gather them
        family_kernels.gather_bin(b16, a16, lo, hi, 0, sel.streams, sel.prefix, sel.active, sel.above, g.starts,
                                  g.starts + g.sizes, g.fill[k], g.bits[k], g.index[k], None)
    g.check("t")
    assert [g.size(q) for q in range(4)] == sel.in_bin.tolist()
    parts = [[slice(s, s + f) for s, f in zip(g.starts, fill)] for fill in g.fill]
    numpy_bins = GatheredBins([np.concatenate([b[p[q]] for b, p in zip(g.bits, parts)]) for q in range(4)],
                              [np.concatenate([x[p[q]] for x, p in zip(g.index, parts)]) for q in range(4)])
    for q, t in enumerate(streams):  # each gathered value is |τ_t| at its index
        got = numpy_bins.bits[q].view(np.float32)
        assert got.tolist() == tau[t].abs().numpy()[numpy_bins.index[q]].tolist()
    sel.finish(numpy_bins if kth == "numpy" else g)
    assert sel.done
    for q, (t, k) in enumerate(zip(streams, ranks)):
        a = tau[t].abs()
        v = torch.sort(a, descending=True).values[k - 1]
        assert sel.values()[q] == v.item()
        if sel.active[q]:  # (an answer among the zeros keeps round 0's counts: the non-zero values and the zeros)
            assert (sel.greater[q], sel.equal[q]) == (int((a > v).sum()), int((a == v).sum()))
    assert not sel.active[3] and sel.values()[3] == 0.0


@pytest.mark.parametrize("budget", [0, 20, None])
@pytest.mark.parametrize(("method", "params"), [("ties", {"density": 0.4}), ("breadcrumbs_ties",
                                                                            {"density": 0.8, "gamma": 0.01})])
def test_gathering_or_rounds_same_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, budget: int | None,
                                        method: str, params: dict) -> None:
    """Whether a selection ends by gathering its bins after round 0 (the default budget), after round 1 (a small
    one) or runs every round and scans for the tie cut (none), the bytes are the torch path's; the spies show
    which ran. Ties at the threshold in the edge models exercise the cut found from the gathered indices."""
    from rlmerge.methods.sparsify import fast_select

    base, agents = _edge_models(tmp_path / "in", torch.bfloat16)
    ran: dict[str, int] = {"gather_bin": 0, "hist_next": 0, "tie_scan": 0}
    for name in ran:
        real = getattr(family_kernels, name)

        def spy(*args: object, _real=real, _name=name) -> object:
            ran[_name] += 1
            return _real(*args)

        monkeypatch.setattr(family_kernels, name, spy)
    if budget is not None:
        monkeypatch.setattr(fast_select, "GATHER", budget)
    for block in (1000, 1 << 20):
        _, _, calls = _merge_both(base, agents, tmp_path / f"{block}", monkeypatch, method, params, None, block)
        assert calls > 0
        _same_bytes(tmp_path / f"{block}" / "torch", tmp_path / f"{block}" / "fast")
    if budget == 0:
        assert ran["gather_bin"] == 0 and ran["hist_next"] > 0
    elif budget is None:
        assert ran["gather_bin"] > 0 and ran["hist_next"] == 0 and ran["tie_scan"] == 0
    else:
        assert ran["gather_bin"] > 0 and ran["hist_next"] > 0
    if method == "ties" and budget == 0:
        assert ran["tie_scan"] > 0  # the edge models have ties at the threshold


@pytest.mark.parametrize("order", ["any", "flat"])
@pytest.mark.parametrize("above", [20, 10])
def test_gathered_bins_answer_as_numpys(above: int, order: str) -> None:
    """The fast path's gathered bins (kernels.bin_kth: a k-th largest by counting its digits; kernels.bin_tie: the
    left-th tie in flat order) answer as _select.GatheredBins (a partition), with the bin's values split over
    compute threads' parts in any order, or in flat order (a tensor of one block: bin_tie's walk without the
    partition): every rank and tie of small bins with heavy ties, the first, last and random ranks of larger
    ones, a bin of one value, and a left of 0 or past the ties."""
    from types import SimpleNamespace

    from rlmerge.methods._select import GatheredBins
    from rlmerge.methods.sparsify.fast_select import _Gather

    gen = np.random.default_rng(above)
    prefix = 0x3C8 if above == 20 else 0x3C8 << 10 | 0x155
    for size, spread in [(1, 1), (7, 3), (50, 4), (300, 1 << above), (5000, 1 << 12), (20000, 1 << above)]:
        bits = (np.uint32(prefix) << np.uint32(above)) | gen.integers(0, min(spread, 1 << above), size, dtype=np.uint32)
        index = gen.permutation(size * 3)[:size].astype(np.int64)
        if order == "flat":
            index.sort()
        ref = GatheredBins([bits], [index])
        cut = int(gen.integers(0, size + 1))  # two parts: [0, cut) and [cut, size)
        fast = SimpleNamespace(threads=2, run_parts=lambda parts, fn: [fn(*p) for p in parts])
        g = _Gather.of(np.array([size]), fast)
        assert g is not None
        for k, part in enumerate((slice(0, cut), slice(cut, size))):
            g.bits[k, :part.stop - part.start], g.index[k, :part.stop - part.start] = bits[part], index[part]
            g.fill[k, 0] = part.stop - part.start
        ranks = range(1, size + 1) if size <= 300 else [1, size, *gen.integers(1, size + 1, 20).tolist()]
        assert g.kth([(0, r, prefix) for r in ranks], above) == ref.kth([(0, r, prefix) for r in ranks], above)
        for pattern in {int(bits[0]), int(bits.max()), int(bits[-1])}:
            ties = int((bits == pattern).sum())
            for left in {0, 1, ties // 2, ties, ties + 1}:
                assert g.tie(0, pattern, left) == ref.tie(0, pattern, left)
                if 0 < left <= ties:
                    assert ref.tie(0, pattern, left)[1] == np.sort(index[bits == pattern])[left - 1]


@pytest.mark.parametrize("threads", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("block", [5, 17, 64, 200])
def test_tie_cut_scan_split_over_threads_finds_numpys_cut(monkeypatch: pytest.MonkeyPatch, threads: int,
                                                          block: int) -> None:
    """The fast path's tie scan (a pending stream's block cut into pieces when fewer streams than threads are
    pending) finds the cut TieCut.feed's numpy scan finds, block by block: the left-th tie in the first piece,
    in a later one after earlier pieces held some, exactly at a piece's end, never, and streams that keep none
    (need 0) or all (need −1) of theirs."""
    from types import SimpleNamespace

    from rlmerge.methods._select import TieCut
    from rlmerge.methods.sparsify import fast_select

    monkeypatch.setattr(fast_select, "SCAN_PIECE", 3)
    gen = np.random.default_rng(block * 10 + threads)
    n = 200
    agents = [gen.choice(np.float32([-0.5, -0.25, 0.25, 0.5, 1.0]), n).astype(np.float32) for _ in range(5)]
    base = np.zeros(n, dtype=np.float32)
    thr = np.float32([0.5, 0.25, 0.5, 1.0, 0.25])
    ties = [int((np.abs(a) == t).sum()) for a, t in zip(agents, thr)]
    needs = [[k, 1, ties[1] - 3, 0, -1] for k in range(0, ties[0] + 2, 7)] + [[ties[0], ties[1], ties[2] + 5, 1, 2]]
    ran: list[int] = []
    fast = SimpleNamespace(threads=threads, tau_arg=None,
                           run_parts=lambda parts, fn: ran.append(len(parts)) or [fn(*p) for p in parts])
    for need in needs:
        want, got = TieCut(thr, np.int64(need)), TieCut(thr, np.int64(need))
        for start in range(0, n, block):
            hi = min(n, start + block)
            want.feed(start, np.abs(np.stack([a[start:hi] for a in agents])))
            fast_select._feed_cut(fast, got, start, base[start:hi], tuple(a[start:hi] for a in agents))
        assert got.cut.tolist() == want.cut.tolist() and got.pending.tolist() == want.pending.tolist(), need
        assert got.seen.tolist() == want.seen.tolist()
    if threads >= 4 and block >= 64:
        assert max(ran) > 4  # some stream's block was split
