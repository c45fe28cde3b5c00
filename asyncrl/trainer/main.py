"""The trainer role: wait for batch k, train version k into k+1, publish it, checkpoint.

Run as `python -m asyncrl.trainer.main RUN_DIR`. It reads only the run directory: batches in,
weights and checkpoints out. It always starts from the newest checkpoint that verifies, so a
restart after a crash (or `asyncrl train --resume`) continues where the last durable state was:
the batches trained after that checkpoint are trained again, from the same files, with the same
RNG state, and each re-published version is checked bit for bit against the one published
before the crash.
"""
from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from asyncrl.config import read_run_config
from asyncrl.control import pausing
from asyncrl.control.live import with_settings
from asyncrl.files import poll
from asyncrl.objectives import get_objective
from asyncrl.observe.events import EventLog
from asyncrl.observe.profile import Phases
from asyncrl.policy import lora, routing
from asyncrl.policy.model import load_policy
from asyncrl.run.heartbeat import Heartbeat
from asyncrl.run.role import FatalError, run_role
from asyncrl.rundir import CheckpointFiles, RunDir
from asyncrl.store import checkpoint
from asyncrl.store.ledger import batch_digest
from asyncrl.swarm import quarantine
from asyncrl.trainer.ranks import Ranks, join_group
from asyncrl.trainer.step import train_step, warm_up
from asyncrl.trajectory import read_batch, read_header
from asyncrl.transports import weights
from asyncrl.vision.inputs import picture_loader

log = logging.getLogger("asyncrl.trainer")


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


def use_lr(optimizer, scheduler, lr: float) -> None:
    """trainer.lr in force at this step: a live change sets the base the schedule's factor multiplies,
    from this step on (the scheduler's state, and so a checkpoint, holds the base)."""
    if scheduler.base_lrs[0] != lr:
        factor = scheduler.lr_lambdas[0](scheduler.last_epoch)
        scheduler.base_lrs = [lr] * len(scheduler.base_lrs)
        for group in optimizer.param_groups:
            group["lr"] = lr * factor


def wait_for_batch(run_dir: Path, step: int, deadline_s: float, heartbeat: Heartbeat) -> Path:
    path = RunDir(run_dir).batch(step)

    def arrived() -> bool:
        heartbeat.beat()
        return path.exists()

    what = (f"trainer: step {step} (training version {step}) waited {deadline_s:.0f}s for its batch {path} "
            "from the orchestrator (timeouts.batch); is the orchestrator alive?")
    # (a wait that a pause outlasts waits again: asyncrl ctl RUN pause)
    pausing.patiently_blocking(run_dir, deadline_s, lambda: poll(arrived, deadline_s, what, every=0.005))
    return path


