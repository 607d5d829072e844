"""The command line: every bad input gets its exit code, a message naming file and tensor, and no output."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import load_output
from rlmerge.cli import main


def run(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def nothing_written(out: Path) -> bool:
    return not out.exists() and not list(out.parent.glob(f".{out.name}*"))


def _edit(model: Path, fn) -> None:  # rewrite a model's single safetensors file through fn(dict) -> dict
    f = model / "model.safetensors"
    tensors = load_file(str(f))
    save_file(fn(tensors), str(f), metadata={"format": "pt"})


def test_merge_prints_rho_and_lambda(example, tmp_path: Path, capsys) -> None:
    base, agents = example
    code, out, _ = run(capsys, "merge", base, *agents, "-o", tmp_path / "m", "--method", "ram+")
    assert code == 0
    assert "ρ" in out and "λ" in out and "coder" in out
    code, out, _ = run(capsys, "merge", base, *agents, "-o", tmp_path / "m2", "--json", "--preset", "official",
                       "--rescale-factor", "1.5")
    doc = json.loads(out)
    assert code == 0 and doc["method"] == "ram+" and len(doc["agents"]) == 3
    assert all(1.0 <= a["lambda"] <= 1.5 for a in doc["agents"])


def test_missing_tensor_is_an_error_unless_allowed(example, tmp_path: Path, capsys) -> None:
    base, agents = example
    _edit(agents[1], lambda t: {k: v for k, v in t.items() if k != "model.layers.0.mlp.up_proj.weight"})
    out = tmp_path / "m"
    code, _, err = run(capsys, "merge", base, *agents, "-o", out)
    assert code == 3
    assert "model.layers.0.mlp.up_proj.weight" in err and str(agents[1]) in err and "--allow-missing" in err
    assert nothing_written(out)
    code, _, _ = run(capsys, "merge", base, *agents, "-o", out, "--allow-missing", "-q")
    assert code == 0
    prov = json.loads((out / "rlmerge.json").read_text())
    assert prov["missing_tensors_allowed"] == {"model.layers.0.mlp.up_proj.weight": [str(agents[1])]}


def test_shape_and_vocabulary_mismatch(example, tmp_path: Path, capsys) -> None:
    base, agents = example
    _edit(agents[0], lambda t: {**t, "model.embed_tokens.weight": torch.zeros(130, 32, dtype=torch.bfloat16)})
    _edit(agents[2], lambda t: {**t, "model.norm.weight": torch.zeros(31, dtype=torch.bfloat16)})
    out = tmp_path / "m"
    code, _, err = run(capsys, "merge", base, *agents, "-o", out)
    assert code == 3
    assert "2 problem(s)" in err  # both reported together
    assert "model.embed_tokens.weight" in err and "vocabulary" in err
    assert "model.norm.weight" in err and "[31]" in err
    assert nothing_written(out)


@pytest.mark.parametrize("method", ["ram+", "task_arithmetic"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_inf_in_a_task_vector(example, tmp_path: Path, capsys, method: str, bad: float) -> None:
    base, agents = example
    name = "model.layers.1.self_attn.o_proj.weight"  # late in the file: the one-pass merge is mid-write

    def poison(t):
        w = t[name].clone()
        w[3, 5] = bad
        return {**t, name: w}

    _edit(agents[2], poison)
    out = tmp_path / "m"
    code, _, err = run(capsys, "merge", base, *agents, "-o", out, "--method", method, "--shard-size", "10KB")
    assert code == 3
    assert "NaN or Inf" in err and name in err and str(agents[2]) in err and "element 101" in err
    assert nothing_written(out)


def test_fp32_agent_against_bf16_base_warns(example, tmp_path: Path, capsys) -> None:
    base, agents = example
    _edit(agents[0], lambda t: {k: v.float() for k, v in t.items()})
    code, _, err = run(capsys, "merge", base, *agents, "-o", tmp_path / "m", "-q")
    assert code == 0
    assert "F32 against a BF16 base" in err.replace("\n", " ") and "denser" in err


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_unreadable_or_truncated_file(example, tmp_path: Path, capsys, damage: str) -> None:
    base, agents = example
    f = agents[1] / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes({"truncate": data[: len(data) - 1000], "garbage": b"\x08\x00\x00\x00\x00\x00\x00\x00not json",
                   "empty": b""}[damage])
    out = tmp_path / "m"
    code, _, err = run(capsys, "merge", base, *agents, "-o", out)
    assert code == 3 and str(f) in err
    assert {"truncate": "truncated", "garbage": "not valid JSON", "empty": "shorter"}[damage] in err
    assert nothing_written(out)


@pytest.mark.parametrize(("args", "needle"), [
    (["--method", "nope"], "unknown method 'nope'"),
    (["--preset", "nope"], "'nope' is not one of 'paper', 'paper-soft', 'official', 'tensor-local'"),
    (["--r", "-1"], "r = -1.0 is out of range"),
    (["--eps", "2"], "epsilon = 2.0 is out of range"),
    (["--rescale-factor", "1.3"], "rescale_factor does not apply to preset 'paper'"),
    (["--preset", "official", "--alpha", "1"], "alpha does not apply to preset 'official'"),
    (["--method", "task_arithmetic", "--preset", "paper"], "unknown parameter 'preset'"),
    (["--method", "task_arithmetic", "--scaling", "99"], "scaling = 99.0 is out of range"),
    (["--param", "weights=1,2"], "unknown parameter 'weights' for method 'ram+'"),
    (["--method", "linear", "--param", "weights=1,2"], "2 weight(s) given for 3 agent(s)"),
    (["--dtype", "int8"], "unknown dtype 'int8'"),
    (["--shard-size", "lots"], "cannot read size 'lots'"),
])
def test_bad_configuration_exit_2(example, tmp_path: Path, capsys, args: list[str], needle: str) -> None:
    base, agents = example
    out = tmp_path / "m"
    code, _, err = run(capsys, "merge", base, *agents, "-o", out, *args)
    assert code == 2, err
    assert needle in err.replace("\n", " ")
    assert nothing_written(out)


def test_existing_output_refused_then_forced(example, tmp_path: Path, capsys) -> None:
    base, agents = example
    out = tmp_path / "m"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, _, err = run(capsys, "merge", base, *agents, "-o", out)
    assert code == 4 and "already exists" in err and "--force" in err
    assert (out / "keep.txt").read_text() == "mine"
    # --force replaces only a folder rlmerge wrote: this one holds the user's file, and stays as it is
    code, _, err = run(capsys, "merge", base, *agents, "-o", out, "--force", "-q")
    assert code == 4 and "replaces only a folder rlmerge wrote" in err and "keep.txt" in err
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()
    code, _, _ = run(capsys, "merge", base, *agents, "-o", out, "--method", "ram", "-q")  # an empty folder
    assert code == 4
    code, _, _ = run(capsys, "merge", base, *agents, "-o", out, "--method", "ram", "-q", "--force")
    assert code == 0 and (out / "model.safetensors").exists()
    first = (out / "rlmerge.json").read_text()
    code, _, _ = run(capsys, "merge", base, *agents, "-o", out, "--force", "-q")  # rlmerge's own: replaced
    assert code == 0 and (out / "rlmerge.json").read_text() != first
    assert not list(tmp_path.glob(".m.rlmerge-*"))


def test_missing_folder_and_offline_hub_id_fail_at_once(example, tmp_path: Path, capsys, monkeypatch) -> None:
    base, agents = example
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.perf_counter()
    code, _, err = run(capsys, "merge", base, agents[0], "nobody-xyz/not-a-model@v1", str(tmp_path / "nope"),
                       "-o", tmp_path / "m")
    assert time.perf_counter() - t0 < 10
    assert code == 3 and "2 problem(s)" in err
    assert "nobody-xyz/not-a-model" in err and "HF_HUB_OFFLINE" in err and "no such folder" in err
    assert nothing_written(tmp_path / "m")


def test_recipe(example, tmp_path: Path, capsys) -> None:
    base, agents = example
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"""
merge_method: task_arithmetic
base_model: {base}
models:
  - model: {agents[0]}
    parameters: {{weight: 0.5}}
  - model: {agents[1]}
  - model: {agents[2]}
