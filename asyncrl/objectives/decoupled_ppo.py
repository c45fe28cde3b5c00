"""Decoupled PPO (AReaL: Fu et al. 2025, arXiv 2505.24298, eq. 5).

The behaviour policy (whatever version sampled the token) corrects by importance weight; the
proximal policy (the weights at the start of this step) anchors the trust region, so stale data
is clipped relative to a recent policy rather than to an old one. The proximal logprobs are
recomputed or approximated log-linearly (objective.prox; see trainer.step.loglinear_prox).

    r_t    = exp(logp_t − prox_t)                       trust-region ratio
    w_t    = sg(min(exp(prox_t − behav_t), C))          behaviour importance weight, capped at C
    loss_t = −w_t · min(r_t · A_t, clip(r_t, 1 − ε_low, 1 + ε_high) · A_t)
"""
from __future__ import annotations

import torch

from asyncrl.objectives.common import LossInputs, clip_metrics, clipped_surrogate, masked, masked_fraction


def loss(inp: LossInputs, cfg) -> tuple[torch.Tensor, dict[str, float]]:
    cap = cfg.behav_weight_cap if cfg.behav_weight_cap is not None else float("inf")
    ratio = torch.exp(masked(inp.logp - inp.prox, inp.mask))
    weight = torch.exp(masked(inp.prox - inp.behav, inp.mask)).detach()
    capped = weight > cap
    per_token, low, high = clipped_surrogate(ratio, inp.advantages, cfg.eps_low, cfg.eps_high, cfg.dual_clip)
    metrics = clip_metrics(low, high, inp.mask)
    metrics["behav_weight_capped"] = masked_fraction(capped, inp.mask)
    return weight.clamp(max=cap) * per_token, metrics
