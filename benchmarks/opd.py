"""On-policy distillation against RL alone, at η = 0 and η = 4 (docs/distillation.md).

The teacher is the default policy after RL (the default recipe: its warm start, then 200 RL steps); the
student has the same tokenizer and task, half the layers, and a weak warm start. From the same student,
each seed runs RL alone (ppo_clip, the verifier's reward), OPD (opd: the teacher's per-token reverse KL)
and RL + OPD (rl_opd), at each η, for the same number of steps. Reported: held-out accuracy against wall
time and trained samples; how soon each reaches RL-alone's final accuracy (the mean over seeds); samples/s
with and without the teacher, and the teacher's share of the CPU.

    python benchmarks/opd.py [--steps 100] [--seeds 0 1 2] [--etas 0 4] [extra asyncrl overrides]

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
STUDENT = {"layers": 2, "steps": 300}  # the default's 4 layers and 1500 warm-start steps


def teacher() -> Path:
    """The default recipe's policy after its 200 RL steps (built once)."""
    final = RunDir(RUNS / "opd-teacher").checkpoint(200)
    if not final.exists():
        print("=== teacher: the default recipe (warm start, then 200 RL steps) ===", flush=True)
        train(load_config(overrides=["--run.name", "opd-teacher", "--run.root", str(RUNS),
                                     "--run.overwrite", "true"]), log=lambda *a, **k: None)
    return final


def student() -> Path:
    path = RUNS / "opd-student"
    if not (path / "config.json").exists():
        print(f"=== student: {STUDENT['layers']} layers, {STUDENT['steps']} warm-start steps ===", flush=True)
        cfg = load_config(overrides={"warmstart": STUDENT})
        warmstart(cfg, path, log=lambda *a, **k: None)
    return path


def run(name: str, objective: str, eta: int, seed: int, steps: int, paths: tuple[Path, Path],
        extra: list[str]) -> dict:
    student_path, teacher_path = paths
    distils = objective != "ppo_clip"
    cfg = load_config(overrides=[
        "--run.name", f"opd-{objective}-eta{eta}-seed{seed}", "--run.root", str(RUNS),
        "--run.overwrite", "true",
        "--run.steps", str(steps), "--run.seed", str(seed), "--rollout.max_staleness", str(eta),
        "--model.path", str(student_path), "--objective.name", objective, "--task.eval_every", "10",
        *(["--teacher.path", str(teacher_path)] if distils else []), *extra])
    print(f"=== {name}, η = {eta}, seed {seed} ===", flush=True)
    run_dir = train(cfg, log=lambda *a, **k: None)
    summary = json.loads((run_dir / "summary.json").read_text())
    rows, evals = read_metrics(run_dir)
    samples_per_step = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    curve = [(e["time"], e["eval_version"] * samples_per_step, e["eval_accuracy"])
             for e in sorted(evals, key=lambda e: e["eval_version"])]
    last = rows[-1]
    wall = last["time"]
    return {"name": name, "objective": objective, "eta": eta, "seed": seed, "curve": curve,
            "final_accuracy": curve[-1][2], "samples_per_s": summary["samples_per_s"],
            "train_seconds": summary["train_seconds"],
            "teacher_cpu_share": round(last.get("time/teacher/score", 0.0) / wall, 4) if distils else 0.0,
            "teacher_share_of_sample": round(statistics.mean(r.get("teacher_share", 0.0) for r in rows), 4)}


def reach(curve: list, target: float) -> tuple[float, float] | None:
    """(seconds, samples) at the first evaluation at or above `target`; None if never."""
    return next(((t, n) for t, n, acc in curve if acc >= target - 1e-9), None)


def table(results: list[dict], etas: list[int]) -> str:
    lines = ["| η | run | final accuracy | seconds to RL's final | samples to RL's final | speed-up (time) "
             "| speed-up (samples) | samples/s | teacher CPU share |", "|---" * 9 + "|"]
    for eta in etas:
        cell = [r for r in results if r["eta"] == eta]
        target = statistics.mean(r["final_accuracy"] for r in cell if r["name"] == "RL alone")
        rl = _mean_reach([r for r in cell if r["name"] == "RL alone"], target)
        for name in OBJECTIVES:
            runs = [r for r in cell if r["name"] == name]
            got = _mean_reach(runs, target)
            speed = (f"{rl[0] / got[0]:.1f}x", f"{rl[1] / got[1]:.1f}x") if got and rl else ("-", "-")
            shown = (f"{got[0]:.0f}", f"{got[1]:.0f}") if got else ("never", "never")
            lines.append(f"| {eta} | {name} | {statistics.mean(r['final_accuracy'] for r in runs):.3f} "
                         f"(target {target:.3f}) | {shown[0]} | {shown[1]} | {speed[0]} | {speed[1]} "
                         f"| {statistics.mean(r['samples_per_s'] for r in runs):.0f} "
                         f"| {statistics.mean(r['teacher_cpu_share'] for r in runs):.3f} |")
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
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--etas", type=int, nargs="+", default=[0, 4])
    args, extra = parser.parse_known_args()
    paths = (student(), teacher())
    check_teacher(load_config(overrides={"model": {"path": str(paths[0])},
                                         "teacher": {"path": str(paths[1])}}))  # (the same tokenizer)
    results = [run(name, objective, eta, seed, args.steps, paths, extra)
               for seed in args.seeds for eta in args.etas for name, objective in OBJECTIVES.items()]
    text = table(results, args.etas)
    print("\n" + text)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "opd.json").write_text(json.dumps(results, indent=2))
    (OUT / "opd.md").write_text(text + "\n")
    plot(results, args.etas, OUT / "opd.png")
    print(f"\nwrote {OUT / 'opd.json'}, {OUT / 'opd.md'} and {OUT / 'opd.png'}")


if __name__ == "__main__":
    sys.exit(main())
