"""The unit of data that crosses process boundaries (DESIGN.md, "The unit of data")."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import orjson

from asyncrl.files import atomic_path
from asyncrl.rundir import RunDir


@dataclass
class Trajectory:
    id: str
    group_id: str
    task: str
    prompt_id: int
    tokens: list[int]        # prompt + completion (+ tool/env turns)
    loss_mask: list[int]     # 1 only where the policy sampled the token
    logprobs: list[float]    # behaviour logprob per token (0.0 where not sampled)
    versions: list[int]      # policy version that sampled each token (-1 elsewhere)
    reward: float = 0.0
    advantages: list[float] = field(default_factory=list)
    info: dict = field(default_factory=dict)
    # on-policy distillation (docs/distillation.md): the teacher's logprob of each token (0.0 where the
    # policy did not sample it), and where teacher.top_k is set its k likeliest tokens at each sampled
    # position ([ids, logprobs]; [] elsewhere). None: the run has no teacher.
    teacher_logprobs: list[float] | None = None
    teacher_top: list[list[list]] | None = None
    # a mixture-of-experts policy's routing (docs/moe.md): the experts the engine chose for each token it
    # fed, [len(tokens) - 1, MoE layers, top-k] packed (asyncrl/policy/routing.py); None: a dense policy,
    # or an engine that does not record it
    routing: dict | None = None
    # a vision-language policy's prompt images (asyncrl/vision/): their content hashes, in prompt order;
    # the bytes are in the run's image store, once however many samples and batches show them
    images: list[str] | None = None

    @property
    def oldest_version(self) -> int:
        sampled = [v for v in self.versions if v >= 0]
        return min(sampled) if sampled else -1

    def to_json(self) -> str:
        # the fields are plain JSON values already: no dataclasses.asdict deep copy (it was a fifth
        # of the orchestrator's CPU); orjson writes the float lists ~10x faster than json
        return orjson.dumps(vars(self)).decode()

    @classmethod
    def from_json(cls, text: str | bytes) -> "Trajectory":
        return cls(**orjson.loads(text))

    def staleness(self, trained_version: int) -> int:
        """Versions between the oldest token's sampler and the weights that train on it."""
        return trained_version - self.oldest_version


def write_batch(run_dir: str | Path, step: int, trajectories: list[Trajectory], settings: dict | None = None,
                actions: list[str] = ()) -> Path:
    """Atomically: the trainer never sees a half-written batch. `settings`: the live settings in force
    at this step, `actions`: what the trainer is asked to do after it (asyncrl/control/live.py); a first line
    of their own, written only when there are any."""
    path = RunDir(run_dir).batch(step)
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        if settings or actions:
            f.write(orjson.dumps({"settings": settings or {}, "actions": list(actions)}).decode() + "\n")
        for t in trajectories:
            f.write(t.to_json() + "\n")
    return path


HEADER = '{"settings"'


def read_batch(path: str | Path) -> list[Trajectory]:
    with open(path) as f:
        return [Trajectory.from_json(line) for line in f if line.strip() and not line.startswith(HEADER)]


def read_header(path: str | Path) -> dict:
    """{"settings": the live settings the batch was assembled under, "actions": for the trainer}."""
    with open(path) as f:
        first = f.readline()
    return orjson.loads(first) if first.startswith(HEADER) else {"settings": {}, "actions": []}
