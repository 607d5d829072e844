"""Model Stock (Jang et al. 2024, arXiv:2403.19522), as mergekit's ``model_stock``.

Per tensor (or per row with ``filter_wise``), from the agents' task vectors τ_t:

    cos θ = mean over pairs a < b of ⟨τ_a, τ_b⟩ / max(‖τ_a‖‖τ_b‖, 1e-6), clipped to [−1, 1]
    t     = N cos θ / (1 + (N − 1) cos θ)                     (0 where the denominator is ~0)
    θ     = t · mean_t θ_t + (1 − t) · θ₀

Norms and dots per tensor come from the statistics pass (float64): tensor-local. ``filter_wise`` computes
them per row inside row-aligned blocks and needs no statistics pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .._torch import torch
from ..errors import ConfigError
from ..stats import TensorStats
from ..stream.blocks import row_length
from .interface import BlockContext
from .rule import Expr, Terms
from .spec import MethodSpec


@dataclass(frozen=True)
class ModelStockParams:
    filter_wise: bool = False  # one t per row (output filter) instead of per tensor


def interpolation(cos: np.ndarray, n: int) -> np.ndarray:
    """t from the mean pairwise cosine; 0 at the singularity (the base is kept there), as mergekit."""
    den = 1 + (n - 1) * cos
    singular = np.abs(den) < 1e-6
    return np.where(singular, 0.0, n * cos / np.where(singular, 1.0, den))


def _mean_cos(dots: np.ndarray) -> np.ndarray:
    """dots [N, N, ...] float64 Gram entries → mean pairwise cosine [...], pairs in order, as mergekit."""
    n = dots.shape[0]
    total = np.zeros(dots.shape[2:])
    for a in range(n):
        for b in range(a + 1, n):
            norm = np.maximum(np.sqrt(dots[a, a]) * np.sqrt(dots[b, b]), 1e-6)
            total = total + np.clip(dots[a, b] / norm, -1, 1)
    return total / (n * (n - 1) // 2)


def tensor_t(dots: np.ndarray, n: int) -> np.float32:
    """One tensor's t (float32) from its Gram matrix: the same number on the torch path and the fast path."""
    return np.float32(interpolation(_mean_cos(dots), n))


def stock_rule(t: Terms, p: ModelStockParams) -> Expr:
    """t · mean_i θ_i + (1 − t) · θ₀ with the tensor's t; Σ θ_i in agent order."""
    total = t.b + t.x[0]
    for i in range(1, t.n):
        total = total + (t.b + t.x[i])
    return t.const.t * (total / t.const.n) + (t.lit(1.0) - t.const.t) * t.b


def _constants(p: ModelStockParams, prepared: Any, ts: TensorStats | None, n: int, name: str) -> dict[str, Any]:
    if ts is None:
        raise RuntimeError("model_stock ran without its statistics pass")
    return {"t": tensor_t(ts.dots, n), "n": np.float32(n)}


def _merge_rows(base: torch.Tensor, deltas: torch.Tensor, params: ModelStockParams,
                ctx: BlockContext) -> torch.Tensor:
    """``filter_wise``: one t per row, from the rows of the block (row-aligned; a 1-D tensor is one row)."""
    n = deltas.shape[0]
    row = row_length(ctx.shape)
    rows = deltas.reshape(n, -1, row).double()  # [N, rows, row]
    dots = torch.einsum("arc,brc->abr", rows, rows).cpu().numpy()  # [N, N, rows]
    t = torch.from_numpy(interpolation(_mean_cos(dots), n)).float().to(base.device)  # [rows]
    t = t.repeat_interleave(row)
    total = base + deltas[0]
    for k in range(1, n):
        total += base + deltas[k]
    return t * (total / n) + (1 - t) * base


def _check_agents(params: ModelStockParams, n: int) -> None:
    if n < 2:
        raise ConfigError(f"model_stock needs at least two agents (got {n})", hint="add agents, or use another method")



class ModelStock(MethodSpec):
    """Per tensor, ``stock_rule`` with t from the statistics pass's Gram matrix; ``filter_wise``: ``_merge_rows``,
    one t per row from row-aligned blocks, no statistics pass."""

    def elementwise(self, p: ModelStockParams) -> bool:
        return not p.filter_wise

    def needs_stats(self, p: ModelStockParams) -> bool:
        return not p.filter_wise

    def row_blocks(self, p: ModelStockParams) -> bool:
        return p.filter_wise


METHODS = [
    ModelStock("model_stock", "Model Stock: interpolate base → agent average by the agents' mean cosine",
               "arXiv:2403.19522", "tensor-local", ModelStockParams, _merge_rows, rule=stock_rule,
               constants=_constants, checks=_check_agents, exact_gram=True),
]
