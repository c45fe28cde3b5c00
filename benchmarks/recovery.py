"""Recovery: how long the run stalls when a role is SIGKILLed, and what a checkpoint costs training.

For each model (the tiny default, ~1M params, and a ~20M-param Llama of the same tokenizer):

1. Checkpoint stall, in process: the seconds `CheckpointWriter.save` blocks training (the copy to
   host memory) next to the seconds a synchronous checkpoint would (the whole write, fsync and
   rename), median of 5, with the model's Adam state in place.
2. Mean time to recovery per role: asynchronous runs (max_staleness 1) in which each role is
   SIGKILLed twice at random moments (asyncrl/run/chaos.py), once with cold restarts (a new Python
   process each: run.fork_roles = false) and once warm (every role forked by the run's starter, which
   imported everything once: asyncrl/run/starter.py). For every kill: when the supervisor noticed,
   when the role was back (trainer: in its training loop again; inference: serving the run's version
   again; orchestrator: state rebuilt from the ledger), and how much longer than a normal step the run
   went without a new version.

Prints a table, writes benchmarks/results/recovery.{json,png}.

    python benchmarks/recovery.py [--steps N] [--models tiny 20M]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from asyncrl.observe.events import read_events
from asyncrl.observe.report import read_metrics
from asyncrl.policy.model import build_char_tokenizer, build_tiny_model, load_policy
from asyncrl.run.chaos import Chaos
from asyncrl.store import checkpoint
from asyncrl.store.ledger import Ledger, audit

OUT = Path(__file__).parent / "results"
ROLES = ("trainer", "inference-0", "orchestrator")
READY_EVENT = {
    "trainer": "trainer_ready",
    "inference-0": "inference_recovered",
    "orchestrator": "orchestrator_resumed",
}


def model_20m(directory: Path) -> str:
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, hidden_size=448, layers=6, heads=7, seed=0)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return str(directory)


def checkpoint_stall(path: str, repeats: int = 5) -> dict:
    torch.set_num_threads(1)
    model, tok = load_policy(path)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    ids = torch.randint(3, 20, (8, 16))
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    stalls, writes = [], []
    with tempfile.TemporaryDirectory() as tmp:
        writer = checkpoint.CheckpointWriter(tmp, tok, keep=2, deadline=600)
        for step in range(1, repeats + 1):
            start = time.monotonic()
            stalls.append(writer.save(step, *checkpoint.parts(model, optimizer, scheduler)))
            writer.wait()
            writes.append(time.monotonic() - start)
    params = sum(p.numel() for p in model.parameters())
    stall, write = statistics.median(stalls), statistics.median(writes)
    return {"params": params, "stall_s": round(stall, 4), "sync_write_s": round(write, 4),
            "stall_fraction_of_sync": round(stall / write, 3)}


def chaos_run(name: str, model_path: str, steps: int, root: Path, warm: bool) -> dict:
    plan = [(role, 2 + i) for i, role in enumerate(ROLES * 2)]  # spaced in time by Chaos.min_gap
    cmd = [
        sys.executable,
        "-m",
        "asyncrl.cli",
        "train",
        "--run.root",
        str(root),
        "--run.name",
        name,
        "--run.overwrite",
        "true",
        "--model.path",
        model_path,
        "--run.steps",
        str(steps),
        "--rollout.prompts_per_step",
        "8",
        "--rollout.group_size",
        "4",
        "--trainer.checkpoint_every",
        "5",
        "--task.eval_size",
        "0",
        "--run.max_restarts",
        "3",
        "--run.fork_roles",
        "true" if warm else "false",
    ]
    run_dir = root / name
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(2)
    chaos = Chaos(run_dir, plan, seed=0, min_gap=15.0)  # each recovery measured on its own
    chaos.start()
    _, err = proc.communicate(timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: the run failed:\n{err[-3000:]}")
    return measure(run_dir, chaos.kills)


def measure(run_dir: Path, kills: list[dict]) -> dict:
    events = read_events(run_dir)
    started_at = Ledger(run_dir).get("started_at")
    steps, _ = read_metrics(run_dir)
    step_walls = sorted(started_at + s["time"] for s in steps)
    gaps = [b - a for a, b in zip(step_walls, step_walls[1:])]
    median_step = statistics.median(gaps)
    rows = []
    for kill in kills:
        t = kill["time"]
        def after(name: str, **match) -> float | None:  # seconds from the kill to the first such event
            return next((e["wall_time"] - t for e in events if e["event"] == name and e["wall_time"] > t
                         and all(e.get(k) == v for k, v in match.items())), None)

        next_step = next((w - t for w in step_walls if w > t), None)
        rows.append({
            "role": kill["role"], "step": kill["step"],
            "detected_s": after("role_restarted", target=kill["role"]),
            "role_ready_s": after(READY_EVENT[kill["role"]]),
            "next_version_s": next_step,
            "stall_s": None if next_step is None else max(0.0, next_step - median_step),
        })
    max_staleness = json.loads((run_dir / "config.json").read_text())["rollout"]["max_staleness"]
    trainer_markers = [json.loads(p.read_text()) for p in sorted((run_dir / "weights").glob("v*.json"))]
    ckpt = [m["checkpoint_stall_seconds"] for m in trainer_markers if "checkpoint_stall_seconds" in m]
    return {"median_step_s": round(median_step, 3), "kills": rows,
            "in_run_checkpoint_stall_s": round(statistics.mean(ckpt), 4) if ckpt else None,
            "mean_train_step_s": round(statistics.mean(m["train_seconds"] for m in trainer_markers), 4),
            "ledger": audit(run_dir, max_staleness)}


def per_role(rows: list[dict], key: str) -> dict:
    out = {}
    for role in ROLES:
        values = [r[key] for r in rows if r["role"] == role and r[key] is not None]
        out[role] = round(statistics.mean(values), 2) if values else None
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    cells = [(name, start) for name in results for start in ("cold", "warm")]
    width = 0.8 / len(cells)
    for i, (name, start) in enumerate(cells):
        r = results[name][start]
        xs = [j + i * width for j in range(len(ROLES))]
        a.bar(xs, [r["mttr_s"][role] or 0 for role in ROLES], width, label=f"{name}, {start} restart")
        a.scatter(xs, [r["role_ready_s"][role] or 0 for role in ROLES], color="k", zorder=3, s=12)
    a.set_xticks([j + width * (len(cells) - 1) / 2 for j in range(len(ROLES))], ROLES)
    a.set(ylabel="seconds after SIGKILL", title="run stalled per killed role (dots: role back)")
    a.legend(fontsize=8)
    names = list(results)
    b.bar(
        [n + "\nsync" for n in names],
        [results[n]["checkpoint"]["sync_write_s"] for n in names],
        color="tab:red",
    )
    b.bar(
        [n + "\nbackground" for n in names],
        [results[n]["checkpoint"]["stall_s"] for n in names],
        color="tab:green",
    )
    b.set(ylabel="seconds training waits per checkpoint", title="checkpoint stall")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def summarize(run: dict) -> dict:
    return {
        **run,
        "mttr_s": per_role(run["kills"], "stall_s"),
        "detected_s": per_role(run["kills"], "detected_s"),
        "role_ready_s": per_role(run["kills"], "role_ready_s"),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=None,
                        help="steps per run (default: enough for six kills 15 s apart: tiny 700, 20M 110)")
    parser.add_argument("--models", nargs="+", default=["tiny", "20M"], choices=["tiny", "20M"])
    parser.add_argument("--tiny-model", default="models/tiny-default")
    args = parser.parse_args()
    root = OUT / "runs"
    paths = {"tiny": args.tiny_model}
    if "20M" in args.models:
        paths["20M"] = model_20m(root / "model-20m")
    results = {}
    for name in args.models:
        print(f"=== {name}: checkpoint stall", flush=True)
        results[name] = {"checkpoint": checkpoint_stall(paths[name])}
        for start in ("cold", "warm"):
            steps = args.steps or {"tiny": 700, "20M": 110}[name]
            print(f"=== {name}: {steps} steps, each role killed twice, {start} restarts", flush=True)
            run = chaos_run(f"recovery-{name}-{start}", paths[name], steps, root, warm=start == "warm")
            results[name][start] = summarize(run)
    print(
        "\n| model | role killed | noticed after (s) | role back, cold / warm (s) "
        "| run stalled, cold / warm (s) "
        "| speed-up | normal step (s) |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        cold, warm = r["cold"], r["warm"]
        for role in ROLES:
            ratio = (cold["mttr_s"][role] / warm["mttr_s"][role]) if warm["mttr_s"][role] else float("nan")
            print(
                f"| {name} ({r['checkpoint']['params'] / 1e6:.1f}M) | {role} | {cold['detected_s'][role]} | "
                f"{cold['role_ready_s'][role]} / {warm['role_ready_s'][role]} | "
                f"{cold['mttr_s'][role]} / {warm['mttr_s'][role]} | {ratio:.1f}x | {cold['median_step_s']} |"
            )
    print(
        "\n| model | checkpoint stall, background (s) | synchronous write (s) | ratio | in-run stall (s) "
        "| train step (s) |"
    )
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        c = r["checkpoint"]
        print(f"| {name} | {c['stall_s']} | {c['sync_write_s']} | {c['stall_fraction_of_sync']} | "
              f"{r['warm']['in_run_checkpoint_stall_s']} | {r['warm']['mean_train_step_s']} |")
    for name, r in results.items():
        for start in ("cold", "warm"):
            ledger = r[start]["ledger"]
            print(
                f"{name} {start}: ledger problems {ledger['problems']}, samples {ledger['samples_by_state']}"
            )
    OUT.mkdir(exist_ok=True)
    (OUT / "recovery.json").write_text(json.dumps(results, indent=2))
    plot(results, OUT / "recovery.png")
    print(f"wrote {OUT / 'recovery.json'} and {OUT / 'recovery.png'}")


if __name__ == "__main__":
    main()
