"""The circuit breaker: a run that cannot accept a single sample stops, and says why.

A verifier that always raises, a JSONL file whose every row is invalid, an agent that always
fails, an engine whose every step fails (its samples come back aborted): each sample is dropped,
the run never reaches its next step, and without a breaker it would spin until a timeout far away.
The breaker counts failed samples since the last accepted one; `rollout.max_failed_samples` of
them in a row, or `timeouts.no_accepted_sample` seconds of failures with none accepted (and at
least MIN_FAILED of them: a pause while the trainer catches up is not a failure), end the run with
the first and the most frequent error.
"""
from __future__ import annotations

import time
from collections import Counter

from asyncrl.run.role import FatalError

MIN_FAILED = 16


class RunCannotProgress(FatalError):
    pass


class Breaker:
    def __init__(self, max_failed: int, seconds: float):
        self.max_failed, self.seconds = max_failed, seconds
        self._reset()

    def _reset(self) -> None:
        self.failed, self.since, self.first = 0, None, None
        self.errors: Counter[str] = Counter()

    def record(self, accepted: int, failures: list[tuple[str, str]]) -> None:
        """`accepted` samples kept and `failures` as (reason, error) since the last call; raises
        RunCannotProgress once the run has failed too long."""
        if accepted:
            self._reset()
        for reason, error in failures:
            if self.since is None:
                self.since = time.monotonic()
            message = f"{reason}: {error}" if error else reason
            self.first = self.first or message
            self.errors[message[:300]] += 1
            self.failed += 1
        if self.failed and not accepted:
            self._check()

    def _check(self) -> None:
        waited = time.monotonic() - self.since
        if self.failed < self.max_failed and (waited < self.seconds or self.failed < MIN_FAILED):
            return
        common, count = self.errors.most_common(1)[0]
        limit = (f"rollout.max_failed_samples = {self.max_failed}" if self.failed >= self.max_failed
                 else f"timeouts.no_accepted_sample = {self.seconds:g}s")
        raise RunCannotProgress(
            f"no sample could be accepted: {self.failed} failed in a row over {waited:.0f}s ({limit}). "
            f"First error: {self.first}. Most frequent ({count} of {self.failed}): {common}"
        )
