"""PPO-clip with token-level ratios against the behaviour policy (GRPO / DAPO).

GRPO: Shao et al. 2024, arXiv 2402.03300, eq. 3; clip-higher (ε_high > ε_low): DAPO, Yu et al.
2025, arXiv 2503.14476, eq. 8. The behaviour policy is also the trust-region anchor ("coupled").

    r_t    = exp(logp_t − behav_t)
    loss_t = −min(r_t · A_t, clip(r_t, 1 − ε_low, 1 + ε_high) · A_t)
"""
from __future__ import annotations

import torch

from asyncrl.objectives.common import LossInputs, clip_metrics, clipped_surrogate, masked


def loss(inp: LossInputs, cfg) -> tuple[torch.Tensor, dict[str, float]]:
    ratio = torch.exp(masked(inp.logp - inp.behav, inp.mask))
    per_token, low, high = clipped_surrogate(ratio, inp.advantages, cfg.eps_low, cfg.eps_high, cfg.dual_clip)
    return per_token, clip_metrics(low, high, inp.mask)
