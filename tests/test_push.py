"""--push-to-hub (issue 25, part 2) against a fake Hub served on loopback.

The fake Hub implements exactly what huggingface_hub 2.4 calls for ``create_repo``, ``create_branch`` and
``create_commit`` (read from its source): ``GET /api/whoami-v2``, ``POST /api/repos/create``,
``POST /api/models/{repo}/branch/{b}``, ``POST /api/validate-yaml`` (the README's metadata, checked here with
huggingface_hub's own ``ModelCard`` parsing and repo-id validation), ``POST /api/models/{repo}/preupload/{rev}``
(``lfs`` for shards, ``regular`` for the rest), the LFS batch API and its ``PUT`` uploads (xet disabled, as on a
machine without hf_xet), and the NDJSON ``POST /api/models/{repo}/commit/{rev}``. It records every file a commit
holds, so the tests assert what was uploaded, byte for byte. The merge runs as a separate process with
``HF_ENDPOINT`` pointing there and ``HF_HUB_OFFLINE=0`` (this test's process keeps the suite's offline setting).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from huggingface_hub import ModelCard
from huggingface_hub.utils import validate_repo_id

import rlmerge
from rlmerge.errors import ConfigError, OutputError
from rlmerge.io.partial import not_ours

SRC = Path(__file__).resolve().parents[1] / "src"
TOKEN = "hf_fake_token_for_tests"


@dataclass
class Hub:
    """What the fake Hub was asked and holds."""

    url: str = ""
    fail_commit: bool = False
    calls: list[tuple[str, str]] = field(default_factory=list)
    repos: dict[str, dict[str, Any]] = field(default_factory=dict)  # repo → the create_repo payload
    branches: list[tuple[str, str]] = field(default_factory=list)
    lfs: dict[str, bytes] = field(default_factory=dict)  # oid → bytes PUT
    commits: list[dict[str, Any]] = field(default_factory=list)  # {"repo", "revision", "summary", "files"}
    cards: list[ModelCard] = field(default_factory=list)


def _handler(hub: Hub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:  # quiet
            pass

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                data = b""
                while True:
                    size = int(self.rfile.readline().strip().split(b";")[0], 16)
                    if size == 0:
                        self.rfile.readline()
                        return data
                    data += self.rfile.read(size)
                    self.rfile.readline()
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _send(self, status: int, doc: Any) -> None:
            raw = json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self) -> None:  # noqa: N802  http.server's name
            hub.calls.append(("GET", self.path))
            if self.path == "/api/whoami-v2" and self.headers.get("Authorization") == f"Bearer {TOKEN}":
                return self._send(200, {"type": "user", "name": "tester", "auth": {"type": "access_token"}})
            return self._send(401 if self.path == "/api/whoami-v2" else 404, {"error": "no"})

        def do_PUT(self) -> None:  # noqa: N802
            hub.calls.append(("PUT", self.path))
            data = self._body()
            oid = self.path.rsplit("/", 1)[-1]
            assert hashlib.sha256(data).hexdigest() == oid
            hub.lfs[oid] = data
            self._send(200, {})

        def do_POST(self) -> None:  # noqa: N802
            hub.calls.append(("POST", self.path))
            body = self._body()
            path = self.path.split("?")[0]
            parts = path.strip("/").split("/")
            if path == "/api/repos/create":
                doc = json.loads(body)
                hub.repos[f"{doc['organization']}/{doc['name']}"] = doc
                return self._send(200, {"url": f"{hub.url}/{doc['organization']}/{doc['name']}"})
            if path == "/api/validate-yaml":
                card = ModelCard(json.loads(body)["content"])  # raises on metadata huggingface_hub cannot read
                for repo in card.data.base_model or []:
                    validate_repo_id(repo)
                hub.cards.append(card)
                return self._send(200, {"errors": [], "warnings": []})
            if path.endswith("/info/lfs/objects/batch"):
                objects = json.loads(body)["objects"]
                return self._send(200, {"transfer": "basic", "objects": [
                    {"oid": o["oid"], "size": o["size"],
                     "actions": {"upload": {"href": f"{hub.url}/lfs-upload/{o['oid']}"}}} for o in objects]})
            if parts[:2] == ["api", "models"] and parts[4] == "branch":
                hub.branches.append(("/".join(parts[2:4]), parts[5]))
                return self._send(200, {})
            if parts[:2] == ["api", "models"] and parts[4] == "preupload":
                files = json.loads(body)["files"]
                return self._send(200, {"files": [
                    {"path": f["path"], "uploadMode": "lfs" if f["path"].endswith(".safetensors") else "regular",
                     "shouldIgnore": False} for f in files]})
            if parts[:2] == ["api", "models"] and parts[4] == "commit":
                if hub.fail_commit:
                    return self._send(500, {"error": "the fake Hub is down"})
                lines = [json.loads(x) for x in body.splitlines() if x.strip()]
                files = {}
                for line in lines[1:]:
                    v = line["value"]
                    files[v["path"]] = (base64.b64decode(v["content"]) if line["key"] == "file"
                                        else hub.lfs[v["oid"]])
                hub.commits.append({"repo": "/".join(parts[2:4]), "revision": parts[5],
                                    "summary": lines[0]["value"]["summary"], "files": files})
                return self._send(200, {"commitUrl": f"{hub.url}/{parts[2]}/{parts[3]}/commit/abc",
                                        "commitOid": "a" * 40})
            return self._send(404, {"error": f"not faked: {path}"})

    return Handler


@pytest.fixture
def hub() -> Iterator[Hub]:
    state = Hub()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()


def _cli(args: list[str], hub: Hub, home: Path) -> subprocess.CompletedProcess[str]:
    """``rlmerge ARGS`` in a process of its own, talking to the fake Hub."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0",
           "TRANSFORMERS_OFFLINE": "0", "HF_TOKEN": TOKEN, "HF_HUB_DISABLE_XET": "1", "HF_HOME": str(home),
           "RLMERGE_THREADS": "1", "NO_COLOR": "1", "COLUMNS": "200"}
    code = "import sys; from rlmerge.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=120)


