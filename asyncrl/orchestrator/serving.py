"""The inference server as the orchestrator sees it: the version it serves, and its coming back.

If the server goes away mid-run (killed, restarted by the supervisor), a call fails with
InferenceUnavailable; `call` then waits for the new server (its URL from inference.json), has it
load the version the run is at, and retries, up to ATTEMPTS times.
"""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from asyncrl import weights
from asyncrl.events import EventLog
from asyncrl.files import apoll
from asyncrl.inference.client import InferenceClient, InferenceUnavailable

ATTEMPTS = 3  # a call whose server dies under it this often fails (a prompt so failing is dropped)


class Serving:
    def __init__(self, cfg, run_dir: Path, client: InferenceClient, events: EventLog, version: int):
        self.cfg, self.run_dir, self.client, self.events = cfg, run_dir, client, events
        self.version = version  # the version the server holds, once `ensure` has run
        self.recovering = asyncio.Lock()  # one recovery at a time

    async def call(self, call, what: str):
        """Run `call()`; if the server is unreachable, wait for it to come back and retry."""
        for attempt in range(ATTEMPTS):
            try:
                return await call()
            except InferenceUnavailable as e:
                if attempt + 1 == ATTEMPTS:
                    raise
                await self._recover(what, e)

    async def _recover(self, what: str, error: Exception) -> None:
        async with self.recovering:
            self.events.write("inference_unreachable", what=what, error=str(error))
            start = time.monotonic()
            self.client.url = json.loads((self.run_dir / "inference.json").read_text())["url"]
            await self.client.wait_healthy(self.cfg.timeouts.startup)
            self.client.forget_version()
            await self.ensure()
            self.events.write("inference_recovered", what=what, seconds=time.monotonic() - start,
                              version=self.version)

    async def ensure(self) -> None:
        """A restarted server holds the initial weights: load the version the run is at (whose file, if
        a resume found it damaged, the trainer is publishing again)."""
        held = (await self.client.version())["version"]
        if held != self.version and self.version > 0:
            marker = weights.marker_file(self.run_dir, self.version)
            await apoll(marker.exists, self.cfg.timeouts.train_step,
                        f"orchestrator: the served version {self.version} ({marker}) was not published again "
                        f"within {self.cfg.timeouts.train_step:.0f}s (timeouts.train_step)", every=0.05)
            body = weights.load_request(self.run_dir, self.version, patch=False)
            await self.client.update_weights(body, self.cfg.timeouts.weight_load)

    async def load(self, version: int, marker: dict) -> None:
        body = weights.load_request(self.run_dir, version, marker)
        await self.call(lambda: self.client.update_weights(body, self.cfg.timeouts.weight_load),
                        f"loading version {version}")
        self.version = version
