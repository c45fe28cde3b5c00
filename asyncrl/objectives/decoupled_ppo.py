"""Decoupled PPO (AReaL: Fu et al. 2025, arXiv 2505.24298, eq. 5).

The behaviour policy (whatever version sampled the token) corrects by importance weight; the
proximal policy (the weights at the start of this step) anchors the trust region, so stale data
is clipped relative to a recent policy rather than to an old one.

    r_t    = exp(logp_t − prox_t)                       trust-region ratio
    w_t    = sg(exp(prox_t − behav_t)), capped at C      behaviour importance weight
    loss_t = −w_t · min(r_t · A_t, clip(r_t, 1 − ε_low, 1 + ε_high) · A_t)
"""
from __future__ import annotations

import torch

from asyncrl.objectives.common import LossInputs, masked_fraction


def loss(inp: LossInputs, cfg) -> tuple[torch.Tensor, dict[str, float]]:
    ratio = torch.exp(inp.logp - inp.prox)
    cap = cfg.behav_weight_cap if cfg.behav_weight_cap is not None else float("inf")
    weight = torch.exp(inp.prox - inp.behav).detach()
    capped = weight > cap
    weight = weight.clamp(max=cap)
    clipped = ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)
    per_token = -weight * torch.minimum(ratio * inp.advantages, clipped * inp.advantages)
    metrics = {
        "clip_low": masked_fraction((ratio < 1 - cfg.eps_low) & (inp.advantages < 0), inp.mask),
        "clip_high": masked_fraction((ratio > 1 + cfg.eps_high) & (inp.advantages > 0), inp.mask),
        "behav_weight_capped": masked_fraction(capped, inp.mask),
    }
    return per_token, metrics
