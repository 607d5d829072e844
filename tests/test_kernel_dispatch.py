"""A warm fused kernel is called through numba's fast dispatch, not its compile path.

The program's key used to reach the kernel as ``numba.literally(int)``: correct bytes, but every call went
through ``Dispatcher._compile_for_args`` (3.3 ms a call, measured; a 0.5B RAM+ merge 2.4× slower). The key now
travels in an argument's type. Not a timing test: it counts entries into the compile path. (That programs
still get their own specialisations is what tests/test_golden.py checks, byte for byte.)
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

from numba.core.dispatcher import Dispatcher  # noqa: E402

from rlmerge import kernels  # noqa: E402
from rlmerge.kernels.layout import hist_shape  # noqa: E402


def _args(n: int, m: int = 64) -> tuple:
    rng = np.random.default_rng(0)
    base = rng.integers(0, 1 << 15, m, dtype=np.uint16)
    agents = tuple(rng.integers(0, 1 << 15, m, dtype=np.uint16) for _ in range(n))
    return base, agents, m


@pytest.mark.parametrize("with_stats", [True, False])
def test_a_warm_kernel_never_enters_the_compile_path(monkeypatch, with_stats: bool) -> None:
    n = 3
    base, agents, m = _args(n)
    out = np.zeros(m, np.uint16)
    hist = np.zeros(hist_shape(n), np.int64) if with_stats else None
    gram = np.zeros((n, n)) if with_stats else None
    eps, consts, agent_consts = np.float32(0), np.zeros(1, np.float32), np.zeros((1, n), np.float32)
    kernels.fused_range(None, base, agents, 0, m, eps, consts, agent_consts, out, hist, gram)  # warm (compiles)
    entered = []
    real = Dispatcher._compile_for_args

    def counting(self, *args, **kws):  # type: ignore[no-untyped-def]
        entered.append(self.py_func.__name__)
        return real(self, *args, **kws)

    monkeypatch.setattr(Dispatcher, "_compile_for_args", counting)
    for _ in range(3):
        kernels.fused_range(None, base, agents, 0, m, eps, consts, agent_consts, out, hist, gram)
    assert entered == []

