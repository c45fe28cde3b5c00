"""GSPO: group sequence policy optimisation (Zheng et al. 2025, arXiv 2507.18071, eqs. 5–7).

One length-normalised ratio per sequence instead of one per token, clipped with a small ε; the
gradient still flows through every token's logprob (each gets 1/|τ_i| of the sequence's):

    s_i    = exp(mean_{t∈i}(logp_t − prox_t))
    loss_i = −min(s_i A_i, clip(s_i, 1 − ε_low, 1 + ε_high) A_i),   ε = objective.gspo_eps_{low,high}

The per-sequence loss is placed on each of its tokens; objective.loss_agg = "seq_mean" gives the
paper's average over sequences.
"""
from __future__ import annotations

import torch

from asyncrl.objectives.common import LossInputs, clip_metrics, clipped_surrogate, seq_mean


def loss(inp: LossInputs, cfg) -> tuple[torch.Tensor, dict[str, float]]:
    seq_ratio = torch.exp(seq_mean(inp.logp - inp.prox, inp.mask))[:, None].expand_as(inp.logp)
    per_token, low, high = clipped_surrogate(seq_ratio, inp.advantages, cfg.gspo_eps_low, cfg.gspo_eps_high)
    return per_token, clip_metrics(low, high, inp.mask)
