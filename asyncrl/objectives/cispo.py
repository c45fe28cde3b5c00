"""CISPO: clipped importance-sampling policy optimisation (MiniMax-M1, arXiv 2506.13585, eq. 4).

PPO drops the gradient of every clipped token, and rare "fork" tokens with large ratios are the
ones clipped most. CISPO keeps every token's gradient and clips only the (detached) weight:

    r_t    = exp(logp_t − behav_t)
    loss_t = −sg(clip(r_t, 1 − ε_low, 1 + ε_high)) · A_t · logp_t
"""
from __future__ import annotations

import torch

from asyncrl.objectives.common import LossInputs, clip_metrics, masked


def loss(inp: LossInputs, cfg) -> tuple[torch.Tensor, dict[str, float]]:
    ratio = torch.exp(masked(inp.logp - inp.behav, inp.mask)).detach()
    weight = ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)
    per_token = -weight * inp.advantages * masked(inp.logp, inp.mask)
    return per_token, clip_metrics(ratio < 1 - cfg.eps_low, ratio > 1 + cfg.eps_high, inp.mask)
