"""The end-of-run report: curves as PNG and a summary table, from metrics.jsonl alone."""
from __future__ import annotations

import json
from pathlib import Path

from asyncrl.config import read_run_config
from asyncrl.observe.profile import COMPUTE, WAITING
from asyncrl.rundir import RunDir
from asyncrl.store.ledger import read_changes


def read_metrics(run_dir: Path) -> tuple[list[dict], list[dict]]:
    steps, evals = [], []
    path = RunDir(run_dir).metrics
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
        "trainer_busy_fraction": round(
            last["trainer_busy_seconds"]
            / max(last["trainer_busy_seconds"] + last["trainer_idle_seconds"], 1e-9),
            3,
        ),
        "inference_busy_fraction": round(
            last["inference_busy_seconds"]
            / max(last["inference_busy_seconds"] + last["inference_idle_seconds"], 1e-9),
            3,
        ),
        **profile_summary(profile(last)),
        **teacher_summary(steps, head, tail),
    }


def teacher_summary(steps: list[dict], head: list[dict], tail: list[dict]) -> dict:
    """On-policy distillation: the reverse KL to the teacher at the start and the end, and what the teacher
    cost: its busy share of its uptime, the seconds a group waited for its scores, and their share of the
    time from a sample's request to its scores."""
    if "teacher_share" not in steps[-1]:
        return {}
    mean = lambda rows, key: sum(r.get(key, 0) for r in rows) / len(rows)  # noqa: E731
    last = steps[-1]
    out = {"teacher_busy_fraction": last.get("teacher_busy"),
           "teacher_seconds_per_group": round(mean(steps, "teacher_seconds_mean"), 4),
           "teacher_share_of_sample_time": round(mean(steps, "teacher_share"), 3),
           "teacher_retries": last.get("teacher_retries", 0)}
    if "reverse_kl" in last:
        out.update(reverse_kl_first_20pct=round(mean(head, "reverse_kl"), 4),
                   reverse_kl_last_20pct=round(mean(tail, "reverse_kl"), 4))
    return out


def profile(record: dict) -> dict[str, dict[str, float]]:
    """{role: {phase: seconds}} from one step record's running totals; each role's phases add up to
    its uptime ("other" is what no phase timed). The orchestrator's row is CPU time, the verifiers'
    too (their processes idle otherwise)."""
    roles: dict[str, dict[str, float]] = {}
    for key, value in record.items():
        if key.startswith("time/"):
            _, role, phase = key.split("/", 2)
            roles.setdefault(role, {})[phase] = value
    for role, phases in roles.items():
        uptime = phases.pop("uptime", None)
        if role == "orchestrator":
            cpu = phases.pop("cpu", 0.0)
            phases["http_and_bookkeeping"] = max(0.0, cpu - sum(phases.values()))
            phases["off_cpu"] = max(0.0, (uptime or cpu) - cpu)
        elif uptime is not None:
            rest = "idle" if role in ("inference", "teacher") else "other"  # (servers wait for requests)
            phases[rest] = max(0.0, uptime - sum(phases.values()))
    return roles


def profile_summary(roles: dict[str, dict[str, float]]) -> dict:
    """Compute per role, the framework's share of the compute roles' time, and what bounds the run.

    Framework time is every timed phase that is neither a role's compute nor waiting: batch files,
    collation, publishing and loading weights, responses, the orchestrator's CPU. Its fraction is
    over 2 × the trainer's uptime: the generation and training roles' time together."""
    if "trainer" not in roles or "inference" not in roles:
        return {}
    framework = sum(v for role in ("trainer", "inference") for k, v in roles[role].items()
                    if k not in COMPUTE and k not in WAITING)
    framework += sum(v for k, v in roles.get("orchestrator", {}).items() if k != "off_cpu")
    compute = {role: sum(v for k, v in phases.items() if k in COMPUTE) for role, phases in roles.items()}
    wall = sum(roles["trainer"].values())
    return {
        "generation_seconds": round(compute["inference"], 1),
        "training_compute_seconds": round(compute["trainer"], 1),
        "scoring_seconds": round(compute.get("verifiers", 0.0), 1),
        "framework_seconds": round(framework, 1),
        "framework_overhead_fraction": round(framework / max(2 * wall, 1e-9), 3),
        "bound_by": max(("inference", "trainer"), key=lambda r: compute[r]),
    }


