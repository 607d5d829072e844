"""The rule generator's numba kernels: the one door to them (numba is imported only when a kernel runs).

``fused_range`` runs a method's traced rule (methods/rule.py) compiled into a fused loop (fused.py); ``rule_key``
selects a program's loop for a kernel that calls ``fused.rule_tile`` (a family's own kernels end that way). No
method is named here: a family with kernels of its own keeps them in its folder (methods/sparsify/kernels/).
docs/architecture.md has the design.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

from .layout import (  # noqa: F401  re-exported: the engine's one door to the kernels
    MAX_AGENTS,
    SUBHISTS,
    TILE,
    hist_shape,
)

if TYPE_CHECKING:
    from ..methods.rule import Program

HAVE_NUMBA = importlib.util.find_spec("numba") is not None


def fused_range(program: Program | None, base: Any, agents: tuple[Any, ...], lo: int, hi: int, eps: Any,
                consts: Any, agent_consts: Any, out: Any, hist: Any, gram: Any, exact: bool = False,
                rescaled: Any = None, kept: Any = None, tau: bool = False) -> bool:
    """Elements [lo, hi) of one block through a method's elementwise ``program`` (methods/rule.py; None: the
    statistics only); True when a τ is not finite.

    base [n] and each of the N agents [n]: uint16 (bfloat16 bits) or float32; consts [C] and agent_consts [A, N]
    float32 (``Program.arrays``); eps float32, the statistics' threshold; out [n] uint16 or float32 (ignored
    without a program). hist [S, 4^N] int64 and gram [N, N] float64 (upper triangle) accumulate the statistics,
    or are both None: then nothing is gathered and no τ is checked (a statistics pass over the same bytes
    already did). ``exact``: gram from float64 products, for a method that merges with it (exact_gram); else
    float32 sums over tiles. ``kept`` [N, 2] int64 (with ``rescaled`` [N] bool; both None without a statistics
    pass's hist): what the written output kept of a rescale of unique elements (engine/survival.py). ``tau``: each
    agent's array holds its τ in float32 instead (stream/fast.py, when an agent is a LoRA adapter). Compiled on
    first use for each (program, N, dtypes, tau), cached on disk.
    """
    from .fused import fused_range as kernel

    return bool(kernel(base, agents, lo, hi, eps, consts, agent_consts, out, hist, gram, exact, rescaled, kept,
                       rule_key(program, tau)))


def rule_key(program: Program | None, tau: bool = False) -> Any:
    """The kernel argument that selects ``program``'s compiled loop (fused.ProgramKey; None: the statistics
    only), the program registered for its first compilation. ``tau``: the agents come as their float32 τ."""
    from .fused import PROGRAMS, STATS_ONLY, ProgramKey

    if program is None:
        return ProgramKey(STATS_ONLY, tau)
    PROGRAMS.setdefault(program.key, program)
    return ProgramKey(program.key, tau)
