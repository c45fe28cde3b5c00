"""How many cores a process can actually get: its CPU affinity, its cgroup's CPU quota, less the cores other
processes keep busy. os.cpu_count() says none of that, and on 2 cores two processes of 2 threads each ran
several times slower than one thread each (a thread pool spins on a core another pool holds): a build that
took 3.5 min alone hit a 600 s deadline beside one other busy process.

A leaf module: no torch, nothing of asyncrl's, so the launcher, the roles and the warm start all use it.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")
SAMPLE_SECONDS = 0.3  # the first look at what other processes use


def usable_cores() -> int:
    """Cores this process may run on: its affinity, capped by its cgroup's CPU quota (rounded up)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # (not Linux)
        cores = os.cpu_count() or 1
    quota = cgroup_quota()
    return max(1, min(cores, -int(-quota // 1))) if quota else max(1, cores)


def cgroup_quota() -> float | None:
    """The cgroup's CPU quota in cores (cgroup v2 cpu.max, or v1 cfs_quota_us / cfs_period_us); None: none."""
    try:
        text = (CGROUP / "cpu.max").read_text().split()
        if text[0] != "max":
            return int(text[0]) / int(text[1])
        return None
    except (OSError, IndexError, ValueError):
        pass
    try:
        quota = int((CGROUP / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((CGROUP / "cpu" / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


class CoreMeter:
    """Cores free for this process, from the machine's busy time (/proc/stat) less this process's own, between
    one look and the next (the first look samples SAMPLE_SECONDS)."""

    def __init__(self):
        self.last = _reading()

    def free(self) -> int:
        """Usable cores less those others kept busy since the last look; at least 1."""
        usable = usable_cores()
        now = _reading()
        if now is None or self.last is None:
            return usable
        if now[0] - self.last[0] < SAMPLE_SECONDS / 2:  # (too short a window to tell)
            time.sleep(SAMPLE_SECONDS)
            now = _reading()
        (wall0, busy0, own0), (wall1, busy1, own1) = self.last, now
        self.last = now
        others = max(0.0, (busy1 - busy0) - (own1 - own0)) / max(wall1 - wall0, 1e-9)
        return max(1, min(usable, round(usable - others)))


def available_cores() -> int:
    """Cores free for this process now (samples the machine for SAMPLE_SECONDS)."""
    return CoreMeter().free()


def _reading() -> tuple[float, float, float] | None:
    """(wall seconds, CPU-seconds the whole machine was busy, CPU-seconds of this process and its
    threads), or None where /proc/stat cannot be read."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        ticks = [int(x) for x in fields]
    except (OSError, ValueError, IndexError):
        return None
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # (idle + iowait)
    busy = sum(ticks[:8]) - idle  # (user nice system idle iowait irq softirq steal; guests are in user)
    return time.monotonic(), busy / hz, time.process_time()
