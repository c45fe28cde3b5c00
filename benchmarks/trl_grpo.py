"""TRL's GRPOTrainer on an asyncrl task, set up the way asyncrl's run of the same config is.

The baseline of benchmarks/vs_trl.py, run as its own process so it has the whole machine:

    python benchmarks/trl_grpo.py OUT_DIR CONFIG_JSON

CONFIG_JSON is an asyncrl config (config.json of a run, or `asyncrl.config.save_config`). Same
model, tokenizer, prompts in the same order (items 0, 1, 2, ... of task.seed), group size,
prompts per step, max tokens, temperature, learning rate and warm-up, Adam betas, clip range,
token-mean (DAPO) loss, one optimizer step per generation batch, and the task's own verifier.
Every `snapshot_every` steps the policy is saved with the training clock stopped; OUT_DIR gets
snapshots/step_N/ and trl.json: [(step, training seconds)], samples, wall seconds.

TRL is a benchmark dependency only: `pip install -e ".[bench]"` (after scripts/setup.sh).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch


def dataset(cfg, size: int):
    """The first `size` training prompts, in asyncrl's order, each with its task item for scoring."""
    from datasets import Dataset

    from asyncrl.rewards.tasks import load_tasks

    tasks = load_tasks(cfg.task)
    items = [tasks.item(i) for i in range(size)]
    # a user turn, as asyncrl sends it (task.chat): TRL renders it with the tokenizer's chat template and the
    # generation prompt; a plain string would reach the policy without the template it was trained on
    prompts = [[{"role": "user", "content": tasks.prompt(e)}] if cfg.task.chat else tasks.prompt(e)
               for e in items]
    return Dataset.from_dict({"prompt": prompts, "entry": [json.dumps(e) for e in items]})


def reward_function(cfg):
    """The task's verifier (the same TaskSource.score asyncrl's verifier pool runs)."""
    from asyncrl.rewards.tasks import load_tasks

    tasks = load_tasks(cfg.task)

    def task_reward(prompts, completions, entry, **_):
        # (a conversational completion is the list of its messages: the assistant's reply)
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [tasks.score(t, json.loads(e)) for t, e in zip(texts, entry)]

    return task_reward


class Clock:
    """Training seconds since the first step, minus the time spent saving snapshots."""

    def __init__(self, out: Path, every: int):
        from transformers import TrainerCallback

        clock = self
        self.out, self.every, self.points, self.paused = out, every, [], 0.0
        self.start = None

        class Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, **kw):
                clock.start = time.monotonic()

            def on_step_end(self, args, state, control, model=None, processing_class=None, **kw):
                if state.global_step % clock.every == 0 or state.global_step == state.max_steps:
                    clock.snapshot(state.global_step, model, processing_class)

        self.callback = Callback()

    def now(self) -> float:
        return time.monotonic() - self.start - self.paused

    def snapshot(self, step: int, model, tokenizer) -> None:
        self.points.append((step, round(self.now(), 3)))
        began = time.monotonic()
        model.save_pretrained(self.out / "snapshots" / f"step_{step:06d}")
        tokenizer.save_pretrained(self.out / "snapshots" / f"step_{step:06d}")
        self.paused += time.monotonic() - began


def time_phases(trainer) -> dict[str, float]:
    """Seconds in TRL's own methods, accumulated as it trains: its time profile, by role. `training_step`
    holds `_prepare_inputs` (generation, scoring, advantages) and the loss's forward, backward and step."""
    seconds: dict[str, float] = {}
    for phase, method in [("training_step", "training_step"), ("prepare_inputs", "_prepare_inputs"),
                          ("generate", "_generate"), ("score", "_calculate_rewards")]:
        inner = getattr(trainer, method)

        def timed(*args, _inner=inner, _phase=phase, **kw):
            began = time.monotonic()
            try:
                return _inner(*args, **kw)
            finally:
                seconds[_phase] = seconds.get(_phase, 0.0) + time.monotonic() - began

        setattr(trainer, method, timed)
    return seconds


def profile(seconds: dict[str, float], train_seconds: float) -> dict[str, float]:
    """The training clock split into generation, scoring, the rest of preparing a batch, the optimizer
    step's forward/backward/update, and what lies outside training_step (the Trainer's loop, callbacks)."""
    prepare, step = seconds.get("prepare_inputs", 0.0), seconds.get("training_step", 0.0)
    gen, score = seconds.get("generate", 0.0), seconds.get("score", 0.0)
    return {"generate": round(gen, 1), "score": round(score, 1),
            "prepare_other": round(prepare - gen - score, 1), "train": round(step - prepare, 1),
            "outside_step": round(train_seconds - step, 1)}


def main(out_dir: str, config_json: str) -> None:
    from trl import GRPOConfig, GRPOTrainer

    from asyncrl.config import Config
    from asyncrl.policy.model import load_policy

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = Config.model_validate_json(Path(config_json).read_text())
    every = int(os.environ.get("SNAPSHOT_EVERY", "10"))
    threads = int(os.environ.get("TRL_THREADS", os.cpu_count() or 1))
    torch.set_num_threads(threads)
    ro, obj, tr = cfg.rollout, cfg.objective, cfg.trainer
    model, tokenizer = load_policy(cfg.model.path)
    args = GRPOConfig(
        output_dir=str(out / "trl"),
        use_cpu=True,
        use_vllm=False,
        seed=cfg.run.seed,
        max_steps=cfg.run.steps,
        per_device_train_batch_size=ro.prompts_per_step * ro.group_size,
        gradient_accumulation_steps=1,
        num_generations=ro.group_size,
        steps_per_generation=1,
        num_iterations=1,
        max_completion_length=ro.max_tokens,
        temperature=ro.temperature,
        top_p=ro.top_p,
        top_k=0,
        learning_rate=tr.lr,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=tr.warmup_steps,
        adam_beta1=tr.betas[0],
        adam_beta2=tr.betas[1],
        weight_decay=tr.weight_decay,
        max_grad_norm=tr.grad_clip,
        epsilon=obj.eps_low,
        epsilon_high=obj.eps_high,
        beta=0.0,
        loss_type="dapo",
        scale_rewards="group",
        gradient_checkpointing=False,
        shuffle_dataset=False,
        disable_dropout=True,
        bf16=False,
        logging_steps=10,
        save_strategy="no",
        report_to="none",
        dataloader_num_workers=0,
    )
    clock = Clock(out, every)
    trainer = GRPOTrainer(model=model, reward_funcs=reward_function(cfg), args=args,
                          train_dataset=dataset(cfg, cfg.run.steps * ro.prompts_per_step),
                          processing_class=tokenizer, callbacks=[clock.callback])
    seconds = time_phases(trainer)
    began = time.monotonic()
    trainer.train()
    wall = time.monotonic() - began
    samples = cfg.run.steps * ro.prompts_per_step * ro.group_size
    (out / "trl.json").write_text(json.dumps({
        "points": clock.points, "train_seconds": round(clock.now(), 2), "wall_seconds": round(wall, 2),
        "samples": samples, "samples_per_s": round(samples / clock.now(), 2), "threads": threads,
        "profile": profile(seconds, clock.now()), "log": trainer.state.log_history}, indent=1))
    print(
        f"trl: {cfg.run.steps} steps in {clock.now():.1f}s of training, "
        f"{samples / clock.now():.1f} samples/s",
        flush=True,
    )


if __name__ == "__main__":
    main(*sys.argv[1:3])
