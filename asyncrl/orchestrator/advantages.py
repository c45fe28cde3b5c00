"""Group-relative advantages (ALGORITHMS.md, "Advantages"): one number per trajectory."""
from __future__ import annotations

import math
import statistics


def group_advantages(rewards: list[float], kind: str = "grpo") -> list[float]:
    """grpo: (R − mean) / (std + 1e-6), population std; dr_grpo: R − mean; rloo: R − mean of the others."""
    mean = statistics.fmean(rewards)
    if kind == "grpo":  # (statistics.pstdev computes in fractions: 0.2 ms a group, most of assembly's CPU)
        std = math.sqrt(statistics.fmean([(r - mean) ** 2 for r in rewards]))
        return [(r - mean) / (std + 1e-6) for r in rewards]
    if kind == "dr_grpo":
        return [r - mean for r in rewards]
    if kind == "rloo":
        g = len(rewards)
        if g == 1:
            return [0.0]
        return [r - (sum(rewards) - r) / (g - 1) for r in rewards]
    raise ValueError(f"advantage kind {kind!r} is not one of grpo, dr_grpo, rloo")


class RunningBaseline:
    """A_i = R_i − b, b an exponential moving average of past group mean rewards (SAO's single
    rollout per prompt has no group to normalise against)."""

    def __init__(self, decay: float):
        self.decay = decay
        self.value: float | None = None

    def __call__(self, rewards: list[float]) -> list[float]:
        mean = statistics.fmean(rewards)
        base = mean if self.value is None else self.value
        self.value = mean if self.value is None else self.decay * self.value + (1 - self.decay) * mean
        return [r - base for r in rewards]


def advantage_fn(kind: str, decay: float):
    """rewards of one group -> advantages, for the configured kind."""
    if kind == "running_baseline":
        return RunningBaseline(decay)
    return lambda rewards: group_advantages(rewards, kind)


def normalize_per_task(trajs: list) -> None:
    """AgentRL's task advantage normalisation: within one batch, each task's token advantages
    are rescaled to mean 0 and std 1, so a task with larger rewards or longer replies does not
    drown the others' gradient. In place; a task whose advantages are all equal is left at 0."""
    by_task: dict[str, list] = {}
    for t in trajs:
        by_task.setdefault(t.task, []).append(t)
    for group in by_task.values():
        values = [a for t in group for a, m in zip(t.advantages, t.loss_mask) if m]
        if not values:
            continue
        mean = sum(values) / len(values)
        std = (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5
        for t in group:
            t.advantages = [
                (a - mean) / (std + 1e-6) if m else 0.0 for a, m in zip(t.advantages, t.loss_mask)
            ]
