"""Which objectives hold accuracy as staleness grows: every objective × η, same budget and seeds.

Each cell trains the default task from the same warm start with the same number of trained
samples (steps × prompts × group size) and reports the final held-out greedy accuracy (mean over
seeds) and the accuracy curve. Writes benchmarks/results/staleness.{json,md,png}; cells already
in the JSON are kept, so an interrupted sweep resumes where it stopped.

    python benchmarks/staleness.py [--steps 24] [--etas 0 1 4 16 64] [--seeds 0 1 2] [--objectives ...]

A cell is a real run (three processes, 500 held-out evaluations at versions 0, steps/3, 2·steps/3
and steps), ~30 s on 2 cores. Within `steps` versions the rollouts can run at most `steps` versions
ahead, so an η at or above the run's length means "unbounded": the table reports the staleness each
column actually reached.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from asyncrl.config import load_config
from asyncrl.observe.report import read_metrics
from asyncrl.run.launcher import train

OUT = Path(__file__).parent / "results"

# objective label -> overrides that make it that objective (same sample budget for all); the ones
# the seed papers make claims about come first, so a sweep cut short still answers them
VARIANTS = {
    "ppo_clip": [],
    "unclipped_is": ["--objective.name", "ppo_clip",
                     "--objective.eps_low", "1e6", "--objective.eps_high", "1e6"],
    "decoupled_ppo": [],
    "m2po": [],
    "vcpo": [],
    "tis": [],
    "cispo": [],
    "gspo": ["--objective.loss_agg", "seq_mean"],
    "mis": [],
    "decoupled_ppo_loglinear": ["--objective.name", "decoupled_ppo", "--objective.prox", "loglinear"],
    "dr_grpo": ["--rollout.advantage", "dr_grpo", "--objective.loss_agg", "constant"],
    # one rollout per prompt: G times as many prompts for the same number of samples
    "sao": ["--rollout.group_size", "1", "--rollout.prompts_per_step", "128",
            "--rollout.advantage", "running_baseline"],
}


def cell(label: str, eta: int, seed: int, steps: int) -> dict:
    overrides = (
        ["--objective.name", label] if not any(a == "--objective.name" for a in VARIANTS[label]) else []
    )
    cfg = load_config(
        overrides=[
            "--run.name",
            f"{label}-eta{eta}-s{seed}",
            "--run.root",
            str(OUT / "runs" / "staleness"),
            "--run.overwrite",
            "true",
            "--run.steps",
            str(steps),
            "--run.seed",
            str(seed),
            "--rollout.max_staleness",
            str(eta),
            "--task.eval_every",
            str(max(1, steps // 3)),
            "--task.seed",
            str(1 + 1000 * seed),
            "--trainer.checkpoint_every",
            str(steps),
            *overrides,
            *VARIANTS[label],
        ]
    )
    run_dir = train(cfg, log=lambda *a, **k: None)
    summary = json.loads((run_dir / "summary.json").read_text())
    steps_rows, evals = read_metrics(run_dir)
    return {
        "final_accuracy": summary["eval_accuracy_final"],
        "start_accuracy": summary["eval_accuracy_start"],
        "staleness_mean": summary["staleness_mean"],
        "wall_seconds": summary["wall_seconds"],
        "ess_min": min((r.get("ess_fraction", 1.0) for r in steps_rows), default=None),
        "skipped_steps": sum(r.get("skipped_nonfinite", 0) for r in steps_rows),
        "curve": [
            (e["eval_version"], e["eval_accuracy"]) for e in sorted(evals, key=lambda e: e["eval_version"])
        ],
    }


def table(results: dict, labels: list[str], etas: list[int]) -> str:
    head = "| objective | " + " | ".join(f"η = {e}" for e in etas) + " |\n|---|" + "---|" * len(etas) + "\n"
    rows = []
    for label in labels:
        cells = []
        for eta in etas:
            runs = [v for k, v in results.items() if k.startswith(f"{label}|{eta}|")]
            if runs:
                accs = [r["final_accuracy"] for r in runs]
                cells.append(f"{sum(accs) / len(accs):.3f} ({min(accs):.2f}–{max(accs):.2f})")
            else:
                cells.append("–")
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    reached = []
    for eta in etas:
        runs = [v["staleness_mean"] for k, v in results.items() if f"|{eta}|" in k]
        reached.append(f"{sum(runs) / len(runs):.1f}" if runs else "–")
    rows.append("| *mean staleness reached* | " + " | ".join(reached) + " |")
    return head + "\n".join(rows) + "\n"


def plot(results: dict, labels: list[str], etas: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colors = plt.get_cmap("tab20").colors
    for k, label in enumerate(labels):
        means = []
        for eta in etas:
            runs = [v["final_accuracy"] for k, v in results.items() if k.startswith(f"{label}|{eta}|")]
            means.append(sum(runs) / len(runs) if runs else float("nan"))
        ax.plot([str(e) for e in etas], means, "o-" if k < 10 else "s--", color=colors[k % 20], label=label)
    start = [v["start_accuracy"] for v in results.values()]
    if start:
        ax.axhline(start[0], color="gray", ls="--", label="warm start")
    ax.set(
        xlabel="max_staleness η",
        ylabel="final held-out greedy accuracy",
        title="accuracy vs staleness, same sample budget",
    )
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--etas", type=int, nargs="+", default=[0, 1, 4, 16, 64])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--objectives", nargs="+", default=list(VARIANTS))
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "staleness.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    todo = [
        (o, e, s)
        for o in args.objectives
        for e in args.etas
        for s in args.seeds
        if f"{o}|{e}|{s}" not in results
    ]
    for n, (label, eta, seed) in enumerate(todo, 1):
        r = cell(label, eta, seed, args.steps)
        results[f"{label}|{eta}|{seed}"] = r
        path.write_text(json.dumps(results, indent=1))
        print(f"[{n}/{len(todo)}] {label:24s} η={eta:<3d} seed {seed}: accuracy {r['start_accuracy']:.3f} -> "
              f"{r['final_accuracy']:.3f}  min ESS {r['ess_min']:.2f}  {r['wall_seconds']:.0f}s", flush=True)
    md = table(results, args.objectives, args.etas)
    (OUT / "staleness.md").write_text(md)
    plot(results, args.objectives, args.etas, OUT / "staleness.png")
    print("\nfinal held-out greedy accuracy, mean over seeds (min–max):\n" + md)


if __name__ == "__main__":
    main()
