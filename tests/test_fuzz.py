"""Fuzzing the parsers that read untrusted input: any exception that is not an RLMergeError is a bug.

Bounded for CI (a few hundred examples per target, ~20 s in all). For a longer run:
``HYPOTHESIS_PROFILE=long pytest tests/test_fuzz.py`` (or the atheris harness in benchmarks/fuzz_atheris.py).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from rlmerge.errors import ConfigError, RLMergeError
from rlmerge.io.checkpoint import DTYPES, Checkpoint
from rlmerge.methods import REGISTRY, get_method
from rlmerge.recipe import load_recipe, parse_recipe
from rlmerge.stream.match import match_models

settings.register_profile("ci", max_examples=150, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", max_examples=int(os.environ.get("FUZZ_EXAMPLES", "20000")), deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

WORK = Path(tempfile.mkdtemp(prefix="rlmerge-fuzz-"))

json_leaf = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8)
json_any = st.recursive(json_leaf, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(
    st.text(max_size=8), kids, max_size=4), max_leaves=12)
dtype_names = st.sampled_from([*DTYPES, "Q4", ""])
entry = st.fixed_dictionaries({
    "dtype": dtype_names | json_leaf,
    "shape": st.lists(st.integers(-2, 5), max_size=3) | json_any,
    "data_offsets": st.lists(st.integers(-4, 64), min_size=2, max_size=2) | json_any,
})
header = st.dictionaries(st.text(max_size=6), entry | json_any, max_size=4)


def _valid_file() -> bytes:
    path = WORK / "valid.safetensors"
    if not path.exists():
        save_file({"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(2, 2, dtype=torch.bfloat16),
                   "c": torch.tensor([1, 2], dtype=torch.int64)}, str(path))
    return path.read_bytes()


def _open_and_read(data: bytes, extra: dict[str, str] | None = None) -> None:
    folder = WORK / "m"
    folder.mkdir(exist_ok=True)
    for p in folder.iterdir():
        p.unlink()
    (folder / "model.safetensors").write_bytes(data)
    for name, text in (extra or {}).items():
        (folder / name).write_text(text)
    try:
        ckpt = Checkpoint(folder)
        try:
            for info in ckpt.tensors.values():  # every byte a header admits is readable
                ckpt.read_raw(info.name, 0, info.numel)
                if info.is_float:
                    ckpt.read_f32(info.name, 0, info.numel, torch.empty(info.numel))
            match_models(ckpt, [ckpt])
        finally:
            ckpt.close()
    except RLMergeError:
        pass


@given(header, st.binary(max_size=64))
def test_fuzz_safetensors_header(h: dict, tail: bytes) -> None:
    body = json.dumps(h).encode()
    _open_and_read(struct.pack("<Q", len(body)) + body + tail)


@given(st.data())
def test_fuzz_mutated_safetensors(data: st.DataObject) -> None:
    raw = bytearray(_valid_file())
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    _open_and_read(bytes(raw[:cut]))


@given(st.binary(max_size=300))
def test_fuzz_raw_bytes(raw: bytes) -> None:
    _open_and_read(raw)


@given(json_any, json_any)
def test_fuzz_config_and_index(config: object, index: object) -> None:
    valid = _valid_file()
    _open_and_read(valid, {"config.json": json.dumps(config)})
    folder = WORK / "sharded"
    folder.mkdir(exist_ok=True)
    (folder / "s.safetensors").write_bytes(valid)
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with contextlib.suppress(RLMergeError):
        Checkpoint(folder).close()


# YAML, unlike JSON, allows mapping keys of any scalar type.
yaml_key = st.text(max_size=5) | st.integers() | st.none() | st.booleans() | st.floats()
yaml_any = st.recursive(json_leaf, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(
    yaml_key, kids, max_size=4), max_leaves=12)
bin_value = st.builds(lambda n, dt: torch.zeros(n, dtype=dt), st.integers(0, 4),
                      st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.bool])) | json_leaf
bin_state = st.dictionaries(st.text(max_size=6) | st.integers() | st.none(), bin_value | st.dictionaries(
    st.text(max_size=4), bin_value, max_size=2), max_size=4) | st.lists(bin_value, max_size=2) | bin_value


@given(bin_state)
def test_fuzz_bin_state(state: object) -> None:
    """What a .bin may hold under weights_only=True: any mix of keys, tensors, containers and plain values."""
    folder = WORK / "bin"
    folder.mkdir(exist_ok=True)
    torch.save(state, folder / "pytorch_model.bin")
    try:
        ckpt = Checkpoint(folder)
        for info in ckpt.tensors.values():
            ckpt.read_raw(info.name, 0, info.numel)
            if info.is_float:
                ckpt.read_f32(info.name, 0, info.numel, torch.empty(info.numel))
        match_models(ckpt, [ckpt])
    except RLMergeError:
        pass


recipe_doc = st.dictionaries(
    st.sampled_from(["merge_method", "base_model", "models", "parameters", "dtype", "options",
                     "tokenizer_source"]) | st.text(max_size=5) | st.integers(),
    yaml_any | st.lists(st.dictionaries(st.sampled_from(["model", "parameters", "x"]) | yaml_key, yaml_any),
                        max_size=3)
    | st.lists(st.fixed_dictionaries({"model": st.sampled_from(["a", "b"])}, optional={"parameters": st.dictionaries(
        st.sampled_from(["weight", "density", "epsilon"]) | yaml_key, yaml_any, max_size=3)}), max_size=3),
    max_size=6)


model_entry = st.fixed_dictionaries({"model": st.sampled_from(["a", "b", "c"])}, optional={
    "parameters": st.dictionaries(st.sampled_from(["weight", "density", "epsilon", "x"]) | yaml_key, yaml_any,
                                  max_size=3)})
plausible_recipe = st.fixed_dictionaries(
    {"merge_method": st.sampled_from(["ram", "ram+", "ties", "dare_ties", "linear", "task_arithmetic", "della",
                                      "breadcrumbs", "slerp", "model_stock", "x"]) | yaml_any,
     "base_model": st.sampled_from(["b", "c"]),
     "models": st.lists(model_entry | st.sampled_from(["a", "b"]), min_size=1, max_size=3)},
    optional={"parameters": st.dictionaries(st.sampled_from(["r", "alpha", "preset", "density", "weight", "t",
                                                             "normalize", "rescale", "lambda"]) | yaml_key,
                                            yaml_any, max_size=3),
              "options": st.dictionaries(yaml_key, yaml_any, max_size=2), "dtype": yaml_any, "out_dtype": yaml_any})


@given(recipe_doc | plausible_recipe | json_any)
def test_fuzz_recipe_and_method_parameters(doc: object) -> None:
    try:
        rec = parse_recipe(doc)
        get_method(rec.method).parse(rec.parameters)
    except RLMergeError:
        pass


@given(st.sampled_from(sorted(REGISTRY)), st.dictionaries(st.text(max_size=10) | st.sampled_from(
    ["r", "alpha", "preset", "epsilon", "weights", "scaling", "agent", "divide_by_n", "big_r", "rescale_factor"]),
    json_any, max_size=3))
def test_fuzz_method_parameters(method: str, params: dict) -> None:
    with contextlib.suppress(RLMergeError):
        get_method(method).parse(params)


@given(st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_fuzz_recipe_text(raw: bytes) -> None:
    path = WORK / "recipe.yaml"
    path.write_bytes(raw)
    with contextlib.suppress(RLMergeError):
        load_recipe(path)


@pytest.mark.skipif(importlib.util.find_spec("atheris") is None, reason="atheris is not installed")
def test_atheris_bounded_run(tmp_path: Path) -> None:
    """Coverage-guided fuzzing for a few seconds from a seed corpus: libFuzzer exits non-zero on a crash."""
    harness = Path(__file__).with_name("fuzz_atheris.py")
    corpus = tmp_path / "corpus"
    corpus.mkdir()  # empty: the harness starts from its seeds
    seconds = os.environ.get("ATHERIS_SECONDS", "6")
    run = subprocess.run([sys.executable, str(harness), str(corpus), f"-max_total_time={seconds}",
                          "-rss_limit_mb=4096", "-seed=1", "-print_final_stats=1"],
                         cwd=tmp_path, capture_output=True, text=True)
    tail = "\n".join(line for line in run.stderr.splitlines() if not line.startswith("INFO: Instrumenting"))[-3000:]
    assert run.returncode == 0, tail
    assert "Done" in run.stderr, tail


def test_regressions_found_by_fuzzing() -> None:
    """Inputs the fuzzers found crashing (each raised a bare Python error before its fix)."""
    # atheris: a YAML flow mapping `{preset: paper, r: 0,1}` has the integer key 1.
    with pytest.raises(ConfigError, match="unknown parameter 1"):
        get_method("ram+").parse({"preset": "paper", "r": 0, 1: None})
    # hypothesis: a zero-element tensor (torch.frombuffer refuses an empty buffer).
    folder = WORK / "empty"
    folder.mkdir(exist_ok=True)
    save_file({"e": torch.zeros(0), "w": torch.ones(2)}, str(folder / "model.safetensors"))
    ckpt = Checkpoint(folder)
    assert ckpt.read_f32("e", 0, 0, torch.empty(1)).numel() == 0 and bytes(ckpt.read_raw("e", 0, 0)) == b""
    # atheris: per-model parameters with a null key next to text keys (sorting them crashed).
    with pytest.raises(ConfigError, match="per-model parameter None"):
        parse_recipe({"merge_method": "ram", "base_model": "b", "models": [{"model": "a", "parameters": {
            "weight": 1, None: 2}}]})
    # hypothesis: a .bin state dict with a non-string key crashed the plan; a nested training checkpoint
    # and a tensor-free base gave an empty "merged" model.
    binf = WORK / "bin-reg"
    binf.mkdir(exist_ok=True)
    for state, needle in (({0: torch.zeros(1)}, "not tensor names"),
                          ({"model": {"w": torch.zeros(1)}, "step": 3}, "training checkpoint")):
        torch.save(state, binf / "pytorch_model.bin")
        with pytest.raises(RLMergeError, match=needle):
            Checkpoint(binf)
    (binf / "pytorch_model.bin").unlink()
    save_file({}, str(binf / "model.safetensors"))
    with pytest.raises(RLMergeError, match="holds no tensors"):
        match_models(Checkpoint(binf), [Checkpoint(binf)])
    # hypothesis: recipe keys of mixed types, config.json that is not an object, recipe bytes not UTF-8.
    with pytest.raises(ConfigError, match="unsupported key 1"):
        parse_recipe({"merge_method": "ram", "base_model": "b", "models": ["a"], 1: 2})
    (folder / "config.json").write_text("true")
    with pytest.raises(RLMergeError, match="not a JSON object"):
        Checkpoint(folder)
    (WORK / "bad.yaml").write_bytes(b"\x80\x81")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_recipe(WORK / "bad.yaml")
