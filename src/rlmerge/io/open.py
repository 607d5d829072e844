"""Opening inputs: a local folder or a hub id, then the reader for the folder's layout (io/layouts.py).

Only headers are read here; weights are read later, block by block, by the reader returned.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import InputError, RLMergeError, raise_all
from .checkpoint import Checkpoint
from .layouts import detect
from .lora import LoraAdapter
from .verl import VerlCheckpoint

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")


def resolve(spec: str | os.PathLike[str]) -> tuple[Path, str | None]:
    """A local folder, or a hub id ``org/name[@revision]`` fetched (or found offline) with huggingface_hub."""
    text = str(spec)
    p = Path(text).expanduser()
    if p.exists():
        if not p.is_dir():
            raise InputError("expected a model folder, got a file", file=text,
                             hint="pass the folder that holds config.json and the weights")
        return p, None
    if not HUB_ID.match(text) or text.startswith((".", "/", "~")):
        raise InputError("no such folder", file=text, hint="check the path")
    parent = p.parent
    if parent.is_dir():  # ``ck/agent9`` where ck/ exists: a local path with a typo, not a hub id
        raise InputError(f"no such folder (read as a local path, not a hub id, because the folder {parent}/ "
                         "exists here)", file=text,
                         hint=f"check the path; to fetch the hub model {text!r}, run from a folder that has no "
                              f"{parent}/ in it")
    repo, _, rev = text.partition("@")
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import HF_HUB_OFFLINE

    patterns = ["*.safetensors", "*.json", "*.bin", "*.txt", "*.model", "*.jinja"]
    try:
        local = snapshot_download(repo, revision=rev or None, allow_patterns=patterns,
                                  local_files_only=bool(HF_HUB_OFFLINE))
    except Exception as e:  # hub errors: offline, not found, gated, network — all need the user
        how = ("HF_HUB_OFFLINE is set and it is not in the local cache" if HF_HUB_OFFLINE
               else f"{type(e).__name__}: {e}")
        raise InputError(f"cannot fetch hub model {repo!r}{'@' + rev if rev else ''}: {how}", file=text,
                         hint="download it first (hf download) or pass a local folder") from e
    return Path(local), rev or None


def open_one(spec: str | os.PathLike[str]) -> Checkpoint:
    """Resolve (a folder or a hub id) and open one model, headers only."""
    path, rev = resolve(spec)
    ckpt = open_checkpoint(path, label=str(spec), revision=rev)
    ckpt.hub_id = hub_id(spec, path)
    return ckpt


def hub_id(spec: str | os.PathLike[str], path: Path) -> str | None:
    """The Hub repository a model came from: the hub id it was given as (without its revision), or the one a Hugging
    Face cache snapshot folder (``models--ORG--NAME/snapshots/REV``) belongs to; None for any other local folder."""
    text = str(spec)
    if not Path(text).expanduser().exists():
        return text.partition("@")[0]
    real = path.resolve()
    repo = real.parent.parent.name if real.parent.name == "snapshots" else ""
    parts = repo.split("--")
    if parts[0] == "models" and len(parts) == 3 and all(parts[1:]):
        return f"{parts[1]}/{parts[2]}"
    return None


def checked_model_folder(spec: str | os.PathLike[str], *, what: str) -> Path:
    """The folder of a Hugging Face model that another library (transformers) is about to load, after rlmerge's own
    readers opened it (headers only) and closed it: the rules a merge's inputs are held to hold here too (every
    file read lies inside the folder, no pickle runs code, headers that lie are refused). ``what`` says who needs
    it, for the refusal of a layout transformers cannot load (verl shards, a LoRA adapter)."""
    ckpt = open_one(spec)
    try:
        if ckpt.format not in ("safetensors", "bin"):
            raise InputError(f"{what} loads a Hugging Face model folder, and this is a {ckpt.format} checkpoint",
                             file=str(ckpt.path), hint="merge or convert it into a model folder first (rlmerge "
                                                       "merge BASE IT -o FOLDER --method task_arithmetic)")
        return ckpt.path
    finally:
        ckpt.close()


def open_checkpoint(path: Path, *, label: str | None = None, revision: str | None = None) -> Checkpoint:
    """The reader for whatever ``path`` holds: a Hugging Face folder, verl FSDP shards, a PEFT LoRA adapter
    (io/layouts.py says how each is recognised, and refuses the layouts rlmerge cannot read)."""
    kind, folder = detect(path)
    if kind == "verl":
        return VerlCheckpoint(folder, label=label, revision=revision)
    if kind == "lora":
        return LoraAdapter(folder, label=label, revision=revision)
    return Checkpoint(folder, label=label, revision=revision)


def open_all(specs: list[str | os.PathLike[str]]) -> list[Checkpoint]:
    """Resolve and open every model, collecting all problems before failing."""
    out: list[Checkpoint] = []
    problems: list[RLMergeError] = []
    for s in specs:
        try:
            out.append(open_one(s))
        except RLMergeError as e:
            problems.append(e)
    raise_all(problems)
    return out
