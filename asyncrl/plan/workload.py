"""What a run asks of its roles: prompt and answer lengths, agent turns and tool latency.

Either measured (the groups of a run, from its ledger: `Workload.from_run`) or described: each
length a mixture of uniform ranges [[low, high, weight], ...] (the long-tailed reversal task is
[[2, 6, 7], [16, 30, 1]]), answers of one prompt the same length (`shared`: a task whose answer
length the prompt decides) or drawn apiece; an agent's episode is `turns` answers, each after the
first coming back from a tool after `tool_seconds` with `tool_tokens` more context.
"""
from __future__ import annotations

import json
import random
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.rundir import RunDir

DESCRIBED = ("prompt", "answer", "shared", "turns", "tool_seconds", "tool_tokens")  # a workload file's keys


@dataclass
class Episode:
    """One sample: its prompt's length and the tokens it generates in each turn."""
    prompt: int
    turns: list[int]


@dataclass
class Workload:
    prompt: list[list[float]] = field(default_factory=lambda: [[8, 8, 1]])
    answer: list[list[float]] = field(default_factory=lambda: [[4, 4, 1]])
    shared: bool = False
    turns: int = 1
    tool_seconds: float = 0.0
    tool_tokens: int = 0
    measured: list[list[Episode]] | None = None  # groups of a run, replayed in order

    def __post_init__(self):
        for name in ("prompt", "answer"):
            ranges = getattr(self, name)
            if not ranges or any(len(r) != 3 or not 1 <= r[0] <= r[1] or r[2] <= 0 for r in ranges):
                raise ValueError(f"workload.{name} must be [[low, high, weight], ...] with 1 ≤ low ≤ high "
                                 f"and weight > 0, got {ranges!r}")
        if self.turns < 1 or self.tool_seconds < 0 or self.tool_tokens < 0:
            raise ValueError("workload: turns ≥ 1, tool_seconds ≥ 0 and tool_tokens ≥ 0")

    @classmethod
    def read(cls, path: str | Path) -> Workload:
        data = json.loads(Path(path).read_text())
        if extra := sorted(set(data) - set(DESCRIBED)):
            raise ValueError(f"{path}: unknown workload keys {', '.join(extra)}")
        return cls(**data)

    @classmethod
    def from_run(cls, run_dir: Path, limit: int = 20_000) -> Workload:
        """The groups a run trained on, each sample's prompt length and its turns' generated lengths."""
        db = sqlite3.connect(f"file:{RunDir(run_dir).ledger}?mode=ro", uri=True)
        try:
            rows = db.execute("SELECT prompt_id, data FROM samples WHERE state IN ('batched', 'committed') "
                              "ORDER BY step, position LIMIT ?", (limit,)).fetchall()
        finally:
            db.close()
        groups: dict[int, list[Episode]] = {}
        for prompt_id, data in rows:
            groups.setdefault(prompt_id, []).append(_episode(json.loads(data)))
        if not groups:
            raise ValueError(f"{run_dir}: its ledger holds no trained samples to measure the workload from")
        first = next(iter(groups.values()))[0]
        return cls(turns=len(first.turns), measured=list(groups.values()))

    def groups(self, size: int, seed: int = 0):
        """Endless groups of `size` episodes."""
        rng = random.Random(seed)
        while True:
            if self.measured:
                yield from (g[:size] + [rng.choice(g) for _ in range(size - len(g))] for g in self.measured)
                continue
            prompt = _draw(self.prompt, rng)
            turns = lambda: [_draw(self.answer, rng) for _ in range(self.turns)]  # noqa: E731
            same = turns()
            yield [Episode(prompt, same if self.shared else turns()) for _ in range(size)]


def _draw(ranges: list[list[float]], rng: random.Random) -> int:
    low, high, _ = rng.choices(ranges, weights=[r[2] for r in ranges])[0]
    return rng.randint(int(low), int(high))


def _episode(traj: dict) -> Episode:
    """Prompt length and the generated runs of a trajectory (its sampled tokens, turn by turn)."""
    mask = traj["loss_mask"]
    prompt = mask.index(1) if 1 in mask else len(mask)
    turns, run = [], 0
    for m in mask[prompt:]:
        if m:
            run += 1
        elif run:
            turns.append(run)
            run = 0
    return Episode(prompt, turns + [run] if run or not turns else turns)
