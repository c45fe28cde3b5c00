"""Truncated importance sampling for the train–inference mismatch (TIS).

Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training"
(fengyao.notion.site/off-policy-rl); as in verl's rollout correction and TRL's `vllm_importance_
sampling_cap`. The engine's numerics (and its version) differ from the trainer's, so the tokens
come from π_behav, not π_prox. Weight the PPO loss around the proximal policy by the truncated
ratio between the two, at token level or per sequence (objective.is_level):

    ρ      = exp(prox − behav)           token;  exp(Σ_t …) sequence;  exp(mean_t …) geometric
    w      = sg(min(ρ, C))                C = objective.is_cap
    loss_t = w · −min(r_t A_t, clip(r_t, 1 − ε_low, 1 + ε_high) A_t),   r_t = exp(logp − prox)
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
    ratio = torch.exp(masked(inp.logp - inp.prox, inp.mask))
    per_token, low, high = clipped_surrogate(ratio, inp.advantages, cfg.eps_low, cfg.eps_high, cfg.dual_clip)
    metrics = clip_metrics(low, high, inp.mask)
    metrics["is_truncated"] = masked_fraction(rho > cfg.is_cap, inp.mask)
    return rho.clamp(max=cfg.is_cap) * per_token, metrics