def plot_profile(ax, roles: dict[str, dict[str, float]]) -> None:
    """One horizontal bar per role, its phases stacked in seconds."""
    import matplotlib

    names = list(roles)
    phases = list(dict.fromkeys(p for r in names for p in roles[r]))
    cmap = matplotlib.colormaps["tab20"]
    for i, phase in enumerate(phases):
        widths = [roles[r].get(phase, 0.0) for r in names]
        lefts = [sum(v for q, v in roles[r].items() if phases.index(q) < i) for r in names]
        hatch = "//" if phase in WAITING or phase in ("off_cpu", "idle") else None
        ax.barh(names, widths, left=lefts, color=cmap(i % 20), hatch=hatch, label=phase, edgecolor="white")
    ax.set(xlabel="seconds (orchestrator, verifiers: CPU)", title="where each role's time went")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))  # beside the bars, not over them


def plot(steps: list[dict], evals: list[dict], path: Path, title: str, changes: list[dict] = ()) -> None:
    """Reward and accuracy, staleness, throughput, the time profile; live changes (asyncrl ctl) as
    dotted lines at the step they took effect."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    roles = profile(steps[-1])
    fig, axes = plt.subplots(1, 4 if roles else 3, figsize=(22 if roles else 15, 4))
    t = [r["time"] for r in steps]
    ax = axes[0]
    rewards = [r["reward"] for r in steps]
    window = max(1, len(steps) // 20)
    smooth = [
        sum(rewards[max(0, i - window + 1) : i + 1]) / len(rewards[max(0, i - window + 1) : i + 1])
        for i in range(len(rewards))
    ]
    ax.plot(t, rewards, label="train reward (per step)", alpha=0.25)
    ax.plot(t, smooth, label=f"train reward ({window}-step mean)")
    heading = "reward vs time"
    if evals:
        evals = sorted(evals, key=lambda e: e["eval_version"])
        ax.plot([e["time"] for e in evals], [e["eval_accuracy"] for e in evals], "o-", lw=2.5, color="black",
                label="held-out greedy accuracy")
        heading = (
            f"held-out greedy accuracy {evals[0]['eval_accuracy']:.0%} → {evals[-1]['eval_accuracy']:.0%}"
        )
    low = min(0.0, min(rewards))  # on one scale from 0, so a rise is seen at a glance, not zoomed into
    ax.set(
        xlabel="wall time (s)",
        ylabel="reward / accuracy",
        title=heading,
        ylim=(low, max(1.0, max(rewards)) * 1.02),
    )
    ax.legend(loc="lower right")
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
    mark_changes(axes[:3], steps, changes)
    if roles:
        plot_profile(axes[3], roles)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def mark_changes(axes, steps: list[dict], changes: list[dict]) -> None:
    """A dotted line where each live change took effect: at its step's time on the time axes (the first
    and third), at its step on the staleness axis, labelled with what changed."""
    when = {r["step"]: r["time"] for r in steps}
    for change in changes:
        if change["step"] not in when:
            continue
        label = f"{change['key'].split('.')[-1]}={change['value']:g}"
        for ax, x in zip(axes, (when[change["step"]], change["step"], when[change["step"]])):
            ax.axvline(x, color="gray", ls=":", lw=1)
            ax.annotate(label, (x, 1), xycoords=("data", "axes fraction"), rotation=90, fontsize=7,
                        va="top", ha="right", color="dimgray")


def table(summary: dict) -> str:
    rows = "\n".join(f"| {k} | {v} |" for k, v in summary.items())
    return f"| metric | value |\n|---|---|\n{rows}\n"


def largest_first(phases: dict[str, float], least: float = float("-inf")) -> str:
    """A role's phases as `name seconds, ...`, largest first (those under `least` seconds left out)."""
    ordered = sorted(phases.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{k} {v:.1f}" for k, v in ordered if v >= least)


def profile_table(roles: dict[str, dict[str, float]]) -> str:
    rows = "\n".join(f"| {role} | {largest_first(phases)} |" for role, phases in roles.items())
    return f"| role | phases, largest first |\n|---|---|\n{rows}\n"


def write_report(run_dir: str | Path) -> dict:
    run_dir = Path(run_dir)
    steps, evals = read_metrics(run_dir)
    summary = summarize(steps, evals)
    if (RunDir(run_dir).config).exists():  # the threads each role ran with (planned or set)
        cfg = read_run_config(run_dir)
        summary["threads"] = (
            f"inference {cfg.role_threads('inference')} / trainer {cfg.role_threads('trainer')}"
            + (f" / teacher {cfg.role_threads('teacher')} x {cfg.teacher.started_here}"
               if cfg.teacher.started_here else "")
        )
    if steps:
        plot(steps, evals, RunDir(run_dir).report_png, f"asyncrl run {run_dir.name}", read_changes(run_dir))
    roles = profile(steps[-1]) if steps else {}
    (RunDir(run_dir).report_md).write_text(
        f"# Run {run_dir.name}\n\n![curves](report.png)\n\n{table(summary)}"
        + (f"\n## Where the time went (seconds)\n\n{profile_table(roles)}" if roles else "")
    )
    return summary
