"""A model with its own code (config.json's / tokenizer_config.json's ``auto_map``): the output ships the modules.

A merge of such a model wrote a checkpoint that transformers could not load (found by a QA pass, 2026-12-07): the
config still named ``configuration_x.py`` and ``modeling_x.py``, which were not copied. Oracle: transformers itself
loads the output with ``trust_remote_code=True`` into the model class of the copied module, with the merged weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import TINY, load_output
from rlmerge.cli import main
from rlmerge.synthetic import make_example

transformers = pytest.importorskip("transformers")

CONFIG = "from transformers import Qwen2Config\n\n\nclass XConfig(Qwen2Config):\n    model_type = 'xqwen'\n"
HELPERS = "GREETING = 'merged by rlmerge'\n"
MODELING = ("from transformers import Qwen2ForCausalLM\n\nfrom .configuration_x import XConfig\n"
            "from .helpers_x import GREETING\n\n\nclass XForCausalLM(Qwen2ForCausalLM):\n"
            "    config_class = XConfig\n    greeting = GREETING\n")


def _with_code(model: Path, *, modules: dict[str, str]) -> None:
    for name, text in modules.items():
        (model / name).write_text(text)
    cfg = json.loads((model / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    cfg["model_type"] = "xqwen"
    (model / "config.json").write_text(json.dumps(cfg))


def test_the_modules_an_auto_map_names_and_their_relative_imports_are_shipped(tmp_path: Path) -> None:
    base, agents = make_example(tmp_path / "in", shape=TINY)
    modules = {"configuration_x.py": CONFIG, "modeling_x.py": MODELING, "helpers_x.py": HELPERS}
    for m in (base, *agents):
        _with_code(m, modules=modules)
    (base / "unrelated.py").write_text("raise SystemExit('not part of the model')\n")
    out = tmp_path / "out"
    assert main(["merge", str(base), *map(str, agents), "-o", str(out), "-q", "--method", "ram"]) == 0
    for name, text in modules.items():  # helpers_x.py only through modeling_x.py's relative import
        assert (out / name).read_text() == text, name
    assert not (out / "unrelated.py").exists()
    model = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    assert type(model).__name__ == "XForCausalLM" and model.greeting == "merged by rlmerge"
    merged = load_output(out)
    state = model.state_dict()
    for name, tensor in merged.items():
        assert state[name].to(tensor.dtype).equal(tensor), name


def test_a_module_the_auto_map_names_that_the_folder_lacks_is_a_warning_in_plan_and_merge(tmp_path: Path,
                                                                                         capsys) -> None:
    base, agents = make_example(tmp_path / "in", shape=TINY)
    for m in (base, *agents):
        _with_code(m, modules={"configuration_x.py": CONFIG})  # modeling_x.py is missing
    said = f"config.json's auto_map needs modeling_x.py, which {base} does not hold"
    for command in ("plan", "merge"):
        assert main([command, str(base), *map(str, agents), "-o", str(tmp_path / "out"), "--method", "ram"]) == 0
        assert said in " ".join(capsys.readouterr().err.split()), command
    assert (tmp_path / "out" / "configuration_x.py").read_text() == CONFIG
