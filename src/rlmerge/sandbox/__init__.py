"""Run model-written code under OS isolation (bubblewrap namespaces), never on a ban-list alone.

A program a model wrote (a coding answer, a HumanEval solution with its tests) is a stranger's code. ``run_python``
runs it as an unprivileged user in its own user, PID, network, mount, IPC and UTS namespaces, seeing only the
system's libraries and one Python interpreter (read-only) and a private scratch tmpfs; it cannot reach the network,
the user's files or this process, and everything it starts dies when the call ends. docs/guarantees.md states the
threat model and the tests behind it.

Where the machine cannot isolate (no ``bwrap``, or user namespaces not allowed), ``SandboxUnavailable`` says how to
get isolation, unless the user opted in to unisolated execution (``--unsafe-unisolated-code``,
``$RLMERGE_UNSAFE_UNISOLATED_CODE=1`` or ``unsafe_unisolated=True``).

>>> run_python("print(6 * 7)").stdout                                   # doctest: +SKIP
'42\\n'
>>> run_python(solution, files={"test_solution.py": tests}).ok            # doctest: +SKIP
"""

from .isolation import (
    BWRAP_ENV,
    UNSAFE_ENV,
    UNSAFE_FLAG,
    Isolation,
    allow_unisolated,
    ensure_isolation,
    isolation,
    unsafe_opted_in,
)
from .run import RunResult, run_python

__all__ = ["BWRAP_ENV", "UNSAFE_ENV", "UNSAFE_FLAG", "Isolation", "RunResult", "allow_unisolated", "ensure_isolation",
           "isolation", "run_python", "unsafe_opted_in"]
