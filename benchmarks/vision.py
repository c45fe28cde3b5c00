"""Images in, text out on CPU: what RL adds to a warm-started tiny Qwen2.5-VL, and what the images cost.

    python benchmarks/vision.py [--steps 100] [--seeds 0 1 2] [--only shapes|gui]

1. Per seed: the recipe of examples/vision/shapes_tiny.toml (a tiny Qwen2.5-VL warm-started on "which
   colour is the largest shape?" by a teacher that names the smaller shape's colour in 60% of its
   answers; warmstart.seed = the seed), then `--steps` RL steps; held-out greedy accuracy (200 pictures
   never trained on) after the warm start and after RL. Goal: RL adds >= 10 points on each seed.
2. Against text only at the same shapes: the same task told in words ("a large red circle and a small
   blue square"), a text-only Qwen2 of the same language model (128 wide, 2 layers) warm-started by the
   same teacher, the same RL run: samples/s of the run, bytes per step on the samples channel, and the
   trainer's peak memory over two steps on one of each run's batches (a fresh process each).
3. The GUI agent (examples/agents/gui_tiny.toml: a form on a rendered screen, a new picture every turn):
   per seed, its warm start then 60 RL steps; the training reward over the first and last 20% of the
   steps and the held-out greedy accuracy (both fields right) before and after.

Writes benchmarks/results/vision.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from asyncrl.config import load_config
from asyncrl.run.launcher import train
from asyncrl.rundir import RunDir
from asyncrl.trajectory import read_batch
from asyncrl.vision import shapes

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results"
RECIPE = ROOT / "examples" / "vision" / "shapes_tiny.toml"
GUI = ROOT / "examples" / "agents" / "gui_tiny.toml"
SIZES = {0: "small", 1: "large"}


def described(index: int, seed: int) -> dict:
    """The shapes task told in words (a task.name generator): the same items, no picture."""
    item = shapes.largest_colour(index, seed)
    large, small = item["metadata"]["large"], item["metadata"]["small"]
    first, second = (f"a large {large} shape", f"a small {small} shape")[:: 1 if index % 2 else -1]
    return {**{k: v for k, v in item.items() if k != "images"},
            "question": f"The picture shows {first} and {second}. {shapes.QUESTION}"}


def config(kind: str, seed: int, steps: int):
    text = kind == "text"
    overrides = [
        "--model.path", str(OUT / "models" / f"{kind}-s{seed}"), "--warmstart.seed", str(seed),
        "--run.steps", str(steps), "--run.seed", str(seed), "--task.eval_every", str(steps),
        "--run.root", str(OUT / "runs"), "--run.name", f"vision-{kind}-s{seed}", "--run.overwrite", "true",
    ]
    if text:
        overrides += ["--warmstart.architecture", "qwen2", "--task.name", f"{__file__}:described"]
    return load_config(RECIPE, overrides=overrides)


def run(kind: str, seed: int, steps: int) -> dict:
    from asyncrl.policy.warmstart import COMPLETE, build_state, warmstart

    cfg = config(kind, seed, steps)
    if build_state(cfg, cfg.model.path) != COMPLETE:
        warmstart(cfg, cfg.model.path, log=lambda *a, **k: None)
    warm = json.loads((Path(cfg.model.path) / "warmstart.json").read_text())
    start = time.monotonic()
    run_dir = train(cfg, log=lambda *a, **k: None)
    summary = json.loads((run_dir / "summary.json").read_text())
    batches = [p for _, p in RunDir(run_dir).batch_files()]
    first = read_batch(batches[0])
    images = list(RunDir(run_dir).images.iterdir()) if RunDir(run_dir).images.is_dir() else []
    row = {"kind": kind, "seed": seed, "params": warm["params"], "warm_start_s": warm["seconds"],
           "start": summary["eval_accuracy_start"], "final": summary["eval_accuracy_final"],
           "samples_per_s": summary["samples_per_s"], "wall_s": round(time.monotonic() - start, 1),
           "batch_bytes_per_step": sum(p.stat().st_size for p in batches) / max(len(batches), 1),
           "image_bytes_stored": sum(p.stat().st_size for p in images), "images_stored": len(images),
           "prompt_tokens": sum(len(t.tokens) - sum(t.loss_mask) for t in first) / len(first),
           "run_dir": str(run_dir)}
    row["gain"] = row["final"] - row["start"]
    print(f"  {kind} seed {seed}: {row['start']:.3f} -> {row['final']:.3f}, {row['samples_per_s']:.0f} "
          f"samples/s ({row['wall_s']:.0f} s)", flush=True)
    return row


def gui(seed: int) -> dict:
    from asyncrl.run.preflight import check_inputs

    cfg = load_config(GUI, overrides=[
        "--model.path", str(OUT / "models" / f"gui-s{seed}"), "--warmstart.seed", str(seed),
        "--run.seed", str(seed), "--run.root", str(OUT / "runs"), "--run.name", f"gui-s{seed}",
        "--run.overwrite", "true"])
    cfg = check_inputs(cfg, log=lambda *a, **k: None)  # (builds the policy: the recipe's own)
    summary = json.loads((train(cfg, log=lambda *a, **k: None) / "summary.json").read_text())
    row = {"seed": seed, "steps": cfg.run.steps, "reward_first": summary["reward_first_20pct"],
           "reward_last": summary["reward_last_20pct"], "start": summary["eval_accuracy_start"],
           "final": summary["eval_accuracy_final"]}
    print(f"  gui seed {seed}: reward {row['reward_first']:.3f} -> {row['reward_last']:.3f}, held-out "
          f"{row['start']:.3f} -> {row['final']:.3f}", flush=True)
    return row


def memory(row: dict) -> int:
    """Peak resident bytes of a fresh process training two steps on the run's first batch."""
    out = subprocess.run([sys.executable, __file__, "--one-step", row["run_dir"]], capture_output=True,
                         text=True, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_rss"]


def one_step(run_dir: str) -> None:
    import torch

    from asyncrl.config import read_run_config
    from asyncrl.objectives import get_objective
    from asyncrl.policy.model import load_policy
    from asyncrl.run.memory import peak_rss
    from asyncrl.trainer.step import train_step
    from asyncrl.trajectory import read_batch
    from asyncrl.vision.inputs import picture_loader

    torch.set_num_threads(1)
    cfg = read_run_config(run_dir)
    model, tokenizer = load_policy(cfg.model.path)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    trajs = read_batch(RunDir(run_dir).batch(0))
    pictures = picture_loader(cfg.model.path, model.config, run_dir)
    for _ in range(2):
        train_step(model, optimizer, get_objective("ppo_clip"), trajs, 0, cfg, tokenizer.pad_token_id,
                   pictures=pictures)
    print(json.dumps({"peak_rss": peak_rss(os.getpid())}))


def markdown(result: dict) -> str:
    lines = ["# Vision-language RL on CPU (benchmarks/vision.py)", ""]
    if result.get("runs"):
        lines += _shapes_lines(result)
    if result.get("gui"):
        lines += ["", "GUI agent (examples/agents/gui_tiny.toml), 60 RL steps after its warm start:", "",
                  "| seed | reward, first 20% of steps | last 20% | held-out, start | final |",
                  "|---|---|---|---|---|"]
        lines += [f"| {g['seed']} | {g['reward_first']:.3f} | {g['reward_last']:.3f} | {g['start']:.3f} | "
                  f"{g['final']:.3f} |" for g in result["gui"]]
    return "\n".join(lines) + "\n"


def _shapes_lines(result: dict) -> list[str]:
    lines = [f"{result['steps']} RL steps of 16 prompts x 8 samples, η = 1, after the warm start; held-out "
             "greedy accuracy on 200 pictures never trained on.", "",
             "| policy | seed | params | prompt tokens | after warm start | after RL | RL adds | samples/s "
             "| batch bytes/step | trainer peak RSS |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        accuracy = (f"{r['start']:.3f} | {r['final']:.3f} | {r['gain']:+.3f}" if r["kind"] == "vision"
                    else "— | — | —")  # (told in words, the task has 24 distinct items: nothing to hold out)
        rss = f"{r['peak_rss'] / 2**20:.0f} MiB" if "peak_rss" in r else "—"
        lines.append(f"| {r['kind']} | {r['seed']} | {r['params'] / 1e6:.2f}M | {r['prompt_tokens']:.0f} | "
                     f"{accuracy} | {r['samples_per_s']:.0f} | {r['batch_bytes_per_step'] / 1e3:.0f} kB | "
                     f"{rss} |")
    vision = [r for r in result["runs"] if r["kind"] == "vision"]
    return lines + [
        "", f"RL adds >= 10 points on every seed: {all(r['gain'] >= 0.10 for r in vision)}. The text row is "
        "for cost only: told in words, the task has 24 distinct items (two colours, which is larger), so no "
        "held-out set.",
        f"Images stored per run: {vision[0]['images_stored']} files, "
        f"{vision[0]['image_bytes_stored'] / 1e3:.0f} kB on disk (once each, by hash)."]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--only", choices=["shapes", "gui"])
    parser.add_argument("--one-step")
    args = parser.parse_args()
    if args.one_step:
        return one_step(args.one_step)
    old = json.loads((OUT / "vision.json").read_text()) if (OUT / "vision.json").exists() else {}
    result = {"steps": args.steps, "runs": old.get("runs", []), "gui": old.get("gui", [])}
    if args.only != "gui":
        runs = [run("vision", seed, args.steps) for seed in args.seeds]
        runs.append(run("text", args.seeds[0], args.steps))
        for kind in ("vision", "text"):
            row = next(r for r in runs if r["kind"] == kind)
            row["peak_rss"] = memory(row)
        result["runs"] = runs
    if args.only != "shapes":
        result["gui"] = [gui(seed) for seed in args.seeds]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "vision.json").write_text(json.dumps(result, indent=2))
    (OUT / "vision.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