def restore(run_dir: Path, cfg, events: EventLog | None, ranks: Ranks):
    """(model, tokenizer, trainer state or None) on every rank: the newest checkpoint that verifies (the
    leader looks; the others load what it found), else the initial model."""
    def corrupt(message: str) -> None:
        log.warning(f"trainer: {message}")
        events.write("checkpoint_corrupt", detail=message)

    path = ranks.broadcast(checkpoint.latest(run_dir, log=corrupt) if ranks.leader else None)
    spec = cfg.trainer.lora if cfg.trainer.lora.rank else None
    if path is not None and CheckpointFiles(path).adapters.exists() != bool(spec):
        raise FatalError(f"trainer: checkpoint {path} holds {'adapters' if spec is None else 'whole weights'}"
                         f", but trainer.lora.rank = {cfg.trainer.lora.rank}: a run trains adapters or whole "
                         "weights from its start to its end (start a new run, or resume without the change)")
    # (adapters: the base policy, then the checkpoint's adapters on it)
    model, tokenizer = load_policy(str(path) if path and not spec else cfg.model.path)
    if spec is not None:
        lora.attach(model, spec)
        if path is not None:
            adapters = CheckpointFiles(path).adapters
            try:
                lora.load_adapters(model, weights.load(adapters), str(adapters))
            except ValueError as e:  # (another rank or target modules than the checkpoint's, under --force)
                raise FatalError(f"trainer: cannot resume with trainer.lora = "
                                 f"{cfg.trainer.lora.model_dump()}: {e}") from None
    if path is None:
        return model, tokenizer, None
    state = {"path": path, **checkpoint.load_trainer_state(path)}
    if ranks.leader:
        log.info(f"trainer: resuming from {path} (step {state['step']})")
        events.write("trainer_resumed", checkpoint=str(path), step=state["step"])
    return model, tokenizer, state


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every element is finite. A sum is non-finite whenever one of its terms is (inf, nan),
    so one sum per tensor settles it (0.14 ms for the default model against 1.7 ms for an elementwise
    isfinite per tensor); only a sum that overflowed from finite terms needs the elementwise look."""
    if not tensors:
        return True
    with torch.no_grad():
        sums = torch.stack([t.detach().sum(dtype=torch.float32) for t in tensors])
        return bool(sums.isfinite().all()) or all(bool(torch.isfinite(t).all()) for t in tensors)


def check_finite(model, step: int, metrics: dict, ranks: Ranks) -> None:
    """Non-finite weights are never published or checkpointed: the run stops with why (a restart would
    replay the same step into the same weights)."""
    if ranks.all(all_finite([p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()])):
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
    log.warning(f"trainer: replayed version {version} differs from the one published before the restart")
    events.write("version_replayed", version=version, identical=False)
    weights.publish(run_dir, version, state, metrics)


def main(run_dir: str) -> None:
    run_dir = Path(run_dir)
    cfg = read_run_config(run_dir)
    torch.set_num_threads(cfg.role_threads("trainer"))
    ranks = join_group(cfg, run_dir)
    try:
        train(run_dir, cfg, ranks)
    finally:
        ranks.close()


@dataclass
class Setup:
    model: torch.nn.Module  # sharded over the ranks
    tokenizer: object
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    first_step: int
    ref_model: torch.nn.Module | None
    published: list[str]  # names of the published weights (tied weights once), from the unsharded model
    settings: dict  # the live settings in force at the checkpoint resumed from (asyncrl/control/live.py)
    adapters_only: bool  # trainer.lora: versions and checkpoints hold the adapters alone
    pictures: object  # a vision-language policy's hash -> Picture (asyncrl/vision/inputs.py), else None

    def published_state(self, ranks: Ranks) -> dict[str, torch.Tensor]:
        """What a version holds, on the leader (every rank takes part): the weights, or the adapters."""
        state = ranks.full_model_state(self.model, self.published)
        return lora.adapters(state) if self.adapters_only else state


def build(run_dir: Path, cfg, ranks: Ranks, events: EventLog | None) -> Setup:
    """The model (restored, sharded), its optimizer and schedule, on every rank."""
    torch.manual_seed(cfg.run.seed)
    model, tokenizer, resumed = restore(run_dir, cfg, events, ranks)
    model.to(cfg.trainer.device).train()
    adapters_only = bool(cfg.trainer.lora.rank)
    published = [name for name in weights.model_state(model) if not adapters_only or lora.is_adapter(name)]
    if cfg.trainer.routing_replay and not routing.routers(model):
        raise FatalError(f"trainer.routing_replay = true, but {cfg.model.path} has no mixture-of-experts "
                         "router asyncrl can replay (a dense policy, or a router other than softmax top-k: "
                         f"{', '.join(sorted(routing.REPLAYABLE))})")
    if cfg.trainer.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ranks.shard(model, cfg.trainer.mixed_precision)
    ref_model = None
    if cfg.objective.kl_coef > 0:  # the KL anchor is the initial policy, frozen (a whole copy per rank)
        ref_model = load_policy(cfg.model.path)[0].to(cfg.trainer.device).eval().requires_grad_(False)
    t = cfg.trainer
    trained = [p for p in model.parameters() if p.requires_grad]  # (LoRA: the adapters alone)
    optimizer = torch.optim.AdamW(trained, lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(cfg))
    first_step, settings = 0, {}
    if resumed is not None:
        checkpoint.load_optimizer(resumed["path"], model, optimizer, ranks.checkpoint_group)
        scheduler.load_state_dict(resumed["scheduler"])
        torch.set_rng_state(resumed["rng"])
        first_step, settings = resumed["step"], resumed.get("settings", {})
    return Setup(model, tokenizer, optimizer, scheduler, first_step, ref_model, published, settings,
                 adapters_only, picture_loader(cfg.model.path, model.config, run_dir))


def train(run_dir: Path, cfg, ranks: Ranks) -> None:
    """The step loop; only the leader touches the run directory (batches, versions, checkpoints, events)."""
    leader = ranks.leader
    events = EventLog(run_dir, "trainer") if leader else None
    setup = build(run_dir, cfg, ranks, events)
    model, optimizer, scheduler = setup.model, setup.optimizer, setup.scheduler
    objective = get_objective(cfg.objective.name, cfg.objective.import_path)
    serving_dtype = getattr(torch, cfg.inference.dtype)
    state = setup.published_state(ranks)
    served = weights.cast_state(state, serving_dtype) if cfg.trainer.publish_patches and leader else None
    adapter_config = lora.peft_config(cfg.trainer.lora, cfg.model.path) if setup.adapters_only else None
    writer = checkpoint.CheckpointWriter(run_dir, setup.tokenizer, cfg.trainer.keep_checkpoints,
                                         cfg.timeouts.checkpoint, ranks, adapter_config)
    if leader and adapter_config is not None:  # (beside the versions: each is a PEFT directory's weights)
        lora.write_config(adapter_config, RunDir(run_dir).weights)
    sender = None  # inference.weight_transfer = "nccl": versions go from here into the vLLM replicas
    if leader and cfg.inference.weight_transfer == "nccl":
        from asyncrl.transports.weight_sender import Sender

        sender = Sender(cfg, run_dir)
        sender.publish(setup.first_step, state)
    warm_up(model, cfg, setup.tokenizer.pad_token_id, ranks)
    keep = 0  # weight versions kept on disk (finish_version)
    phases, started = Phases(), time.monotonic()  # running totals from here on, reported with every version
    heartbeat = Heartbeat(run_dir, "trainer") if leader else None  # from here on a silent trainer is stuck
    # run.steps is live: the latest batch read (or the checkpoint) says how many
    step, steps = setup.first_step, with_settings(cfg, setup.settings).run.steps
    if leader:
        events.write("trainer_ready", step=step, ranks=ranks.size)
        log.info(f"trainer: {ranks.size} rank(s) x {torch.get_num_threads()} threads, objective "
                 f"{cfg.objective.import_path or cfg.objective.name}, steps {step}..{steps}")
    while step < steps:
        t0 = time.monotonic()
        with phases("wait_batch"):
            path = wait_for_batch(run_dir, step, cfg.timeouts.batch, heartbeat) if leader else None
        # a long step is not a hung one: beats go on through all of it (reading, training, publishing,
        # checkpointing) for at most timeouts.step_compute, past which the supervisor sees a stuck trainer
        with heartbeat.through(cfg.timeouts.step_compute) if leader else contextlib.nullcontext():
            with phases("read_batch"):
                batch = (read_batch(path), read_header(path)) if leader else None
                masked = quarantine.mask(run_dir, batch[0]) if leader else []  # (asyncrl/swarm/quarantine.py)
                trajs, header = ranks.broadcast(batch)
            step_cfg = with_settings(cfg, header["settings"])  # the live changes in force (control/live.py)
            steps = step_cfg.run.steps
            use_lr(optimizer, scheduler, step_cfg.trainer.lr)
            t1 = time.monotonic()
            metrics = train_step(model, optimizer, objective, trajs, step, step_cfg,
                                 setup.tokenizer.pad_token_id, setup.ref_model, phases, ranks, setup.pictures)
            metrics["lr"] = optimizer.param_groups[0]["lr"]
            if masked:
                metrics["quarantined_samples"] = masked
            check_finite(model, step, metrics, ranks)
            scheduler.step()
            t2 = time.monotonic()
            metrics.update(
                step=step, train_seconds=t2 - t1, batch_wait_seconds=t1 - t0, ranks=ranks.size,
                train_tokens_per_s=metrics.get("train_tokens", 0) / max(t2 - t1, 1e-9),
                batch_digest=batch_digest([t.id for t in trajs]),
            )
            with phases("publish"):
                state = setup.published_state(ranks)
                if served is not None:  # the patch lands before the marker that announces the version
                    new = weights.cast_state(state, serving_dtype)
                    patch, changed, total = weights.make_patch(served, new)
                    weights.save_patch(run_dir, step + 1, patch)
                    served = new
                    metrics.update(patch_fraction=changed / total, serving_hash=weights.state_hash(new))
                elif not setup.adapters_only and any(t.dtype != serving_dtype for t in state.values()):
                    # (the engine hashes what it holds; adapters it holds as published, and merges them)
                    metrics["serving_hash"] = weights.state_hash(weights.cast_state(state, serving_dtype))
            asked = "checkpoint" in header["actions"]  # (asyncrl ctl RUN checkpoint)
            if (step + 1) % cfg.trainer.checkpoint_every == 0 or step + 1 == steps or asked:
                with phases("checkpoint"):
                    trainer_state = {"scheduler": scheduler.state_dict(), "rng": torch.get_rng_state(),
                                     "settings": header["settings"]}
                    metrics["checkpoint_stall_seconds"] = writer.save(
                        step + 1, state, model.config.to_dict(), trainer_state,
                        checkpoint.optimizer_state(model, optimizer))
            if sender is not None:  # (before the marker that announces the version)
                sender.publish(step + 1, state)
            if leader:
                # the server may be up to η + 1 versions behind, and must still find the one it serves
                # (η may have changed live: keep the most it has been)
                keep = max(keep, step_cfg.trainer.keep_weight_versions, step_cfg.rollout.max_staleness + 2)
                finish_version(run_dir, keep, step, state, metrics, phases, started, events)
        step += 1
    with heartbeat.through(cfg.timeouts.checkpoint) if leader else contextlib.nullcontext():
        writer.wait()  # (the last checkpoint: a slow disk is not a hang either)
    if leader:
        busy, waited = time.monotonic() - started - phases.seconds["wait_batch"], phases.seconds["wait_batch"]
        log.info(f"trainer: done, {steps} steps, busy {busy:.1f}s, waiting {waited:.1f}s, "
              f"checkpoint writes {sum(writer.write_seconds):.2f}s in the background")


def finish_version(run_dir: Path, keep: int, step: int, state: dict, metrics: dict, phases: Phases,
                   started: float, events: EventLog) -> None:
    """Publish version step + 1 with the step's metrics and the trainer's time so far; keep the last
    `keep` versions."""
    with phases("publish"):
        uptime = time.monotonic() - started
        metrics.update(
            phases.totals("time/trainer"),
            **{"time/trainer/uptime": uptime},
            busy_seconds=uptime - phases.seconds["wait_batch"],
            idle_seconds=phases.seconds["wait_batch"],
        )
        publish_version(run_dir, step + 1, state, metrics, events)
        weights.prune(run_dir, step + 1, keep)


if __name__ == "__main__":
    run_role("trainer", sys.argv[1], lambda: main(sys.argv[1]))
