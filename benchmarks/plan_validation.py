"""Is `asyncrl plan` right? Its predictions against measured runs on this machine (docs/planner.md).

For each workload (the default uniform task; the long-tailed reversal of benchmarks/vs_trl.py), one
calibration run per layout (seed 1): η = 0 (roles alternate), η = 1 (roles overlap, one replica), η = 1
with two replicas, η = 1 under Ray (its weights and batches travel through Ray: a cost a local run's
rates lack). Then the measured runs (seed 0): η = 0, 1, 4, 16 with one replica, η = 4 with two,
and η = 4 under Ray. Each is predicted by the simulator from its layout's calibration (the rates and
the groups of another run, never its own), and compared on samples/s and the mean staleness.

Error: |predicted − measured| / measured; for staleness, whose η = 0 value is 0, over max(measured,
0.5) (half a version: what one step of the rule is worth).

    python benchmarks/plan_validation.py [--steps 60] [--workloads uniform long_tail] [--no-ray]

Writes benchmarks/results/plan_validation.{json,md,png}.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import vs_trl  # noqa: E402  (its workloads and their warm-started models)

from asyncrl.config import load_config, read_run_config  # noqa: E402
from asyncrl.observe.report import read_metrics, summarize  # noqa: E402
from asyncrl.plan.calibrate import calibrate  # noqa: E402
from asyncrl.plan.simulate import simulate  # noqa: E402
from asyncrl.run.launcher import train  # noqa: E402

OUT = Path(__file__).parent / "results"
RUNS = OUT / "runs"
CALIBRATIONS = {"alternate": (0, 1, "local"), "overlap": (1, 1, "local"), "two_replicas": (1, 2, "local"),
                "ray_overlap": (1, 1, "ray")}  # (η, replicas, launcher)
MEASURED = [  # (η, replicas, launcher, calibration)
    (0, 1, "local", "alternate"), (1, 1, "local", "overlap"), (4, 1, "local", "overlap"),
    (16, 1, "local", "overlap"), (4, 2, "local", "two_replicas"), (4, 1, "ray", "ray_overlap"),
]


def run(workload: str, eta: int, replicas: int, launcher: str, seed: int, steps: int) -> Path:
    w = vs_trl.WORKLOADS[workload]
    name = f"plan-{workload}-eta{eta}-r{replicas}-{launcher}-s{seed}"
    cfg = load_config(overrides=[
        "--model.path", str(vs_trl.ROOT / w["model"]), *w["overrides"], "--run.steps", str(steps),
        "--run.seed", str(seed), "--task.seed", str(1 + seed), "--task.eval_size", "0",
        "--rollout.max_staleness", str(eta), "--inference.replicas", str(replicas),
        "--inference.update_policy", "keep", "--run.launcher", launcher, "--run.ray_address", "local",
        "--run.root", str(RUNS), "--run.name", name, "--run.overwrite", "true",
    ])
    print(f"  {name}", flush=True)
    return train(cfg, log=lambda *a, **k: None)


def compare(run_dir: Path, calibration: Path) -> dict:
    rates, groups, layout = calibrate(calibration)
    cfg = read_run_config(run_dir)
    predicted = simulate(cfg, rates, groups, cfg.inference.replicas, cfg.trainer.ranks)
    measured = summarize(*read_metrics(run_dir))
    row = {}
    for key, floor in (("samples_per_s", 1e-9), ("staleness_mean", 0.5)):
        row[f"{key}_measured"], row[f"{key}_predicted"] = measured[key], predicted[key]
        row[f"{key}_error"] = round(abs(predicted[key] - measured[key]) / max(measured[key], floor), 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--workloads", nargs="+", default=["uniform", "long_tail"])
    parser.add_argument("--no-ray", action="store_true")
    args = parser.parse_args()
    rows = []
    for workload in args.workloads:
        vs_trl.ensure_model(workload)
        print(f"{workload}: calibration runs", flush=True)
        calibrations = {name: run(workload, eta, replicas, launcher, 1, args.steps)
                        for name, (eta, replicas, launcher) in CALIBRATIONS.items()
                        if not (launcher == "ray" and args.no_ray)}
        print(f"{workload}: measured runs", flush=True)
        for eta, replicas, launcher, calibration in MEASURED:
            if launcher == "ray" and args.no_ray:
                continue
            run_dir = run(workload, eta, replicas, launcher, 0, args.steps)
            rows.append({"workload": workload, "eta": eta, "replicas": replicas, "launcher": launcher,
                         "calibrated_on": calibration, **compare(run_dir, calibrations[calibration])})
            print("   ", {k: v for k, v in rows[-1].items() if "error" in k or "measured" in k}, flush=True)
    write(rows)


def write(rows: list[dict]) -> None:
    errors = {key: [r[f"{key}_error"] for r in rows] for key in ("samples_per_s", "staleness_mean")}
    stats = {k: {"median": statistics.median(e), "worst": max(e)} for k, e in errors.items()}
    (OUT / "plan_validation.json").write_text(json.dumps({"rows": rows, "errors": stats}, indent=1))
    lines = ["| workload | η | replicas | launcher | calibrated on | samples/s measured | predicted | "
             "error | staleness measured | predicted | error |", "|---" * 11 + "|"]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['eta']} | {r['replicas']} | {r['launcher']} | "
                     f"{r['calibrated_on']} | "
                     f"{r['samples_per_s_measured']:.0f} | {r['samples_per_s_predicted']:.0f} | "
                     f"{r['samples_per_s_error']:.1%} | {r['staleness_mean_measured']:.2f} | "
                     f"{r['staleness_mean_predicted']:.2f} | {r['staleness_mean_error']:.1%} |")
    lines.append("")
    lines += [f"{key}: median error {s['median']:.1%}, worst {s['worst']:.1%}" for key, s in stats.items()]
    (OUT / "plan_validation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(rows, OUT / "plan_validation.png")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, key, label in zip(axes, ("samples_per_s", "staleness_mean"), ("samples/s", "staleness mean")):
        for workload, marker in (("uniform", "o"), ("long_tail", "s")):
            pts = [(r[f"{key}_measured"], r[f"{key}_predicted"]) for r in rows if r["workload"] == workload]
            if pts:
                ax.scatter(*zip(*pts), marker=marker, label=workload)
        top = max(max(r[f"{key}_measured"], r[f"{key}_predicted"]) for r in rows) * 1.1 or 1
        ax.plot([0, top], [0, top], "k--", lw=1)
        ax.fill_between([0, top], [0, 0.9 * top], [0, 1.1 * top], color="gray", alpha=0.15, label="±10%")
        ax.set(xlabel=f"measured {label}", ylabel=f"predicted {label}", title=label)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    main()
