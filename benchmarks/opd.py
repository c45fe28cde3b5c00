"""On-policy distillation against RL alone, at η = 0 and η = 4 (docs/distillation.md).

The teacher is the default policy after RL (the default recipe: its warm start, then 200 RL steps; held-out
accuracy 0.996); the student has the same tokenizer and task, half the layers, and the default warm start
(held-out 0.51). From the same student, each seed runs RL alone (ppo_clip, the verifier's reward), OPD (opd:
the teacher's per-token reverse KL) and RL + OPD (rl_opd), at each η, for the same number of steps.
Reported: held-out accuracy against wall time and trained samples; how soon each reaches fixed accuracy
targets (the mean over seeds); samples/s with and without the teacher, and the teacher's share of the run.
A weaker student (2 layers, 300 warm-start steps: held-out 0.012) learned from none of the three in 100
steps: the reward is too sparse for RL and the student's samples too far from the teacher's for OPD.

    python benchmarks/opd.py [--steps 60] [--seeds 0 1 2] [--etas 0 4] [--collect-only] [asyncrl overrides]

Writes benchmarks/results/opd.{json,png,md}; the teacher and student are built once under
benchmarks/results/runs/ and reused.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from asyncrl.config import load_config
from asyncrl.observe.report import read_metrics
from asyncrl.policy.warmstart import warmstart
from asyncrl.run.launcher import train
from asyncrl.run.preflight import check_teacher
from asyncrl.rundir import RunDir

OUT = Path(__file__).parent / "results"
RUNS = OUT / "runs"
OBJECTIVES = {"RL alone": "ppo_clip", "OPD": "opd", "RL + OPD": "rl_opd"}
STUDENT = {"layers": 2, "steps": 1500}  # the default: 4 layers, 1500 warm-start steps
TARGETS = (0.8, 0.95)  # held-out accuracy


def teacher() -> Path:
    """The default recipe's policy after its 200 RL steps (built once)."""
    final = RunDir(RUNS / "opd-teacher").checkpoint(200)
    if not final.exists():
        print("=== teacher: the default recipe (warm start, then 200 RL steps) ===", flush=True)
        train(load_config(overrides=["--run.name", "opd-teacher", "--run.root", str(RUNS),
                                     "--run.overwrite", "true"]), log=lambda *a, **k: None)
    return final


def student() -> Path:
    path = RUNS / f"opd-student-{STUDENT['layers']}l-{STUDENT['steps']}"
    if not (path / "config.json").exists():
        print(f"=== student: {STUDENT['layers']} layers, {STUDENT['steps']} warm-start steps ===", flush=True)
        cfg = load_config(overrides={"warmstart": STUDENT})
        warmstart(cfg, path, log=lambda *a, **k: None)
    return path


def run(name: str, objective: str, eta: int, seed: int, steps: int, paths: tuple[Path, Path],
        extra: list[str]) -> dict:
    student_path, teacher_path = paths
    cfg = load_config(overrides=[
        "--run.name", run_name(objective, eta, seed), "--run.root", str(RUNS), "--run.overwrite", "true",
        "--run.steps", str(steps), "--run.seed", str(seed), "--rollout.max_staleness", str(eta),
        "--model.path", str(student_path), "--objective.name", objective, "--task.eval_every", "5",
        *(["--teacher.path", str(teacher_path)] if objective != "ppo_clip" else []), *extra])
    print(f"=== {name}, η = {eta}, seed {seed} ===", flush=True)
    return collect(train(cfg, log=lambda *a, **k: None), name, objective, eta, seed)


def run_name(objective: str, eta: int, seed: int) -> str:
    return f"opd-{objective}-eta{eta}-seed{seed}"


def collect(run_dir: Path, name: str, objective: str, eta: int, seed: int) -> dict:
    """One run's numbers, from its run directory."""
    summary = json.loads((run_dir / "summary.json").read_text())
    rows, evals = read_metrics(run_dir)
    samples_per_step = summary["samples"] / summary["steps"]
    curve = [(e["time"], round(e["eval_version"] * samples_per_step), e["eval_accuracy"])
             for e in sorted(evals, key=lambda e: e["eval_version"])]
    kl = [r["reverse_kl"] for r in rows if "reverse_kl" in r]
    wall = rows[-1]["time"]
    return {"name": name, "objective": objective, "eta": eta, "seed": seed, "curve": curve,
            "final_accuracy": curve[-1][2], "samples_per_s": summary["samples_per_s"],
            "train_seconds": summary["train_seconds"],
            "teacher_busy": round(rows[-1].get("time/teacher/score", 0.0) / wall, 4),
            "teacher_share_of_sample": round(statistics.mean(r.get("teacher_share", 0.0) for r in rows), 4),
            "reverse_kl_first10": statistics.mean(kl[:10]) if kl else None,
            "reverse_kl_last10": statistics.mean(kl[-10:]) if kl else None}


