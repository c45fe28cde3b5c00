"""VCPO: variance-controlled policy optimisation (mit-han-lab/vcpo; seed abstract in shared/seeds).

Stale rollouts make sequence importance weights heavy-tailed, and the effective sample size
(ESS) collapses before training does. VCPO (i) shrinks the step when ESS is low and (ii) uses
the closed-form off-policy minimum-variance baseline instead of the group mean:

    w_i    = exp(Σ_t (logp_t − behav_t))          detached; normalised by the batch max
    ESS    = (Σ w_i)² / Σ w_i²,   lr_scale = ESS/B  or  sqrt(ESS/B)    (objective.vcpo_lr_scale)
    b_g    = Σ_{i∈g} w_i² R_i / Σ_{i∈g} w_i²      per prompt group g
    A_i    = R_i − b_g,  then the decoupled PPO loss with these advantages.

The paper's baseline also weights each sample by its squared score-function norm
‖∇ log π(τ_i)‖², which its reference code gets from per-sample gradient buffers; here those
norms are taken as equal (one backward pass per step), which leaves the w²-weighted form above.
The step scale is returned as the metric `lr_scale`; the trainer applies it to this step's lr.
"""
from __future__ import annotations

import math

import torch

from asyncrl.objectives import decoupled_ppo
from asyncrl.objectives.common import LossInputs, seq_sum


def loss(inp: LossInputs, cfg) -> tuple[torch.Tensor, dict[str, float]]:
    log_w = seq_sum(inp.logp - inp.behav, inp.mask).detach()
    w = torch.exp(log_w - log_w.max())
    ess_fraction = float(w.sum() ** 2 / (w**2).sum() / len(w))
    w2 = w**2
    group_w2 = w2.new_zeros(int(inp.groups.max()) + 1).index_add_(0, inp.groups, w2)
    group_w2r = torch.zeros_like(group_w2).index_add_(0, inp.groups, w2 * inp.rewards)
    baseline = group_w2r[inp.groups] / group_w2[inp.groups].clamp(min=1e-30)
    adv = (inp.rewards - baseline)[:, None].expand_as(inp.logp) * (inp.mask > 0)
    per_token, metrics = decoupled_ppo.loss(
        LossInputs(inp.logp, inp.behav, inp.prox, adv, inp.mask, inp.staleness, inp.rewards, inp.groups), cfg
    )
    scale = ess_fraction if cfg.vcpo_lr_scale == "ess" else math.sqrt(ess_fraction)
    metrics.update(lr_scale=scale, vcpo_ess_fraction=ess_fraction)
    return per_token, metrics
