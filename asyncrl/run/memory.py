"""Whether a role died of memory: its peak resident memory, sampled while it lived, and the kernel's
count of out-of-memory kills. A role the OOM killer took would meet the same death on a restart,
so the supervisor stops the run and says which settings drive that role's memory."""
from __future__ import annotations

import signal
import subprocess
from pathlib import Path

from asyncrl.run.starter import ForkedRole

GIB = 2**30
NEAR = 0.8  # a SIGKILLed role whose peak was this share of the memory it could have: counted as OOM
CGROUP_EVENTS = (Path("/sys/fs/cgroup/memory.events"), Path("/sys/fs/cgroup/memory/memory.oom_control"))
CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))


def peak_rss(pid: int) -> int | None:
    """The process's peak resident memory (VmHWM) in bytes; None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def oom_kills() -> int | None:
    """The kernel's OOM kills in this cgroup so far (v2 memory.events, v1 memory.oom_control)."""
    for path in CGROUP_EVENTS:
        try:
            for line in path.read_text().splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return None


def memory_limit() -> int:
    """What a process here can have at most: the machine's memory, or the cgroup's limit if lower."""
    limits = []
    try:
        limits.append(int(Path("/proc/meminfo").read_text().split()[1]) * 1024)  # MemTotal, first line
    except (OSError, ValueError, IndexError):
        pass
    for path in CGROUP_LIMITS:
        try:
            limits.append(int(path.read_text().strip()))
        except (OSError, ValueError):  # ("max": no limit)
            continue
    return min(limits) if limits else 0


class MemoryWatch:
    """The supervisor samples its local roles each poll; `verdict` says whether an exit was an OOM kill."""

    def __init__(self):
        self.peaks: dict[str, int] = {}
        self.kills = oom_kills()
        self.limit = memory_limit()
        self.killed = False  # an OOM kill seen since the last sample

    def sample(self, procs: dict) -> None:
        kills = oom_kills()
        self.killed = kills is not None and self.kills is not None and kills > self.kills
        self.kills = kills
        for role, proc in procs.items():  # (local processes: a Ray actor's pid is another node's)
            peak = peak_rss(proc.pid) if isinstance(proc, (subprocess.Popen, ForkedRole)) else None
            if peak is not None:
                self.peaks[role] = max(peak, self.peaks.get(role, 0))

    def verdict(self, role: str, code: int | None) -> str | None:
        """A sentence if `role`'s exit `code` was the OOM killer's; else None."""
        return oom_verdict(code, self.peaks.get(role), self.limit, self.killed)


def oom_verdict(code: int | None, peak: int | None, limit: int, kernel_killed: bool) -> str | None:
    if code != -signal.SIGKILL:
        return None
    near = bool(peak and limit and peak >= NEAR * limit)
    if not (kernel_killed or near):
        return None  # (a SIGKILL from someone else: chaos tests, a user)
    seen = f"peak resident memory {peak / GIB:.1f} GiB" if peak else "its peak memory unknown"
    return f"was killed by the out-of-memory killer ({seen} of {limit / GIB:.1f} GiB here)"
