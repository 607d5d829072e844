"""What the sparsify family learns in the statistics pass, and how it prunes a block (the torch reference).

Order statistics (top-k thresholds) and L1 rescale factors come from the statistics pass through ``GtaObserver``,
so the merge pass stays elementwise and any block size gives the same bytes. Random drops use ``rng.uniform``:
seeded per (seed, agent, tensor, chunk).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..._torch import torch
from ...params import per_agent
from ...stream.blocks import row_length
from .._select import NO_CUT, ROUNDS, Bins, KthLargest, TieCut
from ..interface import BlockContext, Entries, Observer
from .l1 import LaneSum, l1_factors
from .presets import INF, Preset, Prune, magprune_epsilon
from .rng import row_ranks, uniform


def _ranks(prune: Prune, numel: int, density: float, gamma: float) -> tuple[int | None, int | None]:
    """(rank of the lower threshold, rank of the upper one), 1 = largest |τ|; None: no bound on that side.

    magnitude: keep the k = max(1, ⌊density·numel⌋) largest (mergekit ``magnitude``).
    magnitude-global: keep |τ| ≥ the (⌊density·d⌋ + 1)-th largest of the whole task vector (the TIES authors'
    ``topk_values_mask``: kthvalue(d − ⌊d·K⌋)).
    outliers: keep ascending positions [n_bot, n_bot + ⌊density·numel⌋) (mergekit ``magnitude_outliers``).
    """
    if density >= 1.0:
        return None, None
    if prune == "magnitude":
        return max(1, int(density * numel)), None
    if prune == "magnitude-global":
        return int(density * numel) + 1, None
    target, n_top = int(density * numel), int(gamma * numel)
    n_bot = max(0, numel - target - n_top)
    if target == 0:
        return 0, None  # keep nothing
    hi_rank = numel - n_bot - target + 1
    return numel - n_bot, (hi_rank if hi_rank > 1 else None)


class GtaObserver(Observer):
    """Collects what a preset needs from the statistics pass; becomes the method's ``prepared`` constants."""

    def __init__(self, preset: Preset, params: Any, n: int, at: Callable[[str], Any] | None = None) -> None:
        self.preset, self.params, self.n = preset, params, n
        self.at = at if at is not None else (lambda name: params)  # each tensor's parameters
        self.density = per_agent(params.density, n, "gta", "density")  # the whole model's (ties_global)
        self.gamma = per_agent(getattr(params, "gamma", 0.0), n, "gta", "gamma")
        self.bounds: dict[str, np.ndarray] = {}  # tensor → [2, N] float32 (lo, hi) on |τ|
        self.cuts: dict[str, np.ndarray] = {}  # tensor → [N] int64: |τ| = lo kept below this flat index (exact k)
        self.kept: dict[str, np.ndarray] = {}  # tensor ("": the whole model) → [N] non-zero τ kept (−1: untrimmed)
        # exact k (TIES' tie_break = index): the ties at the threshold are cut in flat order, found by one more stream
        # of the tensor in the statistics pass (torch) or while merging it (the numba path sets this False)
        self.exact = preset.prune == "magnitude" and getattr(params, "tie_break", None) in (None, "index")
        self.stream_cuts = True
        self.cut: TieCut | None = None  # the cut being found for the current tensor
        self.l1: dict[str, np.ndarray] = {}  # tensor → [N] float32 rescale factors
        self.warnings: tuple[str, ...] = ()
        self._sel: KthLargest | None = None
        self._queries: list[tuple[int, int, int]] = []  # (agent, side 0=lo/1=hi, rank)
        self._l1_acc = (LaneSum(n), LaneSum(n))  # Σ|τ_t|, Σ|kept τ_t|, in l1.py's fixed order
        self._global_numel = 0
        self._name = ""

    def streams(self, name: str, numel: int, numba: bool) -> int:
        """Statistics-pass streams of a tensor, at most: every selection round for a whole-model threshold, and
        on the torch path for a per-tensor one (the numba path selects inside the merge pass)."""
        if not self.needs_selection:
            return 1
        if self.preset.prune == "magnitude-global":
            return ROUNDS
        return ROUNDS + int(self.exact) if self.selects(name, numel) and not numba else 1

    def density_of(self, name: str) -> tuple[float, ...]:
        """The keep densities of tensor ``name``, per agent."""
        return per_agent(self.at(name).density, self.n, "gta", "density")

    def gamma_of(self, name: str) -> tuple[float, ...]:
        return per_agent(getattr(self.at(name), "gamma", 0.0), self.n, "gta", "gamma")

    def ranks(self, name: str, numel: int) -> list[tuple[int | None, int | None]]:
        """Per agent, the ranks of tensor ``name``'s window bounds (``_ranks``)."""
        return [_ranks(self.preset.prune, numel, d, g) for d, g in zip(self.density_of(name), self.gamma_of(name))]

    def selects(self, name: str, numel: int) -> bool:
        """Whether tensor ``name`` needs thresholds of its own (per-tensor presets with a density below 1)."""
        return self.preset.prune != "magnitude-global" and any(r for rs in self.ranks(name, numel) for r in rs)

    @property
    def needs_selection(self) -> bool:
        return self.preset.windowed

    @property
    def needs_l1(self) -> bool:
        return getattr(self.params, "rescale", "none") == "l1"

    def observe(self, ctx: BlockContext, base: torch.Tensor, deltas: torch.Tensor) -> None:
        numel = math.prod(ctx.shape)
        if ctx.start == 0 and ctx.name != self._name:
            self.begin_tensor(ctx.name, numel)
        if self.cut is not None:  # the stream after the selection: where the ties at the threshold stop
            self.cut.feed(ctx.start, deltas.abs().cpu().numpy())
            return
        if self.needs_selection and self._sel is not None:
            if self._sel.round == 0 and self.preset.prune == "magnitude-global":
                self._global_numel += ctx.stop - ctx.start
            self._sel.feed(deltas)
        if self.needs_l1:
            kept, _ = prune_block(self.preset, self, deltas, ctx)
            self._l1_acc[0].add(deltas.abs(), ctx.start, numel)
            self._l1_acc[1].add(kept.abs(), ctx.start, numel)

    @property
    def selection(self) -> KthLargest | None:
        """The order statistics being gathered (None: nothing to select for this tensor)."""
        return self._sel

    def add_counts(self, hist: np.ndarray, numel: int) -> None:
        """What ``observe`` adds to the selection, from a histogram of ``numel`` elements the fast path counted."""
        if self._sel is None:
            return
        if self._sel.round == 0 and self.preset.prune == "magnitude-global":
            self._global_numel += numel
        self._sel.add_counts(hist)

    def begin_tensor(self, name: str, numel: int) -> None:
        self._name = name
        self.cut = None
        for acc in self._l1_acc:
            acc.reset()
        if self.preset.prune == "magnitude-global":
            if self._sel is None:
                self._sel = KthLargest(n_streams=self.n, streams=list(range(self.n)))
            return
        if not self.needs_selection:
            return
        self._queries = []
        ranks = self.ranks(name, numel)
        for t, (lo, hi) in enumerate(ranks):
            self._queries += [(t, side, r) for side, r in ((0, lo), (1, hi)) if r]  # rank 0: keep nothing
        streams = [q[0] for q in self._queries]
        self._sel = KthLargest(n_streams=self.n, streams=streams) if streams else None
        self.bounds[name] = self._default_bounds(ranks)

    def _default_bounds(self, ranks: list[tuple[int | None, int | None]]) -> np.ndarray:
        b = np.array([[0.0] * self.n, [INF] * self.n], dtype=np.float32)
        for t, (lo, _) in enumerate(ranks):
            if lo == 0:
                b[0, t], b[1, t] = INF, -1.0  # an empty window
        return b

    def again(self, name: str | None) -> bool:
        """After a tensor (``name``) or the whole model (None): True asks the engine to stream it again."""
        if name is not None and self.needs_l1:
            self.l1[name] = l1_factors(self._l1_acc[0].total, self._l1_acc[1].total)
        global_ = self.preset.prune == "magnitude-global"
        if name is None and self.cut is not None:
            return False
        if name is not None and self.cut is not None:  # the cut stream is over
            self.cuts[name], self.cut = self.cut.cut, None
            return False
        if (name is None) != global_ or self._sel is None:
            return False
        sel = self._sel
        if sel.round == 0:
            ranks = ([_ranks("magnitude-global", self._global_numel, d, 0.0)[0] or 1 for d in self.density]
                     if global_ else [q[2] for q in self._queries])
            sel.next_round(ranks)
        else:
            sel.next_round()
        if not sel.done:
            return True
        return self._selected(name)

    def gathered(self, name: str, bins: Bins) -> None:
        """End tensor ``name``'s selection from the values in its queries' bins (``KthLargest.finish``) instead of more
        rounds; with exact k, the cut comes from their flat indices, so no stream of the tensor is left to find it
        (the numba path gathers a bin that is small enough)."""
        sel = self._sel
        if sel is None or self.preset.prune == "magnitude-global" or self.needs_l1:
            raise RuntimeError(f"{name}: only a per-tensor selection without L1 sums is ended by gathering")
        sel.finish(bins)
        self._selected(name)
        cut = self.cut
        if cut is None:
            return
        thr = cut.thr.view(np.uint32)
        for q, (t, side, _) in enumerate(self._queries):
            if side == 0 and cut.pending[t]:  # the ties are in the bin: take the left(t)-th in flat order
                left = cut.left(t)
                count, index = bins.tie(q, int(thr[t]), left)
                if count < left:
                    raise RuntimeError(f"{name}: {count} ties gathered for agent {t}, {left} to keep")
                cut.add(t, 0, count, index)

    def _selected(self, name: str | None) -> bool:
        """After the last round: the window and, per tensor, what the trim keeps; True asks for the cut stream."""
        sel = self._sel
        assert sel is not None
        global_ = self.preset.prune == "magnitude-global"
        values = sel.values()
        if global_:
            lo = np.where(np.array(self.density) >= 1.0, np.float32(0.0), values).astype(np.float32)
            self.bounds[""] = np.stack([lo, np.full_like(lo, INF)])
            self.kept[""] = np.where(np.array(self.density) >= 1.0, -1, _kept(values, sel, None))
        else:
            for (t, side, _), v in zip(self._queries, values.tolist()):
                self.bounds[name][side, t] = v  # type: ignore[index]
            self._finish_ranks(name, values, sel)  # type: ignore[arg-type]
        self._sel = None
        return self.cut is not None and self.stream_cuts

    def _finish_ranks(self, name: str, values: np.ndarray, sel: KthLargest) -> None:
        """After a tensor's selection: the non-zero τ each agent keeps and, for exact k, the ties to cut."""
        if self.preset.prune != "magnitude":
            return
        need = np.full(self.n, -1, dtype=np.int64)
        kept = np.full(self.n, -1, dtype=np.int64)
        agents = [t for t, _, _ in self._queries]
        if self.exact:  # keep need = k − (values above the threshold) of the ties; all when that is every tie
            short = (values > 0) & (sel.ranks - sel.greater < sel.equal)
            need[agents] = np.where(short, sel.ranks - sel.greater, -1)
        kept[agents] = _kept(values, sel, need[agents] if self.exact else None)
        self.kept[name] = kept
        if (need >= 0).any():
            self.cut = TieCut(self.bounds[name][0], need)
        elif self.exact:  # every tie is kept: the cut is past the end (what a cache keeps for this selection)
            self.cuts[name] = np.full(self.n, NO_CUT, dtype=np.int64)

    def cuts_of(self, name: str) -> np.ndarray | None:
        """[N] int64: |τ_t| equal to the lower bound is kept below flat index cut_t (None: every such value)."""
        return self.cuts.get(name)

    def kept_fraction(self, stats: Any) -> list[float] | None:
        """Per agent, the non-zero τ the trim kept over the elements merged (an untrimmed tensor, density 1,
        counts its changed elements, |τ| > ε); None for the presets that do not trim by magnitude."""
        if self.preset.prune not in ("magnitude", "magnitude-global") or not stats.tensors:
            return None
        kept = np.zeros(self.n, dtype=np.int64)
        numel = 0
        whole = self.kept.get("")
        for name, ts in stats.tensors.items():
            own = whole if whole is not None else self.kept.get(name)
            untrimmed = ts.changed if own is None else np.where(own < 0, ts.changed, 0)
            kept += untrimmed + (0 if own is None or whole is not None else np.maximum(own, 0))
            numel += ts.numel
        if whole is not None:
            kept += np.maximum(whole, 0)
        return (kept / max(numel, 1)).tolist()

    def window(self, name: str) -> np.ndarray:
        """[2, N] float32: keep |τ_t| in [lo_t, hi_t]."""
        return self.bounds[""] if self.preset.prune == "magnitude-global" else self.bounds[name]

    # -- what a statistics cache keeps of it (a sweep's merges of the same inputs; interface.Entries) ------------
    # ``hist0``: a tensor's round-0 histogram of |τ| (any density); ``bounds``: its window under this selection;
    # ``kept``: what the trim kept there ("" for a whole-model window); ``cuts``: with exact k, where the values tied
    # at its threshold stop being kept (TieCut.cut)
    def selection_key(self) -> str:
        """What a tensor's |τ| window depends on besides the data: the pruning and each agent's density and γ."""
        return repr((self.preset.prune, tuple(float(d) for d in self.density), tuple(float(g) for g in self.gamma)))

    def cached_window(self, cache: Entries, name: str) -> np.ndarray | None:
        """[2, N] float32: the cached window of tensor ``name`` ("": the whole model), or None. For an exact-k
        selection (TIES' tie_break = index) only with its cached cut: the window alone does not say which of the
        values tied at its threshold are kept; without the cut such a selection runs its rounds (from the cached
        round-0 histogram)."""
        if self.exact and self.cached_cut(cache, name) is None:
            return None
        w = cache.get("bounds", self.selection_key(), name)
        return None if w is None else np.asarray(w, dtype=np.float32)

    def cached_cut(self, cache: Entries, name: str) -> np.ndarray | None:
        """[N] int64: the cached tie cut of tensor ``name`` under this selection (exact k only), or None."""
        c = cache.get("cuts", self.selection_key(), name) if self.exact else None
        return None if c is None else np.asarray(c, dtype=np.int64)

    def remember(self, cache: Entries, name: str) -> None:
        """Keep tensor ``name``'s selection in ``cache`` once it is merged (the numba path, which selects and cuts
        while merging): its cut is kept as the torch path's cut stream keeps it (``again``), then ``keep``."""
        if self.cut is not None:
            self.cuts[name] = self.cut.cut
        self.keep(cache, [name])

    def recall(self, cache: Entries, name: str) -> bool:
        """Tensor ``name``'s selection from ``cache`` (what ``keep`` put there): its window, what the trim kept and,
        with exact k, its tie cut (``cuts_of``); False when the cache holds no window usable for it."""
        w = self.cached_window(cache, name)
        if w is None:
            return False
        self.bounds[name] = w
        cache.used("bounds")
        c = self.cached_cut(cache, name)
        if c is not None:
            self.cuts[name] = c
        k = cache.get("kept", self.selection_key(), name)
        if k is not None:  # what the trim kept: the merge's `kept` column
            self.kept[name] = np.asarray(k, dtype=np.int64)
        return True

    @property
    def _cacheable(self) -> bool:
        return self.needs_selection and not self.needs_l1

    def reusable(self, cache: Entries, names: Sequence[str]) -> bool:
        if not self._cacheable:
            return False  # L1 sums are counted again
        keys = [""] if self.preset.prune == "magnitude-global" else list(names)
        return all(self.cached_window(cache, n) is not None for n in keys)

    def reuse(self, cache: Entries, names: Sequence[str]) -> None:
        for name in ("", *names):
            self.recall(cache, name)

    def keep(self, cache: Entries, names: Sequence[str] | None = None) -> None:
        """What was selected, into ``cache``: every tensor's (after a statistics pass), or ``names``' (``remember``)."""
        if not self._cacheable:
            return
        key = self.selection_key()
        for kind, table, dtype in (("bounds", self.bounds, np.float32), ("kept", self.kept, np.int64),
                                   ("cuts", self.cuts, np.int64)):
            for name in table if names is None else [n for n in names if n in table]:
                cache.put(kind, key, name, np.asarray(table[name], dtype=dtype))

    def absorb(self, other: Observer) -> None:
        if isinstance(other, GtaObserver):
            self.kept.update(other.kept)


