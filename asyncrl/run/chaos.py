"""Fault injection for a live run: SIGKILL its roles at chosen moments (tests and benchmarks/recovery.py).

A plan is a list of (role, step): once the run has recorded `step` steps, wait a random part of
one step's time (so the kill lands mid-generation, mid-training or mid-write, not on a boundary,
and before the run has moved on by more than a step) and SIGKILL that role's current process,
read from the run's pids.json.
"""
from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from pathlib import Path

from asyncrl.rundir import RunDir


def _step_times(run_dir: Path) -> list[float]:
    path = RunDir(run_dir).metrics
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line)["time"] for line in lines if line.startswith('{"step"')]


def steps_recorded(run_dir: Path) -> int:
    return len(_step_times(run_dir))


def last_step_seconds(run_dir: Path, default: float = 0.5) -> float:
    """How long the run's latest step took (`default` before it has two)."""
    times = _step_times(run_dir)
    return times[-1] - times[-2] if len(times) >= 2 else default


def pid_of(run_dir: Path, role: str) -> int | None:
    try:
        return json.loads((RunDir(run_dir).pids).read_text())[role]
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return None


class Chaos(threading.Thread):
    def __init__(self, run_dir: str | Path, plan: list[tuple[str, int]], seed: int = 0, deadline: float = 600,
                 min_gap: float = 0.0):
        super().__init__(daemon=True, name="chaos")
        self.run_dir, self.plan, self.deadline = Path(run_dir), plan, deadline
        self.min_gap = min_gap  # seconds between kills, so that each recovery is measured on its own
        self.rng = random.Random(seed)
        self.kills: list[dict] = []  # role, pid, step, time (time.time()) of each kill done

    def run(self) -> None:
        start = time.monotonic()
        for role, step in self.plan:
            while steps_recorded(self.run_dir) < step:
                if time.monotonic() - start > self.deadline:
                    return
                time.sleep(0.02)
            if self.kills:
                time.sleep(max(0.0, self.kills[-1]["time"] + self.min_gap - time.time()))
            time.sleep(self.rng.uniform(0.0, last_step_seconds(self.run_dir)))
            killed = {k["pid"] for k in self.kills}
            while (pid := pid_of(self.run_dir, role)) is None or pid in killed:  # not restarted yet
                if time.monotonic() - start > self.deadline:
                    return
                time.sleep(0.02)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # it had just exited
                continue
            self.kills.append(
                {"role": role, "pid": pid, "step": steps_recorded(self.run_dir), "time": time.time()}
            )
