"""The default job at max_staleness 0, 1 and 4: same seed, same budget of trained samples.

Prints wall time, samples/s and final held-out accuracy side by side (with ratios to η = 0) and
writes benchmarks/results/sync_vs_async.{json,png}. Synchronous runs get every core for each
phase (the roles alternate); asynchronous runs give each role one core (config.role_threads).

    python benchmarks/sync_vs_async.py [--steps 200] [--etas 0 1 4] [--seed 0] [extra asyncrl overrides]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from asyncrl.config import load_config
from asyncrl.launcher import train
from asyncrl.report import read_metrics

OUT = Path(__file__).parent / "results"


def run(eta: int, steps: int, seed: int, extra: list[str]) -> dict:
    cfg = load_config(overrides=[
        "--run.name", f"bench-eta{eta}", "--run.root", str(OUT / "runs"), "--run.overwrite", "true",
        "--run.steps", str(steps), "--run.seed", str(seed), "--rollout.max_staleness", str(eta),
        "--task.eval_every", str(max(1, steps // 5)), *extra,
    ])
    print(f"\n=== max_staleness {eta} ===", flush=True)
    run_dir = train(cfg, log=lambda *a, **k: None)
    summary = json.loads((run_dir / "summary.json").read_text())
    steps_rows, evals = read_metrics(run_dir)
    summary["curve"] = [(e["time"], e["eval_accuracy"]) for e in sorted(evals, key=lambda e: e["eval_version"])]
    summary["threads"] = {"inference": cfg.role_threads("inference"), "trainer": cfg.role_threads("trainer")}
    return summary


def plot(results: dict[int, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for eta, r in results.items():
        t, acc = zip(*r["curve"])
        a.plot(t, acc, "o-", label=f"η = {eta}")
    a.set(xlabel="wall time (s)", ylabel="held-out greedy accuracy", title="accuracy vs time")
    a.legend()
    etas = list(results)
    b.bar([str(e) for e in etas], [results[e]["samples_per_s"] for e in etas])
    b.set(xlabel="max_staleness", ylabel="trained samples / s", title="throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--etas", type=int, nargs="+", default=[0, 1, 4])
    parser.add_argument("--seed", type=int, default=0)
    args, extra = parser.parse_known_args()
    results = {eta: run(eta, args.steps, args.seed, extra) for eta in args.etas}
    base = results[args.etas[0]]
    print(f"\n| max_staleness | wall s | samples/s | speed-up | final accuracy | start accuracy | mean staleness | threads (inf/train) |")
    print("|---|---|---|---|---|---|---|---|")
    for eta, r in results.items():
        print(f"| {eta} | {r['train_seconds']} | {r['samples_per_s']} | {r['samples_per_s'] / base['samples_per_s']:.2f}x "
              f"| {r['eval_accuracy_final']:.3f} | {r['eval_accuracy_start']:.3f} | {r['staleness_mean']} "
              f"| {r['threads']['inference']}/{r['threads']['trainer']} |")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "sync_vs_async.json").write_text(json.dumps({str(k): v for k, v in results.items()}, indent=2))
    plot(results, OUT / "sync_vs_async.png")
    print(f"\nwrote {OUT / 'sync_vs_async.json'} and {OUT / 'sync_vs_async.png'}")


if __name__ == "__main__":
    sys.exit(main())
