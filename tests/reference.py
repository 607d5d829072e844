"""A dense, obviously-correct RAM / RAM+ / TA: whole models in memory, the formulas as written.

Sums over agents run in agent order (t = 0, 1, …), as the engine's kernels promise.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from conftest import load_output


def load_models(base: Path, agents: list[Path]) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    return load_output(base), [load_output(a) for a in agents]


def counts(base: dict, agents: list[dict], eps: float, tied_twice: tuple[str, ...] = ()) -> tuple[list, list]:
    """Whole-model shared_t and unique_t, each float tensor counted once (twice if in tied_twice)."""
    n = len(agents)
    shared, unique = [0] * n, [0] * n
    for name, b in base.items():
        if not b.is_floating_point():
            continue
        masks = [(a[name].float() - b.float()).abs() > eps for a in agents]
        c = sum(m.long() for m in masks)
        w = 2 if name in tied_twice else 1
        for t, m in enumerate(masks):
            shared[t] += w * int((m & (c >= 2)).sum())
            unique[t] += w * int((m & (c == 1)).sum())
    return shared, unique


def lam(preset: str, shared: int, unique: int, r: float = 0.1, alpha: float = 2.0, big_r: float = 1.2) -> float:
    rho = (math.inf if shared else 0.0) if unique == 0 else shared / unique
    if preset in ("paper", "tensor-local"):
        return 1 + r * min(max(rho, 0.0), alpha)
    if preset == "paper-soft":
        return 1 + r * (shared / (shared + unique) if shared + unique else 0.0)
    if preset == "official":
        return 1 + (max(big_r, 1.0) - 1) * min(1.0, rho)
    if preset == "arm-r":  # the authors' earlier mode: shared / changed, clipped to [0, 1]
        changed = shared + unique
        return 1 + (max(big_r, 1.0) - 1) * min(max(shared / changed if changed else 0.0, 0.0), 1.0)
    raise ValueError(preset)


def ram_tensor(b: torch.Tensor, ags: list[torch.Tensor], eps: float, lambdas: list[float] | None) -> torch.Tensor:
    base = b.float()
    taus = [a.float() - base for a in ags]
    masks = [t.abs() > eps for t in taus]
    c = torch.zeros_like(base, dtype=torch.long)
    total = torch.zeros_like(base)
    uniq = torch.zeros_like(base)
    for t, (tau, m) in enumerate(zip(taus, masks)):
        c += m.long()
        active = torch.where(m, tau, torch.zeros_like(tau))
        total = active.clone() if t == 0 else total + active
        scaled = active * (1.0 if lambdas is None else torch.tensor(lambdas[t], dtype=torch.float32))
        uniq = scaled if t == 0 else uniq + scaled
    merged = torch.where(c >= 2, base + total / c.clamp(min=1), torch.where(c == 1, base + uniq, base))
    return merged


def ram_reference(base: Path, agents: list[Path], *, preset: str | None, eps: float = 1e-5,
                  out_dtype: torch.dtype | None = None, **knobs: float) -> dict[str, torch.Tensor]:
    """preset None = RAM (λ = 1)."""
    b, ags = load_models(base, agents)
    lambdas = None
    if preset is not None and preset != "tensor-local":
        shared, unique = counts(b, ags, eps)
        lambdas = [lam(preset, s, u, **knobs) for s, u in zip(shared, unique)]
    out = {}
    for name, bt in b.items():
        if not bt.is_floating_point():
            out[name] = bt
            continue
        ls = lambdas
        if preset == "tensor-local":
            shared, unique = counts({name: bt}, [{name: a[name]} for a in ags], eps)
            ls = [lam("tensor-local", s, u, **knobs) for s, u in zip(shared, unique)]
        out[name] = ram_tensor(bt, [a[name] for a in ags], eps, ls).to(out_dtype or bt.dtype)
    return out


def arm_ties_tensor(b: torch.Tensor, ags: list[torch.Tensor], eps: float, mask_rate: float,
                    scaling: float) -> torch.Tensor:
    """The authors' arm-ties on one tensor, as ram-method.md writes it (float32, agent order)."""
    base = b.float().reshape(-1)
    taus = [a.float().reshape(-1) - base for a in ags]
    active = [t.abs() > eps for t in taus]
    c = sum(m.long() for m in active)
    v = [torch.where(m, t, torch.zeros_like(t)) for t, m in zip(taus, active)]
    shared = c >= 2
    d = int(shared.sum())
    k = math.floor(mask_rate * d)
    thr = [torch.sort(x[shared].abs()).values[k - 1] if k > 0 else torch.tensor(0.0) for x in v]
    kept = [x.abs() >= t for x, t in zip(v, thr)]
    zero = torch.zeros_like(base)
    pos, neg = zero.clone(), zero.clone()
    for x, kp in zip(v, kept):
        pos = pos + torch.where(kp & (x > 0), x, zero)
        neg = neg + torch.where(kp & (x < 0), -x, zero)
    margin = pos - neg
    agreed, count = zero.clone(), zero.clone()
    for x, kp in zip(v, kept):
        agree = kp & (((x > 0) & (margin > 0)) | ((x < 0) & (margin < 0)))
        agreed = agreed + torch.where(agree, x, zero)
        count = count + agree.float()
    elected = torch.where(count > 0, agreed / torch.where(count > 0, count, torch.ones_like(count)), zero)
    elected = elected * torch.tensor(scaling, dtype=torch.float32)
    total = zero.clone()
    for x in v:
        total = total + x
    merged = torch.where(shared, base + elected, base + total)
    return torch.where(c == 0, base, merged).reshape(b.shape)
