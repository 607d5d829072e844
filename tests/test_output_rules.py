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
import zlib
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


def _sweep(w: World, out: Path, force: bool) -> list[str]:
    return ["sweep", str(w.base), *map(str, w.agents), "-o", str(out), "-q", "--candidate",
            "task_arithmetic scaling=0.5,1", "--keep", "1", *(["--force"] if force else [])]


FOLDER_COMMANDS = {"merge": _merge, "fisher": _fisher, "plots": _plots, "sweep": _sweep}
MANIFESTS = {"sweep": "rlmerge-sweep.json"}  # the file that proves a folder rlmerge's; else rlmerge.json
# A sweep has no partial sibling: one planted there is neither used nor touched, and the sweep goes ahead.
EXPECT = {("sweep", "planted partial folder is a symlink to an input"): ("ok", "ok"),
          ("sweep", "planted partial folder holds someone's file"): ("ok", "ok")}


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
    manifest = w.root / "out" / MANIFESTS.get(cmd, "rlmerge.json")
    victim = next(p for p in sorted((w.root / "out").iterdir())
                  if p != manifest and p.is_file() and not p.name.startswith("."))
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
    ("a file stands where the output's folder would be", lambda w, c: w.root / "user" / "notes.txt" / "a" / "b",
     REFUSED, REFUSED),
    ("output is the current directory", _dot, REFUSED, REFUSED),
    ("output is an earlier output of the same command", _previous_output, REFUSED, OK),
    ("an earlier output holding a file the user added", _previous_output_with_a_user_file, REFUSED, REFUSED),
    ("an earlier output with a file the user changed", _previous_output_with_a_changed_file, REFUSED, REFUSED),
]


def _check(w: World, before: dict[str, tuple], code: int, expect: str, out: Path, err: str,
           manifest: str = "rlmerge.json") -> None:
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
    assert (out / manifest).is_file()


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
    plain, forced = EXPECT.get((cmd, case), (plain, forced))
    expect = forced if force else plain
    before = tree(world.root)
    with contextlib.nullcontext() if expect == OK else no_weight_reads():
        code = main(FOLDER_COMMANDS[cmd](world, out, force))
    _check(world, before, code, expect, out, capsys.readouterr().err, MANIFESTS.get(cmd, "rlmerge.json"))
    if cmd == "merge" and expect == REFUSED:  # plan reports exactly what merge refuses, and writes nothing either
        with no_weight_reads():
            code = main(_plan(world, out, force))
        assert code == 4, capsys.readouterr().err
        assert tree(world.root) == before


# -- manifests that lie: one rule (partial.listed_problem) for what a manifest may delete ------------------------
def _victim(w: World) -> tuple[Path, dict[str, int]]:
    """A user's file, and the record a manifest would give it (so that a size or checksum check cannot save it)."""
    victim = w.root / "user" / "notes.txt"
    data = victim.read_bytes()
    return victim, {"bytes": len(data), "crc32": zlib.crc32(data)}


def _list_in(manifest: Path, *names: str, rec: dict[str, int]) -> None:
    doc = json.loads(manifest.read_text())
    doc["files"].update({n: rec for n in names})
    manifest.write_text(json.dumps(doc))


def _sweep_lists_outside(w: World) -> tuple[list[str], Path]:
    out = w.root / "out"
    victim, rec = _victim(w)
    _list_in(out / "rlmerge-sweep.json", "cache/../../user/notes.txt", "../user/notes.txt", str(victim), rec=rec)
    return _sweep(w, out, True), out


def _sweep_lists_one_outside(name: str) -> Callable[[World], tuple[list[str], Path]]:
    def setup(w: World) -> tuple[list[str], Path]:
        out = w.root / "out"
        _list_in(out / "rlmerge-sweep.json", name.format(root=w.root), rec=_victim(w)[1])
        return _sweep(w, out, True), out
    return setup


