"""The two ways a role touches shared files: write atomically, and wait for something with a deadline
(and whether the process a file names still exists).

Every file another process reads (batches, weights, markers, replicas/<i>.json, metrics) is written
to a temporary name beside it and renamed into place, so a reader never sees half of one. Every
wait polls a condition until a deadline and then fails with a message that says what it waited for.
"""
from __future__ import annotations

import asyncio
import contextlib
import fcntl
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


def sha256_of(path: str | Path) -> str:
    """The file's sha256, hex (a model file's cache key, a worker's blob name)."""
    import hashlib

    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


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


@contextlib.contextmanager
def exclusive(lock: str | Path, what: str, seconds: float, log=print) -> Iterator[None]:
    """Hold an exclusive lock on the file `lock` while the block runs (one process builds `what`, the others
    wait for it, saying so). The kernel frees the lock when its holder dies, however it dies."""
    lock = Path(lock)
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        start, said = time.monotonic(), 0.0
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - start
                if waited > seconds:
                    raise TimeoutError(f"{what}: another process (PID {_holder(fd)}) held {lock} for more "
                                       f"than {seconds:.0f}s") from None
                if waited >= said:
                    log(f"waiting for {what}: another process (PID {_holder(fd)}) is doing it "
                        f"({waited:.0f}s so far)")
                    said = waited + 30
                time.sleep(0.2)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)


def _holder(fd: int) -> str:
    return os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"


def process_exists(pid: int) -> bool:
    """Whether a process `pid` exists (one of another user's counts: it exists, signal or not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
