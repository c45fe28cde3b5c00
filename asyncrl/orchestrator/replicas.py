"""The inference replicas as the orchestrator sees them: a router over N data-parallel servers.

Each group (G samples of one prompt, or G agent episodes, so an episode's turns stay on one
server and reuse its prefix) goes to the replica with the fewest sequences in flight. Control
calls (load a version, stats) fan out to every replica in routing. A replica that cannot be reached
is taken out of routing and what it was generating is retried on another one (the caller's group
starts over, so the ledger records it once); a watcher brings it back, or a new one in, only after it
holds the served version. Replicas are found through `replicas/<i>.json` (asyncrl/inference/replica.py),
which a restarted server rewrites and a replica started mid-run writes for the first time.
"""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

from asyncrl.files import apoll
from asyncrl.inference import replica as replica_files
from asyncrl.inference.client import InferenceClient, InferenceError, InferenceUnavailable
from asyncrl.inference.vllm_client import VLLMClient
from asyncrl.observe.events import EventLog
from asyncrl.rundir import RunDir
from asyncrl.transports.staging import Stager

ATTEMPTS = 3  # a group whose server dies under it this often fails (and with it the run)
WATCH_EVERY = 0.5  # seconds between looks for replicas that came back or joined


class Replica:
    def __init__(self, index: int, info: dict, client):
        self.index, self.info, self.client = index, info, client
        self.in_flight = 0  # sequences
        self.sequences = 0  # sequences routed to it, all told
        self.routed = False  # holds the served version and takes traffic
        self.version: int | None = None  # the version it holds, as last loaded or read
        self.opened = False  # the client's connection pool
        self.left_at: float | None = None  # when it left routing (None: never routed yet)