def _kept(values: np.ndarray, sel: KthLargest, need: np.ndarray | None) -> np.ndarray:
    """Non-zero values kept per query: those above the threshold, and the ties kept (all, or ``need`` of them; none
    when the threshold is 0)."""
    ties = sel.equal if need is None else np.where(need >= 0, need, sel.equal)
    return np.where(values > 0, sel.greater + ties, sel.greater)


# -- the merge pass -----------------------------------------------------------------------------------------------
def prune_block(preset: Preset, obs: GtaObserver, deltas: torch.Tensor,
                ctx: BlockContext) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(pruned τ [N, n] before any L1 factor, per-element keep probability [N, n] for ``inverse`` or None)."""
    n_agents, n = deltas.shape
    numel = math.prod(ctx.shape)
    if preset.windowed:  # keep lo_t ≤ |τ_t| ≤ hi_t; with TIES' exact k |τ_t| = lo_t only at flat index < cut_t
        absd, cuts = deltas.abs(), obs.cuts_of(ctx.name)
        lo, hi = torch.from_numpy(obs.window(ctx.name)).to(deltas.device).unsqueeze(-1)  # [N, 1] each
        above = absd >= lo
        if cuts is not None:
            index = torch.arange(ctx.start, ctx.stop, device=deltas.device)
            above = (absd > lo) | ((absd == lo) & (index < torch.from_numpy(cuts).to(deltas.device).unsqueeze(-1)))
        return deltas * (above & (absd <= hi)), None
    u = torch.stack([uniform(ctx.seed, t, ctx.name, numel, ctx.start, ctx.stop) for t in range(n_agents)])
    u = u.to(deltas.device)
    dens = torch.tensor(obs.density_of(ctx.name), dtype=torch.float32, device=deltas.device).unsqueeze(-1)  # [N, 1]
    if preset.prune == "random":
        prob = dens.expand(n_agents, n)
    else:  # magprune: p_i = density − ε + 2ε · (rank of |τ_i| in its row, normalised to [0, 1])
        eps = torch.tensor(magprune_epsilon(obs.at(ctx.name), n_agents),
                           dtype=torch.float32, device=deltas.device).unsqueeze(-1)
        prob = (dens - eps) + row_ranks(deltas.abs(), row_length(ctx.shape)) * (2 * eps)
    keep = u < prob
    return deltas * keep, prob
