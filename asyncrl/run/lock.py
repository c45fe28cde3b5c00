"""One live launcher per run directory: `train`, `--resume` and `--run.overwrite` take an exclusive
lock first, and refuse with the holder's PID when another launcher has it. The lock is a `flock` on
run.root/.NAME.lock (beside the run directory, so that an overwrite cannot delete it while it is
held); the kernel releases it when its launcher dies, however it dies, so a stale lock is simply
taken over."""
from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Iterator

from asyncrl.config import ConfigError
from asyncrl.plugins import check_directory
from asyncrl.rundir import RunDir


@contextlib.contextmanager
def run_lock(run_dir: str | Path) -> Iterator[Path]:
    run_dir = Path(run_dir)
    path = RunDir(run_dir).lock
    check_directory(run_dir.parent, "run.root")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # (not inherited by the roles)
    except OSError as e:
        raise ConfigError(f"run.root = {str(run_dir.parent)!r} cannot hold runs: {e.strerror or e}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise ConfigError(f"run {run_dir} is live: launcher PID {holder} holds {path}; stop that run "
                          "(or let it finish) before starting, resuming or overwriting it") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield path
    finally:
        os.close(fd)
