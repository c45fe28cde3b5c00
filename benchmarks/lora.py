"""LoRA (trainer.lora) against full fine-tuning: what a version costs to move, what the trainer holds, and
what RL gains.

    python benchmarks/lora.py [--steps 40] [--seeds 0 1 2] [--ranks 8 32] [--lora-lr 2e-3]

1. Bytes per version, and seconds to publish one (the trainer writes it and hashes it) and to load it (the
   engine reads it, checks its hash and writes it into its weights: a full load_state_dict, or the
   adapters merged into the kept base), for the default tiny policy and for a Qwen3-0.6B-shaped one
   (random weights, float32), full weights against LoRA at each rank (adapters on every linear layer).
2. The trainer's memory for one step of the default recipe's batch, full against LoRA (each in a fresh
   process: peak resident memory over the step, and the bytes of trained weights + gradients + AdamW's
   moments).
3. Held-out greedy accuracy (500 items) before and after `--steps` RL steps of the default recipe
   (16 prompts × 8 samples, η = 1), full fine-tuning at trainer.lr 1e-4 against LoRA at each rank at
   `--lora-lr`, per seed.

Writes benchmarks/results/lora.{json,md}.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from asyncrl.config import load_config
from asyncrl.policy import lora
from asyncrl.policy.model import load_policy
from asyncrl.run.launcher import train
from asyncrl.transports import weights

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results"
MODEL = ROOT / "models" / "tiny-default"


def spec(rank: int):
    return load_config(overrides=["--trainer.lora.rank", str(rank), "--trainer.lora.alpha",
                                  str(2 * rank)]).trainer.lora


def qwen3_06b_shape():
    """A Qwen3-0.6B-shaped model (its published config's sizes), random weights."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                         tie_word_embeddings=True)
    return Qwen3ForCausalLM(config).eval()


def best_of(call, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times)


def transfer(model, name: str, ranks: list[int]) -> list[dict]:
    """Bytes, publish and load seconds of one version: the whole weights, then adapters at each rank."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        full = weights.model_state(model)

        def load_full():
            state = weights.load(Path(tmp) / "weights" / "v000001.safetensors")
            weights.state_hash(state)
            model.load_state_dict(state, strict=False)

        publish = best_of(lambda: weights.publish(tmp, 1, full, {}))
        size = (Path(tmp) / "weights" / "v000001.safetensors").stat().st_size
        rows.append({"model": name, "kind": "full", "bytes": size, "publish_s": publish,
                     "load_s": best_of(load_full)})
        for rank in ranks:
            adapted = lora.attach(copy.deepcopy(model), spec(rank))
            with torch.no_grad():  # (trained adapters: B is not 0)
                for n, p in adapted.named_parameters():
                    if lora.is_adapter(n):
                        p.normal_(0, 0.01)
            saved = lora.adapters(weights.model_state(adapted))
            del adapted
            merged = lora.Merged(model, spec(rank))

            def load_adapters():
                state = weights.load(Path(tmp) / "weights" / "v000002.safetensors")
                weights.state_hash(state)
                merged.apply(state, "benchmark")

            publish = best_of(lambda: weights.publish(tmp, 2, saved, {}))
            size = (Path(tmp) / "weights" / "v000002.safetensors").stat().st_size
            rows.append({"model": name, "kind": f"lora r{rank}", "bytes": size, "publish_s": publish,
                         "load_s": best_of(load_adapters), "share_of_full": size / rows[0]["bytes"]})
            print(f"  {name} {rows[-1]['kind']}: {size / 2**20:.2f} MiB ({size / rows[0]['bytes']:.1%}), "
                  f"publish {publish * 1e3:.1f} ms, load {rows[-1]['load_s'] * 1e3:.1f} ms", flush=True)
    return rows


def counted(model, name: str, ranks: list[int]) -> list[dict]:
    """What the trainer holds for the trained weights (float32 weights, gradients, AdamW's two moments)."""
    rows = [{"model": name, "rank": 0, "trained_params": sum(p.numel() for p in model.parameters())}]
    for rank in ranks:
        adapted = lora.attach(copy.deepcopy(model), spec(rank))
        rows.append({"model": name, "rank": rank,
                     "trained_params": sum(p.numel() for p in adapted.parameters() if p.requires_grad)})
        del adapted
    for row in rows:
        row["trained_state_bytes"] = row["trained_params"] * 4 * 4
    return rows


def batch_file(directory: Path) -> Path:
    """One step's batch of the default recipe (16 prompts × 8 samples from the warm start), on disk."""
    from asyncrl.inference.engine import Engine, SamplingParams
    from asyncrl.rewards.tasks import load_tasks
    from asyncrl.run.threads import _first_prompts, _trajectories
    from asyncrl.rundir import RunDir
    from asyncrl.trajectory import write_batch

    cfg = load_config(overrides=["--model.path", str(MODEL)])
    model, tokenizer = load_policy(MODEL)
    prompts = [p for p in _first_prompts(load_tasks(cfg.task), tokenizer, 16, 512) for _ in range(8)]
    samples = Engine(model, tokenizer.pad_token_id, tokenizer.eos_token_id, seed=0).generate(
        prompts, SamplingParams(cfg.rollout.max_tokens, 1.0, 1.0))
    write_batch(directory, 0, _trajectories(prompts, samples, 8))
    return RunDir(directory).batch(0)


def memory(rank: int, batch: Path) -> dict:
    """Peak resident memory of a fresh process training two steps on `batch` (rank 0: full weights)."""
    out = subprocess.run([sys.executable, __file__, "--one-step", str(rank), "--batch", str(batch)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def one_step(rank: int, batch: Path) -> dict:
    import os

    from asyncrl.objectives import get_objective
    from asyncrl.run.memory import peak_rss
    from asyncrl.trainer.step import train_step
    from asyncrl.trajectory import read_batch

    torch.set_num_threads(2)
    cfg = load_config(overrides=["--model.path", str(MODEL), "--trainer.lora.rank", str(rank)])
    model, tokenizer = load_policy(MODEL)
    if rank:
        lora.attach(model, cfg.trainer.lora)
    model.train()
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-5)
    trajs = read_batch(batch)
    before = peak_rss(os.getpid())
    for _ in range(2):
        train_step(model, optimizer, get_objective("ppo_clip"), trajs, 0, cfg, tokenizer.pad_token_id)
    held = sum(p.numel() for p in trained) * 4 * 4  # weights, gradients, two moments (float32)
    return {"rank": rank, "peak_rss": peak_rss(os.getpid()), "rss_before_step": before,
            "trained_params": sum(p.numel() for p in trained), "trained_state_bytes": held}


def gain(rank: int, seed: int, steps: int, lora_lr: float) -> dict:
    name = f"lora-r{rank}-s{seed}" if rank else f"full-s{seed}"
    cfg = load_config(overrides=[
        "--model.path", str(MODEL), "--run.steps", str(steps), "--run.seed", str(seed),
        "--task.seed", str(1 + seed), "--rollout.prompts_per_step", "16", "--rollout.group_size", "8",
        "--rollout.max_staleness", "1", "--task.eval_size", "500", "--task.eval_every", str(steps),
        "--trainer.lora.rank", str(rank), "--trainer.lora.alpha", str(2 * max(rank, 1)),
        "--trainer.lr", str(lora_lr if rank else 1e-4),
        "--run.root", str(OUT / "runs"), "--run.name", name, "--run.overwrite", "true",
    ])
    start = time.monotonic()
    run_dir = train(cfg, log=lambda *a, **k: None)
    summary = json.loads((run_dir / "summary.json").read_text())
    row = {"rank": rank, "seed": seed, "start": summary["eval_accuracy_start"],
           "final": summary["eval_accuracy_final"], "wall_s": time.monotonic() - start}
    row["gain"] = row["final"] - row["start"]
    print(f"  {name}: {row['start']:.3f} -> {row['final']:.3f} ({row['wall_s']:.0f} s)", flush=True)
    return row


def markdown(result: dict) -> str:
    lines = ["# LoRA against full weights (benchmarks/lora.py)", "",
             "| model | version | bytes | share of full | publish ms | load ms |",
             "|---|---|---|---|---|---|"]
    for r in result["transfer"]:
        lines.append(f"| {r['model']} | {r['kind']} | {r['bytes']:,} | {r.get('share_of_full', 1):.1%} | "
                     f"{r['publish_s'] * 1e3:.1f} | {r['load_s'] * 1e3:.1f} |")
    lines += ["", "| trainer | trained params | weights+grads+AdamW | peak RSS over a step |",
              "|---|---|---|---|"]
    for r in result["memory"]:
        lines.append(f"| tiny-default, {'lora r' + str(r['rank']) if r['rank'] else 'full'} | "
                     f"{r['trained_params']:,} | "
                     f"{r['trained_state_bytes'] / 2**20:.1f} MiB | {r['peak_rss'] / 2**20:.0f} MiB |")
    for r in result["counted"]:
        lines.append(f"| {r['model']}, {'lora r' + str(r['rank']) if r['rank'] else 'full'} | "
                     f"{r['trained_params']:,} | {r['trained_state_bytes'] / 2**20:,.1f} MiB | (counted) |")
    lines += ["", "| run | per seed: start → final | mean gain |", "|---|---|---|"]
    for rank in sorted({r["rank"] for r in result["gain"]}):
        rows = [r for r in result["gain"] if r["rank"] == rank]
        seeds = ", ".join(f"{r['start']:.3f} → {r['final']:.3f}" for r in rows)
        lines.append(f"| {'lora r' + str(rank) if rank else 'full'} | {seeds} | "
                     f"{statistics.mean(r['gain'] for r in rows):+.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--lora-lr", type=float, default=2e-3)
    parser.add_argument("--skip-runs", action="store_true", help="transfer and memory only")
    parser.add_argument("--one-step", type=int, help=argparse.SUPPRESS)  # (memory's child process)
    parser.add_argument("--batch", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_step is not None:
        print(json.dumps(one_step(args.one_step, args.batch)))
        return
    torch.set_num_threads(2)
    OUT.mkdir(parents=True, exist_ok=True)
    print("versions: bytes, publish, load", flush=True)
    rows = transfer(load_policy(MODEL)[0], "tiny-default", args.ranks)
    big = qwen3_06b_shape()
    rows += transfer(big, "Qwen3-0.6B shape", args.ranks)
    held = counted(big, "Qwen3-0.6B shape", args.ranks)
    del big
    print("trainer memory", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        batch = batch_file(Path(tmp))
        mem = [memory(rank, batch) for rank in [0, *args.ranks]]
    runs = [] if args.skip_runs else [
        gain(rank, seed, args.steps, args.lora_lr) for seed in args.seeds for rank in [0, *args.ranks]]
    result = {"args": vars(args), "transfer": rows, "memory": mem, "counted": held, "gain": runs}
    (OUT / "lora.json").write_text(json.dumps(result, indent=2))
    (OUT / "lora.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
