"""RL and on-policy distillation at once (slime's form): the verifier's group advantage, less λ times
each token's sampled reverse KL to the teacher, then decoupled PPO as usual (its behaviour weight and
proximal trust region handle staleness):

    A'_t   = A_t − λ · sg(behav_t − teach_t)                        λ = objective.opd_coef
    loss_t = decoupled_ppo(A')_t

λ = 0 is plain decoupled PPO; a large λ is distillation with the reward as a nudge.
"""
from __future__ import annotations

import dataclasses

import torch

from asyncrl.objectives import decoupled_ppo
from asyncrl.objectives.common import LossInputs, masked
from asyncrl.objectives.opd import distillation_inputs, reverse_kl_metrics


def loss(inp: LossInputs, cfg) -> tuple[torch.Tensor, dict[str, float]]:
    teacher = distillation_inputs(inp)
    kl = masked(inp.behav - teacher, inp.mask).detach()
    shaped = dataclasses.replace(inp, advantages=inp.advantages - cfg.opd_coef * kl)
    per_token, metrics = decoupled_ppo.loss(shaped, cfg)
    return per_token, {**metrics, **reverse_kl_metrics(inp)}
