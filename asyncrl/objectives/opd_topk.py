"""On-policy distillation by forward KL over the teacher's top-k tokens (teacher.top_k), at the positions
the student visited (AsyncOPD: teacher-weighted forward KL is robust to staleness, so no importance
ratio). The teacher's top-k probabilities are renormalised over the k; the student's are its own, so
mass it puts outside the teacher's top-k is penalised too:

    p̂_j    = softmax_j(teach_top_t)                                 over the teacher's k ids j at t
    loss_t = Σ_j p̂_j · (log p̂_j − logp_θ(j))                        ≥ KL(p̂ ‖ π_θ renormalised) ≥ 0

The trainer computes logp_θ(j) from the same logits as logp_t (asyncrl/trainer/logprobs.py: top_ids).
"""
from __future__ import annotations

import torch

from asyncrl.objectives.common import LossInputs, masked
from asyncrl.objectives.opd import reverse_kl_metrics


def loss(inp: LossInputs, cfg) -> tuple[torch.Tensor, dict[str, float]]:
    if inp.teacher_top is None or inp.top_logp is None:
        raise ValueError("opd_topk trains on the teacher's top-k logprobs, and the batch has none "
                         "(set teacher.top_k)")
    counted = inp.mask > 0
    teacher = torch.where(counted[..., None], inp.teacher_top, torch.zeros_like(inp.teacher_top))
    p = torch.softmax(teacher, dim=-1).detach()  # (a row of -inf where not counted: zeros above, uniform)
    log_p = torch.log_softmax(teacher, dim=-1).detach()
    student = torch.where(counted[..., None], inp.top_logp, torch.zeros_like(inp.top_logp))
    per_token = (p * (log_p - student)).sum(-1)
    tokens, mass = inp.mask.sum().clamp(min=1), torch.logsumexp(teacher, -1).exp()
    metrics = {"forward_kl_topk": float(masked(per_token.detach(), inp.mask).sum() / tokens),
               "teacher_topk_mass": float(masked(mass, inp.mask).sum() / tokens)}
    if inp.teacher is not None:
        metrics.update(reverse_kl_metrics(inp))
    return masked(per_token, inp.mask), metrics
