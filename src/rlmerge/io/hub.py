"""Publishing a finished output on the Hugging Face Hub (``--push-to-hub REPO``): checked first, pushed last.

``push_problems`` runs before any weight is read: a repository id the Hub would refuse is a ``ConfigError`` (exit
2); offline mode (``HF_HUB_OFFLINE``), no token, a token the Hub refuses or a Hub that cannot be reached is an
``OutputError`` (exit 4: the output cannot be written where it was asked to go). ``push`` runs after the output
folder is published and only on a folder whose ``rlmerge.json`` proves every file in it (io/partial.not_ours, with
checksums): it creates the repository (or uses it), the branch for ``revision``, and uploads exactly the files
``rlmerge.json`` lists, and itself, in one commit; a failed upload leaves the local folder as it was and says how to
push it again. huggingface_hub is imported when used: it reads its HF_* variables once, at import.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError, OutputError, RLMergeError
from .partial import MANIFEST, not_ours, read_manifest


def _again(folder: Path, repo: str, revision: str | None) -> str:
    return (f"the output is complete at {folder}; push it again with `hf upload {repo} {folder} . "
            + (f"--revision {revision} " if revision else "") + "` once the Hub is reachable")


def push_problems(repo: str, *, revision: str | None = None) -> list[RLMergeError]:
    """Every reason ``push`` to ``repo`` would fail that can be known before merging (the module docstring)."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.utils import HFValidationError, get_token, validate_repo_id

    try:
        validate_repo_id(repo)
    except HFValidationError as e:
        return [ConfigError(f"--push-to-hub {repo!r} is not a Hub repository id: {e}",
                            hint="give ORG/NAME (or NAME, in your own namespace)")]
    if revision is not None and (not revision.strip() or revision != revision.strip()):
        return [ConfigError(f"--revision {revision!r} is not a branch name", hint="e.g. --revision main")]
    if constants.is_offline_mode():
        return [OutputError(f"cannot push to the Hub repository {repo!r}: HF_HUB_OFFLINE is set",
                            hint="unset HF_HUB_OFFLINE (or drop --push-to-hub and upload the folder later)")]
    token = get_token()
    if token is None:
        return [OutputError(f"cannot push to the Hub repository {repo!r}: no Hugging Face token",
                            hint="run `hf auth login`, or set HF_TOKEN to a token with write access")]
    try:
        HfApi().whoami(token=token)
    except Exception as e:  # an HTTP error (a refused token) or a network error: either way, no push
        return [OutputError(f"cannot push to the Hub repository {repo!r} at {constants.ENDPOINT}: {_short(e)}",
                            hint="check HF_TOKEN (`hf auth whoami`) and the network, then rerun")]
    return []


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def push(folder: Path, repo: str, *, private: bool = False, revision: str | None = None,
         message: str = "Upload a merge made with rlmerge") -> str:
    """Upload ``folder`` (a finished rlmerge output) to ``repo``; returns the URL of the commit's tree."""
    from huggingface_hub import CommitOperationAdd, HfApi

    why = not_ours(folder, checksums=True)
    doc = read_manifest(folder)
    if why is not None or doc is None:
        raise OutputError(f"not pushed: the folder {why or 'has no rlmerge.json'}", file=str(folder),
                          hint="push only an output rlmerge wrote and nobody changed since")
    names = [*sorted(doc["files"]), MANIFEST]
    api = HfApi()
    try:
        url = api.create_repo(repo, private=private, exist_ok=True, repo_type="model")
        if revision is not None:
            api.create_branch(repo, branch=revision, exist_ok=True)
        ops = [CommitOperationAdd(path_in_repo=n, path_or_fileobj=str(folder / n)) for n in names]
        api.create_commit(repo, operations=ops, commit_message=message, revision=revision)
    except Exception as e:  # HTTP errors, network errors, a README the Hub's validation refuses: all the same here
        raise OutputError(f"uploading to the Hub repository {repo} failed: {_short(e)}", file=str(folder),
                          hint=_again(folder, repo, revision)) from e
    return f"{str(url).rstrip('/')}/tree/{revision or 'main'}"
