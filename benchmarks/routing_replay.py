"""Routing replay (R3) on a tiny Qwen3-MoE: the engine–trainer mismatch it removes; runs with and without it.

    python benchmarks/routing_replay.py [--steps 40] [--seeds 0 1 2] [--warmstart-steps 1200]

1. A tiny MoE policy (8 experts, top-2) warm-started on the default task, once (models/tiny-moe).
2. Runs at η = 4 with the engine serving in bfloat16 (the trainer trains in float32), with and
   without `trainer.routing_replay`, per seed: held-out greedy accuracy (200 items) at the start and
   end, the trainer's entropy and its mismatch KL (at the version that sampled) per step.
3. Offline, on the first batch of each seed's run without replay (every token sampled by version 0):
   the mismatch KL between the engine's logprobs and the initial policy's in float32, without and
   with replay; and again with the trainer's routers perturbed (Gaussian noise of a third of their
   weights' scale), the failure replay guards against.

Mismatch KL per token: r − 1 − log r with r = π_trainer / π_engine (the trainer's own metric), mean
over sampled tokens. Writes benchmarks/results/routing_replay.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from asyncrl.config import load_config
from asyncrl.observe.report import read_metrics, summarize
from asyncrl.policy import routing
from asyncrl.policy.model import load_policy
from asyncrl.run.launcher import train
from asyncrl.rundir import RunDir
from asyncrl.trainer.logprobs import token_logprobs
from asyncrl.trainer.step import collate
from asyncrl.trajectory import read_batch

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results"
MODEL = ROOT / "models" / "tiny-moe"


def ensure_model(steps: int) -> None:
    if (MODEL / "config.json").exists():
        return
    from asyncrl.policy.warmstart import warmstart

    cfg = load_config(overrides=["--warmstart.architecture", "qwen3_moe", "--warmstart.steps",
                                 str(steps)])
    warmstart(cfg, MODEL, log=lambda *a, **k: print(*a, **{**k, "flush": True}))


def run(replay: bool, seed: int, steps: int) -> Path:
    cfg = load_config(overrides=[
        "--model.path", str(MODEL), "--run.steps", str(steps), "--run.seed", str(seed),
        "--task.seed", str(1 + seed), "--rollout.max_staleness", "4", "--inference.dtype", "bfloat16",
        "--inference.update_policy", "keep", "--trainer.routing_replay", str(replay).lower(),
        "--task.eval_size", "200", "--task.eval_every", str(steps),
        "--run.root", str(OUT / "runs"), "--run.name", f"r3-{'replay' if replay else 'plain'}-s{seed}",
        "--run.overwrite", "true",
    ])
    print(f"  {cfg.run.name}", flush=True)
    return train(cfg, log=lambda *a, **k: None)


def mismatch_kl(model, trajs, replay: bool) -> float:
    batch = collate(trajs, model.config.pad_token_id or 0, version=0, with_routes=replay)
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch, temperature=1.0)
    mask = batch["mask"] > 0
    log_r = (logp - batch["behav"])[mask].double()
    return float((log_r.exp() - 1 - log_r).mean())


def offline(run_dir: Path) -> dict:
    """Mismatch KL on batch 0 (version 0's samples), float32 trainer, without and with replay."""
    trajs = read_batch(RunDir(run_dir).batch(0))
    model, _ = load_policy(MODEL)
    out = {f"same_router_{'replay' if r else 'plain'}": mismatch_kl(model, trajs, r) for r in (False, True)}
    torch.manual_seed(0)
    with torch.no_grad():
        for gate in routing.routers(model):
            gate.weight.add_(gate.weight.std() / 3 * torch.randn_like(gate.weight))
    for r in (False, True):
        out[f"perturbed_{'replay' if r else 'plain'}"] = mismatch_kl(model, trajs, r)
    return out


def summary(run_dir: Path) -> dict:
    steps, evals = read_metrics(run_dir)
    fresh = [r["mismatch_kl"] for r in steps if r["mismatch_kl"] == r["mismatch_kl"]]  # (NaN: none fresh)
    return {"accuracy_start": evals[0]["eval_accuracy"], "accuracy_final": evals[-1]["eval_accuracy"],
            "entropy_first": steps[0]["entropy"],
            "entropy_last": statistics.mean(r["entropy"] for r in steps[-5:]),
            "mismatch_kl": statistics.mean(fresh) if fresh else float("nan"),
            "samples_per_s": round(summarize(steps, evals)["samples_per_s"], 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--warmstart-steps", type=int, default=1200)
    args = parser.parse_args()
    torch.set_num_threads(2)
    ensure_model(args.warmstart_steps)
    rows = []
    for seed in args.seeds:
        for replay in (False, True):
            run_dir = run(replay, seed, args.steps)
            row = {"seed": seed, "replay": replay, **summary(run_dir)}
            if not replay:
                row["offline"] = offline(run_dir)
            rows.append(row)
            print("   ", row, flush=True)
    OUT.mkdir(exist_ok=True)
    (OUT / "routing_replay.json").write_text(json.dumps(rows, indent=1))
    (OUT / "routing_replay.md").write_text(table(rows))
    print(table(rows))


def table(rows: list[dict]) -> str:
    lines = ["| seed | replay | accuracy start → final | entropy first → last | mismatch KL in run | "
             "samples/s |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['seed']} | {'on' if r['replay'] else 'off'} | {r['accuracy_start']:.3f} → "
                     f"{r['accuracy_final']:.3f} | {r['entropy_first']:.3f} → {r['entropy_last']:.3f} | "
                     f"{r['mismatch_kl']:.2e} | {r['samples_per_s']} |")
    lines += ["", "Offline, batch 0 of each run without replay (bfloat16 engine, float32 trainer):", "",
              "| seed | same router, plain | same router, replay | ratio | perturbed, plain | "
              "perturbed, replay | ratio |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "offline" in r:
            o = r["offline"]
            lines.append(f"| {r['seed']} | {o['same_router_plain']:.2e} | {o['same_router_replay']:.2e} | "
                         f"{o['same_router_plain'] / max(o['same_router_replay'], 1e-30):.1f}× | "
                         f"{o['perturbed_plain']:.2e} | {o['perturbed_replay']:.2e} | "
                         f"{o['perturbed_plain'] / max(o['perturbed_replay'], 1e-30):.1f}× |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
