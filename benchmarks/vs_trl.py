"""asyncrl against TRL's GRPOTrainer: wall-clock time to a held-out accuracy, side by side.

    python benchmarks/vs_trl.py [--workloads uniform long_tail] [--seeds 0 1] [--etas 0 4]
                                [--steps N] [--snapshot-every 10] [--eval-size 500]

For each workload and seed, one system after the other (each has the whole machine):
  trl    TRL GRPOTrainer, use_cpu=True, use_vllm=False, every core (benchmarks/trl_grpo.py)
  η=0    asyncrl synchronous: the roles alternate, each with every core
  η=k    asyncrl asynchronous: the thread split the run plans from measured rates, weight
         updates in flight without KV recompute (--update-policy keep)
Same warm-started tiny model and tokenizer, task, verifier, prompts in the same order, prompts
per step × samples per prompt, learning rate, clip range, loss aggregation and seeds (run.seed
and task.seed = 1 + seed). Every system saves its policy every `--snapshot-every` steps; after
all runs every snapshot is scored by greedy decoding of the same held-out items with the same
evaluator, outside every training clock.

Target accuracy (unless --target): 90% of the gain the weakest system reaches, i.e.
start + 0.9 · (min over systems of the mean final accuracy − start), where a run's final accuracy
is the mean of its last two snapshots and time-to-target is the first snapshot at or above it.

Writes benchmarks/results/vs_trl.{json,png,md}.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from asyncrl.config import load_config, save_config

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results"
RUNS = OUT / "runs"

# The default CPU job, a reversal task whose answer lengths are long-tailed (examples/long_tail.py), and
# sums after a long preamble (examples/long_prompt.py).
DEFAULT_MODEL = "models/tiny-default"
# Each workload leaves RL ≥ 10 points of held-out headroom and takes TRL ≥ 30 s to its target, so that
# time-to-target measures training, not start-up (docs/performance.md, "against TRL"): a lower learning
# rate than the demo's and larger batches stretch the rise over 100+ steps.
WORKLOADS = {
    "uniform": {"model": DEFAULT_MODEL, "steps": 250, "overrides": [
        "--trainer.lr", "1e-5", "--rollout.prompts_per_step", "32",
    ]},
    # One token per character, so that reversing is reversing. The warm start's teacher writes the last
    # digit twice in 70% of its answers (examples/long_tail.py:stutters): every digit is learned, and
    # the habit leaves the policy at ~6% greedy, headroom an exact-match reward removes (+70 points).
    # Long strings stay mostly beyond a 1M policy, but their answers are long all the same. (At lr 2e-5
    # TRL reached the target in 21-22 s: too close to start-up to time.)
    "long_tail": {"model": "models/tiny-reverse-stutter", "steps": 150, "overrides": [
        "--task.name", "examples/long_tail.py:reverse_digits", "--rollout.max_tokens", "34",
        "--inference.max_prompt_tokens", "64", "--trainer.lr", "1e-5", "--warmstart.steps", "150",
        "--warmstart.warmup_steps", "10", "--warmstart.tokenizer", "char",
        "--warmstart.teacher", "examples/long_tail.py:stutters", "--warmstart.teacher_params", "{}",
    ]},
    # ~130-token prompts, 1-3-token answers (examples/long_prompt.py): the trainer re-ran each prompt G times.
    # Its warm start fine-tunes the uniform workload's policy (which can add) for 300 steps: from scratch,
    # 1500 steps left a 1M-parameter policy at 5% behind the preamble.
    "long_prompt": {"model": "models/tiny-long-prompt", "steps": 120, "base": "uniform", "overrides": [
        "--task.name", "examples/long_prompt.py:sums_after_preamble", "--task.prompt_format", "question",
        "--inference.max_prompt_tokens", "320", "--warmstart.base", str(ROOT / DEFAULT_MODEL),
        "--warmstart.steps", "300", "--warmstart.warmup_steps", "20",
    ]},
}


def workload_config(name: str, seed: int, steps: int, every: int, extra: list[str]):
    w = WORKLOADS[name]
    keep = steps // every + 2
    return load_config(overrides=[
        "--model.path", str(ROOT / w["model"]), "--run.steps", str(steps), "--run.seed", str(seed),
        "--task.seed", str(1 + seed), "--task.eval_size", "0", "--trainer.checkpoint_every", str(every),
        "--trainer.keep_checkpoints", str(keep), "--run.root", str(RUNS), "--run.overwrite", "true",
        *w["overrides"], *extra,
    ])


def ensure_model(name: str) -> None:
    """Warm-start the workload's tiny model once (supervised, on the task's own prompt -> answer pairs)."""
    from asyncrl.policy.warmstart import warmstart

    path = ROOT / WORKLOADS[name]["model"]
    if "base" in WORKLOADS[name]:
        ensure_model(WORKLOADS[name]["base"])
    if not path.exists():
        print(f"warm-starting {path} for {name}", flush=True)
        cfg = load_config(overrides=WORKLOADS[name]["overrides"])
        warmstart(cfg, path, log=lambda *a, **k: print(*a, **{**k, "flush": True}))


def run_trl(cfg, out: Path, every: int) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "asyncrl_config.json")
    began = time.monotonic()
    env = {**os.environ, "SNAPSHOT_EVERY": str(every), "TQDM_DISABLE": "1"}
    with open(out / "trl.log", "w") as log:
        code = subprocess.run(
            [
                sys.executable,
                str(ROOT / "benchmarks" / "trl_grpo.py"),
                str(out),
                str(out / "asyncrl_config.json"),
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=3 * 3600,
        ).returncode
    if code != 0:
        tail = "\n  ".join((out / "trl.log").read_text().splitlines()[-8:])
        sys.exit(f"vs_trl: the TRL run exited with code {code}; the end of {out / 'trl.log'}:\n  {tail}")
    result = json.loads((out / "trl.json").read_text())
    snaps = {step: str(out / "snapshots" / f"step_{step:06d}") for step, _ in result["points"]}
    return {
        "points": [(t, step, snaps[step]) for step, t in result["points"]],
        "train_seconds": result["train_seconds"],
        "wall_seconds": round(time.monotonic() - began, 1),
        "samples_per_s": result["samples_per_s"],
        "threads": f"{result['threads']} (one process)",
        "profile": {"trl (one process)": result["profile"]},
    }


def run_asyncrl(cfg) -> dict:
    from asyncrl.observe.report import profile, read_metrics
    from asyncrl.run.launcher import train

    began = time.monotonic()
    run_dir = train(cfg, log=lambda *a, **k: None)
    wall = time.monotonic() - began
    steps, _ = read_metrics(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    times = {r["version"]: r["time"] for r in steps}
    versions = sorted(int(p.name.removeprefix("step_")) for p in (run_dir / "checkpoints").glob("step_*"))
    points = [(round(times[v], 3), v, str(run_dir / "checkpoints" / f"step_{v:06d}")) for v in versions]
    return {"points": points, "train_seconds": summary["train_seconds"], "wall_seconds": round(wall, 1),
            "samples_per_s": summary["samples_per_s"], "staleness_mean": summary["staleness_mean"],
            "threads": summary["threads"], "overhead": summary.get("framework_overhead_fraction"),
            "profile": profile(steps[-1])}


def score_snapshots(cfg, points: list, eval_size: int) -> list[tuple[float, int, float]]:
    """(seconds, step, greedy accuracy) per snapshot, the initial model at 0 s first."""
    import torch

    from asyncrl.policy.model import load_policy
    from asyncrl.policy.warmstart import greedy_accuracy
    from asyncrl.rewards.tasks import load_tasks

    torch.set_num_threads(os.cpu_count() or 1)
    tasks = load_tasks(cfg.task, held_out=True)
    curve = []
    for seconds, step, path in [(0.0, 0, cfg.model.path), *points]:
        model, tokenizer = load_policy(path)
        curve.append(
            (seconds, step, greedy_accuracy(model, tokenizer, tasks, eval_size, cfg.rollout.max_tokens))
        )
    return curve


def final(curve) -> float:
    return sum(a for _, _, a in curve[-2:]) / len(curve[-2:])


def time_to(curve, target: float) -> float:
    return next((t for t, _, a in curve if a >= target), math.inf)


def accuracy_at(curve, seconds: float) -> float:
    return [a for t, _, a in curve if t <= seconds][-1]


def summarize(runs: dict[str, list[dict]], target: float | None) -> dict:
    """Per system: means over seeds of time-to-target, final accuracy, accuracy at equal time, samples/s."""
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    start = mean([r["curve"][0][2] for rs in runs.values() for r in rs])
    finals = {s: mean([final(r["curve"]) for r in rs]) for s, rs in runs.items()}
    if target is None:
        target = start + 0.9 * (min(finals.values()) - start)
    equal_time = min(r["curve"][-1][0] for rs in runs.values() for r in rs)  # when the fastest run ends
    rows = {}
    for system, rs in runs.items():
        times = [time_to(r["curve"], target) for r in rs]
        rows[system] = {
            "time_to_target_s": mean(times), "time_to_target_per_seed": times,
            "final_accuracy": finals[system], "final_per_seed": [final(r["curve"]) for r in rs],
            "accuracy_at_equal_time": mean([accuracy_at(r["curve"], equal_time) for r in rs]),
            "samples_per_s": mean([r["samples_per_s"] for r in rs]),
            "train_seconds": mean([r["train_seconds"] for r in rs]), "threads": rs[0]["threads"],
        }
    for row in rows.values():  # (None where a system is missing, or reached the target at its first snapshot)
        row["speedup_vs_trl"] = (
            rows["trl"]["time_to_target_s"] / row["time_to_target_s"]
            if "trl" in rows and row["time_to_target_s"] else None
        )
        row["speedup_vs_eta0"] = (
            rows["η=0"]["time_to_target_s"] / row["time_to_target_s"]
            if "η=0" in rows and row["time_to_target_s"] else None
        )
    return {"start_accuracy": start, "target": target, "equal_time_s": equal_time, "systems": rows}


def table(name: str, s: dict) -> str:
    lines = [
        f"**{name}**: target accuracy {s['target']:.3f} (start {s['start_accuracy']:.3f}); accuracy at equal "
        f"time = at {s['equal_time_s']:.0f} s, when the fastest run ended\n",
        "| system | threads | time to target s | vs TRL | vs η=0 | final accuracy | accuracy at equal time "
        "| samples/s | training s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for system, r in s["systems"].items():
        ratio = lambda x: f"{x:.2f}×" if x is not None and math.isfinite(x) else "–"  # noqa: E731
        per_seed = ", ".join(f"{t:.0f}" for t in r["time_to_target_per_seed"])
        lines.append(
            f"| {system} | {r['threads']} | {r['time_to_target_s']:.0f} ({per_seed}) | "
            f"{ratio(r['speedup_vs_trl'])} | {ratio(r['speedup_vs_eta0'])} | {r['final_accuracy']:.3f} "
            f"({', '.join(f'{a:.3f}' for a in r['final_per_seed'])}) | {r['accuracy_at_equal_time']:.3f} "
            f"| {r['samples_per_s']:.1f} | {r['train_seconds']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def profiles(name: str, runs: dict[str, list[dict]]) -> str:
    """Where each system's time went (its first seed), by role and phase, largest first: the next
    bottleneck of each."""
    from asyncrl.observe.report import largest_first

    lines = [f"**{name}**: where the time went (seconds, first seed)\n", "| system | role | phases |",
             "|---|---|---|"]
    for system, rs in runs.items():
        for role, phases in rs[0]["profile"].items():
            lines.append(f"| {system} | {role} | {largest_first(phases, least=0.05)} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 2, figsize=(12, 4 * len(results)), squeeze=False)
    for (name, res), (a, b) in zip(results.items(), axes):
        colors = {}
        for system, rs in res["runs"].items():
            for k, r in enumerate(rs):
                t, _, acc = zip(*r["curve"])
                line, = a.plot(t, acc, "o-", ms=3, color=colors.get(system), alpha=0.85,
                               label=system if k == 0 else None)
                colors[system] = line.get_color()
        a.axhline(res["summary"]["target"], color="gray", ls="--", lw=1, label="target")
        a.set(
            xlabel="training wall time (s)",
            ylabel="held-out greedy accuracy",
            title=f"{name}: accuracy vs time",
        )
        a.legend()
        systems = list(res["summary"]["systems"])
        b.bar(systems, [res["summary"]["systems"][s]["time_to_target_s"] for s in systems],
              color=[colors[s] for s in systems])
        b.set(ylabel="seconds to target (mean over seeds)", title=f"{name}: time to target")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--etas", type=int, nargs="+", default=[0, 4], help="asyncrl max_staleness values")
    parser.add_argument(
        "--update-policy", default="keep", help="inference.update_policy of the asynchronous runs"
    )
    parser.add_argument("--no-trl", action="store_true", help="asyncrl only (TRL not installed)")
    parser.add_argument("--steps", type=int, default=None, help="override every workload's step count")
    parser.add_argument("--snapshot-every", type=int, default=10)
    parser.add_argument("--eval-size", type=int, default=500)
    parser.add_argument("--target", type=float, default=None)
    parser.add_argument("--name", default="vs_trl")
    args, extra = parser.parse_known_args()
    if not args.no_trl and importlib.util.find_spec("trl") is None:
        sys.exit(
            'vs_trl: TRL is not installed; pip install -e ".[bench]" (or pass --no-trl to run asyncrl only)'
        )
    results = {}
    for name in args.workloads:
        ensure_model(name)
        steps = args.steps or WORKLOADS[name]["steps"]
        runs: dict[str, list[dict]] = {}
        for seed in args.seeds:
            systems = ([] if args.no_trl else ["trl"]) + [f"η={eta}" for eta in args.etas]
            for system in systems:
                tag = f"vs_trl-{name}-{'trl' if system == 'trl' else 'eta' + system[2:]}-s{seed}"
                eta = (
                    ["--rollout.max_staleness", system[2:], "--inference.update_policy", args.update_policy]
                    if system != "trl"
                    else []
                )
                cfg = workload_config(
                    name, seed, steps, args.snapshot_every, ["--run.name", tag, *eta, *extra]
                )
                print(f"\n=== {name} seed {seed}: {system} ({steps} steps) ===", flush=True)
                r = run_trl(cfg, RUNS / tag, args.snapshot_every) if system == "trl" else run_asyncrl(cfg)
                r["curve"] = score_snapshots(cfg, r.pop("points"), args.eval_size)
                print(
                    f"  {r['train_seconds']:.0f}s training, {r['samples_per_s']:.1f} samples/s, accuracy "
                    f"{r['curve'][0][2]:.3f} -> {r['curve'][-1][2]:.3f}, threads {r['threads']}",
                    flush=True,
                )
                runs.setdefault(system, []).append(r)
        results[name] = {"steps": steps, "runs": runs, "summary": summarize(runs, args.target)}
        print("\n" + table(name, results[name]["summary"]) + "\n" + profiles(name, runs), flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{args.name}.json").write_text(json.dumps(results, indent=1, default=str))
    (OUT / f"{args.name}.md").write_text(
        "\n".join(table(n, r["summary"]) + "\n" + profiles(n, r["runs"]) for n, r in results.items())
    )
    plot(results, OUT / f"{args.name}.png")
    print(f"wrote {OUT / args.name}.{{json,md,png}}")


if __name__ == "__main__":
    sys.exit(main())
