"""The door to lm-evaluation-harness (the `eval` extra) for the `lm-eval:` scorer (`rlmerge.scoring.lmeval`), which
`rlmerge sweep` and `rlmerge eval` share: task names checked (`split_tasks`: built-in, or YAML files in an
`--include-path` folder) and lm-eval's run (`evaluate`). The model is loaded by the lab's loader (which keeps a
checkpoint's own word-level tokenizer intact, see `rlmerge.lab.tokenizer`) and handed to lm-eval as a model object,
so lm-eval never resolves a hub name or a tokenizer class itself.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlmerge.lab.tasks import FAMILIES

INSTALL_HINT = "pip install 'rlmerge[eval]'"


class UnknownTask(ValueError):
    """A requested task is neither a lab family nor a task lm-eval knows; the message lists what is."""


class HarnessMissing(ImportError):
    """lm-evaluation-harness is not installed; the message says how to install it."""


@dataclass(frozen=True)
class TaskSplit:
    lab: list[str]  # lab families, in request order
    harness: list[str]  # lm-eval task / group / tag names, in request order


def _import_lm_eval() -> Any:
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager  # noqa: F401 - fail here, not halfway through a run
    except ImportError as err:
        raise HarnessMissing(
            f"lm-evaluation-harness is not installed (needed for tasks other than {', '.join(FAMILIES)}): "
            f"{INSTALL_HINT}"
        ) from err
    return lm_eval


@functools.lru_cache(maxsize=4)
def _task_manager(include_path: tuple[str, ...], defaults: bool = True) -> Any:
    # Indexing lm-eval's ~15k built-in task configs takes seconds (~15 s measured); one index per include path per
    # process. ``defaults=False``: the include path's own tasks only (a few files: no such cost).
    _import_lm_eval()
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(include_path) or None, include_defaults=defaults)


def _manager_for(names: Sequence[str], include_path: tuple[str, ...]) -> Any:
    """lm-eval's TaskManager to load ``names`` with: an index of the include path alone (a few files) when it gives
    them what the full index would, else the full index (~7–15 s, once per process).

    The full index reads the built-in configs first and each include path after; a name an include path defines
    (a task, a group, a tag with that path's tasks) replaces the built-in entry of that name. So a name defined in
    the include path is the same entry in both. What only the full index can tell is a name the include path
    does not define, among those asked or among a group's members (lm-eval makes a member it does not find an
    inline task of that name, so a built-in member would silently change): then the full index is used.
    """
    if include_path:
        alone = _task_manager(include_path, False)
        if _defined_in(names, alone):
            return alone
    return _task_manager(include_path)


def _defined_in(names: Sequence[str], manager: Any) -> bool:
    """Whether each of ``names``, and each member of the groups reached from them, is a task, group or tag in
    ``manager``'s index (lm-eval 0.4.13's ``Entry``; anything else: False, and the full index decides)."""
    try:
        from lm_eval.tasks._index import Kind

        index = manager.task_index
        todo: list[Any] = list(names)
        seen: set[str] = set()
        while todo:
            item = todo.pop()
            # a group's member: a name, or {"task": name, overrides…} / {"group": name, …}
            name = item.get("group", item.get("task")) if isinstance(item, dict) else item
            if not isinstance(name, str) or name not in index or index[name].kind == Kind.UNKNOWN:
                return False
            entry = index[name]
            if entry.kind == Kind.GROUP and name not in seen:
                seen.add(name)
                members = (entry.cfg or {}).get("task")
                todo += members if isinstance(members, list) else []
        return True
    except Exception:  # noqa: BLE001 - another lm-eval's internals: the full index decides
        return False


def split_tasks(names: Sequence[str], include_path: Sequence[Path] = ()) -> TaskSplit:
    """Sort requested names into lab families and lm-eval tasks; refuse unknown names, all at once.

    lm-eval is imported only when some name is not a lab family, so the lab's own tasks need no extra.
    """
    lab = [n for n in names if n in FAMILIES]
    rest = [n for n in names if n not in FAMILIES]
    if not rest:
        return TaskSplit(lab, [])
    paths = tuple(str(p) for p in include_path)  # the index cache's key
    try:
        manager = _manager_for(rest, paths)
    except HarnessMissing as err:
        raise UnknownTask(
            f"unknown task(s) {', '.join(map(repr, rest))}: the lab's tasks are {', '.join(FAMILIES)}; "
            f"any other name is looked up in lm-evaluation-harness, which is not installed: {INSTALL_HINT}"
        ) from err
    known = set(manager.all_tasks)
    unknown = [n for n in rest if n not in known]
    if unknown:
        lines = []
        for name in unknown:
            close = difflib.get_close_matches(name, [*FAMILIES, *manager.all_tasks], n=5, cutoff=0.6)
            lines.append(f"unknown task {name!r}" + (f" (did you mean {', '.join(close)}?)" if close else ""))
        # the include path's own names from an index of it alone: not a second index of every built-in config
        local = sorted(set(_task_manager(paths, False).all_tasks) & known) if paths else []
        raise UnknownTask(
            "; ".join(lines)
            + f". Available: the lab's tasks {', '.join(FAMILIES)}"
            + (f"; from --include-path: {', '.join(local)}" if local else "")
            + f"; and {len(known - set(local))} {'more ' if local else ''}lm-eval tasks, groups and tags (list "
              "them: lm-eval ls tasks)."
        )
    return TaskSplit(lab, rest)


def evaluate(
    lm: Any,
    tasks: Sequence[str],
    *,
    include_path: Sequence[Path] = (),
    limit: int | None = None,
    num_fewshot: int | None = None,
    seed: int = 0,
    log_samples: bool = False,
) -> dict[str, Any]:
    """lm-eval's own results document (``results``, ``n-samples``, ``group_subtasks``, and with ``log_samples``
    each example's ``samples``) for an lm-eval model object (HFLM around a loaded model, or lm-eval's VLLM)."""
    lm_eval = _import_lm_eval()
    manager = _manager_for(tasks, tuple(str(p) for p in include_path))
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=list(tasks),
        num_fewshot=num_fewshot,
        limit=limit,
        task_manager=manager,
        log_samples=log_samples,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
    )
    if results is None:  # only on non-zero ranks of a distributed run, which this never starts
        raise RuntimeError("lm-eval returned no results")
    return results
