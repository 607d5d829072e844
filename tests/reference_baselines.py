"""Dense, obviously-correct references for the baselines: whole tensors (or the whole model) in memory.

Order statistics come from torch.sort / kthvalue on the whole tensor (or the concatenated task vector);
random numbers from one generator per 65,536-element chunk concatenated over the whole tensor.
"""

from __future__ import annotations

import math

import torch

from rlmerge.methods.sparsify.rng import RNG_CHUNK, chunk_seed


def kth_largest(x: torch.Tensor, k: int) -> float:
    return float(x.abs().reshape(-1).sort(descending=True).values[k - 1])


def whole_uniform(seed: int, agent: int, name: str, numel: int) -> torch.Tensor:
    parts = []
    for chunk in range(math.ceil(numel / RNG_CHUNK)):
        g = torch.Generator().manual_seed(chunk_seed(seed, agent, name, chunk))
        parts.append(torch.rand(min(RNG_CHUNK, numel - chunk * RNG_CHUNK), generator=g))
    return torch.cat(parts)


def ties_masks(taus: list[torch.Tensor], density: list[float], *, numel_all: int | None = None,
               global_tau: list[torch.Tensor] | None = None, tie_break: str = "index") -> list[torch.Tensor]:
    """Per-tensor: the k = max(1, ⌊d·numel⌋) largest |τ|, ties at the k-th broken by flat index (``index``) or all
    kept (``keep-all``: |τ| ≥ k-th largest); global: ≥ (⌊d·D⌋+1)-th largest of the whole τ."""
    out = []
    for t, tau in enumerate(taus):
        if density[t] >= 1:
            out.append(torch.ones_like(tau, dtype=torch.bool))
        elif global_tau is None and tie_break == "index":  # exactly k: equal |τ| by flat index, first kept
            k = max(1, int(density[t] * tau.numel()))
            order = torch.sort(tau.abs().reshape(-1), descending=True, stable=True).indices
            mask = torch.zeros(tau.numel(), dtype=torch.bool)
            mask[order[:k]] = True
            out.append(mask.reshape(tau.shape))
        elif global_tau is None:
            out.append(tau.abs() >= kth_largest(tau, max(1, int(density[t] * tau.numel()))))
        else:
            flat = global_tau[t]
            d = flat.numel()
            kth = float(flat.abs().kthvalue(d - int(d * density[t])).values)  # the TIES authors' code
            out.append(tau.abs() >= kth)
    return out


def breadcrumbs_masks(taus: list[torch.Tensor], density: list[float], gamma: list[float]) -> list[torch.Tensor]:
    out = []
    for t, tau in enumerate(taus):
        n = tau.numel()
        target, n_top = int(density[t] * n), int(gamma[t] * n)
        n_bot = max(0, n - target - n_top)
        asc = tau.abs().reshape(-1).sort().values
        if target == 0:
            out.append(torch.zeros_like(tau, dtype=torch.bool))
            continue
        lo, hi = float(asc[n_bot]), float(asc[n_bot + target - 1])
        out.append((tau.abs() >= lo) & (tau.abs() <= (math.inf if n_bot + target == n else hi)))
    return out


def gta_combine(base: torch.Tensor, pruned: list[torch.Tensor], weights: list[float], *, sign: bool,
                normalize: bool, scaling: float) -> torch.Tensor:
    weighted = [p * w for p, w in zip(pruned, weights)]
    if sign:
        total = sum(weighted[1:], weighted[0].clone())
        elected = torch.where(total >= 0, 1.0, -1.0)
        masks = [torch.sign(u) == elected for u in weighted]
    else:
        masks = [torch.ones_like(base, dtype=torch.bool) for _ in weighted]
    mixed = sum((u * m for u, m in zip(weighted[1:], masks[1:])), weighted[0] * masks[0])
    if normalize:
        if sign:
            div = sum((m * w for m, w in zip(masks[1:], weights[1:])), masks[0] * weights[0])
            mixed = mixed / torch.where(div == 0, 1.0, div)
        else:
            s = sum(weights)
            mixed = mixed / (s if abs(s) >= 1e-8 else 1.0)
    return base + mixed * scaling if scaling != 1.0 else base + mixed


def della_probs(tau: torch.Tensor, density: float, eps: float) -> torch.Tensor:
    rows = tau.reshape(tau.shape[0], -1) if tau.dim() >= 2 else tau.reshape(1, -1)
    n = rows.shape[1]
    rank = rows.abs().argsort(dim=-1, stable=True).argsort(dim=-1).float() / max(n - 1, 1)
    return ((density - eps) + rank * (2 * eps)).reshape(tau.shape)


def model_stock(base: torch.Tensor, ags: list[torch.Tensor]) -> torch.Tensor:
    taus = [(a - base).double().reshape(-1) for a in ags]
    n = len(taus)
    cos = [torch.clamp(taus[a] @ taus[b] / max(float(taus[a].norm() * taus[b].norm()), 1e-6), -1, 1)
           for a in range(n) for b in range(a + 1, n)]
    c = float(sum(cos) / len(cos))
    den = 1 + (n - 1) * c
    t = 0.0 if abs(den) < 1e-6 else n * c / den
    return t * (sum(ags) / n) + (1 - t) * base


def slerp(v0: torch.Tensor, v1: torch.Tensor, t: float, threshold: float = 0.9995) -> torch.Tensor:
    a, b = v0.double().reshape(-1), v1.double().reshape(-1)
    dot = float((a / a.norm()) @ (b / b.norm()))
    if abs(dot) > threshold:
        return (1 - t) * v0 + t * v1
    th = math.acos(max(-1.0, min(1.0, dot)))
    return math.sin((1 - t) * th) / math.sin(th) * v0 + math.sin(t * th) / math.sin(th) * v1


def fisher(base: torch.Tensor, ags: list[torch.Tensor], fs: list[torch.Tensor], coef: list[float],
           floor: float) -> torch.Tensor:
    num = sum(c * f.clamp(min=floor) * (a - base) for c, f, a in zip(coef, fs, ags))
    den = sum(c * f.clamp(min=floor) for c, f in zip(coef, fs))
    return base + num / den
