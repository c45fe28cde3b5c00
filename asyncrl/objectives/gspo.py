"""GSPO: group sequence policy optimisation (Zheng et al. 2025, arXiv 2507.18071, eqs. 5–7).

One length-normalised ratio per sequence instead of one per token, clipped with a small ε; the
gradient still flows through every token's logprob (each gets 1/|τ_i| of the sequence's).
Asynchronous data adds AReaL's decoupling at sequence level: the trust region is around the
proximal policy, and a capped, detached geometric-mean weight corrects for the behaviour policy
(without it, stale sequences count as on-policy and training collapses as staleness grows):

    s_i    = exp(mean_{t∈i}(logp_t − prox_t))
    w_i    = sg(min(exp(mean_{t∈i}(prox_t − behav_t)), C))      C = objective.behav_weight_cap
    loss_i = −w_i · min(s_i A_i, clip(s_i, 1 − ε_low, 1 + ε_high) A_i),   ε = objective.gspo_eps_{low,high}

The per-sequence loss is placed on each of its tokens; objective.loss_agg = "seq_mean" gives the
paper's average over sequences. On-policy (behav = prox) w_i = 1 and this is the paper's GSPO.
"""
from __future__ import annotations

import torch

from asyncrl.objectives.common import LossInputs, clip_metrics, clipped_surrogate, seq_mean


def loss(inp: LossInputs, cfg) -> tuple[torch.Tensor, dict[str, float]]:
    cap = cfg.behav_weight_cap if cfg.behav_weight_cap is not None else float("inf")
    seq_ratio = torch.exp(seq_mean(inp.logp - inp.prox, inp.mask))[:, None].expand_as(inp.logp)
    weight = torch.exp(seq_mean(inp.prox - inp.behav, inp.mask)).detach().clamp(max=cap)[:, None]
    per_token, low, high = clipped_surrogate(seq_ratio, inp.advantages, cfg.gspo_eps_low, cfg.gspo_eps_high)
    return weight * per_token, clip_metrics(low, high, inp.mask)
