"""Where a command may write: one table of output locations, walked for every command that writes.

Each case builds a small tree (input models, a user's own files, planted links and folders), runs one command
with and without ``--force``, and checks the whole tree before and after: a refused command changes nothing (no
file, no folder, no link, not a byte, not an mtime) and is refused before a single weight is read; an accepted
one changes only its own output. ``plan`` must refuse exactly what ``merge`` refuses.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from conftest import TINY
from rlmerge.cli import main
from rlmerge.io import mapping
from rlmerge.io.checkpoint import Checkpoint
from rlmerge.synthetic import make_example

REFUSED, OK = "refused", "ok"


def tree(root: Path) -> dict[str, tuple]:
    """Every entry under ``root`` (links not followed): kind, content hash or link target, mtime."""
    out: dict[str, tuple] = {}
    for dirpath, dirs, files in os.walk(root, followlinks=False):
        for name in dirs + files:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            st = p.lstat()
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir",)
            else:
                out[rel] = ("file", hashlib.sha256(p.read_bytes()).hexdigest(), st.st_mtime_ns)
    return out


@dataclass
class World:
    root: Path
    base: Path
    agents: list[Path]
    data: Path  # the Fisher command's examples

    @property
    def input(self) -> Path:
        return self.agents[0]  # "an input": the first agent (the Fisher command's model)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    src = tmp_path_factory.mktemp("models")
    base, agents = make_example(src, shape=TINY, dtype=torch.float32, densities=(0.1, 0.4))
    return base, agents


@pytest.fixture
def world(tmp_path: Path, models: tuple[Path, list[Path]]) -> World:
    root = tmp_path / "root"
    shutil.copytree(models[0].parent, root / "models")
    (root / "user").mkdir()
    (root / "user" / "notes.txt").write_text("a user's own file\n")
    data = root / "user" / "data.jsonl"
    data.write_text(json.dumps({"text": "hello world"}) + "\n")
    base = root / "models" / models[0].name
    return World(root, base, [root / "models" / a.name for a in models[1]], data)


@contextlib.contextmanager
def no_weight_reads() -> Iterator[None]:
    """Every weight read fails inside: a refusal must come before the first one."""
    with pytest.MonkeyPatch.context() as mp:
        for name in ("read_f32", "read_raw", "read_into"):
            mp.setattr(Checkpoint, name, _refuse)
        mp.setattr(mapping.Mapped, "view", _refuse)
        yield


def _refuse(*a: object, **k: object) -> None:
    raise AssertionError("a weight was read before the output was checked")


# -- commands ---------------------------------------------------------------------------------------------
def _merge(w: World, out: Path, force: bool) -> list[str]:
    return ["merge", str(w.base), *map(str, w.agents), "-o", str(out), "-q", "--method", "ram",
            *(["--force"] if force else [])]


def _plan(w: World, out: Path, force: bool) -> list[str]:
    return ["plan", str(w.base), *map(str, w.agents), "-o", str(out), "--method", "ram",
            *(["--force"] if force else [])]


def _fisher(w: World, out: Path, force: bool) -> list[str]:
    return ["fisher", str(w.input), "--data", str(w.data), "-o", str(out), "--examples", "1",
            *(["--force"] if force else [])]


def _plots(w: World, out: Path, force: bool) -> list[str]:
    return ["inspect", str(w.base), *map(str, w.agents), "--plots", str(out), "-q", *(["--force"] if force else [])]


def _save(w: World, out: Path, force: bool) -> list[str]:
    return ["inspect", str(w.base), *map(str, w.agents), "--save", str(out), "-q", *(["--force"] if force else [])]


FOLDER_COMMANDS = {"merge": _merge, "fisher": _fisher, "plots": _plots}


def _write_previous(cmd: str, w: World, out: Path) -> None:
    """A folder the same command wrote earlier (what --force may replace)."""
    assert main(FOLDER_COMMANDS[cmd](w, out, False)) == 0


# -- folder outputs: (name, setup(world, command) -> output, expected without --force, with --force) -------------
def _inside_input(w: World, cmd: str) -> Path:
    return w.input / "F"


def _parent_of_inputs(w: World, cmd: str) -> Path:
    return w.root / "models"


def _symlink_to_input(w: World, cmd: str) -> Path:
    (w.root / "link").symlink_to(w.input, target_is_directory=True)
    return w.root / "link"


def _dangling_symlink(w: World, cmd: str) -> Path:
    (w.root / "dangling").symlink_to(w.root / "nowhere", target_is_directory=True)
    return w.root / "dangling"


def _planted_partial_symlink(w: World, cmd: str) -> Path:
    (w.root / ".out.rlmerge-partial").symlink_to(w.input, target_is_directory=True)
    return w.root / "out"


def _planted_partial_folder(w: World, cmd: str) -> Path:
    (w.root / ".out.rlmerge-partial").mkdir()
    (w.root / ".out.rlmerge-partial" / "keep.txt").write_text("not rlmerge's\n")
    return w.root / "out"


def _planted_old_file(w: World, cmd: str) -> Path:
    _write_previous(cmd, w, w.root / "out")
    (w.root / ".out.rlmerge-old").write_text("a leftover file\n")
    return w.root / "out"


def _planted_old_is_an_input(w: World, cmd: str) -> Path:
    _write_previous(cmd, w, w.root / "out")
    old = w.root / ".out.rlmerge-old"
    shutil.copytree(w.input, old)
    w.agents[0] = old  # the folder --force used to delete is now one of the inputs
    return w.root / "out"


def _foreign_folder(w: World, cmd: str) -> Path:
    return w.root / "user"


def _existing_file(w: World, cmd: str) -> Path:
    return w.root / "user" / "notes.txt"


def _previous_output(w: World, cmd: str) -> Path:
    _write_previous(cmd, w, w.root / "out")
    return w.root / "out"


def _previous_output_with_a_user_file(w: World, cmd: str) -> Path:
    _write_previous(cmd, w, w.root / "out")
    (w.root / "out" / "my-notes.txt").write_text("added by the user after the merge\n")
    return w.root / "out"


def _previous_output_with_a_changed_file(w: World, cmd: str) -> Path:
    _write_previous(cmd, w, w.root / "out")
    manifest = w.root / "out" / "rlmerge.json"
    victim = next(p for p in sorted((w.root / "out").iterdir()) if p != manifest)
    victim.write_bytes(victim.read_bytes() + b"edited by the user")
    return w.root / "out"


def _dot(w: World, cmd: str) -> Path:
    os.chdir(w.root / "user")
    return Path(".")


FOLDER_CASES: list[tuple[str, Callable[[World, str], Path], str, str]] = [
    ("output is an input", lambda w, c: w.input, REFUSED, REFUSED),
    ("output inside an input", _inside_input, REFUSED, REFUSED),
    ("output is the parent of the inputs", _parent_of_inputs, REFUSED, REFUSED),
    ("output is a symlink to an input", _symlink_to_input, REFUSED, REFUSED),
    ("output is a dangling symlink", _dangling_symlink, REFUSED, REFUSED),
    ("planted partial folder is a symlink to an input", _planted_partial_symlink, REFUSED, REFUSED),
    ("planted partial folder holds someone's file", _planted_partial_folder, REFUSED, REFUSED),
    ("a leftover -old sibling is a file", _planted_old_file, REFUSED, OK),
    ("the -old sibling is one of the inputs", _planted_old_is_an_input, REFUSED, OK),
    ("output is a folder rlmerge did not write", _foreign_folder, REFUSED, REFUSED),
    ("output is an existing file", _existing_file, REFUSED, REFUSED),
    ("output is the current directory", _dot, REFUSED, REFUSED),
    ("output is an earlier output of the same command", _previous_output, REFUSED, OK),
    ("an earlier output holding a file the user added", _previous_output_with_a_user_file, REFUSED, REFUSED),
    ("an earlier output with a file the user changed", _previous_output_with_a_changed_file, REFUSED, REFUSED),
]


def _check(w: World, before: dict[str, tuple], code: int, expect: str, out: Path, err: str) -> None:
    after = tree(w.root)
    if expect == REFUSED:
        assert code == 4, err
        assert after == before, "a refused command changed the tree"
        return
    assert code == 0, err
    out = out if out.is_absolute() else Path.cwd() / out
    rel = os.path.relpath(out, w.root)
    mine = {k for k in set(before) | set(after) if k == rel or k.startswith(rel + os.sep)}
    assert {k: v for k, v in after.items() if k not in mine} == {k: v for k, v in before.items() if k not in mine}
    assert (out / "rlmerge.json").is_file()


@pytest.mark.parametrize("force", [False, True], ids=["plain", "force"])
@pytest.mark.parametrize(("case", "setup", "plain", "forced"), FOLDER_CASES, ids=[c[0] for c in FOLDER_CASES])
@pytest.mark.parametrize("cmd", sorted(FOLDER_COMMANDS))
def test_folder_outputs(world: World, cmd: str, case: str, setup, plain: str, forced: str, force: bool,
                        monkeypatch, capsys) -> None:
    if cmd == "fisher":
        pytest.importorskip("transformers")
    if cmd == "plots":
        pytest.importorskip("matplotlib")
    monkeypatch.chdir(world.root)
    out = setup(world, cmd)  # the setup may run the command for real
    expect = forced if force else plain
    before = tree(world.root)
    with contextlib.nullcontext() if expect == OK else no_weight_reads():
        code = main(FOLDER_COMMANDS[cmd](world, out, force))
    _check(world, before, code, expect, out, capsys.readouterr().err)
    if cmd == "merge" and expect == REFUSED:  # plan reports exactly what merge refuses, and writes nothing either
        with no_weight_reads():
            code = main(_plan(world, out, force))
        assert code == 4, capsys.readouterr().err
        assert tree(world.root) == before


# -- a single output file: inspect --save -------------------------------------------------------------------
def _onto_input_weights(w: World) -> Path:
    return w.base / "model.safetensors"


def _new_file_inside_input(w: World) -> Path:
    return w.base / "report.json"


def _file_symlink_to_input(w: World) -> Path:
    (w.root / "link.json").symlink_to(w.base / "model.safetensors")
    return w.root / "link.json"


def _file_dangling_symlink(w: World) -> Path:
    (w.root / "dangling.json").symlink_to(w.root / "nowhere.json")
    return w.root / "dangling.json"


def _previous_report(w: World) -> Path:
    assert main(_save(w, w.root / "user" / "report.json", False)) == 0
    return w.root / "user" / "report.json"


FILE_CASES: list[tuple[str, Callable[[World], Path], str, str]] = [
    ("onto an input's weights", _onto_input_weights, REFUSED, REFUSED),
    ("a new file inside an input", _new_file_inside_input, REFUSED, REFUSED),
    ("a symlink to an input's weights", _file_symlink_to_input, REFUSED, REFUSED),
    ("a dangling symlink", _file_dangling_symlink, REFUSED, REFUSED),
    ("a file rlmerge did not write", lambda w: w.root / "user" / "notes.txt", REFUSED, REFUSED),
    ("an existing folder", lambda w: w.root / "user", REFUSED, REFUSED),
    ("an earlier report", _previous_report, REFUSED, OK),
    ("a new file in the user's folder", lambda w: w.root / "user" / "new.json", OK, OK),
]


@pytest.mark.parametrize("force", [False, True], ids=["plain", "force"])
@pytest.mark.parametrize(("case", "setup", "plain", "forced"), FILE_CASES, ids=[c[0] for c in FILE_CASES])
def test_inspect_save(world: World, case: str, setup, plain: str, forced: str, force: bool, monkeypatch,
                      capsys) -> None:
    monkeypatch.chdir(world.root)
    out = setup(world)
    expect = forced if force else plain
    before = tree(world.root)
    with contextlib.nullcontext() if expect == OK else no_weight_reads():
        code = main(_save(world, out, force))
    err = capsys.readouterr().err
    after = tree(world.root)
    if expect == REFUSED:
        assert code == 4, err
        assert after == before
        return
    assert code == 0, err
    rel = str(out.relative_to(world.root))
    assert {k: v for k, v in after.items() if k != rel} == {k: v for k, v in before.items() if k != rel}
    assert json.loads(out.read_text())["schema"]


def test_demo_replaces_only_its_own_example_and_merge(tmp_path: Path, capsys) -> None:
    """`rlmerge demo` twice works (it replaces what it wrote); into a folder holding a user's model, refused."""
    work = tmp_path / "work"
    assert main(["demo", "--workdir", str(work)]) == 0
    first = tree(work)
    assert main(["demo", "--workdir", str(work)]) == 0
    assert {k: v[:2] for k, v in tree(work).items()} == {k: v[:2] for k, v in first.items()}  # same bytes again
    mine = work / "inputs" / "coder" / "my-notes.txt"
    mine.write_text("the user's\n")
    before = tree(tmp_path)
    assert main(["demo", "--workdir", str(work)]) == 4
    assert "my-notes.txt" in capsys.readouterr().err
    assert tree(tmp_path) == before
