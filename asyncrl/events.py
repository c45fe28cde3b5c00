"""`events.jsonl`: one line per thing that happened to the run (drops, restarts, recoveries).

Several processes append to it; each record is one short write in append mode, so lines do
not interleave."""
from __future__ import annotations

import json
import time
from pathlib import Path


class EventLog:
    def __init__(self, run_dir: str | Path, role: str):
        self.path, self.role = Path(run_dir) / "events.jsonl", role

    def write(self, event: str, **fields) -> None:
        line = json.dumps({"event": event, "role": self.role, "wall_time": time.time(), **fields}) + "\n"
        with open(self.path, "a") as f:
            f.write(line)


def read_events(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "events.jsonl"
    return (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    )
