"""Names of the servers a run starts: inference replica i is the role `inference-i`, and once it serves
it writes `replicas/i.json` in its run directory ({"url", "pid"}; under Ray the launcher copies it into
the run directory with the actor that hosts it). Teacher i (on-policy distillation) is the role
`teacher-i`, the same server on teacher.path, and writes `teachers/i.json`."""
from __future__ import annotations

import json
from pathlib import Path

from asyncrl.rundir import RunDir

KINDS = ("inference", "teacher")


def role(index: int, kind: str = "inference") -> str:
    return f"{kind}-{index}"


def index_of(role_name: str, kind: str = "inference") -> int | None:
    """The index of a role name among servers of `kind`, None for any other role."""
    prefix, _, index = role_name.partition("-")
    return int(index) if prefix == kind and index.isdigit() else None


def server_of(role_name: str) -> tuple[str, int] | None:
    """(kind, index) of a server's role name (a replica's or a teacher's), None for any other role."""
    for kind in KINDS:
        if (index := index_of(role_name, kind)) is not None:
            return kind, index
    return None


def info_path(run_dir: str | Path, index: int, kind: str = "inference") -> Path:
    return RunDir(run_dir).replica(index) if kind == "inference" else RunDir(run_dir).teacher(index)


def read_info(run_dir: str | Path, index: int, kind: str = "inference") -> dict | None:
    """What server `index` last wrote, or None (not started yet, or a torn write by a foreign tool)."""
    try:
        info = json.loads(info_path(run_dir, index, kind).read_text())
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
