"""A sweep's ``results.json``: the document it writes as it goes (its fingerprint says which sweep it is), and what
``--resume`` reads back of an earlier run's (finished candidates, confirmed scores), after checking it is this
sweep's. sweep.py writes it; report/sweep.py renders it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from .._version import __version__
from ..engine.preflight import Preflight
from ..errors import OutputError, RLMergeError
from ..io.sweepdir import SweepDir
from ..stream.blocks import device_type
from .build import Reference, Scored
from .cache import inputs_key
from .candidates import Candidate
from .scores import details_from_json, make

RESULTS = "results.json"
SCHEMA = "rlmerge.sweep"


def new_doc(pf: Preflight, cands: list[Candidate], settings: Mapping[str, Any] | None,
            options: dict[str, Any], search: dict[str, Any] | None = None) -> dict[str, Any]:
    """The document of a new run: its fingerprint (inputs, scoring settings, dtype, device, and a search's sampler,
    seed and spaces) and a grid's planned candidates."""
    assert pf.match is not None and pf.base is not None
    fixed = {"inputs": inputs_key(pf.match), "settings": dict(settings or {}),
             "dtype": str(pf.out_dtype) if pf.out_dtype else None, "device": device_type(options["device"]),
             **({"search": search} if search is not None else {})}  # a grid's fingerprint is what it always was
    return {"schema": SCHEMA, "version": 1, "rlmerge_version": __version__,
            "fingerprint": json.dumps(fixed, sort_keys=True, default=str),
            "base": pf.base.label, "agents": [a.label for a in pf.match.agents],
            "settings": dict(settings or {}), "planned": [c.to_json() for c in cands], "candidates": [],
            "examples": {}}  # per-example samples' ids, shared by the candidates scored on them (scores.py)


def dump(doc: dict[str, Any]) -> bytes:
    return (json.dumps(doc, indent=2, default=str) + "\n").encode()


def resumed(folder: SweepDir, old: Any, doc: dict[str, Any], lookup: Callable[[dict[str, Any]], Candidate | None],
            *, keep_failed: bool = False) -> dict[str, Scored]:
    """The candidates an earlier run of this sweep finished (``old``: its results.json, ``old_doc``), after checking
    it is this sweep. ``lookup`` finds a record's candidate (None: not this sweep's); a candidate the scorer failed
    on is scored again, unless ``keep_failed`` (a search: its failed trial was told, and stays failed)."""
    if old is None:
        return {}
    if not isinstance(old, dict) or old.get("schema") != SCHEMA or old.get("fingerprint") != doc["fingerprint"]:
        raise OutputError("the sweep in this folder was run on other inputs or with other scoring settings",
                          file=str(folder.path / RESULTS),
                          hint="resume with the same models, tasks and options, or pass --force to start over")
    examples = old.get("examples") or {}
    out = {}
    records = old.get("candidates")
    for rec in records if isinstance(records, list) else []:
        c = lookup(rec) if isinstance(rec, dict) else None
        if c is None or (rec.get("error") is not None and not keep_failed):
            continue
        try:
            out[c.id] = _scored(rec, c, examples)
        except (AttributeError, KeyError, TypeError, ValueError, RLMergeError):
            continue  # a record this rlmerge cannot read back (an older one's, or edited): the candidate is redone
    return out


def _scored(rec: dict[str, Any], c: Candidate | Reference, examples: Mapping[str, list[str]]) -> Scored:
    """A results.json record (a candidate's or a reference's) read back; raises on one it cannot read."""
    details = {k: make(v, task=k, where=RESULTS)
               for k, v in details_from_json(dict(rec["scores"]), rec.get("details"), examples).items()}
    return Scored(c, {k: v.score for k, v in details.items()}, str(rec["where"]), float(rec["merge_seconds"]),
                  float(rec["score_seconds"]), [str(p) for p in rec["passes"]], int(rec["read_bytes"]),
                  rec.get("lambdas"), details, None if rec.get("error") is None else str(rec["error"]))


def read_references(old: Any, doc: dict[str, Any], refs: list[Reference],
                    confirm: dict[str, Any] | None = None) -> tuple[dict[str, Scored], dict[str, Scored]]:
    """The references (inputs scored as they are) an earlier run of this sweep recorded (``old``: its results.json,
    ``references``), by id: only those of the same input at the same place, a failed one is scored again; and
    their held-out scores, when ``confirm`` (the confirming scorer's settings) is what that run confirmed with."""
    if not isinstance(old, dict) or old.get("fingerprint") != doc["fingerprint"]:
        return {}, {}
    same_confirm = confirm is not None and (old.get("confirm") or {}).get("settings") == confirm
    mine = {r.id: r for r in refs}
    out: tuple[dict[str, Scored], dict[str, Scored]] = {}, {}
    for rec in old.get("references") or []:
        try:
            ref = mine.get(rec["id"])
            if ref is None or ref.to_json() != {k: rec[k] for k in ref.to_json()}:
                continue
            for i, r in enumerate([rec, rec.get("confirmed") if same_confirm else None]):
                if r is not None and r.get("error") is None:
                    out[i][ref.id] = _scored(r, ref, old.get("examples") or {})
        except (AttributeError, KeyError, TypeError, ValueError, RLMergeError):
            continue
    return out


def old_doc(folder: SweepDir) -> Any:
    """The results.json an earlier run wrote here, parsed (None: none, or not JSON). A resumed sweep reads it once,
    before it saves its own over it, and hands it to ``resumed``, ``read_references`` and ``read_confirmed``."""
    raw = folder.read(RESULTS)
    try:
        return json.loads(raw) if raw is not None else None
    except ValueError:
        return None


def from_record(rec: dict[str, Any]) -> Candidate | None:
    """A search's candidate, rebuilt from its results.json record (None when that is not the id recorded)."""
    try:
        params = rec["params"]
        c = Candidate(str(rec["method"]), tuple((str(k), v) for k, v in params.items()),
                      int(rec["seed"]) if rec.get("seed") is not None else 0)
        return c if c.id == rec.get("id") else None
    except (AttributeError, KeyError, TypeError, ValueError, RLMergeError):
        return None


def read_confirmed(old: Any, doc: dict[str, Any], confirm: dict[str, Any] | None) -> dict[str, Scored]:
    """An earlier run's confirmed scores (``old``: its results.json, ``confirmed``, when its sweep and its confirming
    scorer's settings, ``confirm``, are this one's), by candidate id; a failed one is scored again."""
    if not isinstance(old, dict) or old.get("fingerprint") != doc["fingerprint"] or \
            (old.get("confirm") or {}).get("settings") != confirm:
        return {}
    by_id = {r.get("id"): r for r in old.get("candidates") or [] if isinstance(r, dict)}
    out = {}
    for rec in old.get("confirmed") or []:
        try:
            c = from_record(by_id[rec["id"]])
            if c is None or rec.get("error") is not None:
                continue
            details = {k: make(v, task=k, where=RESULTS) for k, v in
                       details_from_json(dict(rec["scores"]), rec.get("details"), old.get("examples") or {}).items()}
            out[c.id] = Scored(c, {k: v.score for k, v in details.items()}, "memory", float(rec["merge_seconds"]),
                               float(rec["score_seconds"]), [], 0, None, details)
        except (AttributeError, KeyError, TypeError, ValueError, RLMergeError):
            continue
    return out
