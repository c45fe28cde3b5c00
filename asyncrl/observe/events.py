"""`events.jsonl`: one line per thing that happened to the run (drops, restarts, recoveries).

Several processes append to it; each record is one short write in append mode, so lines do
not interleave. A kind of event that keeps happening (the same event and reason) is written in full
REPEATS times per process, then counted: a `repeated` line at 10×REPEATS, 100×REPEATS, ... says how
many there were, so a run that fails the same way a million times leaves a few hundred lines, not
hundreds of megabytes. Exact counts of dropped samples and prompts are the ledger's."""
from __future__ import annotations

import json
import time
from pathlib import Path

from asyncrl.rundir import RunDir

REPEATS = 100


class EventLog:
    def __init__(self, run_dir: str | Path, role: str):
        self.path, self.role = RunDir(run_dir).events, role
        self.counts: dict[tuple[str, str], int] = {}  # (event, reason) -> occurrences in this process

    def write(self, event: str, **fields) -> None:
        kind = (event, str(fields.get("reason", "")))
        n = self.counts[kind] = self.counts.get(kind, 0) + 1
        if n <= REPEATS:
            self._append(event, fields)
        elif n == REPEATS + 1 or _power_of_ten(n // REPEATS) and n % REPEATS == 0:
            self._append("repeated", {"of": event, "reason": kind[1], "count": n,
                                      "note": "counted, not written, from here on", "last": fields})

    def _append(self, event: str, fields: dict) -> None:
        line = json.dumps({"event": event, "role": self.role, "wall_time": time.time(), **fields}) + "\n"
        with open(self.path, "a") as f:
            f.write(line)


def _power_of_ten(n: int) -> bool:
    while n >= 10 and n % 10 == 0:
        n //= 10
    return n == 1


def read_events(run_dir: str | Path) -> list[dict]:
    path = RunDir(run_dir).events
    return (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    )
