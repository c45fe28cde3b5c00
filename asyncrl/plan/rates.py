"""What a layout's parts cost: the rate model `asyncrl plan` simulates with.

Seconds, per device: an inference replica's decode step is `decode_base + decode_per_row · rows`
and a prefill `prefill_base + prefill_per_token · tokens` (the built-in engine measures both lines
as it runs: asyncrl/observe/fit.py); a version's load takes `load_seconds` on each replica. A
training step on one rank is `step_base + step_per_token · completion tokens`; `ranks` ranks
divide the per-token part (data parallel). `group_seconds` is the orchestrator's and the
verifier's time from a group's last token to the ready pool; `handoff_seconds` from a published
version to the replicas' load. `asyncrl plan --calibrate RUN_DIR` fits them from a run
(asyncrl/plan/calibrate.py); a file of them is what a user writes for hardware not yet rented.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

REQUIRED = ("decode_base", "decode_per_row", "prefill_base", "prefill_per_token", "load_seconds", "step_base",
            "step_per_token")


@dataclass
class Rates:
    decode_base: float
    decode_per_row: float
    prefill_base: float
    prefill_per_token: float
    load_seconds: float
    step_base: float
    step_per_token: float
    group_seconds: float = 0.0
    handoff_seconds: float = 0.0
    source: str = ""  # where they were measured (a run directory, a paper)

    @classmethod
    def read(cls, path: str | Path) -> Rates:
        data = json.loads(Path(path).read_text())
        names = [f.name for f in fields(cls)]
        missing = [n for n in REQUIRED if n not in data]
        extra = sorted(set(data) - set(names))
        if missing or extra:
            said = [f"{what} {', '.join(ks)}" for what, ks in (("missing", missing), ("unknown", extra))
                    if ks]
            raise ValueError(f"{path}: {'; '.join(said)}")
        rates = cls(**data)
        if bad := [n for n in names if n != "source" and not (isinstance(data.get(n, 0), (int, float))
                                                               and getattr(rates, n) >= 0)]:
            raise ValueError(f"{path}: rates are seconds ≥ 0; not so: {', '.join(bad)}")
        return rates

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1) + "\n")

    def decode_tokens_per_s(self, rows: int) -> float:
        """A replica's decode throughput with `rows` sequences running."""
        return rows / (self.decode_base + self.decode_per_row * rows)
