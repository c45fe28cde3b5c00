"""What every objective receives, and the pieces several objectives share.

Tensors are [rows, tokens]: one row per trajectory, token t holding the logprob of token t+1.
An objective returns a per-token loss (the trainer weights and sums it, see
`trainer.step.aggregation_weights`) and a dict of float metrics. Positions where `mask` is 0
may hold any value, even inf or nan: objectives must not let them leak.
"""
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
    rewards: torch.Tensor     # [rows] the trajectory's reward
    groups: torch.Tensor      # [rows] integer id of the prompt group the row belongs to
    # on-policy distillation (None without a teacher): log π_T(y_t), and at each position the teacher's
    # top-k logprobs [rows, tokens, k] (-inf where not sampled) with the current policy's logprobs of the
    # same ids (with gradient)
    teacher: torch.Tensor | None = None
    teacher_top: torch.Tensor | None = None
    top_logp: torch.Tensor | None = None


def masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x where mask is set, 0 elsewhere (also where x is inf or nan)."""
    return torch.where(mask > 0, x, torch.zeros_like(x))


def masked_fraction(flags: torch.Tensor, mask: torch.Tensor) -> float:
    """Share of counted tokens where `flags` holds (0 when nothing counts)."""
    total = mask.sum()
    return float((flags.float() * mask).sum() / total) if total > 0 else 0.0


def seq_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked(x, mask).sum(-1)


def seq_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-row mean over counted tokens; 0 for a row with none."""
    return seq_sum(x, mask) / mask.sum(-1).clamp(min=1)


def clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float,
                      dual_clip: float | None = None):
    """PPO's −min(r·A, clip(r, 1−ε_low, 1+ε_high)·A), and where each side clipped.

    Dual clip (Ye et al. 2020, arXiv 1912.09729): for A < 0 the loss is at most −c·A, so one
    token with a huge ratio cannot dominate the step.
    """
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    loss = -torch.minimum(ratio * adv, clipped * adv)
    if dual_clip is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -dual_clip * adv), loss)
    return loss, (ratio < 1 - eps_low) & (adv < 0), (ratio > 1 + eps_high) & (adv > 0)


def clip_metrics(low: torch.Tensor, high: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    return {"clip_low": masked_fraction(low, mask), "clip_high": masked_fraction(high, mask)}


def importance_weight(log_rho: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """exp of a per-token log-ratio at token level, or one value per row broadcast to its tokens:
    `sequence` exp(Σ_t), `geometric` exp(mean_t)."""
    if level == "token":
        return torch.exp(masked(log_rho, mask))
    per_row = seq_sum(log_rho, mask) if level == "sequence" else seq_mean(log_rho, mask)
    return torch.exp(per_row)[:, None].expand_as(log_rho)
