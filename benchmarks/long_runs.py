"""What a run's length costs: every per-step and per-run cost of the run directory at 1k, 10k and 100k steps
(docs/performance.md, "Long runs").

A short real default run gives the shapes: its last step's metrics record, one of its samples (the
ledger's payload), its events. From them a run directory of N steps is filled the way a run fills it
(each prompt, sample, batch and step as the ledger writes them; metrics.jsonl; events.jsonl at the real
run's events per step), and then, at each length:

    per step   the ledger's writes of one more step (dispatch, finish 32 groups, batch, metrics, commit),
               the dashboard's poll of events.jsonl
    per run    resume (the ledger reads the orchestrator rebuilds its state from, metrics.jsonl rewritten),
               the end-of-run audit, the report (metrics.jsonl read, summary, plots), the first
               dashboard read of events.jsonl
    disk       the ledger's bytes per step

Batch files, checkpoints and weights are not synthesised: their bytes per step come from the real run.
At 100k steps the samples carry no payload (the database side alone: 12.8M rows; with payloads the
ledger would hold ~110 KB a step, 11 GB). Writes benchmarks/results/long_runs.{json,md}.

    python benchmarks/long_runs.py [--lengths 1000 10000 100000]
"""
from __future__ import annotations

import argparse
import json
import shutil
import sqlite3
import statistics
import sys
import time
from pathlib import Path

from asyncrl.config import load_config
from asyncrl.observe.dashboard import RestartCount
from asyncrl.observe.report import write_report
from asyncrl.run.launcher import train
from asyncrl.rundir import RunDir
from asyncrl.store.ledger import Ledger, audit, batch_digest
from asyncrl.trajectory import Trajectory

OUT = Path(__file__).parent / "results"
WORK = OUT / "runs" / "long_runs"
SHAPE_STEPS = 40
PAYLOAD_UP_TO = 10_000  # longer fills store samples without their payload (the database side alone)


def shapes() -> dict:
    """A real default run's per-step metrics record, one sample, events per step, and disk per step."""
    cfg = load_config(overrides=["--run.name", "shapes", "--run.root", str(WORK), "--run.overwrite", "true",
                                 "--run.steps", str(SHAPE_STEPS), "--task.eval_every", "20",
                                 "--trainer.checkpoint_every", "20"])
    run_dir = train(cfg, log=lambda *a, **k: None)
    records = [json.loads(line) for line in RunDir(run_dir).metrics.read_text().splitlines()]
    db = sqlite3.connect(RunDir(run_dir).ledger)
    sample = Trajectory.from_json(db.execute("SELECT data FROM samples WHERE data IS NOT NULL").fetchone()[0])
    events = RunDir(run_dir).events.read_text().splitlines()
    size = lambda sub: sum(f.stat().st_size for f in (run_dir / sub).rglob("*") if f.is_file())  # noqa: E731
    return {"step": [r for r in records if "eval_accuracy" not in r][-1],
            "eval": [r for r in records if "eval_accuracy" in r][-1], "sample": sample,
            "events_per_step": len(events) / cfg.run.steps, "event": events[-1],
            "prompts": cfg.rollout.prompts_per_step, "group": cfg.rollout.group_size,
            "bytes_per_step": {sub: size(sub) / cfg.run.steps
                               for sub in ("batches", "checkpoints", "weights")}}


def group(shape: dict, prompt_id: int, version: int) -> list[Trajectory]:
    base = shape["sample"]
    return [Trajectory(**{**base.__dict__, "id": f"{prompt_id}-{k}", "group_id": str(prompt_id),
                          "prompt_id": prompt_id,
                          "versions": [version if v >= 0 else -1 for v in base.versions]})
            for k in range(shape["group"])]