def _sweep_cache_is_a_link(w: World) -> tuple[list[str], Path]:
    out = w.root / "out"
    shutil.rmtree(out / "cache")
    (out / "cache").symlink_to(w.root / "user", target_is_directory=True)
    _list_in(out / "rlmerge-sweep.json", "cache/notes.txt", rec=_victim(w)[1])
    return _sweep(w, out, True), out


def _kept_checkpoint_lists_outside(w: World) -> tuple[list[str], Path]:
    out = w.root / "out"
    _list_in(out / "best-1" / "rlmerge.json", "../../user/notes.txt", rec=_victim(w)[1])
    return _sweep(w, out, True), out


def _stale_checkpoint_lists_outside(w: World) -> tuple[list[str], Path]:
    """A --resume keeping fewer checkpoints than the earlier run removes the stale best-2."""
    out = w.root / "out"
    _list_in(out / "best-2" / "rlmerge.json", "../../user/notes.txt", rec=_victim(w)[1])
    return [*_sweep(w, out, False), "--resume"], out


def _candidate_folder_lists_outside(w: World) -> tuple[list[str], Path]:
    """A scored candidate's folder left behind, whose manifest lists a user's file; the sweep merges there."""
    out = w.root / "out"
    shutil.copytree(out / "best-1", out / "candidate-0123456789ab")
    _list_in(out / "candidate-0123456789ab" / "rlmerge.json", "../../user/notes.txt", rec=_victim(w)[1])
    return [*_sweep(w, out, False), "--resume"], out


def _kept_checkpoint_is_a_link(name: str) -> Callable[[World], tuple[list[str], Path]]:
    """best-1 (or a candidate folder) replaced by a link to an rlmerge output of the user's elsewhere: --force
    must not empty it."""
    def setup(w: World) -> tuple[list[str], Path]:
        out = w.root / "out"
        mine = w.root / "user" / "my-merge"
        assert main(_merge(w, mine, False)) == 0
        shutil.rmtree(out / "best-1")
        (out / name).symlink_to(mine, target_is_directory=True)
        return _sweep(w, out, True), out
    return setup


def _cache_entry_is_a_link(w: World) -> tuple[list[str], Path]:
    out = w.root / "out"
    entry = next((out / "cache").iterdir())
    entry.unlink()
    entry.symlink_to(w.root / "user" / "notes.txt")
    return _sweep(w, out, True), out


def _merge_output_lists_outside(w: World) -> tuple[list[str], Path]:
    out = w.root / "merged"
    assert main(_merge(w, out, False)) == 0
    _list_in(out / "rlmerge.json", "../user/notes.txt", rec=_victim(w)[1])
    return _merge(w, out, True), out


LIES: list[tuple[str, Callable[[World], tuple[list[str], Path]]]] = [
    ("sweep --force: its manifest lists files outside", _sweep_lists_outside),
    ("sweep --force: cache/../../FILE", _sweep_lists_one_outside("cache/../../user/notes.txt")),
    ("sweep --force: ../FILE", _sweep_lists_one_outside("../user/notes.txt")),
    ("sweep --force: an absolute path", _sweep_lists_one_outside("{root}/user/notes.txt")),
    ("sweep --force: a name in another sub-folder", _sweep_lists_one_outside("best-1/../../user/notes.txt")),
    ("sweep --force: cache is a link out", _sweep_cache_is_a_link),
    ("sweep --force: a kept checkpoint's manifest", _kept_checkpoint_lists_outside),
    ("sweep --resume: a stale best-N's manifest", _stale_checkpoint_lists_outside),
    ("sweep --resume: a candidate folder's manifest", _candidate_folder_lists_outside),
    ("merge --force: its manifest lists a file outside", _merge_output_lists_outside),
    # beyond the list
    ("sweep --force: a NUL in a listed name", _sweep_lists_one_outside("cache/a\u0000b")),
    ("sweep --force: best-1 is a link to the user's merge", _kept_checkpoint_is_a_link("best-1")),
    ("sweep --force: a candidate folder is a link to the user's merge",
     _kept_checkpoint_is_a_link("candidate-0123456789ab")),
    ("sweep --force: a cache entry is a link to the user's file", _cache_entry_is_a_link),
]


