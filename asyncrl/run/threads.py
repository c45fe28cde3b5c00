"""How many CPU threads each role gets, chosen from measured rates.

The planner times one step's generation G(n) and one training step T(n) of the run's own model
and task at every thread count n. More is not always faster: the tiny model decodes 3-4x slower
on two threads than on one (a decode step is many small ops, and a thread pool synchronises on
each), while it trains 1.7x faster.

- Alternating roles (max_staleness 0) each take their fastest count: a step is min G + min T.
- Overlapping roles split the cores, g + t = cores, and a step is max(G(g), T(t)): the slower
  role bounds it. Both using every core is not a candidate: pools that preempt each other spin,
  and measured here the tiny run went 1.3x slower with the trainer on two threads beside
  generation on one.

When alternating is predicted faster than the best split, overlap does not pay on this machine
for this workload (it pays when the phases are balanced, or a synchronous batch waits on
stragglers) and the launcher says so. Run as `python -m asyncrl.run.threads CONFIG_JSON` (the
launcher does, in a process of its own); prints the plan as JSON.
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from asyncrl.config import Config, save_config
from asyncrl.cores import available_cores, usable_cores
from asyncrl.files import write_atomic
from asyncrl.run.processes import role_env
from asyncrl.rundir import RunRoot

ALTERNATE = "alternate"  # what max_staleness 0 does: the phases one after the other
REPEATS = 2  # each timing is the best of this many (one slow outlier would decide the split)
ONCE_FROM = 5.0  # seconds: a call this long is timed once (a real model's step: noise is a small share of it)


def measure(cfg, threads: list[int]) -> dict[int, dict[str, float]]:
    """{threads: {"generate": s, "train": s}} for one step's batch of the run's own task."""
    import torch

    from asyncrl.inference.engine import Engine, SamplingParams
    from asyncrl.policy.model import load_policy
    from asyncrl.rewards.tasks import load_tasks

    model, tokenizer = load_policy(cfg.model.path)
    tasks, ro = load_tasks(cfg.task), cfg.rollout
    prompts = _first_prompts(tasks, tokenizer, ro.prompts_per_step, cfg.inference.max_prompt_tokens)
    prompts = [p for p in prompts for _ in range(ro.group_size)]
    params = SamplingParams(ro.max_tokens, ro.temperature, ro.top_p)
    rates = {}
    for n in threads:
        torch.set_num_threads(n)
        engine = Engine(model, tokenizer.pad_token_id, tokenizer.eos_token_id, seed=cfg.run.seed)
        engine.generate(prompts[: ro.group_size], params)  # warm-up: first calls allocate
        generate, samples = _best_of(lambda: engine.generate(prompts, params))
        trajs = _trajectories(prompts, samples, ro.group_size)
        rates[n] = {"generate": generate, "train": _time_training(cfg, model, tokenizer.pad_token_id, trajs)}
    return rates


def _first_prompts(tasks, tokenizer, count: int, limit: int) -> list[list[int]]:
    """The first `count` prompts the run will train on, bad rows skipped as the orchestrator skips them."""
    from asyncrl.rewards.tasks import BadTaskRow, servable_prompt

    prompts = []
    for index in range(20 * count):
        try:
            prompts.append(servable_prompt(tasks, index, tokenizer, limit)[1])
        except BadTaskRow:
            continue
        if len(prompts) == count:
            break
    return prompts


def _best_of(call):
    """(shortest seconds over REPEATS calls, the last call's result)."""
    best = float("inf")
    for _ in range(REPEATS):
        start = time.monotonic()
        result = call()
        best = min(best, time.monotonic() - start)
        if best >= ONCE_FROM:
            break
    return best, result


def _trajectories(prompts, samples, group_size: int):
    from asyncrl.policy import routing
    from asyncrl.trajectory import Trajectory

    return [
        Trajectory(
            id=str(i),
            group_id=str(i // group_size),
            task="plan",
            prompt_id=i // group_size,
            tokens=p + s.token_ids,
            loss_mask=[0] * len(p) + [1] * len(s.token_ids),
            logprobs=[0.0] * len(p) + s.logprobs,
            versions=[-1] * len(p) + [0] * len(s.token_ids),
            reward=float(i % 2),
            advantages=[0.0] * len(p) + [1.0 - 2 * (i % 2)] * len(s.token_ids),
            # (a MoE policy's experts: a run with trainer.routing_replay times its step with replay)
            routing=routing.pack(routing.stacked(s.routes)) if s.routes else None,
        )
        for i, (p, s) in enumerate(zip(prompts, samples))
    ]


def _time_training(cfg, model, pad_id: int, trajs) -> float:
    """Seconds of one training step on `trajs`, on a copy of the model (the run's stays as it is)."""
    import torch

    from asyncrl.objectives import get_objective
    from asyncrl.trainer.step import train_step

    objective = get_objective(cfg.objective.name, cfg.objective.import_path)
    learner = copy.deepcopy(model).train()
    if cfg.trainer.lora.rank:  # (the adapters' step: the frozen weights take no gradient)
        from asyncrl.policy import lora

        lora.attach(learner, cfg.trainer.lora)
    optimizer = torch.optim.AdamW([p for p in learner.parameters() if p.requires_grad], lr=1e-6)
    train_step(learner, optimizer, objective, trajs[:8], 0, cfg, pad_id)  # warm-up
    return _best_of(lambda: train_step(learner, optimizer, objective, trajs, 0, cfg, pad_id))[0]


def choose(rates: dict[int, dict[str, float]], cores: int, overlap: bool) -> dict:
    """Thread counts for the roles, with every plan's predicted seconds per step.

    Alternating roles (`overlap` False, max_staleness 0) each take the count that is fastest for
    them, which need not be all cores: tiny decode steps run slower on two threads than on one.
    Overlapping roles split the cores and the slower of the two bounds a step."""
    fastest = {phase: min(rates, key=lambda n: rates[n][phase]) for phase in ("generate", "train")}
    splits = {
        f"{g}/{cores - g}": max(rates[g]["generate"], rates[cores - g]["train"]) for g in range(1, cores)
    }
    alternate = rates[fastest["generate"]]["generate"] + rates[fastest["train"]]["train"]
    if overlap and splits:
        best = min(splits, key=splits.get)
        inference, trainer = map(int, best.split("/"))
    else:
        best, inference, trainer = ALTERNATE, fastest["generate"], fastest["train"]
    return {"inference": inference, "trainer": trainer, "plan": best, "cores": cores,
            "overlap_pays": bool(splits) and min(splits.values()) < alternate,
            "predicted_step_seconds": {k: round(v, 4) for k, v in {**splits, ALTERNATE: alternate}.items()},
            "measured_seconds": {n: {k: round(v, 4) for k, v in r.items()} for n, r in rates.items()}}


def plan(cfg, cores: int) -> dict:
    return choose(measure(cfg, list(range(1, cores + 1))), cores, overlap=cfg.rollout.max_staleness > 0)


# --- the launcher's side: run the planner in a process of its own, cache its plan -----------
def plan_threads(cfg: Config, log=print) -> tuple[Config, dict | None]:
    """(cfg with the unset thread counts of the CPU roles chosen from measured rates, the plan).

    Only where there is a choice: a CPU trainer and the built-in engine, with more than one core free
    (asyncrl/cores.py: affinity, cgroup quota, other busy processes; measured under the same load the roles
    will meet). The plan is cached per model, task, batch shape and free cores under run.root; a planner
    that fails or is not worth its time leaves the static split over the free cores."""
    if (cfg.trainer.device != "cpu" or cfg.inference.device != "cpu" or cfg.inference.engine != "builtin"
            or (cfg.trainer.threads and cfg.inference.threads)):
        return cfg, None
    cores, usable = cfg.run.cores or available_cores(), usable_cores()
    if cores < usable and not cfg.run.cores:
        log(f"threads: {cores} of this process's {usable} cores are free (other processes keep the rest "
            "busy)")
    if cores < 2:
        return static_split(cfg, cores), None
    if cfg.model.defaults != "tiny":
        log("threads: the static split (the planner times whole steps at each thread count: minutes for a "
            "pretrained model; trainer.threads / inference.threads set them)")
        return static_split(cfg, cores), None
    plan = _cached_plan(cfg, cores)
    if plan is None:
        log("planning threads: timing one step's generation and training at each thread count ...")
        tmp = RunRoot(cfg.run.root).thread_probe_config(os.getpid())
        tmp.parent.mkdir(parents=True, exist_ok=True)
        save_config(cfg, tmp)
        try:
            out = subprocess.run(
                [sys.executable, "-m", "asyncrl.run.threads", str(tmp), str(cores)],
                capture_output=True,
                text=True,
                timeout=cfg.timeouts.startup,
                env=role_env(cores),
            )
            plan = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else None
        except (subprocess.TimeoutExpired, ValueError, IndexError):
            out, plan = None, None
        finally:
            tmp.unlink(missing_ok=True)
        if plan is None:
            why = (
                "\n".join(out.stderr.splitlines()[-5:]) if out else f"timed out ({cfg.timeouts.startup:.0f}s)"
            )
            log(f"planning threads failed; using the static split: {why}")
            return static_split(cfg, cores), None
        _cache_plan(cfg, cores, plan)
    cfg = cfg.model_copy(deep=True)
    cfg.inference.threads = cfg.inference.threads or plan["inference"]
    cfg.trainer.threads = cfg.trainer.threads or plan["trainer"]
    return cfg, plan


def static_split(cfg: Config, cores: int) -> Config:
    """Every core to each role when they alternate (η = 0), half each when they overlap; what is set stays."""
    each = cores if cfg.rollout.max_staleness == 0 else max(1, cores // 2)
    cfg = cfg.model_copy(deep=True)
    cfg.inference.threads = cfg.inference.threads or each
    cfg.trainer.threads = cfg.trainer.threads or each
    return cfg


def _plan_key(cfg: Config, cores: int) -> str:
    import hashlib

    model = Path(cfg.model.path)
    stamp = max((p.stat().st_mtime for p in model.glob("*.safetensors")), default=0) if model.is_dir() else 0
    t, ro = cfg.task, cfg.rollout  # what the measured step's cost depends on
    shape = [
        cfg.model.path,
        stamp,
        t.name,
        t.path,
        t.params,
        t.prompt_format,
        [m.model_dump(mode="json") for m in t.mix],
        ro.prompts_per_step,
        ro.group_size,
        ro.max_tokens,
        ro.temperature,
        cfg.objective.name,
        cfg.objective.prox,
        ro.max_staleness > 0,
        cfg.trainer.minibatches,
        cfg.inference.dtype,
        cores,
    ]
    return hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _plans(cfg: Config) -> tuple[Path, dict]:
    """(the plan cache under run.root, the plans in it by key); an unreadable cache is empty."""
    path = RunRoot(cfg.run.root).thread_plans
    try:
        return path, json.loads(path.read_text())
    except (OSError, ValueError):
        return path, {}


def _cached_plan(cfg: Config, cores: int) -> dict | None:
    return _plans(cfg)[1].get(_plan_key(cfg, cores))


def _cache_plan(cfg: Config, cores: int, plan: dict) -> None:
    """Add a plan to the cache: two launches may share run.root, so the read-modify-write holds a lock
    (without it the later writer drops the earlier one's plan)."""
    import fcntl

    with open(RunRoot(cfg.run.root).thread_plans_lock, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        path, plans = _plans(cfg)
        plans[_plan_key(cfg, cores)] = plan
        write_atomic(path, json.dumps(plans, indent=1))


if __name__ == "__main__":
    from asyncrl.config import Config

    with open(sys.argv[1]) as f:
        config = Config.model_validate_json(f.read())
    print(json.dumps(plan(config, int(sys.argv[2]))))
