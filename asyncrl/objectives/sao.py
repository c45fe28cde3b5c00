"""SAO: single-rollout asynchronous optimisation, strict double-sided token clipping.

"Single-rollout Asynchronous Optimization" (GLM team, 2026; seed abstract in shared/seeds).
PPO only stops the gradient on the side that would push the ratio further out (r > 1+ε with
A > 0, r < 1−ε with A < 0); SAO drops every token whose ratio left the band, whatever the sign
of A. It pairs with one rollout per prompt and a baseline instead of group normalisation
(rollout.group_size = 1, rollout.advantage = "running_baseline").

    r_t    = exp(logp_t − behav_t)
    loss_t = −1[1 − ε_low ≤ r_t ≤ 1 + ε_high] · r_t · A_t
"""
from __future__ import annotations

import torch

from asyncrl.objectives.common import LossInputs, masked, masked_fraction


def loss(inp: LossInputs, cfg) -> tuple[torch.Tensor, dict[str, float]]:
    ratio = torch.exp(masked(inp.logp - inp.behav, inp.mask))
    below, above = ratio < 1 - cfg.eps_low, ratio > 1 + cfg.eps_high
    inside = ~(below | above)
    # clamping changes no kept token; it keeps the dropped branch's gradient finite (0, not 0·inf)
    kept = -ratio.clamp(max=1 + cfg.eps_high) * inp.advantages
    per_token = torch.where(inside, kept, torch.zeros_like(ratio))
    return per_token, {
        "clip_low": masked_fraction(below, inp.mask),
        "clip_high": masked_fraction(above, inp.mask),
    }
