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
    group_ids = {g: i for i, g in enumerate(dict.fromkeys(t.group_id for t in trajs))}
    return {
        "rewards": torch.tensor([t.reward for t in trajs], dtype=torch.float32),
        "groups": torch.tensor([group_ids[t.group_id] for t in trajs], dtype=torch.long),
        "tokens": tokens,
        "attention": attention,
        "targets": tokens[:, 1:],
        "mask": mask,
        "behav": pad("logprobs", 0.0, torch.float32)[:, 1:],
        "advantages": pad("advantages", 0.0, torch.float32)[:, 1:],
        "staleness": torch.where(mask > 0, version - versions, 0).float(),
    }


def token_logprobs(model, batch: dict, temperature: float, entropy_grad: bool = False):
    """(log π(target) per position, entropy per position); temperature as the engine sampled.

    The entropy keeps its graph only when a bonus needs its gradient (it costs a [B, T, V] term).
    """
    logits = model(input_ids=batch["tokens"], attention_mask=batch["attention"]).logits[:, :-1].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    source = logprobs if entropy_grad else logprobs.detach()
    entropy = -(source.exp() * source).sum(-1)
    return logprobs.gather(-1, batch["targets"][..., None]).squeeze(-1), entropy


def aggregation_weights(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Per-token weights w with loss = Σ w_t · loss_t over the whole batch (ALGORITHMS.md).

    token_mean: 1/N;  seq_mean: 1/(B·|τ_i|);  constant: 1/(B·L_max), L_max the longest row.
    """
    rows = mask.shape[0]
    if mode == "token_mean":
        return mask / mask.sum().clamp(min=1)
    if mode == "seq_mean":
        return mask / (rows * mask.sum(-1, keepdim=True).clamp(min=1))
    if mode == "constant":
        return mask / (rows * max(1.0, float(mask.sum(-1).max())))
    raise ValueError(f"objective.loss_agg {mode!r} is not one of token_mean, seq_mean, constant")


def kl_penalty(logp: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) from samples of π_θ (Schulman's k1, k2, k3)."""
    log_ratio = ref - logp  # log π_ref/π_θ
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    return torch.exp(log_ratio) - 1 - log_ratio


def loglinear_prox(behav: torch.Tensor, logp: torch.Tensor, staleness: torch.Tensor) -> torch.Tensor:
    """AReaL's approximation of the proximal logprob without a forward pass (ALGORITHMS.md).

    The step trains version v into v+1; the proximal policy is v, the token's sampler v − s.
    α = (v − (v − s)) / ((v + 1) − (v − s)) = s / (s + 1); prox ≈ behav + α · (logp − behav).
    """
    alpha = staleness / (staleness + 1)
    return behav + alpha * (logp.detach() - behav)


def _rows(batch: dict, rows: slice) -> dict:
    return {k: v[rows] for k, v in batch.items()}


def train_step(model, optimizer, objective, trajs: list[Trajectory], version: int, cfg, pad_id: int,
               ref_model=None) -> dict:
    """Optimizer steps over `trajs` (cfg.trainer.minibatches of them); returns the step's metrics."""
    device = next(model.parameters()).device
    batch = {k: v.to(device) for k, v in collate(trajs, pad_id, version).items()}
    batch["weights"] = aggregation_weights(batch["mask"], cfg.objective.loss_agg)
    temperature = cfg.rollout.temperature
    obj = cfg.objective
    recompute = obj.prox == "recompute" and cfg.trainer.minibatches > 1
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
        logp, entropy = token_logprobs(model, mb, temperature, entropy_grad=obj.entropy_coef > 0)
        if "prox" in mb:
            prox = mb["prox"]
        elif obj.prox == "loglinear":
            prox = loglinear_prox(mb["behav"], logp, mb["staleness"])
        else:
            prox = logp.detach()
        inp = LossInputs(logp, mb["behav"], prox, mb["advantages"], mb["mask"], mb["staleness"],
                         mb["rewards"], mb["groups"])
        per_token, obj_metrics = objective(inp, obj)
        if ref_model is not None and obj.kl_coef > 0:
            with torch.no_grad():
                ref = token_logprobs(ref_model, mb, temperature)[0]
            kl = kl_penalty(logp, ref, obj.kl_estimator)
            per_token = per_token + obj.kl_coef * kl
            obj_metrics["kl_ref"] = float((kl.detach() * mb["mask"]).sum() / mb["mask"].sum().clamp(min=1))
        if obj.entropy_coef > 0:
            per_token = per_token - obj.entropy_coef * entropy
        loss = torch.where(mb["mask"] > 0, per_token * mb["weights"], 0.0).sum()
        optimizer.zero_grad(set_to_none=True)
        if not torch.isfinite(loss):  # keep the weights; the step is recorded as skipped
            skipped += 1
            parts.append({"loss": float(loss), **obj_metrics})
            continue
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.grad_clip)
        _step_with_lr_scale(optimizer, obj_metrics.get("lr_scale", 1.0))
        parts.append({"loss": float(loss), "grad_norm": float(grad_norm), **obj_metrics})
        logp_all.append(logp.detach())
        entropy_all.append(entropy.detach())
    metrics = _average(parts)
    metrics["loss"] = sum(p["loss"] for p in parts)  # parts are slices of one token mean
    metrics["skipped_nonfinite"] = skipped
    if logp_all:
        metrics.update(diagnostics(torch.cat(logp_all), torch.cat(entropy_all), batch))
    return metrics


def _step_with_lr_scale(optimizer, scale: float) -> None:
    """One optimizer step at lr · scale (an objective may ask, e.g. VCPO by effective sample size)."""
    base = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] *= scale
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, base):
        g["lr"] = lr


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
    q = torch.quantile(ratios, ratios.new_tensor([0.05, 0.5, 0.95])).tolist() if ratios.numel() else [math.nan] * 3
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
