"""PPO-clip with token-level ratios against the behaviour policy (GRPO / DAPO).

GRPO: Shao et al. 2024, arXiv 2402.03300, eq. 3; clip-higher (ε_high > ε_low): DAPO, Yu et al.
2025, arXiv 2503.14476, eq. 8. The behaviour policy is also the trust-region anchor ("coupled").

    r_t    = exp(logp_t − behav_t)
    loss_t = −min(r_t · A_t, clip(r_t, 1 − ε_low, 1 + ε_high) · A_t)
"""
from __future__ import annotations

import torch

from asyncrl.objectives.common import LossInputs, masked_fraction


def loss(inp: LossInputs, cfg) -> tuple[torch.Tensor, dict[str, float]]:
    ratio = torch.exp(inp.logp - inp.behav)
    clipped = ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)
    per_token = -torch.minimum(ratio * inp.advantages, clipped * inp.advantages)
    metrics = {
        "clip_low": masked_fraction((ratio < 1 - cfg.eps_low) & (inp.advantages < 0), inp.mask),
        "clip_high": masked_fraction((ratio > 1 + cfg.eps_high) & (inp.advantages > 0), inp.mask),
    }
    return per_token, metrics