def fill(run_dir: Path, steps: int, shape: dict) -> None:
    """A run directory after `steps` steps, every batch committed, as the ledger's own statements leave it
    (bulk, one transaction per 1000 steps)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    Ledger(run_dir).close()  # (the schema)
    db = sqlite3.connect(RunDir(run_dir).ledger, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    P, G = shape["prompts"], shape["group"]
    payload = shape["sample"].to_json() if steps <= PAYLOAD_UP_TO else None  # (one real sample's bytes)
    per_step = shape["events_per_step"]
    with open(RunDir(run_dir).metrics, "w") as metrics, open(RunDir(run_dir).events, "w") as events:
        for chunk in range(0, steps, 1000):
            db.execute("BEGIN")
            for step in range(chunk, min(chunk + 1000, steps)):
                pids = range(step * P, (step + 1) * P)
                db.executemany("INSERT INTO prompts VALUES (?, 'finished', 1, NULL)", ((p,) for p in pids))
                rows = [(f"{p}-{k}", p, step, n, step, payload)
                        for n, (p, k) in enumerate((p, k) for p in pids for k in range(G))]
                db.executemany("INSERT INTO samples VALUES (?, ?, 'committed', ?, ?, ?, 1.0, NULL, ?)", rows)
                line = json.dumps({**shape["step"], "version": step + 1})
                db.execute("INSERT INTO steps VALUES (?, 'committed', ?, '{}', ?)",
                           (step, batch_digest([r[0] for r in rows]), line))
                metrics.write(line + "\n")
                events.write((shape["event"] + "\n") * (int((step + 1) * per_step) - int(step * per_step)))
            db.execute("COMMIT")
    db.close()


def timed(fn, repeat: int = 1) -> float:
    seconds = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def one_step(led: Ledger, shape: dict, step: int) -> None:
    """The ledger's writes of one step, as the orchestrator makes them."""
    P = shape["prompts"]
    first = led.next_prompt_id()
    led.dispatch(list(range(first, first + P)))
    for p in range(first, first + P):
        led.finish(p, group(shape, p, step), [])
    ready = [t for g in led.ready_groups() for t in g]
    led.batch(step, ready, {})
    led.record_step(step + 1, {**shape["step"], "version": step + 1})
    led.commit_through(step + 1)


def resume(led: Ledger, run_dir: Path) -> None:
    """The ledger reads the orchestrator's _restore makes, and metrics.jsonl rewritten whole."""
    led.next_prompt_id(), led.in_flight(), led.ready_groups(), led.live_groups(), led.scheduled_changes()
    for step in range(led.get("pruned_through", 0), led.step_count()):
        RunDir(run_dir).batch(step).exists()
    RunDir(run_dir).metrics.write_text("".join(line + "\n" for line in led.metrics_lines()))


def measure(steps: int, shape: dict) -> dict:
    run_dir = WORK / f"steps_{steps}"
    start = time.perf_counter()
    fill(run_dir, steps, shape)
    print(f"  filled {steps} steps in {time.perf_counter() - start:.0f} s", flush=True)
    led = Ledger(run_dir)
    per_step = [timed(lambda s=s: one_step(led, shape, s)) for s in range(steps, steps + 20)]
    out = {"steps": steps, "payload": steps <= PAYLOAD_UP_TO,
           "step_ledger_ms": 1000 * statistics.median(per_step),
           "resume_s": timed(lambda: resume(led, run_dir)),
           "audit_s": timed(lambda: audit(run_dir, 1)),
           "report_s": timed(lambda: write_report(run_dir))}
    restarts = RestartCount(RunDir(run_dir).events)
    out["events_first_read_s"] = timed(restarts.counts)
    with open(RunDir(run_dir).events, "a") as f:
        f.write(shape["event"] + "\n")
    out["events_poll_ms"] = 1000 * timed(restarts.counts)
    led.close()
    db = RunDir(run_dir).ledger
    out["ledger_bytes_per_step"] = db.stat().st_size / steps  # (closed: its WAL is checkpointed into it)
    shutil.rmtree(run_dir)
    return out


def table(rows: list[dict], shape: dict) -> str:
    lines = ["| steps | ledger writes per step (ms) | dashboard poll of events (ms) | resume (s) | audit (s) "
             "| report (s) | first read of events (s) | ledger KB per step |", "|---" * 8 + "|"]
    for r in rows:
        kb = f"{r['ledger_bytes_per_step'] / 1024:.1f}" + ("" if r["payload"] else " (no payloads)")
        lines.append(f"| {r['steps']:,} | {r['step_ledger_ms']:.1f} | {r['events_poll_ms']:.2f} | "
                     f"{r['resume_s']:.2f} | {r['audit_s']:.2f} | {r['report_s']:.2f} | "
                     f"{r['events_first_read_s']:.2f} | {kb} |")
    per, mib, n = shape["bytes_per_step"], 2**20, SHAPE_STEPS
    lines += ["", f"Not synthesised, from the real {n}-step run: batch files {per['batches'] / 1024:.1f} KB "
              f"a step (kept: they grow with the run); checkpoints {per['checkpoints'] * n / mib:.1f} MiB "
              f"and weights {per['weights'] * n / mib:.1f} MiB in all (the last few kept: bounded)."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    args = parser.parse_args()
    print(f"=== a real {SHAPE_STEPS}-step default run, for the shapes ===", flush=True)
    shape = shapes()
    rows = []
    for steps in args.lengths:
        print(f"=== {steps} steps ===", flush=True)
        rows.append(measure(steps, shape))
        print(json.dumps(rows[-1]), flush=True)
    text = table(rows, shape)
    print("\n" + text)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "long_runs.json").write_text(json.dumps({"rows": rows, "bytes_per_step": shape["bytes_per_step"]},
                                                   indent=2))
    (OUT / "long_runs.md").write_text(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
