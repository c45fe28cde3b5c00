"""One training step on one batch of trajectories: tensors in, optimizer step out, metrics back.

Knows nothing of tasks or rewards and never branches on the objective: it builds `LossInputs`,
calls the configured objective, and aggregates the per-token loss as a token mean over the batch.
"""
from __future__ import annotations

import math

import torch

from asyncrl.objectives.common import LossInputs
from asyncrl.observe.profile import Phases
from asyncrl.policy import routing
from asyncrl.rewards.tasks import as_number
from asyncrl.run.role import ContractError
from asyncrl.trainer.logprobs import token_logprobs
from asyncrl.trainer.ranks import Ranks
from asyncrl.trajectory import Trajectory


def collate(trajs: list[Trajectory], pad_id: int, version: int,
            with_routes: bool = False, pictures=None) -> dict[str, torch.Tensor]:
    """Right-padded tensors; per-token fields are shifted to align with next-token logits. `with_routes`: with
    the engine's experts of every token ([B, T, MoE layers, k], unshifted: a token's routing is its
    own input position's), for routing replay. `pictures` (hash -> Picture): a vision-language policy's
    images; a batch that shows any gets "pictures", each row's list (not a tensor)."""
    width = max(len(t.tokens) for t in trajs)

    def pad(field: str, fill, dtype) -> torch.Tensor:  # one tensor from padded lists: no per-row copies
        rows = [getattr(t, field) for t in trajs]
        return torch.tensor([r + [fill] * (width - len(r)) for r in rows], dtype=dtype)

    tokens = pad("tokens", pad_id, torch.long)
    attention = torch.tensor(
        [[1] * len(t.tokens) + [0] * (width - len(t.tokens)) for t in trajs], dtype=torch.long
    )
    versions = pad("versions", -1, torch.long)[:, 1:]
    mask = pad("loss_mask", 0, torch.float32)[:, 1:]
    group_ids = {g: i for i, g in enumerate(dict.fromkeys(t.group_id for t in trajs))}
    return {
        **_pictures_field(trajs, pictures),
        **(_routing_field(trajs, width) if with_routes else {}),
        **_teacher_fields(trajs, pad),
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


def _routing_field(trajs: list[Trajectory], width: int) -> dict[str, torch.Tensor]:
    """The engine's experts per token, -1 where none was recorded (the last sampled token, padding: those
    tokens route by the trainer's own router, and no loss reads what they compute)."""
    if missing := sum(t.routing is None for t in trajs):
        raise ContractError(
            f"trainer.routing_replay is on, but {missing} of the batch's {len(trajs)} samples carry no "
            "routing: their engine did not record the experts it chose (a dense policy, or an engine without "
            "routing records); turn routing_replay off or serve the MoE policy with the built-in engine")
    routes = [routing.unpack(t.routing) for t in trajs]
    layers, k = routes[0].shape[1:]
    out = torch.full((len(trajs), width, layers, k), -1, dtype=torch.long)
    for row, r in enumerate(routes):
        if r.shape[1:] != (layers, k) or len(r) > width:
            raise ContractError(f"sample {trajs[row].id}: routing of shape {tuple(r.shape)} for "
                                f"{len(trajs[row].tokens)} tokens (the first's: [tokens, {layers}, {k}])")
        out[row, :len(r)] = r
    return {"routing": out}


def _pictures_field(trajs: list[Trajectory], pictures) -> dict[str, list]:
    if not any(t.images for t in trajs):
        return {}
    if pictures is None:
        raise ContractError(f"{sum(bool(t.images) for t in trajs)} of the batch's samples show images, but "
                            "the trainer's policy is a text-only model")
    return {"pictures": [[pictures(h) for h in t.images or ()] for t in trajs]}


def _teacher_fields(trajs: list[Trajectory], pad) -> dict[str, torch.Tensor]:
    """On-policy distillation's per-token fields, shifted like the others: the teacher's logprob of each
    token, and its top-k ids and logprobs (teacher.top_k). {} for a batch without a teacher."""
    scored = sum(t.teacher_logprobs is not None for t in trajs)
    if scored == 0:
        return {}
    if scored < len(trajs):  # (the orchestrator batches only scored samples: a batch file from elsewhere)
        raise ContractError(f"{len(trajs) - scored} of the batch's {len(trajs)} samples have no "
                            "teacher_logprobs")
    out = {"teacher": pad("teacher_logprobs", 0.0, torch.float32)[:, 1:]}
    if all(t.teacher_top is not None for t in trajs):
        k = max((len(top[0]) for t in trajs for top in t.teacher_top if top), default=0)
        width = max(len(t.tokens) for t in trajs)
        ids = torch.zeros(len(trajs), width, k, dtype=torch.long)
        logps = torch.full((len(trajs), width, k), -torch.inf)
        for row, t in enumerate(trajs):
            for pos, top in enumerate(t.teacher_top):
                if top:
                    ids[row, pos], logps[row, pos] = torch.tensor(top[0]), torch.tensor(top[1])
        out.update(top_ids=ids[:, 1:], teacher_top=logps[:, 1:])
    return out


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


def group_logprobs(model, batch: dict, temperature: float, ranks: Ranks, entropy_grad: bool = False,
                   share_prefixes: bool = True):
    """token_logprobs of every row of `batch`, each rank computing its own share and all of them gathered
    in order (with their gradient): (logp, entropy, log π of the teacher's top-k ids or None). Over several
    ranks each rank makes one forward call: FSDP gathers the weights in every call, so every rank must make
    the same number."""
    n = batch["tokens"].shape[0]
    outputs = token_logprobs(model, _rows(batch, ranks.rows(n)), temperature, entropy_grad,
                             buckets=ranks.size == 1, share_prefixes=share_prefixes)
    gathered = [ranks.gather_rows(x, n) for x in outputs]
    return gathered[0], gathered[1], gathered[2] if len(gathered) > 2 else None


def train_step(model, optimizer, objective, trajs: list[Trajectory], version: int, cfg, pad_id: int,
               ref_model=None, phases: Phases | None = None, ranks: Ranks | None = None,
               pictures=None) -> dict:
    """Optimizer steps over `trajs` (cfg.trainer.minibatches of them); returns the step's metrics.
    `phases` accumulates the seconds of collate, recompute, forward_backward, optimizer and metrics.
    `ranks`: the trainer's group (asyncrl/trainer/ranks.py); every rank passes the same `trajs`.
    `pictures`: a vision-language policy's hash -> Picture."""
    phases, ranks = phases or Phases(), ranks or Ranks()
    device = next(model.parameters()).device
    with phases("collate"):
        batch = collate(trajs, pad_id, version, cfg.trainer.routing_replay, pictures)
        batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
        batch["weights"] = aggregation_weights(batch["mask"], cfg.objective.loss_agg)
    temperature = cfg.rollout.temperature
    obj = cfg.objective
    recompute = obj.prox == "recompute" and cfg.trainer.minibatches > 1
    if recompute:  # with a single minibatch the current weights are the proximal policy already
        with phases("recompute"), torch.no_grad():
            batch["prox"] = group_logprobs(model, batch, temperature, ranks,
                                           share_prefixes=cfg.trainer.share_prefixes)[0]
    n = len(trajs)
    bounds = [round(i * n / cfg.trainer.minibatches) for i in range(cfg.trainer.minibatches + 1)]
    parts, logp_all, entropy_all = [], [], []
    skipped = 0
    for lo, hi in zip(bounds, bounds[1:]):
        if hi <= lo:
            continue
        mb = _rows(batch, slice(lo, hi))
        with phases("forward_backward"):
            own, loss, logp, entropy, obj_metrics = _minibatch_loss(model, objective, mb, cfg, ref_model,
                                                                    ranks)
            optimizer.zero_grad(set_to_none=True)
            if not torch.isfinite(loss):  # keep the weights; every rank records the step as skipped
                skipped += 1
                parts.append({"loss": float(loss), **obj_metrics})
                continue
            ranks.own_loss(own).backward()
        with phases("optimizer"):
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.grad_clip)
            _step_with_lr_scale(optimizer, obj_metrics.get("lr_scale", 1.0))
        parts.append({"loss": float(loss), "grad_norm": float(_full(grad_norm)), **obj_metrics})
        logp_all.append(logp.detach())
        entropy_all.append(entropy.detach())
    metrics = _average(parts)
    metrics["loss"] = sum(p["loss"] for p in parts)  # parts are slices of one token mean
    metrics["skipped_nonfinite"] = skipped
    if logp_all:
        with phases("metrics"):
            metrics.update(diagnostics(torch.cat(logp_all), torch.cat(entropy_all), batch))
    return metrics


