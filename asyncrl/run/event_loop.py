"""The event loop of the roles that live on HTTP and pipes: the orchestrator and the inference server.

uvloop (libuv, in C) where it is installed: on the default run the orchestrator spends a large share of
its CPU in the loop's own machinery and its socket transports (a request, a verifier round trip and two
ledger transactions per group), and uvloop cut that CPU by ~25%. asyncio's loop elsewhere (Windows).
"""
from __future__ import annotations

import asyncio
from typing import Coroutine, TypeVar

T = TypeVar("T")


def run(main: Coroutine[object, object, T]) -> T:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
