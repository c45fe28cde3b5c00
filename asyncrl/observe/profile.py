"""Where a role's time goes: named phases timed around the code that does them.

Each role keeps one `Phases` and reports its running totals (seconds since the role started)
with its metrics; the run report stacks them per role (asyncrl/observe/report.py), so a user sees what
bounds the run: generation, scoring, logprob recomputation, forward/backward, optimizer,
weight publish/load, or waiting.
"""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

# The phases that are a role's own compute; every other phase is the framework's (serialization,
# transport, bookkeeping) or waiting for another role. recompute_kv is the engine's prefill of its
# running rows under new weights (update_policy = "interrupt"): model compute the policy asks for.
COMPUTE = {"generate", "score", "recompute", "recompute_kv", "forward_backward", "optimizer"}
WAITING = {"wait_batch", "idle"}


class Phases:
    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, name: str):
        start = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] += time.monotonic() - start

    def totals(self, prefix: str) -> dict[str, float]:
        """{"<prefix>/<phase>": seconds} for a metrics record."""
        return {f"{prefix}/{name}": round(value, 4) for name, value in self.seconds.items()}
