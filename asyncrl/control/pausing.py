"""Pausing a run (`asyncrl ctl RUN pause | resume`): the orchestrator stops starting rollouts; groups
already generating finish and are trained, then every role waits.

Every wait in the run has a deadline; a pause must not trip them. The orchestrator records the state
in RUN_DIR/paused.json (and in the ledger, so a restarted orchestrator stays paused); a wait that runs
out while the run is paused, or resumed less than its deadline ago, is excused and waits again.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Awaitable, Callable, TypeVar

from asyncrl.files import write_atomic
from asyncrl.rundir import RunDir

T = TypeVar("T")


def record(run_dir: str | Path, paused: bool) -> None:
    write_atomic(RunDir(run_dir).paused, json.dumps({"paused": paused, "at": time.time()}))


def excused(run_dir: str | Path, seconds: float) -> bool:
    """Whether a wait of `seconds` that just ran out owes it to a pause: paused now, or resumed less than
    `seconds` ago (the other roles need that long again to get going)."""
    try:
        state = json.loads(RunDir(run_dir).paused.read_text())
    except (OSError, ValueError):
        return False
    return bool(state.get("paused")) or time.time() - float(state.get("at", 0)) < seconds


async def patiently(run_dir: str | Path, deadline: float, wait: Callable[[], Awaitable[T]]) -> T:
    """`await wait()` (which raises TimeoutError after `deadline` s), again while a pause excuses it."""
    while True:
        try:
            return await wait()
        except TimeoutError:  # (asyncio's too, since 3.11)
            if not excused(run_dir, deadline):
                raise


def patiently_blocking(run_dir: str | Path, deadline: float, wait: Callable[[], T]) -> T:
    """`patiently` for a blocking `wait()` (the trainer's)."""
    while True:
        try:
            return wait()
        except TimeoutError:
            if not excused(run_dir, deadline):
                raise
