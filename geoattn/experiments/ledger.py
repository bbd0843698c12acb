"""The confirmation ledger, ``results/ledger.jsonl``: one JSON line per confirmatory experiment,
appended before its first test read.

A line records what the confirmation declared and on which code it ran::

    {"experiment": NAME, "spec": PATH, "spec_sha256": HASH, "protocol": {...}, "data": {...},
     "commit": GIT_HEAD, "dirty": BOOL, "cells": [...], "seeds": [...], "time": ISO_UTC}

``protocol`` is what the hash covers (:func:`protocol`): the seeds, each cell's run key (its resolved
settings, the task's recipe included, as its run directory is keyed), the comparisons, alpha and the
data. From then on the runner refuses (one line, exit code 2) to read that test data under another
protocol: a changed spec, added seeds, a changed recipe; and it refuses a new confirmation whose data
another confirmation has read. Resuming the same protocol is allowed.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from geoattn.core.errors import ConfigError, DataError, UserError
from geoattn.experiments.spec import ExperimentSpec
from geoattn.tasks.lm.datasets import sha256_of as file_sha256

LEDGER = "ledger.jsonl"  # in the results folder


class ProtocolError(UserError):
    """A confirmation the ledger refuses: a changed protocol, or data another confirmation read."""


@dataclass
class Entry:
    """One ledger line and its 1-based line number."""

    line: int
    record: dict[str, Any]


def data_identity(spec: ExperimentSpec) -> dict[str, Any]:
    """The data a confirmation declared: ``{"files": {path: sha256}}`` or ``{"generator": {...}}``."""
    if spec.data_generator is not None:
        return {"generator": {"option": "seed", **spec.data_generator}}
    return {"files": dict(sorted(spec.data_sha256.items()))}


def data_tokens(identity: dict[str, Any]) -> set[str]:
    """What two confirmations may not share: each file's sha256, or the generator's draw."""
    if "generator" in identity:
        g = identity["generator"]
        return {f"generator {g['name']} version {g['version']} seed {g['seed']}"}
    return {f"sha256 {digest}" for digest in identity.get("files", {}).values()}


def verify_data(spec: ExperimentSpec) -> None:
    """DataError unless every declared file exists and has its declared sha256."""
    for name, declared in spec.data_sha256.items():
        path = Path(name)
        if not path.is_file():
            raise DataError(f"{spec.name}: declared data file {name} does not exist")
        actual = file_sha256(path)
        if actual != declared:
            raise DataError(
                f"{spec.name}: data file {name} has sha256 {actual}, the spec declares {declared}"
            )


def protocol(spec: ExperimentSpec) -> dict[str, Any]:
    """What a confirmation fixes before its first test read (its hash is the ledger's ``spec_sha256``).

    A cell enters by its run key (``TASK-MODEL-DIGEST`` of its resolved settings, recipe included), so
    editing the TOML's wording leaves it, and a changed recipe changes it."""
    seed = spec.seeds[0]
    cells = {c.name: Path(spec.config(c, seed, Path("runs"))["out"]).parent.name for c in spec.cells}
    metrics = {c["metric"] for c in spec.compare}
    return {
        "seeds": list(spec.seeds),
        "cells": cells,
        "compare": [{k: c[k] for k in ("a", "b", "metric")} for c in spec.compare],
        "alpha": spec.alpha,
        "higher_is_better": sorted(metrics & set(spec.higher_is_better)),
        "descriptive": sorted(metrics & set(spec.descriptive)),
        "evaluate": spec.evaluate,
        "data": data_identity(spec),
    }


def spec_hash(spec: ExperimentSpec) -> str:
    """The sha256 of the spec's protocol (:func:`protocol`, keys sorted): what the ledger holds it to."""
    return hashlib.sha256(json.dumps(protocol(spec), sort_keys=True).encode()).hexdigest()


def git_state(cwd: Path | str = ".") -> dict[str, Any]:
    """``{"commit": HEAD, "dirty": bool}`` of the checkout at ``cwd``; ``None`` values outside one."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True)
        status = subprocess.run(["git", "status", "--porcelain"], cwd=cwd, capture_output=True, text=True)
    except OSError:  # no git on this machine
        return {"commit": None, "dirty": None}
    if head.returncode != 0:
        return {"commit": None, "dirty": None}
    return {"commit": head.stdout.strip(), "dirty": bool(status.stdout.strip())}


def read_ledger(path: Path) -> list[Entry]:
    """Every line of the ledger at ``path`` (none when it does not exist); ConfigError on a bad line."""
    if not path.is_file():
        return []
    entries = []
    for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not text.strip():
            continue
        try:
            entries.append(Entry(number, json.loads(text)))
        except ValueError:
            raise ConfigError(f"{path}: line {number} is not JSON") from None
    return entries


def _changes(old: dict[str, Any], new: dict[str, Any]) -> str:
    """What differs between two protocols, in words (for the refusal)."""
    parts = []
    if old.get("seeds") != new["seeds"]:
        parts.append(f"seeds {old.get('seeds')} -> {new['seeds']}")
    before, after = old.get("cells", {}), new["cells"]
    parts += [f"cell {n!r} added" for n in after if n not in before]
    parts += [f"cell {n!r} removed" for n in before if n not in after]
    parts += [f"cell {n!r} changed settings" for n in after if n in before and before[n] != after[n]]
    fixed = ("compare", "alpha", "higher_is_better", "descriptive", "evaluate", "data")
    parts += [f"{key} changed" for key in fixed if old.get(key) != new[key]]
    return "; ".join(parts) or "the protocol"


def recorded(spec: ExperimentSpec, path: Path) -> Entry | None:
    """The ledger entry of ``spec`` when its protocol is the one recorded, None when it has none;
    ProtocolError when it was recorded under another protocol or its data was read by another
    confirmation."""
    current, digest = protocol(spec), spec_hash(spec)
    tokens = data_tokens(current["data"])
    mine = None
    for entry in read_ledger(path):
        record = entry.record
        if record.get("experiment") == spec.name:
            if record.get("spec_sha256") != digest:
                raise ProtocolError(
                    f"{spec.name}: its confirmation is recorded in {path} (line {entry.line}, spec sha256 "
                    f"{str(record.get('spec_sha256'))[:12]}) and the spec has changed since "
                    f"({_changes(record.get('protocol', {}), current)}): its test data is not read again; "
                    "a new confirmation is a new experiment with data no confirmation has read"
                )
            mine = entry
            continue
        shared = tokens & data_tokens(record.get("data", {}))
        if shared:
            raise ProtocolError(
                f"{spec.name}: its data ({', '.join(sorted(shared))}) was read by confirmation "
                f"{record.get('experiment')!r} ({path} line {entry.line}): a new confirmation needs "
                "data no confirmation has read (new files, or a generator seed no run has used)"
            )
    return mine


def record(spec: ExperimentSpec, path: Path) -> Entry:
    """Before a confirmation's first test read: refuse what :func:`recorded` refuses, check the
    declared files' hashes, and append its entry unless the same protocol is recorded (a resume)."""
    verify_data(spec)
    existing = recorded(spec, path)
    if existing is not None:
        return existing
    line = {
        "experiment": spec.name,
        "spec": spec.path.as_posix(),
        "spec_sha256": spec_hash(spec),
        "claim": spec.claim,
        "protocol": protocol(spec),
        "data": data_identity(spec),
        **git_state(),
        "cells": [c.name for c in spec.cells],
        "seeds": list(spec.seeds),
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(line, sort_keys=True) + "\n")
    return read_ledger(path)[-1]