class Router:
    def __init__(self, cfg, run_dir: Path, events: EventLog, token: str | None, link):
        """`link`: to the trainer, which publishes the versions (asyncrl/transports/trainer_link.py)."""
        self.cfg, self.run_dir, self.events, self.token, self.link = cfg, run_dir, events, token, link
        self.version = 0  # the served version, set from the ledger; every routed replica holds it
        self.replicas: dict[int, Replica] = {}
        self.changed = asyncio.Condition()  # a replica entered routing
        self.loading = asyncio.Lock()  # a version load and a replica's entry never interleave
        self.stager = Stager(run_dir, cfg.timeouts.weight_load, link.fetch)
        self._watcher: asyncio.Task | None = None
        self.broken: Exception | None = None  # why the watcher died

    # --- membership ----------------------------------------------------------------------
    async def reachable(self) -> None:
        """Until one replica answers /health, within timeouts.startup (before anything slower starts)."""
        deadline = self.cfg.timeouts.startup
        await apoll(lambda: self._discover() or None, deadline,
                    f"orchestrator: no inference replica wrote {RunDir(self.run_dir).replicas} within "
                    f"{deadline:.0f}s (timeouts.startup)", every=0.1)
        for r in self.replicas.values():
            await self._open(r)
        waits = [asyncio.ensure_future(r.client.wait_healthy(deadline)) for r in self.replicas.values()]
        try:
            for healthy in asyncio.as_completed(waits):
                try:
                    return await healthy
                except InferenceError as e:
                    error = e
            raise error
        finally:
            for w in waits:
                w.cancel()
            await asyncio.gather(*waits, return_exceptions=True)

    async def start(self) -> None:
        """Route to every replica that answers within timeouts.startup (at least one), then keep watching
        for the others."""
        await self.reachable()
        await self._admit_ready(initial=True)
        await self._wait_routed(self.cfg.timeouts.startup, "an inference replica at start")
        self._watcher = asyncio.create_task(self._watch())

    async def close(self) -> None:
        self.events.write("routing", sequences={r.index: r.sequences for r in self.replicas.values()})
        if self._watcher:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
        for r in self.replicas.values():
            if r.opened:
                await r.client.__aexit__(None, None, None)
        self.stager.close()

    def add(self, index: int, info: dict, client) -> None:
        """A replica found another way than its file (a joined worker: asyncrl/swarm/), routed by the
        watcher once it holds the served version."""
        self.replicas[index] = Replica(index, info, client)

    def _discover(self) -> list[int]:
        """Read every replica file: new replicas get a client; an unrouted one follows its file's URL (a
        restarted server may have another port)."""
        for index, info in replica_files.known(self.run_dir).items():
            r = self.replicas.get(index)
            if r is None:
                client = client_for(self.cfg, info["url"], self.token, self.run_dir)
                self.replicas[index] = r = Replica(index, info, client)
            if not r.routed and info != r.info:
                r.info, r.client.url = info, info["url"].rstrip("/")
        return list(self.replicas)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH_EVERY)
            try:
                self._discover()
                await self._admit_ready()
            except Exception as e:  # a bug here would leave dead replicas out for good: end the run instead
                self.broken = RuntimeError(f"orchestrator: watching the inference replicas failed: "
                                           f"{type(e).__name__}: {e}")
                raise

    async def _admit_ready(self, initial: bool = False) -> None:
        """Bring every healthy unrouted replica into routing, once it holds the served version."""
        waiting = [r for r in self.replicas.values() if not r.routed]
        await asyncio.gather(*(self._admit(r, initial) for r in waiting))

    async def _open(self, r: Replica) -> None:
        if not r.opened:
            await r.client.__aenter__()
            r.opened = True

    async def _admit(self, r: Replica, initial: bool) -> None:
        await self._open(r)
        try:
            await r.client.wait_healthy(self.cfg.timeouts.startup if initial else 2.0)
            async with self.loading:
                r.client.forget_version()
                r.version = (await r.client.version())["version"]
                await self._ensure(r)
                r.routed = True
        except InferenceError as e:  # not up yet, or went away again: the next look tries again
            if initial:
                self.events.write("replica_unreachable", replica=r.index, error=str(e))
            return
        if initial:
            self.events.write("replica_routed", replica=r.index, url=r.info["url"], version=self.version)
        elif r.left_at is None:
            self.events.write("replica_joined", replica=r.index, url=r.info["url"], version=self.version)
        else:
            self.events.write("inference_recovered", replica=r.index, url=r.info["url"], version=self.version,
                              seconds=time.monotonic() - r.left_at)
        async with self.changed:
            self.changed.notify_all()

    async def _ensure(self, r: Replica) -> None:
        """A new or restarted replica holds the initial weights: load the served version (whose file, if a
        resume found it damaged, the trainer is publishing again)."""
        if r.version == self.version or self.version == 0:
            return
        marker = await self.link.marker(
            self.version, self.cfg.timeouts.train_step,
            f"orchestrator: the served version {self.version} was not published again within "
            f"{self.cfg.timeouts.train_step:.0f}s (timeouts.train_step)")
        await self._load_one(r, self.version, marker, patch=False)

    def unroute(self, r: Replica, error: Exception, what: str) -> None:
        if r.routed:
            r.routed, r.left_at = False, time.monotonic()
            self.events.write("replica_unrouted", replica=r.index, what=what, error=str(error))

    async def _wait_routed(self, deadline: float, what: str, trusted: bool = False) -> None:
        try:
            async with self.changed:
                await asyncio.wait_for(self.changed.wait_for(lambda: self.routed(trusted)), deadline)
        except asyncio.TimeoutError:
            raise InferenceUnavailable(
                f"no inference replica in routing for {deadline:.0f}s (timeouts.startup) while waiting for "
                f"{what}; replicas: {self.describe()}") from None

    def routed(self, trusted: bool = False) -> list[Replica]:
        return [r for r in self.replicas.values() if r.routed and not (trusted and "worker" in r.info)]

    def describe(self) -> str:
        return ", ".join(f"{r.index} {'routed' if r.routed else 'out'} ({r.info['url']})"
                         for r in self.replicas.values()) or "none has started"

    # --- generation ----------------------------------------------------------------------
    async def call(self, work, what: str, sequences: int = 1, trusted: bool = False):
        """`await work(client)` on the least-loaded replica; if that replica goes away, on another.
        `trusted`: on the run's own replicas only, not on joined workers (asyncrl/swarm/)."""
        for attempt in range(ATTEMPTS):
            if self.broken:
                raise self.broken
            if not self.routed(trusted):
                await self._wait_routed(self.cfg.timeouts.startup, what, trusted)
            r = min(self.routed(trusted), key=lambda r: (r.in_flight, r.index))
            r.in_flight += sequences
            r.sequences += sequences
            try:
                return await work(r.client)
            except InferenceUnavailable as e:
                self.unroute(r, e, what)
                if attempt + 1 == ATTEMPTS:
                    raise
                self.events.write("inference_unreachable", what=what, replica=r.index, error=str(e))
            finally:
                r.in_flight -= sequences

    # --- control ---------------------------------------------------------------------------
    async def _on_each_routed(self, call, what: str) -> list:
        """`await call(replica)` on every routed replica at once; the results of those that answered. One
        that fails with an inference error leaves routing (the watcher brings it back); any other error
        is raised."""
        replicas = self.routed()
        results = await asyncio.gather(*(call(r) for r in replicas), return_exceptions=True)
        answered = []
        for r, result in zip(replicas, results):
            if isinstance(result, InferenceError):
                self.unroute(r, result, what)
            elif isinstance(result, BaseException):
                raise result
            else:
                answered.append(result)
        return answered

    async def load(self, version: int, marker: dict) -> None:
        """Every routed replica loads `version`; one that fails leaves routing (and comes back holding it)."""
        async with self.loading:
            load = lambda r: self._load_one(r, version, marker)  # noqa: E731
            await self._on_each_routed(load, f"loading version {version}")
            self.version = version
            self.stager.forget_before(version)
        if not self.routed():
            await self._wait_routed(self.cfg.timeouts.startup, f"a replica holding version {version}")

    async def _load_one(self, r: Replica, version: int, marker: dict, patch: bool = True) -> None:
        patch = patch and r.version == version - 1
        body = await self.stager.body(r.info, version, marker, patch)
        try:
            await r.client.update_weights(body, self.cfg.timeouts.weight_load)
        except InferenceError:
            if not body.get("patch") or "actor" not in r.info:
                raise
            body = await self.stager.body(r.info, version, marker, patch=False)  # the patch missed
            await r.client.update_weights(body, self.cfg.timeouts.weight_load)
        r.version = version

    async def stats(self) -> dict:
        """The routed replicas' counters, summed (a replica that fails to answer leaves routing)."""
        total: dict = {}
        for stats in await self._on_each_routed(lambda r: r.client.stats(), "a stats query"):
            _add(total, stats)
        total["replicas_routed"] = len(self.routed())
        return total


def _add(total: dict, stats: dict) -> None:
    """Sum numbers (and dicts of numbers) key by key."""
    for key, value in stats.items():
        if isinstance(value, dict):
            _add(total.setdefault(key, {}), value)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            total[key] = total.get(key, 0) + value


def client_for(cfg, url: str, token: str | None = None, run_dir=None):
    """The client of the configured engine at `url`: asyncrl's own server (with the run's token), or a
    vLLM one (its versions from files, or broadcast by the trainer of the run in `run_dir`)."""
    if cfg.inference.engine == "vllm":
        nccl = cfg.inference.weight_transfer == "nccl"
        return VLLMClient(url, cfg.timeouts.http, model=cfg.model.path,
                          sender=RunDir(run_dir).weight_sender if nccl else None, token=token,
                          adapters=bool(cfg.trainer.lora.rank), routes=cfg.trainer.routing_replay)
    return InferenceClient(url, cfg.timeouts.http, token)
