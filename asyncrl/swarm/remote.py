"""A joined worker as the router sees it: a replica's client whose requests wait in a queue until the
worker pulls them (POST /v1/work), and whose answers arrive when the worker posts them (/v1/results).

Each request is one lease. The worker names the leases it is working on in every poll; a lease it has
not named (or answered) for `workers.lease_seconds`, or every lease of a worker that stopped polling,
fails with InferenceUnavailable: the router takes the worker out of routing and asks another replica
for the groups not yet delivered (the ledger's leases table says so: expired). A version load is a word
in the worker's next poll; a worker that has not loaded it within `workers.load_grace_seconds` leaves
routing until it holds it (the router's watcher lets it back in), so a slow link slows no one else.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

from asyncrl.inference.client import InferenceError, InferenceUnavailable
from asyncrl.swarm.checks import prompt_digest
from asyncrl.swarm.trust import Trust

LOOK_EVERY = 0.25  # seconds between looks at a waiting request's lease


@dataclass(eq=False)  # (one lease is itself: looked up in lists by identity)
class Lease:
    id: str
    prompts: list[list[int]]
    params: dict  # n, max_tokens, temperature, top_p, stop_token_ids
    issued_version: int
    on_group: object  # on_group(i, choices): prompt i's checked samples
    digests: list[str] = field(default_factory=list)
    delivered: set = field(default_factory=set)
    heard: float = 0.0  # monotonic: taken, named in a poll, or answered
    taken: bool = False
    taken_at: float = 0.0
    done: asyncio.Event = field(default_factory=asyncio.Event)
    error: Exception | None = None  # why it ended without its samples

    def body(self) -> dict:
        return {"lease": self.id, "prompts": self.prompts, "prompt_sha256": self.digests,
                "version": self.issued_version, **self.params}


class JoinedWorker:
    """The router's client for one joined worker (its Replica's `client`), and the worker's state."""

    def __init__(self, name: str, swarm, trust: Trust):
        self.name, self.swarm, self.trust = name, swarm, trust
        self.url = f"worker:{name}"
        self.held = -1  # the version it holds, as its last poll said (-1: not yet joined)
        self.wanted: int | None = None  # the version it was told to load
        self.late_for = 0  # the last version it failed to load within the grace
        self.last_seen = 0.0  # monotonic time of its last poll or result
        self.shut_out: str | None = None  # revoked or quarantined: why
        self.waiting: list[Lease] = []  # not yet taken
        self.leases: dict[str, Lease] = {}  # given out, not yet done
        self.arrived = asyncio.Event()  # work queued or a version to load: a poll answers at once
        self.tokens, self.samples = 0, 0  # completion tokens accepted; samples returned
        self.first_version: int | None = None  # the version served when it took its first work
        self._ids = itertools.count()

    # --- the router's client interface ------------------------------------------------------
    async def __aenter__(self) -> "JoinedWorker":
        return self

    async def __aexit__(self, *exc) -> None:
        pass

    def alive(self) -> bool:
        return self.shut_out is None and time.monotonic() - self.last_seen < self.swarm.cfg.lease_seconds

    async def wait_healthy(self, deadline: float) -> None:
        end = time.monotonic() + deadline
        while not self.alive():
            if self.shut_out or time.monotonic() > end:
                raise InferenceError(f"joined worker {self.name} is {self.shut_out or 'not polling'}")
            await asyncio.sleep(0.1)

    async def version(self, with_hash: bool = False) -> dict:
        return {"version": self.held}

    def forget_version(self) -> None:
        pass

    async def stats(self) -> dict:
        return {"tokens_generated": self.tokens}

    async def update_weights(self, body: dict, timeout: float) -> dict:
        """Tell the worker to load body["version"] and give it workers.load_grace_seconds to (the router
        holds the served version still meanwhile). One that misses it leaves routing, its requests not yet
        taken go to other replicas, and it is not waited for again until it holds the version it missed:
        a slow link costs the run at most one grace per version that worker loads."""
        version, grace = body["version"], self.swarm.cfg.load_grace_seconds
        told_before, self.wanted = self.wanted == version, version
        self.arrived.set()
        waits = not told_before and self.held >= self.late_for
        end = time.monotonic() + (grace if waits else 0)
        while self.held != version:
            if self.shut_out or time.monotonic() >= end:
                self.late_for = max(self.late_for, version) if waits else self.late_for
                self._release(f"loading version {version}")
                after = f" after {grace:.0f}s (workers.load_grace_seconds)" if waits else ""
                raise InferenceUnavailable(f"joined worker {self.name} holds version {self.held}, not "
                                           f"{version}{after}: out of routing until it does")
            await asyncio.sleep(0.02)
        return {"version": self.held}

    def _release(self, why: str) -> None:
        """Its requests not yet taken fail now, to be asked of another replica."""
        for lease in list(self.waiting):
            self.finish(lease, "expired", InferenceUnavailable(f"joined worker {self.name} is {why}"))

    async def complete_groups(self, prompts, n, max_tokens, temperature, top_p, on_group, images=None,
                              image_bytes=None) -> None:
        """A wave's part (asyncrl/orchestrator/waves.py): agent episodes and evaluations stay on the run's
        own replicas (Router.call(trusted=True)), so the samples of a joined worker are all plain groups."""
        params = {"n": n, "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
                  "stop_token_ids": []}
        await self._run(prompts, params, on_group, images)

    # --- leases ------------------------------------------------------------------------------
    async def _run(self, prompts, params, on_group, images) -> None:
        if images and any(images):
            raise InferenceUnavailable(f"joined worker {self.name}: joined workers take text-only work")
        lease = Lease(f"{self.name}.{self.swarm.epoch}.{next(self._ids)}", prompts, params,
                      self.swarm.router.version, on_group, [prompt_digest(p) for p in prompts])
        self.waiting.append(lease)
        self.arrived.set()
        try:
            while not lease.done.is_set():
                try:
                    await asyncio.wait_for(lease.done.wait(), LOOK_EVERY)
                except asyncio.TimeoutError:
                    self._check(lease)
        finally:
            self.leases.pop(lease.id, None)
            if lease in self.waiting:
                self.waiting.remove(lease)
        if lease.error is not None:
            raise lease.error

    def _check(self, lease: Lease) -> None:
        """Raise if the lease is lost: the worker was shut out, stopped polling, dropped this work, or has
        held it longer than a replica may take over a request (timeouts.http: a worker naming work it
        never returns would otherwise hold its groups, and with them admission, for ever)."""
        now = time.monotonic()
        silent = now - (lease.heard if lease.taken else self.last_seen)
        held = now - lease.taken_at if lease.taken else 0.0
        if self.shut_out or silent > self.swarm.cfg.lease_seconds or held > self.swarm.request_deadline:
            why = self.shut_out or (f"silent on it for {silent:.0f}s (workers.lease_seconds)"
                                    if silent > self.swarm.cfg.lease_seconds else
                                    f"held for {held:.0f}s (timeouts.http)")
            if lease.taken:
                self.swarm.roster.end(lease.id, "expired", why)
            raise InferenceUnavailable(f"joined worker {self.name} lost lease {lease.id}: {why}")

    def take(self) -> Lease | None:
        """The oldest waiting request, given to the worker now."""
        if not self.waiting:
            return None
        lease = self.waiting.pop(0)
        lease.taken, lease.heard = True, time.monotonic()
        lease.taken_at = lease.heard
        self.first_version = lease.issued_version if self.first_version is None else self.first_version
        self.leases[lease.id] = lease
        self.swarm.roster.issue(lease.id, self.name, lease.digests, lease.issued_version)
        return lease

    def heard_from(self, version: int, working: list) -> None:
        now = time.monotonic()
        self.last_seen, self.held = now, version
        for lease_id in working:
            if lease_id in self.leases:
                self.leases[lease_id].heard = now

    def finish(self, lease: Lease, state: str = "returned", error: Exception | None = None) -> None:
        lease.error = error
        self.swarm.roster.end(lease.id, state, str(error) if error else None)
        lease.done.set()

    def drop_all(self, why: str) -> None:
        """Shut out: every request it holds or would take fails now, to be asked of another replica."""
        self.shut_out = why
        self._release(why)
        for lease in list(self.leases.values()):
            self.finish(lease, "expired", InferenceUnavailable(f"joined worker {self.name}: {why}"))
