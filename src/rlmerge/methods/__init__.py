"""Merge methods: the public method interface (``spec.py``, ``interface.py``, the rule language ``rule.py``) and the
registry of named methods (``registry.py``).

Each family is a module (or a folder, with its own kernels and backend) here that lists its declarations in
``METHODS``. The names below are resolved on first use (PEP 562): importing ``rlmerge.methods.rule`` (as kernels/
and stream/ do) or ``.spec`` and ``.interface`` (as a family does) runs this file, and must not import every
family, whose backends import the stream.
"""

from __future__ import annotations

from typing import Any

# name → the module that defines it
_PUBLIC = {"REGISTRY": "registry", "ALIASES": "registry", "get_method": "registry", "inspected": "registry",
           "MethodSpec": "spec", "Parsed": "spec", "validate": "spec", "Run": "spec", "Runner": "spec",
           "Capability": "spec", "BlockContext": "interface", "Rows": "interface", "Observer": "interface",
           "Prepared": "interface", "Entries": "interface", "Scope": "interface", "Terms": "rule", "Expr": "rule",
           "Rule": "rule"}


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import interface, registry, rule, spec  # on first use (see above)

    module = {"interface": interface, "registry": registry, "rule": rule, "spec": spec}[_PUBLIC[name]]
    value = globals()[name] = getattr(module, name)
    return value


__all__ = sorted(_PUBLIC)
