"""Names of the data-parallel inference replicas: replica i is the role `inference-i`, and once it
serves it writes `replicas/i.json` in its run directory ({"url", "pid"}; under Ray the launcher copies
it into the run directory with the actor that hosts it)."""
from __future__ import annotations

import json
from pathlib import Path

from asyncrl.rundir import RunDir


def role(index: int) -> str:
    return f"inference-{index}"


def index_of(role_name: str) -> int | None:
    """The replica index of a role name, None for any other role."""
    prefix, _, index = role_name.partition("-")
    return int(index) if prefix == "inference" and index.isdigit() else None


def read_info(run_dir: str | Path, index: int) -> dict | None:
    """What replica `index` last wrote, or None (not started yet, or a torn write by a foreign tool)."""
    try:
        info = json.loads(RunDir(run_dir).replica(index).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) and isinstance(info.get("url"), str) else None


def known(run_dir: str | Path) -> dict[int, dict]:
    """Every replica that has written its file: the configured ones and any that joined mid-run."""
    found = {}
    for path in sorted(RunDir(run_dir).replicas.glob("*.json")):
        if path.stem.isdigit() and (info := read_info(run_dir, int(path.stem))) is not None:
            found[int(path.stem)] = info
    return found
