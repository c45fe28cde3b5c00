"""How many CPU threads each role gets, chosen from measured rates.

When the roles alternate (max_staleness 0) each may use every core, but more is not always
faster: the tiny model decodes 3-4x slower on two threads than on one (each step is many small
ops, and a thread pool synchronises on every one), while it trains 1.7x faster. So each role
takes the count measured fastest for it. When the roles overlap, the cores are split between them: both roles using every core oversubscribes the machine, and spinning
thread pools that preempt each other run several times slower than either alone. The planner
times one step's generation G(n) and one training step T(n) at every thread count n, predicts a
step of each split g + t = cores as max(G(g), T(t)) (the roles overlap; the slower bounds) and
picks the fastest. It also predicts the alternating loop, min G + min T: when that is
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


def choose(rates: dict[int, dict[str, float]], cores: int, overlap: bool) -> dict:
    """Thread counts for the roles, with every plan's predicted seconds per step.

    Alternating roles (`overlap` False, max_staleness 0) each take the count that is fastest for
    them, which need not be all cores: tiny decode steps run slower on two threads than on one.
    Overlapping roles split the cores and the slower of the two bounds a step."""
    fastest = {phase: min(rates, key=lambda n: rates[n][phase]) for phase in ("generate", "train")}
    predicted = {f"{g}/{cores - g}": max(rates[g]["generate"], rates[cores - g]["train"]) for g in range(1, cores)}
    predicted[ALTERNATE] = rates[fastest["generate"]]["generate"] + rates[fastest["train"]]["train"]
    if overlap and cores > 1:
        best = min((k for k in predicted if k != ALTERNATE), key=predicted.get)
        inference, trainer = map(int, best.split("/"))
    else:
        best, inference, trainer = ALTERNATE, fastest["generate"], fastest["train"]
    return {"inference": inference, "trainer": trainer, "plan": best, "cores": cores,
            "overlap_pays": min(v for k, v in predicted.items() if k != ALTERNATE) < predicted[ALTERNATE]
            if cores > 1 else False,
            "predicted_step_seconds": {k: round(v, 4) for k, v in predicted.items()},
            "measured_seconds": {n: {k: round(v, 4) for k, v in r.items()} for n, r in rates.items()}}


def plan(cfg) -> dict:
    cores = os.cpu_count() or 1
    return choose(measure(cfg, list(range(1, cores + 1))), cores, overlap=cfg.rollout.max_staleness > 0)


if __name__ == "__main__":
    from asyncrl.config import Config

    with open(sys.argv[1]) as f:
        config = Config.model_validate_json(f.read())
    print(json.dumps(plan(config)))
