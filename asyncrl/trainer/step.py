"""One training step on one batch of trajectories: tensors in, optimizer step out, metrics back.

Knows nothing of tasks or rewards and never branches on the objective: it builds `LossInputs`,
calls the configured objective, and aggregates the per-token loss as a token mean over the batch.
"""
from __future__ import annotations

import math

import torch

from asyncrl.objectives.common import LossInputs
from asyncrl.trajectory import Trajectory


def collate(trajs: list[Trajectory], pad_id: int, version: int) -> dict[str, torch.Tensor]:
    """Right-padded tensors; per-token fields are shifted to align with next-token logits."""
    width = max(len(t.tokens) for t in trajs)

    def pad(field: str, fill, dtype) -> torch.Tensor:
        out = torch.full((len(trajs), width), fill, dtype=dtype)
        for row, t in enumerate(trajs):
            values = getattr(t, field)
            out[row, : len(values)] = torch.tensor(values, dtype=dtype)
        return out

    tokens = pad("tokens", pad_id, torch.long)
    attention = torch.zeros_like(tokens)
    for row, t in enumerate(trajs):
        attention[row, : len(t.tokens)] = 1
    versions = pad("versions", -1, torch.long)[:, 1:]
    mask = pad("loss_mask", 0, torch.float32)[:, 1:]
    return {
        "tokens": tokens,
        "attention": attention,
        "targets": tokens[:, 1:],
        "mask": mask,
        "behav": pad("logprobs", 0.0, torch.float32)[:, 1:],
        "advantages": pad("advantages", 0.0, torch.float32)[:, 1:],
        "staleness": torch.where(mask > 0, version - versions, 0).float(),
    }


def token_logprobs(model, batch: dict, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(log π(target) per position, entropy per position); temperature as the engine sampled."""
    logits = model(input_ids=batch["tokens"], attention_mask=batch["attention"]).logits[:, :-1].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    entropy = -(logprobs.exp() * logprobs).sum(-1).detach()
    return logprobs.gather(-1, batch["targets"][..., None]).squeeze(-1), entropy


def loglinear_prox(behav: torch.Tensor, logp: torch.Tensor, staleness: torch.Tensor) -> torch.Tensor:
    """AReaL's approximation of the proximal logprob without a forward pass (ALGORITHMS.md).

    The step trains version v into v+1; the proximal policy is v, the token's sampler v − s.
    α = (v − (v − s)) / ((v + 1) − (v − s)) = s / (s + 1); prox ≈ behav + α · (logp − behav).
    """
    alpha = staleness / (staleness + 1)
    return behav + alpha * (logp.detach() - behav)


def _rows(batch: dict, rows: slice) -> dict:
    return {k: v[rows] for k, v in batch.items()}


def train_step(model, optimizer, objective, trajs: list[Trajectory], version: int, cfg, pad_id: int) -> dict:
    """Optimizer steps over `trajs` (cfg.trainer.minibatches of them); returns the step's metrics."""
    batch = collate(trajs, pad_id, version)
    total_tokens = batch["mask"].sum().clamp(min=1)
    temperature = cfg.rollout.temperature
    recompute = cfg.objective.prox == "recompute" and cfg.trainer.minibatches > 1
    if recompute:  # with a single minibatch the current weights are the proximal policy already
        with torch.no_grad():
            batch["prox"] = token_logprobs(model, batch, temperature)[0]
    n = len(trajs)
    bounds = [round(i * n / cfg.trainer.minibatches) for i in range(cfg.trainer.minibatches + 1)]
    parts, logp_all, entropy_all = [], [], []
    skipped = 0
    for lo, hi in zip(bounds, bounds[1:]):
        if hi <= lo:
            continue
        mb = _rows(batch, slice(lo, hi))
        logp, entropy = token_logprobs(model, mb, temperature)
        if "prox" in mb:
            prox = mb["prox"]
        elif cfg.objective.prox == "loglinear":
            prox = loglinear_prox(mb["behav"], logp, mb["staleness"])
        else:
            prox = logp.detach()
        inp = LossInputs(logp, mb["behav"], prox, mb["advantages"], mb["mask"], mb["staleness"])
        per_token, obj_metrics = objective(inp, cfg.objective)
        loss = (per_token * mb["mask"]).sum() / total_tokens
        optimizer.zero_grad(set_to_none=True)
        if not torch.isfinite(loss):  # keep the weights; the step is recorded as skipped
            skipped += 1
            parts.append({"loss": float(loss), **obj_metrics})
            continue
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.grad_clip)
        optimizer.step()
        parts.append({"loss": float(loss), "grad_norm": float(grad_norm), **obj_metrics})
        logp_all.append(logp.detach())
        entropy_all.append(entropy)
    metrics = _average(parts)
    metrics["loss"] = sum(p["loss"] for p in parts)  # parts are slices of one token mean
    metrics["skipped_nonfinite"] = skipped
    if logp_all:
        metrics.update(diagnostics(torch.cat(logp_all), torch.cat(entropy_all), batch))
    return metrics


def _average(parts: list[dict]) -> dict:
    keys = {k for p in parts for k in p}
    return {k: sum(p[k] for p in parts if k in p) / sum(1 for p in parts if k in p) for k in keys}


def diagnostics(logp: torch.Tensor, entropy: torch.Tensor, batch: dict) -> dict:
    """Objective-independent health of the step: importance ratios, ESS, mismatch, staleness."""
    mask, behav, stale = batch["mask"], batch["behav"], batch["staleness"]
    counted = mask > 0
    log_ratio = (logp - behav) * mask
    ratios = log_ratio[counted].exp()
    seq_log_w = log_ratio.sum(-1)
    weights = torch.exp(seq_log_w - seq_log_w.max())  # ESS is scale-free; shift for stability
    ess = float(weights.sum() ** 2 / (weights**2).sum() / len(weights))
    fresh = counted & (stale == 0)
    # k3 estimate of KL(behaviour ‖ trainer) on tokens the trainer holds the same version of
    r_fresh = (logp - behav)[fresh].exp()
    mismatch = float((r_fresh - 1 - r_fresh.log()).mean()) if fresh.any() else math.nan
    q = torch.quantile(ratios, torch.tensor([0.05, 0.5, 0.95])).tolist() if ratios.numel() else [math.nan] * 3
    seq_stale = torch.where(counted, stale, -1).max(-1).values
    return {
        "entropy": float(entropy[counted].mean()) if counted.any() else math.nan,
        "ess_fraction": ess,
        "ratio_p05": q[0], "ratio_p50": q[1], "ratio_p95": q[2],
        "ratio_max": float(ratios.max()) if ratios.numel() else math.nan,
        "mismatch_kl": mismatch,
        "staleness_mean": float(seq_stale.float().mean()),
        "staleness_max": int(seq_stale.max()),
        "train_tokens": int(mask.sum()),
    }