def warm_up(model, cfg, pad_id: int, ranks: Ranks, prompt_tokens: int = 24) -> None:
    """One forward and backward of a batch shaped like a step's (random tokens; the configured groups and
    answer length), before the trainer is ready: a process's first costs several times a later one
    (allocations, kernel set-up: the default run's first step took 0.30 s against 0.10 s after a warm-up)
    and would hold back the first version. No objective, no optimizer step, the RNG state restored:
    training is unchanged."""
    ro, device = cfg.rollout, next(model.parameters()).device
    gen = torch.Generator().manual_seed(0)
    vocab = model.get_input_embeddings().num_embeddings
    trajs = []
    for g in range(ro.prompts_per_step):
        prompt = torch.randint(vocab, (prompt_tokens,), generator=gen).tolist()
        for k in range(ro.group_size):
            answer = torch.randint(vocab, (ro.max_tokens,), generator=gen).tolist()
            trajs.append(Trajectory(f"{g}-{k}", str(g), "warm_up", g, prompt + answer,
                                    [0] * prompt_tokens + [1] * len(answer), [0.0] * len(prompt + answer),
                                    [-1] * prompt_tokens + [0] * len(answer)))
    batch = {k: v.to(device) for k, v in collate(trajs, pad_id, version=0).items()}
    with torch.random.fork_rng(devices=[]):
        logp, _, _ = group_logprobs(model, batch, ro.temperature, ranks,
                                 share_prefixes=cfg.trainer.share_prefixes)
        (logp * batch["mask"]).sum().backward()
    model.zero_grad(set_to_none=True)


