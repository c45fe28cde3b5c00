"""How many CPU threads each role gets, chosen from measured rates.

When the roles alternate (max_staleness 0) each may use every core. When they overlap, the cores
are split between them: both roles using every core oversubscribes the machine, and spinning
thread pools that preempt each other run several times slower than either alone. The planner
times one step's generation G(n) and one training step T(n) at every thread count n, predicts a
step of each split g + t = cores as max(G(g), T(t)) (the roles overlap; the slower bounds) and
picks the fastest. It also predicts the alternating loop, G(cores) + T(cores): when that is
faster, overlapping does not pay on this machine for this workload (more threads help little on
small models, two are 1.1-1.6× faster than one for the tiny model, so it pays when the phases
are balanced or a synchronous batch waits on stragglers) and the launcher says so. Run as `python -m asyncrl.threads CONFIG_JSON` (the launcher does, in a
process of its own so its threads and imports stay out of the way); prints the plan as JSON.
"""
from __future__ import annotations

import copy
import json
import os
import sys
import time

ALTERNATE = "alternate"  # what max_staleness 0 does: each phase on every core, one after the other


def measure(cfg, threads: list[int]) -> dict[int, dict[str, float]]:
    """{threads: {"generate": s, "train": s}} for one step's batch of the run's own task."""
    import torch

    from asyncrl.inference.engine import Engine, SamplingParams
    from asyncrl.model import load_policy
    from asyncrl.objectives import get_objective
    from asyncrl.rewards.tasks import load_tasks
    from asyncrl.trainer.step import train_step
    from asyncrl.trajectory import Trajectory

    model, tokenizer = load_policy(cfg.model.path)
    tasks, ro = load_tasks(cfg.task), cfg.rollout
    prompts = [tokenizer(tasks.prompt(tasks.item(i)))["input_ids"] for i in range(ro.prompts_per_step)]
    prompts = [p for p in prompts for _ in range(ro.group_size)]
    params = SamplingParams(ro.max_tokens, ro.temperature, ro.top_p)
    objective = get_objective(cfg.objective.name, cfg.objective.import_path)
    rates = {}
    for n in threads:
        torch.set_num_threads(n)
        engine = Engine(model, tokenizer.pad_token_id, tokenizer.eos_token_id, seed=cfg.run.seed)
        engine.generate(prompts[: ro.group_size], params)  # warm-up: first calls allocate
        start = time.monotonic()
        samples = engine.generate(prompts, params)
        generate = time.monotonic() - start
        trajs = [Trajectory(id=str(i), group_id=str(i // ro.group_size), task="plan", prompt_id=i // ro.group_size,
                            tokens=p + s.token_ids, loss_mask=[0] * len(p) + [1] * len(s.token_ids),
                            logprobs=[0.0] * len(p) + s.logprobs, versions=[-1] * len(p) + [0] * len(s.token_ids),
                            reward=float(i % 2), advantages=[0.0] * len(p) + [1.0 - 2 * (i % 2)] * len(s.token_ids))
                 for i, (p, s) in enumerate(zip(prompts, samples))]
        learner = copy.deepcopy(model).train()
        optimizer = torch.optim.AdamW(learner.parameters(), lr=1e-6)
        train_step(learner, optimizer, objective, trajs[: ro.group_size], 0, cfg, tokenizer.pad_token_id)  # warm-up
        start = time.monotonic()
        train_step(learner, optimizer, objective, trajs, 0, cfg, tokenizer.pad_token_id)
        rates[n] = {"generate": generate, "train": time.monotonic() - start}
    return rates


def choose(rates: dict[int, dict[str, float]], cores: int) -> dict:
    """The split with the shortest predicted step, and every prediction (seconds per step)."""
    predicted = {f"{g}/{cores - g}": max(rates[g]["generate"], rates[cores - g]["train"]) for g in range(1, cores)}
    best = min(predicted, key=predicted.get)
    predicted[ALTERNATE] = rates[cores]["generate"] + rates[cores]["train"]
    inference, trainer = map(int, best.split("/"))
    return {"inference": inference, "trainer": trainer, "plan": best, "cores": cores,
            "overlap_pays": predicted[best] < predicted[ALTERNATE],
            "predicted_step_seconds": {k: round(v, 4) for k, v in predicted.items()},
            "measured_seconds": {n: {k: round(v, 4) for k, v in r.items()} for n, r in rates.items()}}


def plan(cfg) -> dict:
    cores = os.cpu_count() or 1
    return choose(measure(cfg, list(range(1, cores + 1))), cores)


if __name__ == "__main__":
    from asyncrl.config import Config

    with open(sys.argv[1]) as f:
        config = Config.model_validate_json(f.read())
    print(json.dumps(plan(config)))
