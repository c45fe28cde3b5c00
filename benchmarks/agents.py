"""Agent episodes per second and how busy the generation server stays, with slow tools.

Each episode plays 1-4 turns (drawn per episode); after each reply the agent calls a tool whose
latency is drawn from an exponential distribution with the given mean (0, 50, 500 ms), as a
remote API or sandbox would answer. The same episodes run through asyncrl's AgentRunner against
a real inference server process (tiny model, one thread) in two schedules at the same concurrency:

  batch  synchronous episode batching: waves of C episodes; the next wave starts when the
         slowest episode of this one has finished (what a batch rollout loop does)
  queue  asynchronous episodes: a finished episode's slot goes to the next one at once

and reports episodes/s and the server's busy fraction (time with a batch in flight / wall time).

    python benchmarks/agents.py [--episodes 192] [--concurrency 32] [--latencies 0,50,500]

Writes benchmarks/results/agents.json and agents.png.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl.agents import tool  # noqa: E402

MEAN_LATENCY = {"seconds": 0.0}  # set per configuration


@tool
async def lookup(key: str) -> str:
    """A remote lookup: answers after a delay drawn from the key (the same in both schedules)."""
    mean = MEAN_LATENCY["seconds"]
    await asyncio.sleep(random.Random(key).expovariate(1 / mean) if mean else 0.0)
    return f"value of {key}"


async def bench_agent(task: dict, ctx):
    turns = random.Random(task["index"]).randint(1, 4)
    messages = [{"role": "user", "content": task["prompt"]}]
    for turn in range(turns):
        reply, _ = await ctx.chat(messages, max_tokens=8)
        result = await ctx.call_tool(lookup, {"key": f"{task['index']}-{turn}"})
        messages += [reply, {"role": "tool", "content": result.text[:6]}]
    return 0.0


async def measure(cfg, url: str, mode: str, episodes: int) -> dict:
    from transformers import AutoTokenizer

    from asyncrl.agents.runner import AgentRunner
    from asyncrl.inference.client import InferenceClient
    from asyncrl.observe.events import EventLog

    cfg.agent.scheduling = mode
    async with InferenceClient(url, 120) as client:
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        runner = AgentRunner(cfg, tokenizer, None, EventLog(cfg.run_dir, "bench"))
        before = await client.stats()
        start = time.monotonic()
        outcomes = await asyncio.gather(
            *(
                runner.episode({"prompt": f"{i % 90 + 10}+{i % 7}=", "index": i}, str(i), client, i)
                for i in range(episodes)
            )
        )
        wall = time.monotonic() - start
        after = await client.stats()
    failed = sum(o.failure is not None for o in outcomes)
    return {"mode": mode, "episodes": episodes, "failed": failed, "wall_s": round(wall, 3),
            "episodes_per_s": round(episodes / wall, 3),
            "busy_fraction": round((after["busy_seconds"] - before["busy_seconds"]) / wall, 3),
            "turns": sum(o.episode.turns for o in outcomes),
            "tokens_generated": after["tokens_generated"] - before["tokens_generated"]}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    latencies = sorted({r["latency_ms"] for r in results})
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "episodes_per_s", "episodes / s"),
                           (axes[1], "busy_fraction", "generation server busy fraction")):
        for k, mode in enumerate(("batch", "queue")):
            values = [
                next(r[key] for r in results if r["mode"] == mode and r["latency_ms"] == lat)
                for lat in latencies
            ]
            ax.bar([i + 0.4 * k for i in range(len(latencies))], values, width=0.4,
                   label="synchronous batches" if mode == "batch" else "asynchronous (queue)")
        ax.set_xticks([i + 0.2 for i in range(len(latencies))], [f"{lat} ms" for lat in latencies])
        ax.set(xlabel="mean tool latency per call", ylabel=label)
        ax.legend()
    fig.suptitle("agent episodes at equal concurrency")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--episodes", type=int, default=192)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--latencies", default="0,50,500")
    parser.add_argument("--model", default=str(ROOT / "models/tiny-default"))
    args = parser.parse_args()

    import torch

    from asyncrl.config import load_config
    from asyncrl.run.launcher import prepare_run_dir
    from asyncrl.run.preflight import check_inputs
    from asyncrl.run.processes import start_role, stop, wait_for_replica

    torch.set_num_threads(1)
    cfg = load_config(overrides={
        "run": {"root": "/tmp/asyncrl-bench", "name": "agents", "overwrite": True},
        "model": {"path": args.model},
        "agent": {"path": f"{Path(__file__).resolve()}:bench_agent", "chat_template": "tiny",
                  "max_concurrent_episodes": args.concurrency, "max_turns": 4, "max_episode_tokens": 200},
        "inference": {"threads": 1}})
    cfg = check_inputs(cfg)
    run_dir = prepare_run_dir(cfg)
    server = start_role("inference-0", run_dir, threads=1)
    results = []
    try:
        url = wait_for_replica(server, run_dir, 120)
        asyncio.run(measure(cfg, url, "queue", 16))  # warm up the server
        for latency in (int(x) for x in args.latencies.split(",")):
            MEAN_LATENCY["seconds"] = latency / 1000
            for mode in ("batch", "queue"):
                row = {"latency_ms": latency, "concurrency": args.concurrency,
                       **asyncio.run(measure(cfg, url, mode, args.episodes))}
                results.append(row)
                print(
                    f"latency {latency:4d} ms  {mode:5s}  {row['episodes_per_s']:6.2f} episodes/s  "
                    f"busy {row['busy_fraction']:.2f}  ({row['wall_s']:.1f} s, {row['failed']} failed)",
                    flush=True,
                )
    finally:
        stop({"inference-0": server})
    for latency in sorted({r["latency_ms"] for r in results}):
        pair = {r["mode"]: r for r in results if r["latency_ms"] == latency}
        print(f"latency {latency:4d} ms: queue / batch = "
              f"{pair['queue']['episodes_per_s'] / pair['batch']['episodes_per_s']:.2f}x episodes/s")
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "agents.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    plot(results, out / "agents.png")
    print(f"wrote {out / 'agents.json'} and {out / 'agents.png'}")


if __name__ == "__main__":
    main()
