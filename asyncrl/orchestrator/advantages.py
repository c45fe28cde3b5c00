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