parameters: {{scaling: 0.3}}
dtype: float32
""")
    code, _, err = run(capsys, "merge", "--recipe", recipe, "-o", tmp_path / "m", "-q")
    assert code == 0, err
    prov = json.loads((tmp_path / "m" / "rlmerge.json").read_text())
    assert prov["parameters"] == {"scaling": 0.3, "weights": [0.5, 1.0, 1.0], "normalize": False}
    assert prov["recipe"]["merge_method"] == "task_arithmetic"
    # mergekit's defaults for what the recipe omits: printed (even with -q) and kept in the provenance
    for d in ("weight = 1.0 for models[1], models[2]", "normalize = False (mergekit's default)"):
        assert d in err and any(x.startswith(d) for x in prov["defaults_applied"]), (d, err, prov)
    b, ags = load_output(base), [load_output(a) for a in agents]
    name = "model.layers.0.mlp.down_proj.weight"
    taus = [a[name].float() - b[name].float() for a in ags]
    want = b[name].float() + (taus[0] * 0.5 + taus[1] * 1.0 + taus[2] * 1.0) * 0.3
    assert torch.equal(load_output(tmp_path / "m")[name], want)
    recipe.write_text(recipe.read_text() + "bogus: 1\nslices: []\n")
    code, _, err = run(capsys, "merge", "--recipe", recipe, "-o", tmp_path / "m2")
    assert code == 2 and "unsupported key 'bogus'" in err and "slices (layer ranges" in err


def test_console_script_runs(example, tmp_path: Path) -> None:
    base, agents = example
    exe = Path(sys.executable).parent / "rlmerge"
    proc = subprocess.run([str(exe), "merge", str(base), *map(str, agents), "-o", str(tmp_path / "m"), "-q"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run([str(exe), "merge", str(base), "-o", str(tmp_path / "m3")], capture_output=True, text=True)
    assert proc.returncode == 2 and "need BASE and at least one AGENT" in proc.stderr


def test_fsync_by_default_and_no_fsync_writes_the_same_files(example, tmp_path: Path, monkeypatch) -> None:
    """Shards are flushed to disk (and their writeback started early) unless --no-fsync; the files are the same."""
    import os

    from rlmerge.io import writer

    synced, started = [], []
    real_fsync = os.fsync
    monkeypatch.setattr(writer.os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    monkeypatch.setattr(writer, "WRITEBACK_CHUNK", 4096)
    monkeypatch.setattr(writer, "start_writeback", lambda *a: started.append(a))
    base, agents = example
    argv = ["merge", str(base), *map(str, agents), "-q", "--method", "ram"]
    assert main([*argv, "-o", str(tmp_path / "a")]) == 0
    assert synced and started
    synced.clear(), started.clear()
    assert main([*argv, "-o", str(tmp_path / "b"), "--no-fsync"]) == 0
    assert not synced and not started
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "b").iterdir())
    for f in files:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f


def _resident(path: Path) -> np.ndarray:
    """Per page of ``path``, whether it is in the page cache: mincore(2) on a mapping of it (Linux)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = path.stat().st_size
    vec = np.zeros(-(-size // mmap.PAGESIZE), dtype=np.uint8)
    with path.open("rb") as fh, mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_READ) as mm:
        view = np.frombuffer(mm, dtype=np.uint8)
        rc = libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size), vec.ctypes.data_as(ctypes.c_void_p))
        del view
    assert rc == 0, ctypes.get_errno()
    return (vec & 1).astype(bool)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range and mincore are Linux's")
