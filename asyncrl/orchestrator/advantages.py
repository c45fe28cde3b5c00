"""Group-relative advantages (ALGORITHMS.md, "Advantages"): one number per trajectory."""
from __future__ import annotations

import statistics


def group_advantages(rewards: list[float], kind: str = "grpo") -> list[float]:
    """grpo: (R − mean) / (std + 1e-6), population std; dr_grpo: R − mean; rloo: R − mean of the others."""
    mean = statistics.fmean(rewards)
    if kind == "grpo":
        std = statistics.pstdev(rewards)
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
