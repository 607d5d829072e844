"""The sparsify family's random numbers and ranks: DARE's and DELLA's keep masks are drawn from ``uniform``, seeded per
(seed, agent, tensor, chunk), so any block size gives the same masks; DELLA's MagPrune ranks |τ| within each row
(``row_ranks``). Each step takes float32 blocks and returns new tensors; none mutates its inputs.
"""

from __future__ import annotations

import hashlib

from ..._torch import torch

RNG_CHUNK = 1 << 16  # random numbers are drawn per chunk of 65,536 flat elements, aligned at element 0


def chunk_seed(seed: int, agent: int, tensor: str, chunk: int) -> int:
    """A 63-bit seed for one (seed, agent, tensor, chunk): stable across runs, machines and block sizes."""
    h = hashlib.blake2b(f"{seed}\x1f{agent}\x1f{tensor}\x1f{chunk}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 1


def uniform(seed: int, agent: int, tensor: str, numel: int, start: int, stop: int) -> torch.Tensor:
    """U[0, 1) float32 for flat elements [start, stop) of one agent's tensor.

    The numbers for element i depend only on (seed, agent, tensor, i): each chunk of RNG_CHUNK elements is
    drawn whole from its own generator and the block's part sliced out, so any block size gives the same
    numbers.
    """
    out = torch.empty(stop - start, dtype=torch.float32)
    pos = start
    while pos < stop:
        chunk = pos // RNG_CHUNK
        c0 = chunk * RNG_CHUNK
        c1 = min(c0 + RNG_CHUNK, numel)
        g = torch.Generator().manual_seed(chunk_seed(seed, agent, tensor, chunk))
        draw = torch.rand(c1 - c0, generator=g, dtype=torch.float32)
        end = min(c1, stop)
        out[pos - start:end - start] = draw[pos - c0:end - c0]
        pos = end
    return out


def row_ranks(absd: torch.Tensor, row: int) -> torch.Tensor:
    """Rank of each |τ| within its row, normalised to [0, 1] (0 smallest); ties ordered by position.

    absd [N, n] with n a multiple of ``row``: the block holds whole rows (DELLA's MagPrune is row-wise).
    """
    n_agents, n = absd.shape
    rows = absd.reshape(n_agents, n // row, row)
    order = torch.sort(rows, dim=-1, stable=True).indices
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(row, dtype=order.dtype).expand_as(order))
    if row == 1:
        return torch.zeros_like(absd)
    return (ranks.to(torch.float32) / (row - 1)).reshape(n_agents, n)
