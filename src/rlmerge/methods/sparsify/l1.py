"""L1 norms for ``rescale: l1`` (DARE, DELLA), summed in a fixed order that any block size and the fast path
(kernels/dare.py) reproduce bit for bit.

A float64 sum's last bits depend on its order, and the rescale factor Σ|τ| / Σ|kept τ| is rounded to float32
from them: a sum left to torch (whose reduction order depends on the CPU's vector width and the block size)
could flip a factor's last bit between block sizes, machines or the two paths. So the order is part of the
definition, and chosen to vectorise:

    each chunk of CHUNK flat elements (aligned at element 0): 8 lanes, lane l the sequential float64 sum of the
    chunk's elements i ≡ l (mod 8) in increasing i; the chunk's sum ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7));
    the tensor's sum: the chunks' sums added one by one in chunk order, from 0.

A block may end inside a chunk: its lanes are carried to the next block.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .rng import RNG_CHUNK as CHUNK  # one piece of a block serves both the random numbers and the lanes

if TYPE_CHECKING:
    import torch

LANES = 8
EPS = 1e-7  # mergekit's: a (near-)empty tensor is not rescaled
GROUP = 8  # whole chunks per cumsum on the torch path: 8 · 65,536 float64 per row of temporaries


def l1_factors(before: np.ndarray, after: np.ndarray) -> np.ndarray:
    """[N] float32 factors Σ|τ_t| / Σ|kept τ_t| from the float64 sums; 1 where either sum is below EPS."""
    ok = (before >= EPS) & (after >= EPS)
    return np.where(ok, before / np.where(ok, after, 1.0), 1.0).astype(np.float32)


class LaneSum:
    """Σ of each row of [R, n] blocks of one tensor, streamed in order, in the module docstring's order."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.reset()

    def reset(self) -> None:
        self.lanes = np.zeros((self.rows, LANES))  # the open chunk's lanes
        self.total = np.zeros(self.rows)

    def add(self, values: torch.Tensor, start: int, numel: int) -> None:
        """values [R, n] ≥ 0: flat elements [start, start + n) of a tensor of ``numel`` elements."""
        v = values.detach().cpu()  # on the CPU: a CUDA cumsum is a parallel scan, not sequential
        stop = start + v.shape[1]
        pos = start
        while pos < stop:
            whole = min(stop - pos, numel - pos) // CHUNK if pos % CHUNK == 0 else 0
            if whole:  # whole chunks, up to GROUP at a time: their lanes start from 0, no carry to prepend
                k = min(whole, GROUP)
                x = v[:, pos - start:pos - start + k * CHUNK].double().view(self.rows, k, CHUNK // LANES, LANES)
                sums = _tree(x.cumsum(2)[:, :, -1].numpy())  # cumsum: a sequential float64 scan on the CPU
                for c in range(k):
                    self.total += sums[:, c]
                pos += k * CHUNK
            else:
                pos = self._piece(v, start, pos, stop, numel)

    def _piece(self, v: torch.Tensor, start: int, pos: int, stop: int, numel: int) -> int:
        """Add the part of one chunk in [pos, stop), after the lanes it carries; returns where it ended."""
        import torch  # the torch path's helper; this module stays importable without torch

        chunk_end = min((pos // CHUNK + 1) * CHUNK, numel)
        end = min(chunk_end, stop)
        head = pos % LANES
        groups = -(-(head + end - pos) // LANES)
        grid = torch.zeros(self.rows, 1 + groups, LANES, dtype=torch.float64)  # zeros pad: x + 0.0 = x
        grid[:, 0] = torch.from_numpy(self.lanes)
        grid[:, 1:].view(self.rows, -1)[:, head:head + end - pos] = v[:, pos - start:end - start]
        self.lanes = grid.cumsum(1)[:, -1].numpy().copy()
        if end == chunk_end:
            self.total += _tree(self.lanes[:, None])[:, 0]
            self.lanes[:] = 0.0
        return end


def _tree(lanes: np.ndarray) -> np.ndarray:
    """[..., 8] lanes → [...] chunk sums, ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))."""
    a, b = (lanes[..., 0] + lanes[..., 1]) + (lanes[..., 2] + lanes[..., 3]), (
        lanes[..., 4] + lanes[..., 5]) + (lanes[..., 6] + lanes[..., 7])
    return a + b
