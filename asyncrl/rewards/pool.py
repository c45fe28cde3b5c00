"""Verifiers run in worker processes, so one that hangs can be killed and replaced.

A verifier is user code: it may raise, return NaN, or never return. In a thread a hung call can
only be abandoned (it keeps its thread forever, and the pool runs dry); in a process it is
killed at its deadline and a fresh worker takes its place.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import time

from asyncrl.config.sections import TaskConfig
from asyncrl.run.role import ContractError

STARTUP_DEADLINE = 120.0  # seconds for a worker to import the task's code
SPLIT_ABOVE_SECONDS = 0.005  # a chunk that scores faster than this goes to one worker whole


class VerifierError(RuntimeError):
    pass


def _serve(task_cfg: TaskConfig, conn) -> None:
    """A worker: a list of (completion, entry) in; a list of ("ok", reward, seconds) or ("error" or
    "contract", message, seconds) out, one per item."""
    from asyncrl.rewards.tasks import load_tasks

    tasks = load_tasks(task_cfg, score_only=True)
    conn.send("ready")  # imports can take seconds: they must not count against a verifier's deadline
    while True:
        try:
            items = conn.recv()
        except EOFError:  # the orchestrator is gone
            return
        results = []
        for completion, entry in items:
            start = time.process_time()
            try:
                results.append(("ok", tasks.score(completion, entry), time.process_time() - start))
            except ContractError as e:
                results.append(("contract", str(e), time.process_time() - start))
            except Exception as e:  # a user's verifier may raise anything
                results.append(
                    ("error", f"verifier raised {type(e).__name__}: {e}", time.process_time() - start)
                )
        conn.send(results)


def _preload(task_cfg: TaskConfig) -> list[str]:
    """What every worker imports: done once in the fork server, not in each worker (reasoning-gym alone
    is ~2 s of CPU, paid again by every replacement of a killed worker otherwise). A task with its own
    verifier is scored by it alone (TaskSource's score_only); the others by their dataset."""
    tasks = [task_cfg, *task_cfg.mix] if task_cfg.mix else [task_cfg]
    modules = ["asyncrl.rewards.tasks"]
    modules += [t.verifier.partition(":")[0] for t in tasks if t.verifier]
    by_dataset = [t for t in tasks if not t.verifier]
    modules += [t.name.partition(":")[0] for t in by_dataset if ":" in t.name]
    if any(t.name != "jsonl" and ":" not in t.name for t in by_dataset):
        modules.append("reasoning_gym")
    return modules


class _Worker:
    def __init__(self, ctx, task_cfg: TaskConfig):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(task_cfg, child), daemon=True, name="verifier")
        self.process.start()
        child.close()
        self.ready = False

    def kill(self) -> None:
        self.process.kill()  # multiprocessing reaps it later; a join here would block the event loop
        self.conn.close()


