"""The orchestrator's channel to the trainer: batches out, published versions and durable checkpoints back.

`FileLink`: the trainer shares the run directory (the local launcher, or Ray without run.storage): a
batch is delivered once its file is written, a version is published once its marker is, and the
checkpoints are read where the trainer writes them.

`RayLink` (run.launcher = "ray" with run.storage): the trainer runs on any node, in its own directory
in run.storage, and this link is all it shares with the driver. Each batch, written to the run
directory first (with the ledger, the durable record), goes to the trainer's host through the object
store, sha256-checked on arrival; every batch the trainer may still need (from the last durable
checkpoint on) is sent again to a host that has not confirmed it, so a trainer restarted on another
host finds them. Markers, checkpoint steps and the trainer's events come back as actor calls, and a
version's weights go from the trainer's node straight to the replicas' (Stager, `fetch`).
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import time
from pathlib import Path

from asyncrl.files import apoll
from asyncrl.inference.client import InferenceError
from asyncrl.rundir import RunDir
from asyncrl.store import checkpoint
from asyncrl.transports import weights

ASK_EVERY = 1.0  # seconds an actor call waits for a marker before the link looks at the host again


def trainer_link(cfg, run_dir: Path) -> "FileLink | RayLink":
    return RayLink(cfg, run_dir) if cfg.run.launcher == "ray" and cfg.run.storage else FileLink(cfg, run_dir)


class FileLink:
    fetch = None  # (replicas read versions from the run directory)

    def __init__(self, cfg, run_dir: Path):
        self.cfg, self.run_dir = cfg, run_dir
        self.root = RunDir(run_dir).checkpoints  # (run.storage, read from the config once)

    async def start(self, committed_through: int) -> None:
        pass

    async def deliver(self, step: int) -> None:
        pass  # (the trainer reads the file)

    async def marker(self, version: int, deadline: float, what: str, check=lambda: None) -> dict:
        """Version `version`'s marker once published; `check()` may raise to end the wait early."""
        path = RunDir(self.run_dir).marker(version)

        def published() -> bool:  # (a stat every 5 ms; reading the marker each time cost 5% of this process)
            check()
            return path.exists()

        await apoll(published, deadline, what, every=0.005)
        return weights.read_marker(self.run_dir, version)

    async def checkpoints(self, verify: bool = False) -> list[int]:
        return checkpoint.valid_steps(self.root, verify=verify)

    async def copy_events(self, ledger) -> None:
        pass  # (the trainer writes them into the run's events.jsonl)

    def where(self) -> str:
        return str(self.root)


class RayLink:
    def __init__(self, cfg, run_dir: Path):
        import ray

        self.ray, self.cfg, self.run_dir = ray, cfg, run_dir
        self.host, self.host_id = None, None
        self.info: dict = {}
        self.confirmed: set[int] = set()  # batches the current host holds
        self.behind = True  # a batch may be missing on the host: a new host, or a delivery that failed
        self.committed_through = 0  # batches before it are trained for good: never sent again

    # --- the trainer's host ---------------------------------------------------------------------
    def _current(self):
        """The trainer's host as trainer.json names it; a new host (a restart) holds no confirmed batch."""
        path = RunDir(self.run_dir).trainer_info
        try:
            info = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        if info["host"] != self.host_id:
            if not self.ray.is_initialized():
                self.ray.init(address=info["ray_address"], namespace=info["namespace"], log_to_driver=False,
                              logging_level="WARNING")
            try:
                self.host = self.ray.get_actor(info["actor"], namespace=info["namespace"])
            except ValueError:  # gone already: the supervisor is starting another
                return None
            self.host_id, self.info, self.confirmed, self.behind = info["host"], info, set(), True
        return self.host

    async def _ask(self, call, timeout: float):
        """`await host.call(...)` within `timeout`; None if the host is gone or does not answer (the
        supervisor restarts the trainer; the next look finds its new host)."""
        try:
            return await asyncio.wait_for(call(), timeout)
        except (asyncio.TimeoutError, self.ray.exceptions.RayActorError):
            self.host_id = None
            return None

    async def start(self, committed_through: int) -> None:
        self.committed_through = committed_through
        await apoll(self._current, self.cfg.timeouts.startup,
                    f"orchestrator: the trainer's host did not appear in {RunDir(self.run_dir).trainer_info} "
                    f"within {self.cfg.timeouts.startup:.0f}s (timeouts.startup)", every=0.1)
        await self._send_missing()

    # --- batches ----------------------------------------------------------------------------------
    async def deliver(self, step: int) -> None:
        host = self._current()
        if host is None:
            self.behind = True  # (sent once the new host is up: _send_missing)
            return
        data = await asyncio.to_thread(RunDir(self.run_dir).batch(step).read_bytes)
        ref = self.ray.put(data)
        digest = hashlib.sha256(data).hexdigest()
        if await self._ask(lambda: host.receive_batch.remote(step, [ref], digest), self.cfg.timeouts.batch):
            self.confirmed.add(step)
        else:
            self.behind = True

    async def _send_missing(self) -> None:
        """Every batch from the last durable checkpoint on that the current host has not confirmed (a look
        at the batch files only after a host change or a failed delivery, not with every version)."""
        if not self.behind:
            return
        self.behind = False
        for _, path in RunDir(self.run_dir).batch_files():
            step = int(path.stem.removeprefix("step_"))
            if step >= self.committed_through and step not in self.confirmed:
                await self.deliver(step)

    # --- versions and checkpoints -----------------------------------------------------------------
    async def marker(self, version: int, deadline: float, what: str, check=lambda: None) -> dict:
        start = time.monotonic()
        while time.monotonic() - start < deadline:
            check()
            host = self._current()
            if host is None:
                await asyncio.sleep(0.1)
                continue
            await self._send_missing()
            found = await self._ask(lambda: host.wait_version.remote(version, ASK_EVERY), ASK_EVERY + 10)
            if found is not None:
                return found
            if self.host_id is None:  # gone: the supervisor names its successor in trainer.json
                await asyncio.sleep(0.2)
        raise TimeoutError(what)

    async def fetch(self, version: int, kind: str) -> tuple[object, str]:
        """(object ref, sha256) of version `version`'s full file or patch, put once by the trainer's host."""
        host = self._current()
        try:
            if host is None:
                raise RuntimeError("it is being restarted")
            refs, digest = await asyncio.wait_for(host.put_version.remote(version, kind),
                                                  self.cfg.timeouts.weight_load)
        except (asyncio.TimeoutError, RuntimeError, self.ray.exceptions.RayError) as e:
            raise InferenceError(f"the trainer's host could not hand out version {version} ({kind}): "
                                 f"{type(e).__name__}: {e}") from None
        return refs[0], digest

    async def checkpoints(self, verify: bool = False) -> list[int]:
        host = self._current()
        steps = await self._ask(lambda: host.checkpoints.remote(verify), 30) if host else None
        if steps:
            self.committed_through = max(self.committed_through, steps[-1])
        return steps or []

    async def copy_events(self, ledger) -> None:
        """The trainer's new events into the run's events.jsonl (the ledger keeps how far: a restarted
        orchestrator copies none twice)."""
        host = self._current()
        offset = ledger.get("trainer_events_offset", 0)
        answer = await self._ask(lambda: host.events_since.remote(offset), 30) if host else None
        if answer and answer[0]:
            with open(RunDir(self.run_dir).events, "a") as f:
                f.write(answer[0])
            ledger.put("trainer_events_offset", answer[1])

    def where(self) -> str:
        return f"{self.info.get('dir', 'run.storage')} on {self.info.get('node', 'the trainer node')}"
