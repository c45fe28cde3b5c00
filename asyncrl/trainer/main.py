"""The trainer role: wait for batch k, train version k into k+1, publish it, checkpoint.

Run as `python -m asyncrl.trainer.main RUN_DIR`. It reads only the run directory: batches in,
weights and checkpoints out. It always starts from the newest checkpoint that verifies, so a
restart after a crash (or `asyncrl train --resume`) continues where the last durable state was:
the batches trained after that checkpoint are trained again, from the same files, with the same
RNG state, and each re-published version is checked bit for bit against the one published
before the crash.
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch

from asyncrl import checkpoint, weights
from asyncrl.config import read_run_config
from asyncrl.events import EventLog
from asyncrl.fatal import FatalError, run_role
from asyncrl.files import poll
from asyncrl.heartbeat import Heartbeat
from asyncrl.ledger import batch_digest
from asyncrl.model import load_policy
from asyncrl.objectives import get_objective
from asyncrl.profile import Phases
from asyncrl.trainer.step import train_step
from asyncrl.trajectory import batch_path, read_batch


def lr_schedule(cfg):
    """The lr factor at optimizer step s: a linear warm-up (Adam's first steps move every weight by
    ~lr whatever the gradient's size), then constant or a cosine down to trainer.min_lr_ratio at the
    run's last step."""
    t = cfg.trainer
    warmup, total = t.warmup_steps, max(1, cfg.run.steps * t.minibatches)

    def factor(step: int) -> float:
        ramp = min(1.0, (step + 1) / (warmup + 1))
        if t.lr_schedule == "constant" or step < warmup:
            return ramp
        done = min(1.0, (step - warmup) / max(1, total - warmup))
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * done))

    return factor


def wait_for_batch(run_dir: Path, step: int, deadline_s: float, heartbeat: Heartbeat) -> Path:
    path = batch_path(run_dir, step)

    def arrived() -> bool:
        heartbeat.beat()
        return path.exists()

    poll(
        arrived,
        deadline_s,
        f"trainer: step {step} (training version {step}) waited {deadline_s:.0f}s for its batch "
        f"{path} from the orchestrator (timeouts.batch); is the orchestrator alive?",
        every=0.005,
    )
    return path


def restore(run_dir: Path, cfg, events: EventLog):
    """(model, tokenizer, trainer state or None): the newest valid checkpoint, else the initial model."""
    def corrupt(message: str) -> None:
        print(f"trainer: {message}", flush=True)
        events.write("checkpoint_corrupt", detail=message)

    path = checkpoint.latest(run_dir, log=corrupt)
    model, tokenizer = load_policy(str(path) if path else cfg.model.path)
    if path is None:
        return model, tokenizer, None
    state = checkpoint.load_trainer_state(path)
    print(f"trainer: resuming from {path} (step {state['step']})", flush=True)
    events.write("trainer_resumed", checkpoint=str(path), step=state["step"])
    return model, tokenizer, state


def check_finite(model, step: int, metrics: dict) -> None:
    """Non-finite weights are never published or checkpointed: the run stops with why (a restart would
    replay the same step into the same weights)."""
    if all(bool(torch.isfinite(p).all()) for p in model.parameters()):
        return
    raise FatalError(
        f"trainer: step {step} made the weights non-finite (lr {metrics['lr']:.3g}, "
        f"loss {metrics['loss']:.4g}, grad norm {metrics.get('grad_norm', float('nan')):.4g}); version "
        f"{step + 1} is not published, the last good version is {step}. Lower trainer.lr."
    )


def publish_version(run_dir: Path, version: int, state: dict, metrics: dict, events: EventLog) -> None:
    """Publish, or after a restart confirm that the version published before it is bit-identical."""
    before = weights.read_marker(run_dir, version)
    if before is None:
        weights.publish(run_dir, version, state, metrics)
        return
    digest = weights.state_hash(state)
    if digest == before["hash"] and before.get("batch_digest") == metrics["batch_digest"]:
        events.write("version_replayed", version=version, identical=True)
        return
    # Non-deterministic kernels (some GPU ones) can make a replay differ: the new weights win,
    # and samples already drawn from the old ones stay valid off-policy data (their logprobs are theirs).
    print(
        f"trainer: replayed version {version} differs from the one published before the restart", flush=True
    )
    events.write("version_replayed", version=version, identical=False)
    weights.publish(run_dir, version, state, metrics)


