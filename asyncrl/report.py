"""The end-of-run report: curves as PNG and a summary table, from metrics.jsonl alone."""
from __future__ import annotations

import json
from pathlib import Path


def read_metrics(run_dir: Path) -> tuple[list[dict], list[dict]]:
    steps, evals = [], []
    path = Path(run_dir) / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        record = json.loads(line)
        (evals if "eval_accuracy" in record else steps).append(record)
    return steps, evals


def summarize(steps: list[dict], evals: list[dict]) -> dict:
    if not steps:
        return {"steps": 0}
    last = steps[-1]
    tail = steps[-max(1, len(steps) // 5):]
    head = steps[: max(1, len(steps) // 5)]
    mean = lambda rows, key: sum(r.get(key, 0) for r in rows) / len(rows)  # noqa: E731
    evals = sorted(evals, key=lambda e: e["eval_version"])
    samples = sum(r.get("samples", 0) for r in steps)
    return {
        "steps": len(steps),
        "train_seconds": round(last["time"], 1),
        "samples": samples,
        "samples_per_s": round(samples / max(last["time"], 1e-9), 2),
        "reward_first_20pct": round(mean(head, "reward"), 4),
        "reward_last_20pct": round(mean(tail, "reward"), 4),
        "eval_accuracy_start": evals[0]["eval_accuracy"] if evals else None,
        "eval_accuracy_final": evals[-1]["eval_accuracy"] if evals else None,
        "eval_version_final": evals[-1]["eval_version"] if evals else None,
        "staleness_mean": round(mean(steps, "staleness_mean"), 3),
        "staleness_max": max(r.get("staleness_max", 0) for r in steps),
        "dropped_stale_groups": sum(r.get("dropped_stale_groups", 0) for r in steps),
        "gen_tokens_per_s": round(mean(steps, "gen_tokens_per_s"), 1),
        "train_tokens_per_s": round(mean(steps, "train_tokens_per_s"), 1),
        "trainer_busy_fraction": round(last["trainer_busy_seconds"] / max(last["trainer_busy_seconds"] + last["trainer_idle_seconds"], 1e-9), 3),
        "inference_busy_fraction": round(last["inference_busy_seconds"] / max(last["inference_busy_seconds"] + last["inference_idle_seconds"], 1e-9), 3),
    }


def plot(steps: list[dict], evals: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    t = [r["time"] for r in steps]
    ax = axes[0]
    rewards = [r["reward"] for r in steps]
    window = max(1, len(steps) // 20)
    smooth = [sum(rewards[max(0, i - window + 1): i + 1]) / len(rewards[max(0, i - window + 1): i + 1]) for i in range(len(rewards))]
    ax.plot(t, rewards, label="train reward (per step)", alpha=0.3)
    ax.plot(t, smooth, label=f"train reward ({window}-step mean)")
    if evals:
        ax.plot([e["time"] for e in evals], [e["eval_accuracy"] for e in evals], "o-", label="held-out greedy accuracy")
    ax.set(xlabel="wall time (s)", ylabel="reward / accuracy", title="reward vs time")
    ax.legend()
    ax = axes[1]
    x = [r["step"] for r in steps]
    ax.plot(x, [r.get("staleness_mean", 0) for r in steps], label="mean")
    ax.plot(x, [r.get("staleness_max", 0) for r in steps], label="max")
    ax.set(xlabel="step", ylabel="versions behind", title="staleness of trained samples")
    ax.legend()
    ax = axes[2]
    ax.plot(t, [r["gen_tokens_per_s"] for r in steps], label="generation tok/s")
    ax.plot(t, [r.get("train_tokens_per_s", 0) for r in steps], label="training tok/s")
    ax.set(xlabel="wall time (s)", ylabel="tokens/s", title="throughput")
    ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def table(summary: dict) -> str:
    rows = "\n".join(f"| {k} | {v} |" for k, v in summary.items())
    return f"| metric | value |\n|---|---|\n{rows}\n"


def write_report(run_dir: str | Path) -> dict:
    run_dir = Path(run_dir)
    steps, evals = read_metrics(run_dir)
    summary = summarize(steps, evals)
    if steps:
        plot(steps, evals, run_dir / "report.png", f"asyncrl run {run_dir.name}")
    (run_dir / "report.md").write_text(f"# Run {run_dir.name}\n\n![curves](report.png)\n\n{table(summary)}")
    return summary
