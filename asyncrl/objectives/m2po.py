"""M2PO: second-moment trust policy optimisation ("Prosperity before Collapse", Zheng et al. 2025,
arXiv 2510.01161, Alg. 1; AReaL's `m2_threshold`).

Clipping each token's ratio throws away the informative high-ratio tokens under staleness. M2PO
instead bounds the batch's second moment of the behaviour–proximal log-ratio: it masks the
fewest tokens with the largest δ² until the mean δ² of the rest is at most τ (never all), then
applies decoupled PPO to what is left.

    δ_t    = behav_t − prox_t,   m2_t = δ_t²
    keep   = all counted tokens but the k largest m2_t, k = min{k : mean(rest) ≤ τ}
    loss_t = keep_t · decoupled_ppo_t
"""
from __future__ import annotations

import torch

from asyncrl.objectives import decoupled_ppo
from asyncrl.objectives.common import LossInputs, masked, masked_fraction


def second_moment_keep(m2: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """Boolean [rows, tokens]: counted tokens that stay once the largest m2 values are masked."""
    counted = mask > 0
    values = m2[counted]
    n = values.numel()
    keep = counted.clone()
    if n == 0 or values.mean() <= threshold:
        return keep
    ordered, order = values.sort(descending=True)
    # mean of what remains after masking the k largest, for k = 0 .. n−1
    remaining_sum = ordered.sum() - torch.cat([ordered.new_zeros(1), ordered.cumsum(0)[:-1]])
    remaining_mean = remaining_sum / torch.arange(n, 0, -1, dtype=ordered.dtype, device=ordered.device)
    below = (remaining_mean <= threshold).nonzero()
    k = int(below[0]) if below.numel() else n - 1  # never mask every token
    flat = keep[counted]
    flat[order[:k]] = False
    keep[counted] = flat
    return keep


def loss(inp: LossInputs, cfg) -> tuple[torch.Tensor, dict[str, float]]:
    m2 = masked(inp.behav - inp.prox, inp.mask).detach() ** 2
    keep = second_moment_keep(m2, inp.mask, cfg.m2_threshold)
    per_token, metrics = decoupled_ppo.loss(inp, cfg)
    metrics["m2_masked"] = masked_fraction(~keep, inp.mask)
    metrics["m2_before"] = float(m2[inp.mask > 0].mean()) if inp.mask.any() else 0.0
    return torch.where(keep, per_token, torch.zeros_like(per_token)), metrics
