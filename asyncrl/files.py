"""The two ways a role touches shared files: write atomically, and wait for something with a deadline.

Every file another process reads (batches, weights, markers, replicas/<i>.json, metrics) is written
to a temporary name beside it and renamed into place, so a reader never sees half of one. Every
wait polls a condition until a deadline and then fails with a message that says what it waited for.
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import time
from pathlib import Path
from typing import Callable, Iterator, TypeVar

T = TypeVar("T")


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path beside `path`; once the block completes it becomes `path` in one rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # (two processes may write one file)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_atomic(path: str | Path, data: str | bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)


def poll(check: Callable[[], T], seconds: float, what: str | Callable[[], str], every: float = 0.05) -> T:
    """The first truthy result of `check()`, called every `every` s; TimeoutError naming `what` after
    `seconds`. `check` may raise to end the wait early (the process it waits on died)."""
    start = time.monotonic()
    while not (result := check()):
        if time.monotonic() - start > seconds:
            raise TimeoutError(what() if callable(what) else what)
        time.sleep(every)
    return result


async def apoll(
    check: Callable[[], T], seconds: float, what: str | Callable[[], str], every: float = 0.05
) -> T:
    """`poll` for an event loop: the loop goes on between checks (`check` may be a coroutine function)."""
    start = time.monotonic()
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        if time.monotonic() - start > seconds:
            raise TimeoutError(what() if callable(what) else what)
        await asyncio.sleep(every)
