"""What every objective receives: per-token tensors of one (mini)batch, shape [rows, tokens]."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LossInputs:
    logp: torch.Tensor        # current policy log π_θ(y_t), with gradient
    behav: torch.Tensor       # behaviour logprob recorded by the engine that sampled the token
    prox: torch.Tensor        # proximal policy (weights at the start of this step), no gradient
    advantages: torch.Tensor  # per token
    mask: torch.Tensor        # 1.0 where the policy sampled the token and it counts, else 0.0
    staleness: torch.Tensor   # versions between the sampling policy and the trained one


def masked_fraction(flags: torch.Tensor, mask: torch.Tensor) -> float:
    """Share of counted tokens where `flags` holds (0 when nothing counts)."""
    total = mask.sum()
    return float((flags.float() * mask).sum() / total) if total > 0 else 0.0
