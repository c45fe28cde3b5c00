"""The staleness knob η = max_staleness (ALGORITHMS.md, "The staleness rule").

Admission (AReaL's capacity rule): with B groups per step, the n-th group may start only while
⌊n / B⌋ ≤ v + η, v being the version the inference server holds. So no more work starts than the
trainer can consume within η versions. Assembly: batch k (trained by version k) takes a group only
if k − (oldest version among its tokens) ≤ η; older ones are dropped, counted, and their
capacity is given back. With η = 0 this is synchronous on-policy training: batch k is generated
entirely by version k, and generation of batch k+1 starts only once version k+1 is served.
"""
from __future__ import annotations

import heapq


class StalenessGate:
    def __init__(self, groups_per_step: int, max_staleness: int):
        self.groups_per_step = groups_per_step
        self.max_staleness = max_staleness
        self.admitted = 0  # groups started, minus those dropped (their slot is given back)

    def can_admit(self, served_version: int) -> bool:
        return self.admitted // self.groups_per_step <= served_version + self.max_staleness

    def may_start(self, served_version: int, running: int, max_running: int, needed: int,
                  reissue: bool = False) -> bool:
        """Whether one more group may start now: under the cap on groups generating at once and, unless
        it re-issues a lost prompt (whose slot it holds already), within the run's `needed` groups and
        the staleness bound."""
        within = self.admitted < needed and self.can_admit(served_version)
        return running < max_running and (reissue or within)

    def admit(self) -> None:
        self.admitted += 1

    def release(self) -> None:
        """A started group will never be trained on (dropped or failed): free its slot."""
        self.admitted -= 1

    def fresh_enough(self, oldest_version: int, step: int) -> bool:
        return step - oldest_version <= self.max_staleness


# --- the ready pool: finished groups, the oldest first ------------------------------------------
def offer(ready: list, oldest_version: int, prompt_id: int, group) -> None:
    """A finished group into the pool batches are packed from (a heap; the prompt breaks ties, so the
    order is the same after a restart)."""
    heapq.heappush(ready, (oldest_version, prompt_id, group))


def take(ready: list, gate: StalenessGate, step: int) -> tuple[int, object, bool]:
    """The oldest finished group for batch `step`: (its oldest version, the group, whether it is fresh
    enough to train on; a stale one is the caller's to drop and `gate.release()`)."""
    oldest, _, group = heapq.heappop(ready)
    return oldest, group, gate.fresh_enough(oldest, step)
