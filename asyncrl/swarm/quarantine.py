"""Quarantined workers, as the trainer reads them: `quarantine.json` names each one with the samples of
its that a recompute verified. The trainer masks every other sample of theirs in a batch it has not
trained yet (loss mask and advantages to zero) and says which in its step metrics, so the ledger records
exactly what was dropped and what had been trained before the quarantine.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from asyncrl.files import write_atomic
from asyncrl.rundir import RunDir
from asyncrl.trajectory import Trajectory


def read(run_dir: str | Path) -> dict:
    try:
        return json.loads(RunDir(run_dir).quarantine.read_text())
    except (OSError, ValueError):
        return {}


def add(run_dir: str | Path, worker: str, reason: str, verified: set[str]) -> None:
    record = read(run_dir)
    record[worker] = {"at": time.time(), "reason": reason, "verified": sorted(verified)}
    write_atomic(RunDir(run_dir).quarantine, json.dumps(record))


def mask(run_dir: str | Path, trajs: list[Trajectory]) -> list[str]:
    """Zero the loss of every unverified sample of a quarantined worker; their ids."""
    shut = read(run_dir)
    if not shut:
        return []
    verified = {name: set(record["verified"]) for name, record in shut.items()}
    masked = []
    for t in trajs:
        worker = t.info.get("worker")
        if worker in shut and t.info.get("check") not in verified[worker]:
            t.loss_mask = [0] * len(t.loss_mask)
            t.advantages = [0.0] * len(t.advantages)
            masked.append(t.id)
    return masked