def check_objective(result, objective, logp: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """An objective returns (per-token loss shaped like logp, with its gradient; a dict of metrics).
    Anything else would fail the same way every step: ContractError, which stops the run."""
    name = getattr(objective, "__qualname__", repr(objective))
    if not (isinstance(result, tuple) and len(result) == 2):
        shown = "" if isinstance(result, torch.Tensor) else f" {result!r:.60}"
        raise ContractError(f"objective {name} returned {type(result).__name__}{shown}; it must "
                            "return (per-token loss tensor, metrics dict)")
    loss, metrics = result
    if not isinstance(loss, torch.Tensor) or loss.shape != logp.shape:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ContractError(f"objective {name} returned a loss of shape {shape}; it must be per token, "
                            f"shaped like inputs.logp {tuple(logp.shape)}")
    if logp.requires_grad and not loss.requires_grad:
        raise ContractError(f"objective {name} returned a loss without a gradient (detached from "
                            "inputs.logp): training would not change the policy")
    if not isinstance(metrics, dict) or not all(isinstance(k, str) and as_number(v) is not None
                                                for k, v in metrics.items()):
        raise ContractError(f"objective {name} returned metrics {metrics!r:.80}; they must be a dict of "
                            "name -> number")
    return loss, metrics


def _minibatch_loss(model, objective, mb: dict, cfg, ref_model, ranks: Ranks):
    """(this rank's part of the loss, with its graph; the whole loss; logp; entropy; objective metrics) of
    one minibatch: forward, objective, KL and entropy terms. The objective sees every row on every rank."""
    obj, temperature = cfg.objective, cfg.rollout.temperature
    logp, entropy, top_logp = group_logprobs(model, mb, temperature, ranks, entropy_grad=obj.entropy_coef > 0,
                                             share_prefixes=cfg.trainer.share_prefixes)
    if "prox" in mb:
        prox = mb["prox"]
    elif obj.prox == "loglinear":
        prox = loglinear_prox(mb["behav"], logp, mb["staleness"])
    else:
        prox = logp.detach()
    inp = LossInputs(logp, mb["behav"], prox, mb["advantages"], mb["mask"], mb["staleness"],
                     mb["rewards"], mb["groups"], mb.get("teacher"), mb.get("teacher_top"), top_logp)
    try:
        result = objective(inp, obj)
    except Exception as e:  # the same batch after a restart raises the same way: say so once, stop
        name = getattr(objective, "__qualname__", repr(objective))
        raise ContractError(f"objective {name} raised {type(e).__name__}: {e}") from e
    per_token, obj_metrics = check_objective(result, objective, logp)
    if ref_model is not None and obj.kl_coef > 0:
        with torch.no_grad():
            ref = group_logprobs(ref_model, mb, temperature, ranks,
                                 share_prefixes=cfg.trainer.share_prefixes)[0]
        kl = kl_penalty(logp, ref, obj.kl_estimator)
        per_token = per_token + obj.kl_coef * kl
        obj_metrics["kl_ref"] = float((kl.detach() * mb["mask"]).sum() / mb["mask"].sum().clamp(min=1))
    if obj.entropy_coef > 0:
        per_token = per_token - obj.entropy_coef * entropy
    weighted = torch.where(mb["mask"] > 0, per_token * mb["weights"], 0.0)
    # each rank's rows: their sum over ranks is the loss, and the gathers carry each part's gradient to
    # the rank whose forward made it
    own = weighted[ranks.rows(weighted.shape[0])].sum()
    return own, ranks.total(own), logp, entropy, obj_metrics


def _full(value: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) result as a plain tensor."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value


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
    # k3 estimate of KL(behaviour ‖ trainer) on tokens the trainer holds the same version of: none in a
    # trainer-bound run at η ≥ 1 (every sample is a version behind), where it is NaN over 0 mismatch_tokens
    r_fresh = (logp - behav)[fresh].exp()
    mismatch = float((r_fresh - 1 - r_fresh.log()).mean()) if fresh.any() else math.nan
    q = (
        torch.quantile(ratios, ratios.new_tensor([0.05, 0.5, 0.95])).tolist()
        if ratios.numel()
        else [math.nan] * 3
    )
    seq_stale = torch.where(counted, stale, -1).max(-1).values
    return {
        "entropy": float(entropy[counted].mean()) if counted.any() else math.nan,
        "ess_fraction": ess,
        "ratio_p05": q[0], "ratio_p50": q[1], "ratio_p95": q[2],
        "ratio_max": float(ratios.max()) if ratios.numel() else math.nan,
        "mismatch_kl": mismatch,
        "mismatch_tokens": int(fresh.sum()),
        "staleness_mean": float(seq_stale.float().mean()),
        "staleness_max": int(seq_stale.max()),
        "train_tokens": int(mask.sum()),
    }
