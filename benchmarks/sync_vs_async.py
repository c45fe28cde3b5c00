"""The default job at max_staleness 0, 1 and 4: same seed, same budget of trained samples.

With --policies it also compares what a weight update does to generation in flight
(inference.update_policy: interrupt = partial rollouts, keep = the same without recomputing KV caches,
abort = re-generate, finish = drain
under the old version) at each η > 0.

Prints wall time, samples/s and final held-out accuracy side by side (with ratios to η = 0) and
writes benchmarks/results/sync_vs_async.{json,png}. Synchronous runs get every core for each
phase (the roles alternate); asynchronous runs give each role one core (config.role_threads).

    python benchmarks/sync_vs_async.py [--steps 200] [--etas 0 1 4] [--seed 0] [--policies interrupt]
                                       [--name sync_vs_async] [extra asyncrl overrides]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from asyncrl.config import load_config
from asyncrl.observe.report import read_metrics
from asyncrl.run.launcher import train

OUT = Path(__file__).parent / "results"


def run(eta: int, policy: str, steps: int, seed: int, extra: list[str]) -> dict:
    cfg = load_config(overrides=[
        "--run.name", f"bench-eta{eta}-{policy}", "--run.root", str(OUT / "runs"), "--run.overwrite", "true",
        "--run.steps", str(steps), "--run.seed", str(seed), "--rollout.max_staleness", str(eta),
        "--task.eval_every", str(max(1, steps // 5)), "--inference.update_policy", policy, *extra,
    ])
    print(f"\n=== max_staleness {eta}, update policy {policy} ===", flush=True)
    run_dir = train(cfg, log=lambda *a, **k: None)
    summary = json.loads((run_dir / "summary.json").read_text())
    steps_rows, evals = read_metrics(run_dir)
    summary["curve"] = [
        (e["time"], e["eval_accuracy"]) for e in sorted(evals, key=lambda e: e["eval_version"])
    ]
    summary["threads"] = {"inference": cfg.role_threads("inference"), "trainer": cfg.role_threads("trainer")}
    summary["tokens_discarded"] = steps_rows[-1].get("tokens_discarded", 0) if steps_rows else 0
    summary["eta"], summary["policy"] = eta, policy
    return summary


def plot(results: dict[int, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for key, r in results.items():
        t, acc = zip(*r["curve"])
        a.plot(t, acc, "o-", label=key)
    a.set(xlabel="wall time (s)", ylabel="held-out greedy accuracy", title="accuracy vs time")
    a.legend()
    keys = list(results)
    b.bar(keys, [results[k]["samples_per_s"] for k in keys])
    b.set(xlabel="max_staleness / update policy", ylabel="trained samples / s", title="throughput")
    b.tick_params(axis="x", labelrotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--etas", type=int, nargs="+", default=[0, 1, 4])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--policies", nargs="+", default=["interrupt"], choices=["interrupt", "keep", "abort", "finish"]
    )
    parser.add_argument("--name", default="sync_vs_async", help="results file name")
    args, extra = parser.parse_known_args()
    cells = [(eta, p) for eta in args.etas for p in (args.policies if eta > 0 else args.policies[:1])]
    results = {f"η={eta} {p}": run(eta, p, args.steps, args.seed, extra) for eta, p in cells}
    base = next(iter(results.values()))
    print(
        "\n| max_staleness | update policy | wall s | samples/s | speed-up | final accuracy | start accuracy "
        "| mean staleness | tokens discarded | threads (inf/train) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results.values():
        print(f"| {r['eta']} | {r['policy']} | {r['train_seconds']} | {r['samples_per_s']} "
              f"| {r['samples_per_s'] / base['samples_per_s']:.2f}x | {r['eval_accuracy_final']:.3f} "
              f"| {r['eval_accuracy_start']:.3f} | {r['staleness_mean']} | {r['tokens_discarded']} "
              f"| {r['threads']['inference']}/{r['threads']['trainer']} |")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{args.name}.json").write_text(json.dumps(results, indent=2))
    plot(results, OUT / f"{args.name}.png")
    print(f"\nwrote {OUT / (args.name + '.json')} and {OUT / (args.name + '.png')}")


if __name__ == "__main__":
    sys.exit(main())
