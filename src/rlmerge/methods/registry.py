"""The registry of merge methods: every declaration by name, read from the lists that declare them.

A method is declared in a module's ``METHODS`` list (explicit imports, no registration by side effect), wherever
it lives:

- the package's families (``BUILTIN``);
- an installed distribution's entry point in the group ``rlmerge.methods`` (``importlib.metadata``), naming a
  module (its ``METHODS``), a list of declarations or one declaration: ``median = "my_pkg.median"`` in its
  ``[project.entry-points."rlmerge.methods"]``;
- a Python file named in ``RLMERGE_PLUGINS`` (paths separated by ``os.pathsep``), read for its ``METHODS``.

A plugin is declared exactly as a built-in is (``MethodSpec``), and is then one for the route, ``plan``, ``inspect``,
``sweep`` and the command line's flags. The registry is read once per process, on first use; a plugin that cannot
be read, or that declares something else or a name already taken, is an error naming its file (every problem at
once) from the first lookup on: ``rlmerge --help`` still lists the methods that could be read.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..errors import ConfigError, RLMergeError, raise_all
from ..stats import Statistics
from . import arm_ties, fisher, model_stock, ram, slerp, sparsify, task_arithmetic
from .spec import MethodSpec

BUILTIN = (ram, arm_ties, task_arithmetic, sparsify, slerp, model_stock, fisher)  # in the order they are listed
ALIASES = {"ramplus": "ram+", "ram_plus": "ram+", "ta": "task_arithmetic", "dare_linear": "dare_ta"}
ENTRY_POINTS = "rlmerge.methods"
PLUGINS = "RLMERGE_PLUGINS"

_REGISTRY: dict[str, MethodSpec] = {}  # name → declaration, filled by ``load`` (the one dict ``REGISTRY`` names)
_PROBLEMS: list[RLMergeError] = []
_STATE = {"loaded": False, "loading": False}


def load(*, strict: bool = True) -> dict[str, MethodSpec]:
    """Every method by name: the built-ins, then the entry points', then ``RLMERGE_PLUGINS``' files (read once).
    ``strict``: raise the plugins' problems (else the methods that could be read). A plugin that looks a method
    up while it is being read finds those read before it."""
    if not _STATE["loaded"] and not _STATE["loading"]:
        _STATE["loading"] = True
        try:
            _REGISTRY.clear()
            _PROBLEMS[:] = _discover(_REGISTRY)
        finally:
            _STATE["loading"] = False
        _STATE["loaded"] = True
    if strict and not _STATE["loading"]:
        raise_all(list(_PROBLEMS))
    return _REGISTRY


def reset() -> None:
    """Forget what was read: the next lookup reads the plugins again (tests; a changed RLMERGE_PLUGINS)."""
    _STATE["loaded"] = False
    _REGISTRY.clear()
    _PROBLEMS.clear()


def __getattr__(name: str) -> Any:
    if name == "REGISTRY":
        return load()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_method(name: str) -> MethodSpec:
    methods = load()
    key = ALIASES.get(name, name)
    if key not in methods:
        raise ConfigError(f"unknown method {name!r}", hint=f"choose one of: {', '.join(sorted(methods))}")
    return methods[key]


def inspected(stats: Statistics) -> dict[str, list[Any]]:
    """Every method's ``inspect`` of ``stats``, in the registry's order: the report's per-agent method fields."""
    return {key: list(values) for spec in load().values() for key, values in spec.inspect(stats).items()}


# -- discovery ---------------------------------------------------------------------------------------------------
def _discover(specs: dict[str, MethodSpec]) -> list[RLMergeError]:
    """Fill ``specs`` (built-ins first); the plugins' problems."""
    origin: dict[str, str] = {}
    problems: list[RLMergeError] = []

    def add(where: str, file: str | None, declared: Iterable[MethodSpec]) -> None:
        for spec in declared:
            taken = origin.get(spec.name) or ("an alias of " + ALIASES[spec.name] if spec.name in ALIASES else None)
            if taken is not None:
                problems.append(ConfigError(f"{where} declares method {spec.name!r}, already {taken}", file=file,
                                            hint="rename the plugin's method (MethodSpec.name)"))
                continue
            specs[spec.name], origin[spec.name] = spec, f"declared by {where}"

    for module in BUILTIN:
        add(f"rlmerge.methods.{module.__name__.rpartition('.')[2]}", None, module.METHODS)
    for where, file, found in [*_entry_points(), *_files()]:
        if isinstance(found, RLMergeError):
            problems.append(found)
        else:
            add(where, file, found)
    return problems