@pytest.mark.parametrize(("case", "setup"), LIES, ids=[c[0] for c in LIES])
def test_a_manifest_naming_anything_outside_its_folder_deletes_nothing(world: World, case: str, setup,
                                                                        monkeypatch, capsys) -> None:
    """`sweep --force` used to delete every name its manifests listed: `cache/../../victim.txt` deleted a user's
    file outside the sweep folder, exit 0. A name that is not a file of the folder itself (absolute, with `..`, in
    another sub-folder, through a link) makes the whole folder foreign: refused (exit 4), nothing deleted."""
    monkeypatch.chdir(world.root)
    assert main([*_sweep(world, world.root / "out", False)[:-2], "--keep", "2"]) == 0  # best-1 and best-2
    capsys.readouterr()
    args, out = setup(world)
    before = tree(world.root)
    with no_weight_reads():  # refused before any weight is read
        code = main(args)
    err = capsys.readouterr().err
    assert code == 4, err
    assert tree(world.root) == before
    assert (world.root / "user" / "notes.txt").read_text() == "a user's own file\n"
    assert "Traceback" not in err and str(out.name) in err


@pytest.mark.parametrize("cmd", [_plan, _merge])
def test_an_output_under_a_file_names_that_file(world: World, cmd, capsys) -> None:
    # merge used to fail creating the partial folder ("cannot write: File exists", naming a path that does not
    # exist, no hint), and plan said ok
    notes = world.root / "user" / "notes.txt"
    before = tree(world.root)
    with no_weight_reads():
        code = main(cmd(world, notes / "sub", False))
    err = capsys.readouterr().err
    assert code == 4, err
    assert "a file stands where the output's folder would be" in err and f"(file {notes})" in err, err
    assert "move that file away" in err and "rlmerge-partial" not in err, err
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
    ("inside a file", lambda w: w.root / "user" / "notes.txt" / "report.json", REFUSED, REFUSED),
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


@pytest.mark.parametrize("force", [False, True], ids=["plain", "force"])
@pytest.mark.parametrize("save", ["figs/report.json", "figs", "figs/sub/report.json", ".figs.rlmerge-partial/r.json"])
def test_inspect_save_inside_plots_is_refused_first(world: World, save: str, force: bool, monkeypatch,
                                                     capsys) -> None:
    """--save at or under the --plots folder: refused before any weight is read, nothing written; one beside it
    works. (It used to write the report, then fail on the plots folder and leave the report there.)"""
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(world.root)
    def args(report: str) -> list[str]:
        return ["inspect", str(world.base), *map(str, world.agents), "-q", "--plots", "figs", "--save", report,
                *(["--force"] if force else [])]

    before = tree(world.root)
    with no_weight_reads():
        code = main(args(save))
    err = capsys.readouterr().err
    assert code == 4, err
    assert "--plots" in err and "put the report outside the plots folder" in err, err
    assert tree(world.root) == before
    assert main(args("report.json")) == 0
    assert (world.root / "report.json").is_file() and (world.root / "figs" / "rlmerge.json").is_file()


def test_plots_refusal_names_plots(world: World, monkeypatch, capsys) -> None:
    """A refused --plots folder's hint names --plots, not merge's -o."""
    monkeypatch.chdir(world.root)
    with no_weight_reads():
        code = main(_plots(world, world.root / "user", False))
    err = capsys.readouterr().err
    assert code == 4 and "choose another --plots" in err and "another -o" not in err, err


