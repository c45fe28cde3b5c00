"""Verifiers run in worker processes, so one that hangs can be killed and replaced.

A verifier is user code: it may raise, return NaN, or never return. In a thread a hung call can
only be abandoned (it keeps its thread forever, and the pool runs dry); in a process it is
killed at its deadline and a fresh worker takes its place.
"""
from __future__ import annotations

import asyncio
import multiprocessing

from asyncrl.config import TaskConfig


STARTUP_DEADLINE = 120.0  # seconds for a worker to import the task's code


class VerifierError(RuntimeError):
    pass


def _serve(task_cfg: TaskConfig, conn) -> None:
    """A worker: (completion, entry) in, (True, reward) or (False, error message) out."""
    from asyncrl.rewards.tasks import TaskSource

    tasks = TaskSource(task_cfg)
    conn.send("ready")  # imports can take seconds: they must not count against a verifier's deadline
    while True:
        try:
            completion, entry = conn.recv()
        except EOFError:  # the orchestrator is gone
            return
        try:
            conn.send((True, tasks.score(completion, entry)))
        except Exception as e:  # a user's verifier may raise anything
            conn.send((False, f"verifier raised {type(e).__name__}: {e}"))


class _Worker:
    def __init__(self, ctx, task_cfg: TaskConfig):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(task_cfg, child), daemon=True, name="verifier")
        self.process.start()
        child.close()
        self.ready = False

    def kill(self) -> None:
        self.process.kill()
        self.process.join(5)
        self.conn.close()


class VerifierPool:
    def __init__(self, task_cfg: TaskConfig, workers: int):
        self.task_cfg, self.size = task_cfg, workers
        # A fork server forks workers from a clean process that has already imported the task code:
        # a replacement is ready in milliseconds, and nothing forks this threaded process.
        self.ctx = multiprocessing.get_context("forkserver")
        self.ctx.set_forkserver_preload(["asyncrl.rewards.tasks", *([task_cfg.verifier.partition(":")[0]]
                                                                     if task_cfg.verifier else [])])
        self.idle: asyncio.Queue[_Worker] = asyncio.Queue()
        for _ in range(workers):
            self.idle.put_nowait(_Worker(self.ctx, task_cfg))
        self.replaced = 0

    async def score(self, completion: str, entry: dict, timeout: float) -> float:
        """The reward; VerifierError if the verifier raised, hung past `timeout` or died."""
        worker = await self.idle.get()
        try:
            if not worker.ready:
                await self._started(worker)
            worker.conn.send((completion, entry))
            ok, value = await asyncio.wait_for(self._receive(worker), timeout)
        except asyncio.TimeoutError:
            worker = self._replace(worker)
            raise VerifierError(f"verifier took over {timeout:.0f}s (timeouts.verifier); its process was killed") from None
        except asyncio.CancelledError:  # its answer would reach the next caller: start clean
            worker = self._replace(worker)
            raise
        except (EOFError, OSError) as e:
            code = worker.process.exitcode
            worker = self._replace(worker)
            raise VerifierError(f"verifier process died (exit code {code}): {type(e).__name__}") from None
        finally:
            self.idle.put_nowait(worker)
        if not ok:
            raise VerifierError(value)
        return value

    async def _started(self, worker: _Worker) -> None:
        try:
            hello = await asyncio.wait_for(self._receive(worker), STARTUP_DEADLINE)
        except asyncio.TimeoutError:
            raise VerifierError(f"a verifier process did not start within {STARTUP_DEADLINE:.0f}s") from None
        if hello != "ready":
            raise VerifierError(f"a verifier process failed to start: {hello}")
        worker.ready = True

    async def _receive(self, worker: _Worker):
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        fd = worker.conn.fileno()
        loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
        try:
            await ready
        finally:
            loop.remove_reader(fd)
        return worker.conn.recv()

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        self.replaced += 1
        return _Worker(self.ctx, self.task_cfg)

    def close(self) -> None:
        while not self.idle.empty():
            self.idle.get_nowait().kill()