def test_push_uploads_exactly_the_finished_output(example, tmp_path: Path, hub: Hub) -> None:
    base, agents = example
    out = tmp_path / "merged"
    proc = _cli(["merge", str(base), *map(str, agents), "-o", str(out), "--method", "ram", "--shard-size", "40KB",
                 "--push-to-hub", "org/merged", "--private", "--revision", "v1", "-q"], hub, tmp_path / "home")
    assert proc.returncode == 0, proc.stderr
    assert f"pushed to {hub.url}/org/merged/tree/v1" in proc.stdout
    assert hub.repos == {"org/merged": {"name": "merged", "organization": "org", "visibility": "private",
                                        "type": "model"}}
    assert hub.branches == [("org/merged", "v1")]
    (commit,) = hub.commits
    assert commit["repo"] == "org/merged" and commit["revision"] == "v1"
    local = {p.name: p.read_bytes() for p in out.iterdir()}
    assert commit["files"] == local  # every file, byte for byte, nothing else
    shards = sorted(n for n in local if n.endswith(".safetensors"))
    assert len(shards) > 1 and sorted(hub.lfs.values(), key=len) == sorted((local[n] for n in shards), key=len)
    assert hub.cards and hub.cards[0].data.tags == ["merge", "rlmerge", "ram"]
    # the token was checked first (huggingface_hub also fetches its agent-harness registry: not ours)
    asked = [c for c in hub.calls if c != ("GET", "/api/agent-harnesses")]
    assert asked[0] == ("GET", "/api/whoami-v2") and ("GET", "/api/whoami-v2") not in asked[1:]
    assert not_ours(out) is None


def test_a_failed_upload_leaves_the_output_intact_and_says_so(example, tmp_path: Path, hub: Hub) -> None:
    base, agents = example
    hub.fail_commit = True
    out = tmp_path / "merged"
    proc = _cli(["merge", str(base), *map(str, agents), "-o", str(out), "--push-to-hub", "org/merged", "-q"], hub,
                tmp_path / "home")
    assert proc.returncode == 4, proc.stderr
    err = " ".join(proc.stderr.split())
    assert "uploading to the Hub repository org/merged failed" in err and "500" in err
    assert f"the output is complete at {out}" in err and "hf upload org/merged" in err
    assert not_ours(out) is None and (out / "model.safetensors").is_file()  # the proof still holds every file
    assert not hub.commits


def test_no_push_without_network_or_token_and_nothing_read(example, tmp_path: Path, monkeypatch) -> None:
    """Offline (the suite's setting), or online without a token: refused before any weight is read (the readers
    fail if called) and before anything is written; a repository id the Hub refuses is a configuration error."""
    import huggingface_hub.constants as hc

    from rlmerge.io import checkpoint

    base, agents = example

    def no_reading(*_: object, **__: object) -> None:
        raise AssertionError("a weight was read")

    for name in ("read_f32", "read_into", "read_raw"):
        monkeypatch.setattr(checkpoint.Checkpoint, name, no_reading)
    with pytest.raises(OutputError, match="HF_HUB_OFFLINE is set") as info:
        rlmerge.merge(base, agents, tmp_path / "o", push_to_hub="org/merged")
    assert info.value.exit_code == 4
    # the repository is named as what it is, not as a file (it is not one)
    assert info.value.file is None and "the Hub repository 'org/merged'" in info.value.render()
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hc, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    with pytest.raises(OutputError, match="no Hugging Face token"):
        rlmerge.merge(base, agents, tmp_path / "o", push_to_hub="org/merged")
    with pytest.raises(ConfigError, match="not a Hub repository id") as info:
        rlmerge.merge(base, agents, tmp_path / "o", push_to_hub="org/merged@main")
    assert info.value.exit_code == 2
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.rlmerge-partial"))


def test_sweep_pushes_its_best_kept_candidate(example, tmp_path: Path, hub: Hub, monkeypatch) -> None:
    """In this process: huggingface_hub's endpoint, offline flag and xet switch set as HF_ENDPOINT, HF_HUB_OFFLINE=0
    and HF_HUB_DISABLE_XET=1 would have set them at import."""
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "ENDPOINT", hub.url)
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hc, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    base, agents = example
    with pytest.raises(ConfigError, match="give --keep 1"):
        rlmerge.sweep(base, agents, tmp_path / "s0", candidates=["ram"], push_to_hub="org/best")
    res = rlmerge.sweep(base, agents, tmp_path / "s", candidates=["task_arithmetic scaling=0.5,1"], keep=1,
                        push_to_hub="org/best")
    (commit,) = hub.commits
    best = res.kept[0]
    assert commit["files"] == {p.name: p.read_bytes() for p in best.iterdir()} and commit["revision"] == "main"
    assert res.url == f"{hub.url}/org/best/tree/main"
    with contextlib.suppress(FileNotFoundError):
        assert json.loads((best / "rlmerge.json").read_text())["method"] == "task_arithmetic"
