"""On-policy distillation by per-token reverse KL (Thinking Machines' "On-Policy Distillation", 2025;
prime-rl's OPD loss; AsyncOPD). The student samples, a teacher scores the same tokens, and the negative
per-token reverse KL estimate is the reward of that token alone (no discount, no group baseline):

    A_t    = sg(teach_t − behav_t)                                  −k_t, k_t = log π(y_t) − log π_T(y_t)
    r_t    = exp(logp_t − behav_t)                                  the staleness importance ratio
    keep_t = exp(prox_t) ≥ exp(behav_t) − δ                        δ = objective.opd_mismatch
    loss_t = −keep_t · min(r_t, C) · A_t                            C = objective.behav_weight_cap

The ratio to the sampler makes the estimate unbiased for the current policy however stale the sample
(η = 0 … large, as every objective); it is truncated at C (min: no gradient above it) so one token
cannot dominate. Tokens whose probability under the trainer's proximal weights falls more than δ below
the engine's are masked: there the engine and the trainer disagree, not the student and the teacher.
"""
from __future__ import annotations

import torch

from asyncrl.objectives.common import LossInputs, masked, masked_fraction, seq_sum


def distillation_inputs(inp: LossInputs) -> torch.Tensor:
    """log π_T of the batch's tokens, or a clear error for a batch without them."""
    if inp.teacher is None:
        raise ValueError("this objective distils from a teacher, and the batch has no teacher_logprobs "
                         "(set teacher.path)")
    return inp.teacher


def reverse_kl_metrics(inp: LossInputs) -> dict[str, float]:
    """The sampled reverse KL to the teacher per token, and per sample (summed over its tokens)."""
    k = masked(inp.behav - inp.teacher, inp.mask)
    rows = inp.mask.sum(-1) > 0
    return {"reverse_kl": float(k.sum() / inp.mask.sum().clamp(min=1)),
            "reverse_kl_seq": float(seq_sum(k, inp.mask)[rows].mean()) if rows.any() else 0.0}


def loss(inp: LossInputs, cfg) -> tuple[torch.Tensor, dict[str, float]]:
    teacher = distillation_inputs(inp)
    adv = masked(teacher - inp.behav, inp.mask).detach()
    ratio = torch.exp(masked(inp.logp - inp.behav, inp.mask))
    cap = cfg.behav_weight_cap if cfg.behav_weight_cap is not None else float("inf")
    agree = torch.exp(inp.prox) >= torch.exp(inp.behav) - cfg.opd_mismatch
    per_token = -torch.minimum(ratio, torch.full_like(ratio, cap)) * adv
    metrics = reverse_kl_metrics(inp)
    metrics["opd_masked"] = masked_fraction(~agree, inp.mask)
    metrics["ratio_truncated"] = masked_fraction(ratio.detach() > cap, inp.mask)
    return torch.where(agree, per_token, torch.zeros_like(per_token)), metrics