@pytest.mark.parametrize("what", ["plots", "save"])
def test_a_full_disk_mid_run_names_the_option_that_named_the_output(world: World, what: str, monkeypatch,
                                                                     capsys) -> None:
    """The disk fills while inspect writes its --plots figures or its --save report: the hint names that option
    (it said merge's "-o"), and nothing is left that looks complete."""
    import errno

    from rlmerge.io import partial

    if what == "plots":
        pytest.importorskip("matplotlib")

    def full(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(partial.PartialDir, "create", full)  # the figures' files
    monkeypatch.setattr(partial, "_new_temp_file", full)  # the report's temporary file
    out = world.root / "user" / ("figs" if what == "plots" else "report.json")
    code = main((_plots if what == "plots" else _save)(world, out, False))
    err = capsys.readouterr().err
    assert code == 4 and "the disk is full" in err and f"write elsewhere (--{what})" in err, err
    assert "-o)" not in err and not out.exists()


def test_a_lock_taken_mid_run_names_the_option(tmp_path: Path) -> None:
    """Another process locks a folder between the check and the claim: the hint names the folder's option."""
    import fcntl

    from rlmerge.errors import OutputError
    from rlmerge.io.partial import take_lock

    lock = tmp_path / "lock"
    held = os.open(lock, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(OutputError) as e:
            take_lock(lock, "another rlmerge run is writing this output right now", tmp_path / "figs", "--plots")
        assert e.value.hint == "wait for it to finish, or choose another --plots"
    finally:
        os.close(held)


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_a_merged_folder_s_files_get_the_mode_open_gives(world: World, umask: int) -> None:
    """Every file of a merge (shards, index, config, tokenizer, card, manifest) gets the mode a plain open() gives
    under the umask: the shards were created 0o644 less the umask, so under umask 002 (a group's shared folder)
    they alone were not group-writable."""
    import rlmerge

    old = os.umask(umask)
    try:
        with open(world.root / "plain", "wb"):
            pass
        res = rlmerge.merge(world.base, world.agents, world.root / "out", method="ram", shard_size=20_000,
                           fsync=False)
    finally:
        os.umask(old)
    want = (world.root / "plain").stat().st_mode & 0o777
    assert want == 0o666 & ~umask
    files = sorted(p for p in res.output.iterdir())
    assert len([p for p in files if p.suffix == ".safetensors"]) > 1  # sharded: the index is written too
    assert {p.name: p.stat().st_mode & 0o777 for p in files} == {p.name: want for p in files}


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
@pytest.mark.parametrize("force", [False, True], ids=["new", "replaced"])
def test_saved_report_mode_follows_umask(tmp_path: Path, umask: int, force: bool) -> None:
    """write_file's report gets the mode a plain open() gives under the same umask (mkstemp made it 0600)."""
    from rlmerge.io.partial import write_file

    data = json.dumps({"schema": "rlmerge.report"}).encode()
    old = os.umask(umask)
    try:
        with open(tmp_path / "plain.json", "wb") as fh:
            fh.write(data)
        if force:
            write_file(tmp_path / "report.json", data)
        write_file(tmp_path / "report.json", data, force=force)
    finally:
        os.umask(old)
    mode = (tmp_path / "report.json").stat().st_mode & 0o777
    assert mode == (tmp_path / "plain.json").stat().st_mode & 0o777 == 0o666 & ~umask
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain.json", "report.json"]  # no temporary file left


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
    err = capsys.readouterr().err
    assert "my-notes.txt" in err and "--workdir" in err and "-o;" not in err, err  # the demo has no -o
    assert tree(tmp_path) == before
    mine.unlink()  # the merge's folder holding a user's file: refused the same way, naming --workdir
    (work / "merged-ram+" / "my-notes.txt").write_text("the user's\n")
    before = tree(tmp_path)
    assert main(["demo", "--workdir", str(work)]) == 4
    err = capsys.readouterr().err
    assert "my-notes.txt" in err and "--workdir" in err and "-o;" not in err, err
    assert tree(tmp_path) == before