def reach(curve: list, target: float) -> tuple[float, float] | None:
    """(seconds, samples) at the first evaluation at or above `target`; None if never."""
    return next(((t, n) for t, n, acc in curve if acc >= target - 1e-9), None)


def table(results: list[dict], etas: list[int]) -> str:
    reached = " | ".join(f"seconds / samples to {t:.2f}" for t in TARGETS)
    lines = [f"| η | run | final accuracy (± sd) | {reached} | speed-up to {TARGETS[-1]:.2f} "
             "(time / samples) | samples/s | teacher busy (share of wall time) "
             "| reverse KL/token, first → last "
             "10 steps |", "|---" * (7 + len(TARGETS)) + "|"]
    for eta in etas:
        cell = [r for r in results if r["eta"] == eta]
        rl = _mean_reach([r for r in cell if r["name"] == "RL alone"], TARGETS[-1])
        for name in OBJECTIVES:
            runs = [r for r in cell if r["name"] == name]
            finals = [r["final_accuracy"] for r in runs]
            spread = statistics.stdev(finals) if len(finals) > 1 else 0.0
            cells = []
            for target in TARGETS:
                got = _mean_reach(runs, target)
                cells.append(f"{got[0]:.1f} / {got[1]:.0f}" if got else "not all seeds")
            got = _mean_reach(runs, TARGETS[-1])
            speed = f"{rl[0] / got[0]:.2f}x / {rl[1] / got[1]:.2f}x" if got and rl and got[1] else "-"
            kl = (f"{statistics.mean(r['reverse_kl_first10'] for r in runs):.2f} → "
                  f"{statistics.mean(r['reverse_kl_last10'] for r in runs):.2f}"
                  if runs[0]["reverse_kl_first10"] is not None else "-")
            lines.append(f"| {eta} | {name} | {statistics.mean(finals):.3f} ± {spread:.3f} | "
                         f"{' | '.join(cells)} | {speed} "
                         f"| {statistics.mean(r['samples_per_s'] for r in runs):.0f} "
                         f"| {statistics.mean(r['teacher_busy'] for r in runs):.2f} | {kl} |")
    return "\n".join(lines)


def _mean_reach(runs: list[dict], target: float) -> tuple[float, float] | None:
    """Mean (seconds, samples) to `target` over the runs; None if any run never reached it."""
    got = [reach(r["curve"], target) for r in runs]
    if not got or any(g is None for g in got):
        return None
    return statistics.mean(g[0] for g in got), statistics.mean(g[1] for g in got)


def plot(results: list[dict], etas: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(etas), 2, figsize=(11, 3.6 * len(etas)), squeeze=False)
    colors = dict(zip(OBJECTIVES, ("tab:gray", "tab:blue", "tab:green")))
    for row, eta in zip(axes, etas):
        for r in (r for r in results if r["eta"] == eta):
            t, n, acc = zip(*r["curve"])
            label = r["name"] if r["seed"] == min(x["seed"] for x in results) else None
            row[0].plot(t, acc, "-", color=colors[r["name"]], alpha=0.8, label=label)
            row[1].plot(n, acc, "-", color=colors[r["name"]], alpha=0.8, label=label)
        row[0].set(xlabel="wall time (s)", ylabel="held-out accuracy", title=f"η = {eta}: accuracy vs time")
        row[1].set(xlabel="trained samples", ylabel="held-out accuracy", title=f"η = {eta}: vs samples")
        row[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--etas", type=int, nargs="+", default=[0, 4])
    parser.add_argument("--collect-only", action="store_true", help="read the runs already under "
                        "benchmarks/results/runs/, train nothing")
    args, extra = parser.parse_known_args()
    grid = [(name, objective, eta, seed) for seed in args.seeds for eta in args.etas
            for name, objective in OBJECTIVES.items()]
    if args.collect_only:
        results = [collect(RUNS / run_name(o, eta, seed), name, o, eta, seed) for name, o, eta, seed in grid]
    else:
        paths = (student(), teacher())
        check_teacher(load_config(overrides={"model": {"path": str(paths[0])},
                                             "teacher": {"path": str(paths[1])}}))  # (the same tokenizer)
        results = [run(name, o, eta, seed, args.steps, paths, extra) for name, o, eta, seed in grid]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "opd.json").write_text(json.dumps(results, indent=2))
    text = table(results, args.etas)
    print("\n" + text)
    (OUT / "opd.md").write_text(text + "\n")
    plot(results, args.etas, OUT / "opd.png")
    print(f"\nwrote {OUT / 'opd.json'}, {OUT / 'opd.md'} and {OUT / 'opd.png'}")


if __name__ == "__main__":
    sys.exit(main())
