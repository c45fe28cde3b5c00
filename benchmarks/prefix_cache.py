"""Tokens the built-in engine prefills per agent episode, with its prefix cache and without
(inference.prefix_cache_tokens), on the examples in examples/agents/: the same tasks, sampled at the
examples' temperature (greedy episodes of an untrained policy on a deterministic environment would be
identical to each other), through asyncrl's AgentRunner against a real inference server process each
time. Without the cache identical prompts in one admission are still prefilled once.

Writes benchmarks/results/prefix_cache.{json,md}.

    python benchmarks/prefix_cache.py [--model-dir models] [--episodes 64]

Each example runs its own warm-started policy (models/tiny-guess, models/tiny-calculator: `asyncrl train
examples/agents/<example>.toml` builds it on its first run).
"""
from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from tables import write_rows  # (benchmarks/tables.py)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ["examples/agents/guess_tiny.toml", "examples/agents/calculator_tiny.toml"]


async def episodes(cfg, url: str, count: int) -> dict:
    from transformers import AutoTokenizer

    from asyncrl.agents.proxy import start_proxy
    from asyncrl.agents.runner import AgentRunner
    from asyncrl.inference.client import InferenceClient
    from asyncrl.observe.events import EventLog
    from asyncrl.rewards.pool import VerifierPool
    from asyncrl.rewards.tasks import eval_entries, load_tasks

    source = load_tasks(cfg.task)
    tasks = [{**entry, "prompt": source.prompt(entry)} for entry in eval_entries(source, count)]
    async with InferenceClient(url, 120) as client:
        verifiers = VerifierPool(cfg.task, 1)
        runner = AgentRunner(cfg, AutoTokenizer.from_pretrained(cfg.model.path), verifiers,
                             EventLog(cfg.run_dir, "bench"))
        proxy, runner.proxy_url = await start_proxy(runner.sessions, cfg.model.path)  # (OpenAI-style agents)
        try:
            start = time.monotonic()
            outcomes = await asyncio.gather(*(runner.episode(task, str(i), client, i)
                                              for i, task in enumerate(tasks)))
            wall = time.monotonic() - start
            stats = await client.stats()
        finally:
            await proxy.cleanup()
            verifiers.close()
    turns = sum(o.episode.turns for o in outcomes)
    failed = sum(o.failure is not None for o in outcomes)
    return {"episodes": len(tasks), "failed": failed, "turns": turns, "wall_s": round(wall, 2),
            "prefilled_per_episode": round(stats["tokens_prefilled"] / len(tasks), 1),
            "reused_per_episode": round(stats["tokens_reused"] / len(tasks), 1),
            "tokens_generated": stats["tokens_generated"]}


def measure(example: str, model_dir: Path, budget: int, count: int) -> dict:
    from asyncrl.config import load_config
    from asyncrl.run.launcher import prepare_run_dir
    from asyncrl.run.processes import start_role, stop, wait_for_replica

    model = model_dir / Path(load_config(ROOT / example).model.path).name
    cfg = load_config(ROOT / example, overrides={
        "run": {"root": "/tmp/asyncrl-bench", "name": "prefix-cache", "overwrite": True},
        "model": {"path": str(model)}, "inference": {"threads": 1, "prefix_cache_tokens": budget}})
    run_dir = prepare_run_dir(cfg)
    server = start_role("inference-0", run_dir, threads=1)
    try:
        row = asyncio.run(episodes(cfg, wait_for_replica(server, run_dir, 120), count))
    finally:
        stop({"inference-0": server})
    return {"example": Path(example).stem, "prefix_cache_tokens": budget, **row}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=ROOT / "models")
    parser.add_argument("--episodes", type=int, default=64)
    args = parser.parse_args()
    rows = []
    for example in EXAMPLES:
        for budget in (0, 2**16):
            rows.append(measure(example, args.model_dir, budget, args.episodes))
            print(rows[-1], flush=True)
    write_rows("prefix_cache", rows)


if __name__ == "__main__":
    main()
