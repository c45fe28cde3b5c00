"""The trainer over 1 and 2 ranks (trainer.ranks, FSDP2 on gloo) on this machine, side by side: training
tokens/s of a step, the seconds of its parts (the step, gathering the full weights to publish them), a
checkpoint (the seconds training stalls for it, the seconds its background write takes, each rank's
optimizer shard on disk, and loading it back resharded), and the peak resident memory of each rank, for
the tiny policy and a ~20M one.

Writes benchmarks/results/ranks.{json,md}.

    python benchmarks/ranks.py [--steps 5] [--rows 64]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from scale import model_20m  # (benchmarks/scale.py: the same ~20M policy)
from tables import write_rows  # (benchmarks/tables.py)

from asyncrl.config import load_config
from asyncrl.objectives import get_objective
from asyncrl.policy.model import load_policy
from asyncrl.run.ports import free_port
from asyncrl.store import checkpoint
from asyncrl.trainer.ranks import Ranks
from asyncrl.trainer.step import train_step
from asyncrl.trajectory import Trajectory
from asyncrl.transports import weights


def batch(vocab: int, rows: int, seed: int) -> list[Trajectory]:
    rng = random.Random(seed)
    trajs = []
    for i in range(rows):
        prompt, n = rng.randint(8, 24), rng.randint(32, 96)
        trajs.append(Trajectory(
            str(i), str(i // 8), "t", i // 8, [rng.randrange(3, vocab) for _ in range(prompt + n)],
            [0] * prompt + [1] * n, [0.0] * prompt + [-3.0] * n, [-1] * prompt + [0] * n, 0.0,
            [0.0] * prompt + [rng.uniform(-1, 1)] * n))
    return trajs


def measure(rank: int, size: int, port: int, model_path: str, steps: int, rows: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    group = None
    if size > 1:
        dist.init_process_group("gloo", rank=rank, world_size=size)
        group = dist.new_group(backend="gloo")
    ranks = Ranks(rank, size, group)
    model, tokenizer = load_policy(model_path)
    published = list(weights.model_state(model))
    ranks.shard(model, "off")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    cfg = load_config()
    objective = get_objective("ppo_clip")
    step_s, gather_s, tokens = [], [], 0
    for step in range(steps + 1):  # the first step warms up (allocations, FSDP's lazy init)
        trajs = batch(len(tokenizer), rows, step)
        start = time.monotonic()
        metrics = train_step(model, optimizer, objective, trajs, 0, cfg, tokenizer.pad_token_id, ranks=ranks)
        middle = time.monotonic()
        ranks.full_model_state(model, published)
        if step:
            step_s.append(middle - start)
            gather_s.append(time.monotonic() - middle)
            tokens += metrics["train_tokens"]
    saved = save_checkpoint(ranks, model, optimizer, tokenizer, published, Path(out).parent / "run")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB (Linux reports KiB)
    peaks = _gather(ranks, peak)
    if rank == 0:
        Path(out).write_text(json.dumps({
            "ranks": size, "step_s": round(statistics.median(step_s), 3),
            "train_tokens_per_s": round(tokens / sum(step_s), 1),
            "gather_full_weights_s": round(statistics.median(gather_s), 4), **saved,
            "peak_rss_mib_per_rank": [round(p) for p in peaks]}))
    ranks.close()


def save_checkpoint(ranks: Ranks, model, optimizer, tokenizer, published: list, run_dir: Path) -> dict:
    """One checkpoint as the trainer writes it (the model whole from rank 0, the optimizer a shard per rank
    with DCP, in the background), then its optimizer loaded back into this rank's shard."""
    writer = checkpoint.CheckpointWriter(run_dir, tokenizer, keep=1, deadline=600, ranks=ranks)
    state = ranks.full_model_state(model, published)  # (publishing gathers it anyway: measured above)
    start = time.monotonic()
    stall = writer.save(1, state, model.config.to_dict(), {"rng": torch.get_rng_state()},
                        checkpoint.optimizer_state(model, optimizer))
    writer.wait()
    ranks.barrier()
    written = time.monotonic() - start
    path = run_dir / "checkpoints" / "step_000001"
    start = time.monotonic()
    checkpoint.load_optimizer(path, model, optimizer, ranks.checkpoint_group)
    loaded = _gather(ranks, time.monotonic() - start)
    shards = sorted((path / "optimizer").glob("*.distcp"))
    return {"checkpoint_stall_s": round(stall, 3), "checkpoint_written_s": round(written, 3),
            "optimizer_shards_mib": [round(f.stat().st_size / 2**20, 1) for f in shards],
            "optimizer_load_s": round(max(loaded), 3)}


def _gather(ranks: Ranks, value: float) -> list[float]:
    if ranks.size == 1:
        return [value]
    values = [None] * ranks.size
    dist.all_gather_object(values, value)
    return values


def run(model_path: str, size: int, steps: int, rows: int) -> dict:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "out.json")
        mp.spawn(measure, args=(size, port, model_path, steps, rows, out), nprocs=size, join=True)
        result = json.loads(Path(out).read_text())
    print(result, flush=True)
    return {"model": Path(model_path).name, **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--model", default="models/tiny-default")
    args = parser.parse_args()
    big = model_20m(Path(os.environ.get("ASYNCRL_BENCH_20M", "/tmp/asyncrl-bench-20m")))
    rows = [run(path, size, args.steps, args.rows) for path in (args.model, big) for size in (1, 2)]
    for row in rows:
        one = next(r for r in rows if r["model"] == row["model"] and r["ranks"] == 1)
        row["tokens_per_s_vs_1_rank"] = round(row["train_tokens_per_s"] / one["train_tokens_per_s"], 3)
    write_rows("ranks", rows)


if __name__ == "__main__":
    main()
