"""A model's own code (``auto_map``): the Python modules its config names, shipped with the output as bytes.

transformers builds a model whose ``config.json`` (or a tokenizer whose ``tokenizer_config.json``) has an
``auto_map`` from modules in its folder, when its user allows the model's own code: ``{"AutoModelForCausalLM":
"modeling_x.XForCausalLM"}`` is the class ``XForCausalLM`` of ``modeling_x.py``. A merge of such a model that left
them out wrote a checkpoint that does not load. The modules named, and the modules they import relatively
(``from .configuration_x import …``, found in their text as transformers' ``dynamic_module_utils`` finds them), are
copied; none is imported or run (rlmerge runs no input's code). An entry ``org/repo--modeling_x.X`` names another
repository's code, which transformers fetches from there: nothing to copy.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

# transformers.dynamic_module_utils.get_relative_imports: `import .x` and `from .x import y` at a line's start
_RELATIVE = re.compile(r"^\s*(?:import|from)\s+\.(\w+)", re.MULTILINE)


def _references(auto_map: Any) -> Iterator[str]:
    if not isinstance(auto_map, Mapping):
        return
    for value in auto_map.values():
        for ref in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(ref, str) and "--" not in ref and "." in ref:
                yield ref


def code_files(folder: Path, doc: Any, what: str, check: Callable[[Path], None]) -> tuple[list[Path], list[str]]:
    """(the module files in ``folder`` that ``doc``'s ``auto_map`` needs, warnings for those it does not hold).
    ``what``: the file ``doc`` was read from, for the warning; ``check``: refuses a file that resolves outside
    the model's folder (Checkpoint.check_inside)."""
    todo = [ref.rsplit(".", 1)[0] for ref in _references(doc.get("auto_map") if isinstance(doc, Mapping) else None)]
    found: dict[str, Path] = {}
    missing: list[str] = []
    while todo:
        module = todo.pop(0)
        if module in found or module in missing:
            continue
        path = folder / f"{module}.py"
        if not path.is_file():
            missing.append(module)
            continue
        check(path)
        found[module] = path
        todo += _RELATIVE.findall(path.read_text(encoding="utf-8", errors="replace"))
    warnings = [f"{what}'s auto_map needs {m}.py, which {folder} does not hold: the output will not load with the "
                "model's own code (copy the module into the input folder, or give the class another way)"
                for m in missing]
    return list(found.values()), warnings
