"""The shape of the house (docs/architecture.md): data flows one way, and no two modules import each other.

Every ``import`` of an rlmerge module in src/ (at the top of a module, inside a function, or under ``if
TYPE_CHECKING:``, which only type checkers run: a type names a dependency all the same) must go to the same layer or
one to its left in ``LAYERS``, and the import graph of modules has no cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# Left to right, the way the data flows: what a layer may import is itself and the layers to its left. A name is a
# module and everything below it (the longest name that matches decides); "=NAME" is that module alone (a package's
# __init__, e.g. rlmerge.methods: the registry's public face, above the families its folder holds).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundation", ("rlmerge._version", "rlmerge._torch", "rlmerge._threads", "rlmerge.errors", "rlmerge.params",
                    "rlmerge.schedule")),
    ("recipe", ("rlmerge.recipe", "rlmerge.mergekit_names")),
    ("io", ("rlmerge.io",)),
    ("statistics", ("rlmerge.stats",)),
    ("rule", ("rlmerge.methods.rule",)),
    ("kernels", ("rlmerge.kernels",)),
    ("stream", ("rlmerge.stream",)),
    ("method interface", ("rlmerge.methods.interface", "rlmerge.methods.spec", "rlmerge.methods._select")),
    ("families", ("rlmerge.methods",)),
    ("registry", ("=rlmerge.methods", "rlmerge.methods.registry")),
    ("report", ("rlmerge.report",)),
    ("engine", ("rlmerge.engine",)),
    ("sweep", ("rlmerge.sweeping",)),
    ("tools", ("rlmerge.synthetic", "rlmerge.sandbox")),
    ("edge", ("rlmerge.cli", "rlmerge.lab", "rlmerge")),
]


def layer_of(module: str) -> int:
    best, rank = -1, -1
    for i, (_, names) in enumerate(LAYERS):
        for name in names:
            exact = name.startswith("=")
            p = name.lstrip("=")
            if (module == p or (not exact and module.startswith(p + "."))) and len(name) > best:
                best, rank = len(name), i
    assert rank >= 0, f"{module} is in no layer: add it to LAYERS (and to docs/architecture.md)"
    return rank


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """rlmerge modules imported by the file (absolute names), TYPE_CHECKING blocks included."""
    mod = module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names if a.name.split(".")[0] == "rlmerge")
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[: len(base) - (child.level - 1)] if child.level > 1 else base
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                if target.split(".")[0] != "rlmerge":
                    continue
                for a in child.names:  # ``from pkg import submodule`` imports the submodule
                    sub = f"{target}.{a.name}"
                    found.add(sub if (SRC / Path(*sub.split("."))).with_suffix(".py").exists()
                              or (SRC / Path(*sub.split(".")) / "__init__.py").exists() else target)
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    found.discard(mod)
    return found


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports(p) for p in sorted(SRC.rglob("*.py"))}


def test_every_import_follows_the_flow() -> None:
    against = []
    for mod, deps in graph().items():
        for dep in sorted(deps):
            if mod == "rlmerge":  # the package's public face re-exports from every layer
                continue
            if layer_of(dep) > layer_of(mod) and not dep.startswith(mod + "."):
                against.append(f"{mod} ({LAYERS[layer_of(mod)][0]}) imports {dep} ({LAYERS[layer_of(dep)][0]})")
    assert not against, "imports against the flow:\n" + "\n".join(against)


def test_no_import_cycles() -> None:
    g = graph()
    # A package's __init__ may import its submodules (that is how a package is built); a submodule importing names
    # back from its package's __init__ then closes a cycle, and is reported: siblings import siblings.
    edges = {m: {d for d in deps if d in g} for m, deps in g.items()}
    edges["rlmerge"] = set()  # the public face: nothing below may import it (checked next), so no cycle runs through
    edge = LAYERS[-1][1]
    assert not [m for m, deps in g.items() if "rlmerge" in deps and layer_of(m) != layer_of(edge[0])], \
        "modules import the package itself (rlmerge/__init__): import what you need from its module"
    cycles, state = [], {}

    def walk(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(edges[m]):
            if state.get(d) == 1:
                cycles.append(" → ".join(stack[stack.index(d):] + [m, d]) if d in stack else f"{m} → {d}")
            elif d not in state:
                walk(d, [*stack, m])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            walk(m, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_every_module_has_a_layer() -> None:
    for mod in graph():
        layer_of(mod)


# The engine reads a method through the public interface and the registry only: a family declares what it needs
# (its hooks, its own backend's Capability), and the engine never names one.
INTERFACE = ("rlmerge.methods", "rlmerge.methods.registry", "rlmerge.methods.spec", "rlmerge.methods.interface",
             "rlmerge.methods.rule")


def test_the_engine_never_imports_a_method_family() -> None:
    naming = sorted(f"{mod} imports {dep}" for mod, deps in graph().items()
                    if mod.startswith("rlmerge.engine") for dep in deps
                    if dep.startswith("rlmerge.methods") and dep not in INTERFACE)
    assert not naming, "the engine names a method family:\n" + "\n".join(naming)
