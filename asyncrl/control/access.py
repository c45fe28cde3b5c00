"""Who may drive a run's inference servers, and what they may be made to load.

Every run has a token (`run_dir/token`, readable by its owner only), written when the run
directory is prepared. A server asks for it (`Authorization: Bearer <token>`) on every endpoint
that changes what it serves (update_weights, pause, resume, abort), and on every endpoint when it
is bound beyond loopback. `/update_weights` loads only files under the run's own `weights/`: any
other local process could otherwise make a server load any file it names.
"""
from __future__ import annotations

import os
import secrets
from pathlib import Path

from asyncrl.rundir import RunDir

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def ensure_token(run_dir: str | Path) -> str:
    """The run's token, created (mode 0600) if the run has none yet."""
    path = RunDir(run_dir).token
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text().strip()
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32))
    return path.read_text().strip()


def read_token(run_dir: str | Path) -> str | None:
    try:
        return RunDir(run_dir).token.read_text().strip()
    except FileNotFoundError:
        return None


def inside(path: str | Path, root: str | Path) -> bool:
    """Whether `path`, links resolved, lies under `root` (so `weights/../../etc/x` does not)."""
    return Path(path).resolve().is_relative_to(Path(root).resolve())