def main(run_dir: str) -> None:
    run_dir = Path(run_dir)
    cfg = read_run_config(run_dir)
    torch.set_num_threads(cfg.role_threads("trainer"))
    events = EventLog(run_dir, "trainer")
    torch.manual_seed(cfg.run.seed)
    model, tokenizer, resumed = restore(run_dir, cfg, events)
    model.to(cfg.trainer.device).train()
    ref_model = None
    if cfg.objective.kl_coef > 0:  # the KL anchor is the initial policy, frozen
        ref_model = load_policy(cfg.model.path)[0].to(cfg.trainer.device).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.trainer.lr, betas=cfg.trainer.betas, weight_decay=cfg.trainer.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(cfg))
    first_step = 0
    if resumed is not None:
        optimizer.load_state_dict(resumed["optimizer"])
        scheduler.load_state_dict(resumed["scheduler"])
        torch.set_rng_state(resumed["rng"])
        first_step = resumed["step"]
    objective = get_objective(cfg.objective.name, cfg.objective.import_path)
    serving_dtype = getattr(torch, cfg.inference.dtype)
    served = (
        weights.cast_state(weights.model_state(model), serving_dtype) if cfg.trainer.publish_patches else None
    )
    writer = checkpoint.CheckpointWriter(
        run_dir, tokenizer, cfg.trainer.keep_checkpoints, cfg.timeouts.checkpoint
    )
    phases, started = Phases(), time.monotonic()  # running totals from here on, reported with every version
    heartbeat = Heartbeat(run_dir, "trainer")  # from here on a silent trainer is a stuck one
    events.write("trainer_ready", step=first_step)
    print(
        f"trainer: {torch.get_num_threads()} threads, "
        f"objective {cfg.objective.import_path or cfg.objective.name}, "
        f"steps {first_step}..{cfg.run.steps}",
        flush=True,
    )
    for step in range(first_step, cfg.run.steps):
        t0 = time.monotonic()
        with phases("wait_batch"):
            path = wait_for_batch(run_dir, step, cfg.timeouts.batch, heartbeat)
        with phases("read_batch"):
            trajs = read_batch(path)
        t1 = time.monotonic()
        with heartbeat.through(cfg.timeouts.step_compute):  # a long step is not a hung one
            metrics = train_step(
                model, optimizer, objective, trajs, step, cfg, tokenizer.pad_token_id, ref_model, phases
            )
        metrics["lr"] = scheduler.get_last_lr()[0]
        check_finite(model, step, metrics)
        scheduler.step()
        t2 = time.monotonic()
        metrics.update(
            step=step, train_seconds=t2 - t1, batch_wait_seconds=t1 - t0,
            train_tokens_per_s=metrics.get("train_tokens", 0) / max(t2 - t1, 1e-9),
            batch_digest=batch_digest([t.id for t in trajs]),
        )
        with phases("publish"):
            state = weights.model_state(model)
            if served is not None:  # the patch lands before the marker that announces the version
                new = weights.cast_state(state, serving_dtype)
                patch, changed, total = weights.make_patch(served, new)
                weights.save_patch(run_dir, step + 1, patch)
                served = new
                metrics.update(patch_fraction=changed / total, serving_hash=weights.state_hash(new))
        if (step + 1) % cfg.trainer.checkpoint_every == 0 or step + 1 == cfg.run.steps:
            with phases("checkpoint"):
                metrics["checkpoint_stall_seconds"] = writer.save(step + 1, model, optimizer, scheduler)
        with phases("publish"):
            uptime = time.monotonic() - started
            metrics.update(
                phases.totals("time/trainer"),
                **{"time/trainer/uptime": uptime},
                busy_seconds=uptime - phases.seconds["wait_batch"],
                idle_seconds=phases.seconds["wait_batch"],
            )
            publish_version(run_dir, step + 1, state, metrics, events)
            # the server may be up to η + 1 versions behind, and must still find the one it serves
            weights.prune(
                run_dir, step + 1, max(cfg.trainer.keep_weight_versions, cfg.rollout.max_staleness + 2)
            )
        heartbeat.beat()
    writer.wait()
    busy = time.monotonic() - started - phases.seconds["wait_batch"]
    print(
        f"trainer: done, {cfg.run.steps} steps, busy {busy:.1f}s, "
        f"waiting {phases.seconds['wait_batch']:.1f}s, "
        f"checkpoint writes {sum(writer.write_seconds):.2f}s in the background",
        flush=True,
    )


if __name__ == "__main__":
    run_role("trainer", sys.argv[1], lambda: main(sys.argv[1]))
