"""The trainer role: wait for batch k, train version k into k+1, publish it, checkpoint.

Run as `python -m asyncrl.trainer.main RUN_DIR`. It reads only the run directory: batches in,
weights and checkpoints out.
"""
from __future__ import annotations

import copy
import os
import sys
import time
from pathlib import Path

import torch

from asyncrl import weights
from asyncrl.config import read_run_config
from asyncrl.model import load_policy
from asyncrl.objectives import get_objective
from asyncrl.trainer.step import train_step
from asyncrl.trajectory import batch_path, read_batch


def wait_for_batch(run_dir: Path, step: int, deadline_s: float) -> Path:
    path = batch_path(run_dir, step)
    start = time.monotonic()
    while not path.exists():
        if time.monotonic() - start > deadline_s:
            raise TimeoutError(
                f"trainer: step {step} (training version {step}) waited {deadline_s:.0f}s for its batch "
                f"{path} from the orchestrator (timeouts.batch); is the orchestrator alive?"
            )
        time.sleep(0.005)
    return path


def save_checkpoint(run_dir: Path, step: int, model, optimizer, scheduler, keep: int = 2) -> Path:
    """Model + optimizer + scheduler + RNG after `step` steps, written to a temp dir and renamed into place."""
    root = run_dir / "checkpoints"
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}"
    tmp.mkdir(parents=True, exist_ok=True)
    torch.save(
        {"step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
         "rng": torch.get_rng_state()},
        tmp / "trainer_state.pt",
    )
    model.save_pretrained(tmp)
    os.replace(tmp, final)
    for old in sorted(root.glob("step_*"))[:-keep]:
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    return final


def main(run_dir: str) -> None:
    run_dir = Path(run_dir)
    cfg = read_run_config(run_dir)
    torch.set_num_threads(cfg.role_threads("trainer"))
    torch.manual_seed(cfg.run.seed)
    model, tokenizer = load_policy(cfg.model.path)
    model.to(cfg.trainer.device).train()
    ref_model = None
    if cfg.objective.kl_coef > 0:  # the KL anchor is the initial policy, frozen
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.trainer.lr, betas=cfg.trainer.betas, weight_decay=cfg.trainer.weight_decay
    )
    warmup = cfg.trainer.warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (warmup + 1)))
    objective = get_objective(cfg.objective.name, cfg.objective.import_path)
    serving_dtype = getattr(torch, cfg.inference.dtype)
    served = weights.cast_state(weights.model_state(model), serving_dtype) if cfg.trainer.publish_patches else None
    busy = idle = 0.0
    print(f"trainer: {torch.get_num_threads()} threads, objective {cfg.objective.import_path or cfg.objective.name}", flush=True)
    for step in range(cfg.run.steps):
        t0 = time.monotonic()
        path = wait_for_batch(run_dir, step, cfg.timeouts.batch)
        trajs = read_batch(path)
        t1 = time.monotonic()
        metrics = train_step(model, optimizer, objective, trajs, step, cfg, tokenizer.pad_token_id, ref_model)
        metrics["lr"] = scheduler.get_last_lr()[0]
        scheduler.step()
        t2 = time.monotonic()
        idle, busy = idle + (t1 - t0), busy + (t2 - t1)
        metrics.update(
            step=step, train_seconds=t2 - t1, batch_wait_seconds=t1 - t0, busy_seconds=busy,
            idle_seconds=idle, train_tokens_per_s=metrics.get("train_tokens", 0) / max(t2 - t1, 1e-9),
        )
        state = weights.model_state(model)
        if served is not None:  # the patch lands before the marker that announces the version
            new = weights.cast_state(state, serving_dtype)
            patch, changed, total = weights.make_patch(served, new)
            weights.save_patch(run_dir, step + 1, patch)
            served = new
            metrics.update(patch_fraction=changed / total, serving_hash=weights.state_hash(new))
        weights.publish(run_dir, step + 1, state, metrics)
        weights.prune(run_dir, step + 1, cfg.trainer.keep_weight_versions)
        if (step + 1) % cfg.trainer.checkpoint_every == 0 or step + 1 == cfg.run.steps:
            save_checkpoint(run_dir, step + 1, model, optimizer, scheduler)
        busy += time.monotonic() - t2
    print(f"trainer: done, {cfg.run.steps} steps, busy {busy:.1f}s, waiting {idle:.1f}s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
