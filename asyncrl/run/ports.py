"""A free TCP port, for a process that will listen on it next (a rendezvous, a server started by another)."""
from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at `host` now (another process could take it before the caller binds it:
    the bind then fails and says so)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