def test_written_output_leaves_the_page_cache_once_on_disk(example, tmp_path: Path, monkeypatch) -> None:
    """With fsync (the default) each chunk of a shard is dropped from the page cache once written back, and the rest
    after the shard's fsync (io/writer.settle: the next writes reuse those pages); --no-fsync leaves them to the OS.
    Same bytes either way (the test above)."""
    import mmap
    import os

    from rlmerge.io import writer

    settled: list[int] = []  # pages of each settled range still cached right after it was settled

    def settle(fd: int, offset: int, nbytes: int) -> None:
        real(fd, offset, nbytes)
        pages = _resident(Path(os.readlink(f"/proc/self/fd/{fd}")))
        settled.append(int(pages[offset // mmap.PAGESIZE:(offset + nbytes) // mmap.PAGESIZE].sum()))

    real = writer.settle
    monkeypatch.setattr(writer, "WRITEBACK_CHUNK", 8192)
    monkeypatch.setattr(writer, "settle", settle)
    base, agents = example
    argv = ["merge", str(base), *map(str, agents), "-q", "--method", "ram"]
    assert main([*argv, "-o", str(tmp_path / "a")]) == 0
    shards = sorted((tmp_path / "a").glob("*.safetensors"))
    assert shards and len(settled) > 2 and settled == [0] * len(settled)  # each chunk dropped once written back
    assert [int(_resident(f).sum()) for f in shards] == [0] * len(shards)  # and the rest after the fsync
    settled.clear()
    assert main([*argv, "-o", str(tmp_path / "b"), "--no-fsync"]) == 0
    assert not settled
    assert sum(int(_resident(f).sum()) for f in sorted((tmp_path / "b").glob("*.safetensors"))) > 0


def test_one_weight_for_every_agent(example, tmp_path: Path, capsys) -> None:
    """docs/methods.md: a per-agent parameter takes one value for all agents: ``--param weights=0.5`` is
    ``weights=0.5,0.5,0.5`` (it was refused: issue 15)."""
    base, agents = example
    for i, w in enumerate(("0.5", "0.5,0.5,0.5")):
        code, _, err = run(capsys, "merge", base, *agents, "-o", tmp_path / str(i), "-q", "--method",
                           "task_arithmetic", "--param", f"weights={w}", "--dtype", "float32")
        assert code == 0, err
    one, three = load_output(tmp_path / "0"), load_output(tmp_path / "1")
    assert one.keys() == three.keys() and all(torch.equal(one[k], three[k]) for k in one)
    b, ags = load_output(base), [load_output(a) for a in agents]
    name = "model.layers.0.mlp.down_proj.weight"
    want = b[name].float() + sum((a[name].float() - b[name].float()) * 0.5 for a in ags)
    assert torch.allclose(one[name], want, rtol=0, atol=4e-7 * float(want.abs().max()))


# -- messages that mislead: Rich markup ate square brackets ("pip install 'rlmerge'" for rlmerge[ray]) ---------
SRC = Path(__file__).resolve().parents[1] / "src" / "rlmerge"
HINT = re.compile(r"pip install (?:'[^']*'|\S+)")


def _printable_strings() -> list[tuple[str, str]]:
    """(file, text) of every string the code can print: every string constant in src/rlmerge but docstrings,
    plus the docstrings of the CLI's functions (a command's is its --help)."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text())
        docs = {id(node.body[0].value) for node in ast.walk(tree)
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
                and not (path.parent.name == "cli" and isinstance(node, ast.FunctionDef))}
        found += [(str(path.relative_to(SRC)), node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs]
    return found


def _hints() -> list[tuple[str, str]]:
    return [(f, h) for f, text in _printable_strings() for h in HINT.findall(text)]


def test_every_install_hint_the_code_can_print_keeps_its_brackets(capsys, monkeypatch) -> None:
    """Every `pip install …` the code can print, through the console errors go to and through every command's
    --help: `pip install 'rlmerge[ray]'` printed as `pip install 'rlmerge'` (Rich took [ray] for a tag)."""
    from rlmerge.cli import report_error
    from rlmerge.errors import ConfigError

    hints = _hints()
    extras = {h for _, h in hints if "rlmerge[" in h}
    assert {"pip install 'rlmerge[ray]'", "pip install 'rlmerge[eval]'", "pip install 'rlmerge[hf]'",
            "pip install 'rlmerge[report]'"} <= extras, hints  # the grep finds them
    for _, hint in hints:  # as an error's message and as its hint
        assert report_error(ConfigError(f"needs it: {hint}", hint=hint)) == 2
        assert capsys.readouterr().err.count(hint) == 2, hint
    monkeypatch.setenv("COLUMNS", "1000")  # one line per option: nothing wraps inside a hint
    helps = ""
    for cmd in ("merge", "plan", "demo", "fisher", "inspect", "lab", "eval", "sweep"):
        assert main([cmd, "--help"]) == 0
        helps += capsys.readouterr().out
    helps = " ".join(helps.split())
    for f, hint in hints:
        if f.startswith("cli/"):
            assert hint in helps, (f, hint)
    assert "with rlmerge[eval], lm-eval tasks" in helps  # a command's docstring


SWEEP = ["sweep", "{base}", "{agent}", "-o", "{out}", "--candidate", "task_arithmetic scaling=1"]


@pytest.mark.parametrize(("missing", "argv", "hint"), [
    ("ray", ["merge", "{base}", "{agent}", "-o", "{out}", "--backend", "ray"], "pip install 'rlmerge[ray]'"),
    ("ray", [*SWEEP, "--backend", "ray"], "pip install 'rlmerge[ray]'"),
    ("lm_eval", [*SWEEP, "--tasks", "lm-eval:x"], "pip install 'rlmerge[eval]'"),
    ("matplotlib", ["inspect", "{base}", "{agent}", "--plots", "{out}", "-q"], "pip install 'rlmerge[report]'"),
    ("transformers", ["fisher", "{agent}", "--data", "{data}", "-o", "{out}"], "pip install 'rlmerge[hf]'"),
])
def test_an_extra_that_is_missing_is_named_whole(example, tmp_path: Path, capsys, monkeypatch, missing: str,
                                                 argv: list[str], hint: str) -> None:
    """The real errors, with the extra not installed (its import fails)."""
    base, agents = example
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "hello"}\n')
    monkeypatch.setitem(sys.modules, missing, None)  # `import MISSING` now raises ImportError
    for name in [n for n in sys.modules if n.startswith(f"{missing}.")]:  # and so does a submodule imported earlier
        monkeypatch.delitem(sys.modules, name)
    for module in ("rlmerge.engine.distributed", "rlmerge.sweeping.distributed"):  # import Ray when imported
        monkeypatch.delitem(sys.modules, module, raising=False)
    if missing == "lm_eval":
        from rlmerge.lab import harness

        harness._task_manager.cache_clear()
        monkeypatch.setattr(harness, "_task_manager", harness._task_manager.__wrapped__)
    args = [a.format(base=base, agent=agents[0], out=tmp_path / "out", data=data) for a in argv]
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2, err
    assert hint in " ".join(err.split()) and "Traceback" not in err


def _centred(stdout: str, title: str) -> bool:
    """Whether the table titled ``title`` (the line above its top border) has its title centred over it."""
    lines = stdout.splitlines()
    line = next(a for a, b in zip(lines, lines[1:]) if b.startswith("┏") and title in a)
    return line.startswith(" ") and line.endswith(" ")


def test_paths_and_labels_with_brackets_print_whole(example, tmp_path: Path, capsys) -> None:
    """Folders named like `run[3]` are data, not markup: merge's table and result line, plan's and inspect's text."""
    import shutil

    base, agents = example
    agent = tmp_path / "agent[tool]"
    shutil.copytree(agents[1], agent)
    out = tmp_path / "merged[1]"
    code, stdout, err = run(capsys, "merge", base, agents[0], agent, "-o", out, "--method", "ram")
    assert code == 0, err
    # the result line keeps the path whole however long it is (soft wrap): a narrow terminal does not break it
    assert "agent[tool]" in stdout and f"wrote {out} (" in stdout
    assert _centred(stdout, "ram merge of 2 agents")  # tables are printed without the soft wrap
    code, stdout, err = run(capsys, "inspect", base, agents[0], agent)
    assert code == 0, err
    assert "agent[tool]" in stdout and _centred(stdout, "Task vectors per agent")
    # plan names the tokenizer's source (the agent's label, its path as given) as data too, whole on one line
    code, stdout, err = run(capsys, "plan", base, agents[0], agent, "--method", "ram", "--tokenizer-source", agent)
    assert code == 0, err
    assert f"tokenizer: {agent}; chat template: base" in stdout