class VerifierPool:
    """`workers` slots; a slot's process is started on first use (off the event loop: the first one
    also starts the fork server, which takes seconds) and again after it had to be killed."""

    def __init__(self, task_cfg: TaskConfig, workers: int):
        self.task_cfg = task_cfg
        # A fork server forks workers from a clean process that has already imported the task code:
        # a replacement is ready in milliseconds, and nothing forks this threaded process.
        self.ctx = multiprocessing.get_context("forkserver")
        self.ctx.set_forkserver_preload(_preload(task_cfg))
        self.workers = workers
        self.idle: asyncio.Queue[_Worker | None] = asyncio.Queue()
        self.cpu_seconds = 0.0  # spent in the verifiers themselves, summed over workers
        self.items_scored = 0
        for _ in range(workers):
            self.idle.put_nowait(None)

    async def warm(self) -> None:
        """Start every worker now, so the first rollouts' scores do not wait for the fork server to
        import the task code (seconds, on the first batch's path). A failure here is left for the
        first score to meet and report."""
        slots: list[_Worker | None] = []
        try:
            for _ in range(self.workers):
                slots.append(await self.idle.get())
            for i, worker in enumerate(slots):
                slots[i] = worker or await asyncio.to_thread(_Worker, self.ctx, self.task_cfg)
                if not slots[i].ready:
                    await self._started(slots[i])
        except (VerifierError, OSError):
            pass
        finally:
            for worker in slots:
                self.idle.put_nowait(worker)

    async def score(self, completion: str, entry: dict, timeout: float) -> float:
        """The reward; VerifierError if the verifier raised, hung past `timeout` or died."""
        result = (await self.score_many([(completion, entry)], timeout))[0]
        if isinstance(result, (VerifierError, ContractError)):
            raise result
        return result

    async def score_many(self, items: list[tuple[str, dict]], timeout: float) -> list:
        """The reward of each (completion, entry), or the VerifierError (or ContractError) that stands
        for it. The items go to the workers in one chunk per worker: one round trip per chunk, not per
        item (the per-item round trips were a tenth of the orchestrator's CPU); to one worker in one
        chunk when the verifier has proven cheap, since splitting then costs the orchestrator more
        round trips than it saves in scoring time (other groups keep the other workers busy)."""
        if not items:  # (a group whose every sample was cut short or refused)
            return []
        seconds_per_item = self.cpu_seconds / max(self.items_scored, 1)
        cheap = self.items_scored >= len(items) and seconds_per_item * len(items) < SPLIT_ABOVE_SECONDS
        size = len(items) if cheap else max(1, -(-len(items) // self.workers))
        chunks = [items[i: i + size] for i in range(0, len(items), size)]
        return [
            r for part in await asyncio.gather(*(self._score_chunk(c, timeout) for c in chunks)) for r in part
        ]

    async def _score_chunk(self, items: list[tuple[str, dict]], timeout: float) -> list:
        """Results in order. A chunk not answered within `timeout` is scored again one item at a
        time, each under its own deadline, so only an item that hangs (or kills its worker) fails."""
        results = await self._score_run(items, timeout)
        if isinstance(results, VerifierError) and len(items) > 1:
            return [r for item in items for r in await self._score_chunk([item], timeout)]
        return [results] if isinstance(results, VerifierError) else results

    async def _score_run(self, items: list[tuple[str, dict]], timeout: float):
        """Each item's reward or VerifierError; or one VerifierError if the worker hung or died."""
        worker = await self.idle.get()
        try:
            if worker is None:
                worker = await asyncio.to_thread(_Worker, self.ctx, self.task_cfg)
            if not worker.ready:
                await self._started(worker)
            worker.conn.send(items)
            answers = await asyncio.wait_for(self._receive(worker), timeout)
        except asyncio.TimeoutError:
            worker = self._discard(worker)
            return VerifierError(
                f"verifier took over {timeout:.0f}s (timeouts.verifier); its process was killed"
            )
        except asyncio.CancelledError:  # its answers would reach the next caller: start clean
            worker = self._discard(worker)
            raise
        except (EOFError, OSError) as e:
            if worker:  # it has closed its pipe by dying: its exit code is a moment away
                worker.process.join(0.05)
            code = worker.process.exitcode if worker else None
            worker = self._discard(worker)
            return VerifierError(f"verifier process died (exit code {code}): {type(e).__name__}")
        finally:
            self.idle.put_nowait(worker)
        self.cpu_seconds += sum(seconds for _, _, seconds in answers)
        self.items_scored += len(answers)
        return [value if status == "ok" else (ContractError if status == "contract" else VerifierError)(value)
                for status, value, _ in answers]

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

    def _discard(self, worker: _Worker | None) -> None:
        """Kill it; its slot starts a fresh process when next used."""
        if worker is not None:
            worker.kill()
        return None

    def close(self) -> None:
        while not self.idle.empty():
            worker = self.idle.get_nowait()
            if worker is not None:
                worker.kill()
