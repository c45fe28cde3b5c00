"""Masked importance sampling (MIS / IcePop) for the train–inference mismatch.

IcePop: Ling Team 2025, "Every Step Evolves: Scaling RL for Trillion-Scale Thinking Model"
(Ring-1T, arXiv 2510.18855, eq. 4); masked IS as in verl's rollout correction. Where the engine
and the trainer disagree too much, the token (or whole sequence) carries no gradient at all
rather than a truncated one; inside the band it is importance-weighted:

    ρ      = exp(prox − behav)           token;  exp(Σ_t …) sequence;  exp(mean_t …) geometric
    M(ρ)   = ρ if is_low ≤ ρ ≤ is_high else 0          (detached)
    loss_t = M(ρ) · −min(r_t A_t, clip(r_t, 1 − ε_low, 1 + ε_high) A_t),   r_t = exp(logp − prox)
"""
from __future__ import annotations

import torch

from asyncrl.objectives.common import (
    LossInputs,
    clip_metrics,
    clipped_surrogate,
    importance_weight,
    masked,
    masked_fraction,
)


def loss(inp: LossInputs, cfg) -> tuple[torch.Tensor, dict[str, float]]:
    rho = importance_weight(inp.prox - inp.behav, inp.mask, cfg.is_level).detach()
    inside = (rho >= cfg.is_low) & (rho <= cfg.is_high)
    ratio = torch.exp(masked(inp.logp - inp.prox, inp.mask))
    per_token, low, high = clipped_surrogate(ratio, inp.advantages, cfg.eps_low, cfg.eps_high, cfg.dual_clip)
    metrics = clip_metrics(low, high, inp.mask)
    metrics["is_masked"] = masked_fraction(~inside, inp.mask)
    return torch.where(inside, rho * per_token, torch.zeros_like(per_token)), metrics