def _entry_points() -> list[tuple[str, str | None, list[MethodSpec] | RLMergeError]]:
    out: list[tuple[str, str | None, list[MethodSpec] | RLMergeError]] = []
    for ep in importlib.metadata.entry_points(group=ENTRY_POINTS):
        dist = getattr(ep.dist, "name", None)
        where = f"the entry point {ep.name} = {ep.value}" + (f" of {dist}" if dist else "")
        try:
            loaded = ep.load()
        except Exception as e:  # noqa: BLE001 - whatever a plugin raises is reported as that plugin's problem
            out.append((where, None, ConfigError(f"{where} cannot be loaded: {type(e).__name__}: {e}",
                                                 hint=f"fix or uninstall {dist or 'the distribution'}")))
            continue
        file = getattr(loaded, "__file__", None)
        out.append((where, file, _declarations(where, file, getattr(loaded, "METHODS", loaded))))
    return out


def _files() -> list[tuple[str, str | None, list[MethodSpec] | RLMergeError]]:
    out: list[tuple[str, str | None, list[MethodSpec] | RLMergeError]] = []
    for text in os.environ.get(PLUGINS, "").split(os.pathsep):
        if not text.strip():
            continue
        path = Path(text.strip()).expanduser()
        where = f"the plugin {path}"
        module = _load_file(path, where)
        if isinstance(module, RLMergeError):
            out.append((where, str(path), module))
            continue
        if not hasattr(module, "METHODS"):
            out.append((where, str(path), ConfigError(f"{where} has no METHODS list", file=str(path),
                                                      hint="declare METHODS = [MethodSpec(...), ...] at its top "
                                                           "level (examples/plugins/median_active.py)")))
            continue
        out.append((where, str(path), _declarations(where, str(path), module.METHODS)))
    return out


def _load_file(path: Path, where: str) -> Any:
    """The module in ``path``, under a name of its own (``rlmerge_plugin_<stem>_<hash of the path>``), or the error
    that says why not. It is put in sys.modules first: its dataclasses' annotations are resolved there."""
    hint = f"fix it, or take it out of {PLUGINS}"
    if not path.is_file():
        return ConfigError(f"{where} is not a file", file=str(path), hint=f"give a .py file's path in {PLUGINS}")
    stem = "".join(c if c.isalnum() else "_" for c in path.stem)
    name = f"rlmerge_plugin_{stem}_{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:8]}"
    found = importlib.util.spec_from_file_location(name, path)
    if found is None or found.loader is None:
        return ConfigError(f"{where} is not a Python module", file=str(path), hint="name a .py file")
    module = importlib.util.module_from_spec(found)
    sys.modules[name] = module
    try:
        found.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - whatever a plugin raises is reported as that plugin's problem
        sys.modules.pop(name, None)
        line = getattr(e, "lineno", None) if isinstance(e, SyntaxError) else _line(e, path)
        at = f" (line {line})" if line else ""
        return ConfigError(f"{where} cannot be loaded{at}: {type(e).__name__}: {e}", file=str(path), hint=hint)
    return module


def _line(e: BaseException, path: Path) -> int | None:
    """The line of ``path`` where ``e`` was raised, from its traceback."""
    tb, line = e.__traceback__, None
    while tb is not None:
        if Path(tb.tb_frame.f_code.co_filename) == path:
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def _declarations(where: str, file: str | None, declared: Any) -> list[MethodSpec] | RLMergeError:
    """``declared`` (a METHODS list, or one declaration) as a list of MethodSpec, or what is wrong with it."""
    items = [declared] if isinstance(declared, MethodSpec) else declared
    if not isinstance(items, (list, tuple)) or not items:
        return ConfigError(f"{where}: METHODS must be a non-empty list of MethodSpec, not {type(declared).__name__}",
                           file=file, hint="METHODS = [MethodSpec(...), ...]")
    wrong = [type(x).__name__ for x in items if not isinstance(x, MethodSpec)]
    if wrong:
        return ConfigError(f"{where}: METHODS holds {', '.join(sorted(set(wrong)))}, not MethodSpec", file=file,
                           hint="declare each method with rlmerge.methods.MethodSpec (or a subclass of it)")
    loose = [x.name for x in items if not dataclasses.is_dataclass(x.params)]
    if loose:
        return ConfigError(f"{where}: the parameters of {', '.join(map(repr, loose))} are not a dataclass", file=file,
                           hint="params=... takes a frozen dataclass (its fields are the method's parameters)")
    return list(items)


__all__ = ["ALIASES", "BUILTIN", "ENTRY_POINTS", "PLUGINS", "get_method", "inspected", "load", "reset"]  # + REGISTRY
