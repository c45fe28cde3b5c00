"""Heartbeats: each role touches `heartbeats/<role>` from its main loop; the supervisor reads the
file's age. A role that is alive but stuck stops beating and is restarted like a dead one."""
from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from pathlib import Path

from asyncrl.rundir import RunDir


class Heartbeat:
    def __init__(self, run_dir: str | Path, role: str, every: float = 1.0):
        self.path = RunDir(run_dir).heartbeat(role)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.every, self.last = every, 0.0
        self.beat(force=True)

    def beat(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.last >= self.every:
            self.path.touch()  # sets the mtime the supervisor reads
            self.last = now

    @contextlib.contextmanager
    def through(self, limit: float):
        """Beat from a thread while a long call blocks this one (a training step may outlast
        timeouts.heartbeat), for at most `limit` seconds: past it the beats stop, and the supervisor
        sees what it should, a stuck role."""
        stop = threading.Event()
        end = time.monotonic() + limit

        def beat() -> None:
            while not stop.wait(self.every) and time.monotonic() < end:
                self.path.touch()

        thread = threading.Thread(target=beat, daemon=True, name="heartbeat")
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    async def beat_forever(self, every: float = 0.5) -> None:
        """Beat while the event loop runs: a loop that blocks stops beating and is restarted."""
        while True:
            self.beat()
            await asyncio.sleep(every)


EXIT_SECONDS = 60.0  # a finished role's exit: past it the role is stuck after all


def cover_exit(run_dir: str | Path, role: str) -> None:
    """A beat dated EXIT_SECONDS ahead, for a role whose main has returned: what is left is its exit, and
    on a busy machine interpreter teardown outlasted a short timeouts.heartbeat (the supervisor killed a
    finished trainer for silence, three times in a row)."""
    path, later = RunDir(run_dir).heartbeat(role), time.time() + EXIT_SECONDS
    with contextlib.suppress(FileNotFoundError):  # (a role that never beat: a trainer's other ranks)
        os.utime(path, (later, later))


def age(run_dir: str | Path, role: str) -> float | None:
    """Seconds since the role's last beat; None before its first."""
    try:
        return time.time() - RunDir(run_dir).heartbeat(role).stat().st_mtime
    except FileNotFoundError:
        return None
