"""Joined workers that cheat, beside honest ones: what reaches a trained batch, and how soon each is shut out.

Each run is the default tiny policy's arithmetic RL (CPU) with one trusted replica, one honest joined
worker and, for a tamper kind, one dishonest worker (tests/dishonest.py: token, version, model, inflate,
replay, foreign). Per kind: the share of the dishonest worker's samples that reached a trained batch
(unmasked), how many versions after its first work it was quarantined, and why. Honest runs (two honest
workers, float32 and bfloat16 serving, ≥ 10,000 worker samples each) count false quarantines and give the
recompute's differences (the tolerance's margin) and its cost against the trainer's compute at the
fractions asked. Every process is on loopback.

    python benchmarks/verification.py [--only tamper|honest] [--steps N] [--fractions 0.05,0.1,0.25]

Writes benchmarks/results/verification.{json,md} and verification.png.
"""
from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl.control.ctl import request  # noqa: E402
from asyncrl.observe.events import read_events  # noqa: E402
from asyncrl.observe.report import read_metrics  # noqa: E402
from asyncrl.rundir import RunDir  # noqa: E402
from asyncrl.swarm import quarantine  # noqa: E402
from benchmarks.tables import OUT, write_rows  # noqa: E402

MODEL = os.environ.get("ASYNCRL_TEST_MODEL", str(ROOT / "models" / "tiny-default"))
KINDS = ("token", "version", "model", "inflate", "replay", "foreign")


def start_run(root: Path, steps: int, extra: dict) -> tuple[subprocess.Popen, Path]:
    args = {"run.root": str(root), "run.name": "job", "run.steps": steps, "model.path": MODEL,
            "rollout.prompts_per_step": 8, "rollout.group_size": 8, "rollout.max_staleness": 2,
            "task.eval_size": 0, "trainer.threads": 1, "inference.threads": 1, "workers.enabled": "true",
            **extra}
    cmd = [sys.executable, "-m", "asyncrl.cli", "train",
           *[x for k, v in args.items() for x in (f"--{k}", str(v))]]
    proc = subprocess.Popen(cmd, stdout=open(root / "train.log", "w"), stderr=subprocess.STDOUT, cwd=ROOT)
    run_dir = root / "job"
    end = time.monotonic() + 180
    while not (RunDir(run_dir).gateway.exists() and RunDir(run_dir).control.exists()):
        if time.monotonic() > end or proc.poll() is not None:
            raise RuntimeError(f"the run did not open its gateway: {root / 'train.log'}")
        time.sleep(0.2)
    return proc, run_dir


def start_worker(run_dir: Path, name: str, kind: str, root: Path) -> subprocess.Popen:
    token = request(run_dir, "POST", "/workers/add", {"name": name})["token"]
    url = json.loads(RunDir(run_dir).gateway.read_text())["url"]
    cmd = [sys.executable, str(ROOT / "tests" / "dishonest.py"), kind, "--join", url, "--token", token,
           "--dir", str(root / name), "--give-up-after", "10"]
    return subprocess.Popen(cmd, stdout=open(root / f"{name}.log", "w"), stderr=subprocess.STDOUT, cwd=ROOT)


def ready(run_dir: Path, names: list[str], deadline: float = 300) -> None:
    """Until every named worker polls holding the served version (the run paused meanwhile)."""
    end = time.monotonic() + deadline
    while True:
        served = request(run_dir, "GET", "/status")["served_version"]
        listed = {w["name"]: w for w in request(run_dir, "GET", "/workers")["workers"]}
        if all(listed.get(n, {}).get("routed") and listed[n]["version"] == served for n in names):
            return
        if time.monotonic() > end:
            raise RuntimeError(f"workers {names} not ready in {deadline}s: {listed}")
        time.sleep(0.5)


def joined(run_dir: Path, root: Path, kinds: dict[str, str]) -> list[subprocess.Popen]:
    """Workers started while the run is paused, and the run resumed once they all hold its version."""
    request(run_dir, "POST", "/pause")
    workers = [start_worker(run_dir, name, kind, root) for name, kind in kinds.items()]
    ready(run_dir, list(kinds))
    request(run_dir, "POST", "/resume")
    return workers


def finish(proc: subprocess.Popen, workers: list[subprocess.Popen], deadline: float) -> None:
    try:
        if proc.wait(deadline) != 0:
            raise RuntimeError("the run failed")
    finally:
        for w in workers:
            w.terminate()
        for w in workers:
            w.wait(30)


def trained(run_dir: Path, worker: str) -> dict:
    """`worker`'s samples in trained batches: unmasked and unverified, unmasked and verified, masked."""
    verified = set(quarantine.read(run_dir).get(worker, {}).get("verified", []))
    db = sqlite3.connect(f"file:{RunDir(run_dir).ledger}?mode=ro", uri=True)
    rows = db.execute("SELECT reason, json_extract(data, '$.info.check') FROM samples WHERE step IS NOT NULL "
                      "AND json_extract(data, '$.info.worker') = ?", (worker,)).fetchall()
    db.close()
    out = {"trained_unverified": 0, "trained_verified": 0, "masked": 0}
    for reason, check in rows:
        key = "masked" if reason == "quarantined_masked" else \
            "trained_verified" if check in verified else "trained_unverified"
        out[key] += 1
    return out


def summary(run_dir: Path) -> dict:
    events = read_events(run_dir)
    return {"summary": next(e for e in events if e["event"] == "workers_summary"),
            "too_stale": sum(e["event"] == "group_dropped" and e.get("reason") == "too_stale"
                             for e in events),
            "quarantined": {e["worker"]: e for e in events if e["event"] == "worker_quarantined"},
            "train_seconds": sum(r.get("train_seconds", 0) for r in read_metrics(run_dir)[0])}


def tamper(kind: str, steps: int) -> dict:
    root = Path(tempfile.mkdtemp(prefix=f"verify-{kind}-"))
    proc, run_dir = start_run(root, steps, {"workers.verify_fraction": 0.1})
    workers = joined(run_dir, root, {"honest": "honest", kind: kind})
    finish(proc, workers, 1200)
    s = summary(run_dir)
    w, q = s["summary"]["workers"].get(kind, {}), s["quarantined"].get(kind)
    counts = trained(run_dir, kind)
    row = {"kind": kind, "returned": w.get("samples", 0), **counts,
           "share_trained_unverified": round(counts["trained_unverified"] / max(w.get("samples", 0), 1), 3),
           "versions_to_quarantine": q["version"] - q["first_version"] if q else None,
           "checked": w.get("checked"), "refused": w.get("refused"),
           "honest_quarantined": "honest" in s["quarantined"],
           "why": (q["reason"][:90] if q else "not quarantined")}
    print(json.dumps(row), flush=True)
    return row


def honest(dtype: str, fraction: float, steps: int) -> dict:
    root = Path(tempfile.mkdtemp(prefix=f"verify-honest-{dtype}-"))
    proc, run_dir = start_run(root, steps, {"workers.verify_fraction": fraction, "inference.dtype": dtype})
    workers = joined(run_dir, root, {f"honest{i}": "honest" for i in range(2)})
    finish(proc, workers, 2400)
    s = summary(run_dir)
    ws = s["summary"]["workers"].values()
    returned, checked = sum(w["samples"] for w in ws), sum(w["checked"] for w in ws)
    row = {"dtype": dtype, "fraction": fraction, "worker_samples": returned, "recomputed": checked,
           "failed": sum(w["failed"] for w in ws), "false_quarantines": len(s["quarantined"]),
           "mean_diff_p99": max(w["mean_diff"].get("p99", 0) for w in ws),
           "mean_diff_max": max(w["mean_diff"].get("max", 0) for w in ws),
           "most_diff_max": max(w["most_diff"].get("max", 0) for w in ws),
           "tolerance": s["summary"]["tolerance"],
           "recompute_s": s["summary"]["recompute_seconds"], "trainer_s": round(s["train_seconds"], 2),
           "cost_share": round(s["summary"]["recompute_seconds"] / max(s["train_seconds"], 1e-9), 4),
           "groups_too_stale": s["too_stale"],
           "effective_fraction": round(checked / max(returned, 1), 4)}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", choices=("tamper", "honest"))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--honest-steps", type=int, default=280)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--fractions", default="0.05,0.1,0.25")
    args = parser.parse_args()
    path = OUT / "verification.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    if args.only != "honest":
        results["tamper"] = [tamper(k, args.steps) for k in args.kinds.split(",")]
        write_rows("verification_tamper", results["tamper"])
    if args.only != "tamper":
        runs = [("float32", 0.25), ("bfloat16", 0.25)]
        runs += [("float32", float(f)) for f in args.fractions.split(",") if float(f) != 0.25]
        results["honest"] = [honest(d, f, args.honest_steps) for d, f in runs]
        write_rows("verification_honest", results["honest"])
    path.write_text(json.dumps(results, indent=1))
    plot(results)


def plot(results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    rows = results.get("tamper", [])
    kinds = [r["kind"] for r in rows]
    bottom = [0.0] * len(rows)
    for key, colour in (("trained_unverified", "tab:red"), ("trained_verified", "tab:orange"),
                        ("masked", "tab:gray")):
        share = [r[key] / max(r["returned"], 1) for r in rows]
        left.bar(kinds, share, color=colour, label=key, bottom=bottom)
        bottom = [b + s for b, s in zip(bottom, share)]
    left.set_ylabel("share of the cheat's samples in a trained batch")
    left.set_title("dishonest workers (each beside an honest one)")
    left.legend()
    honest = results.get("honest", [])
    labels = [f"{r['dtype']}\n{r['fraction']}" for r in honest]
    right.bar(labels, [r["mean_diff_max"] for r in honest], color="tab:green", label="largest mean |Δ| seen")
    right.scatter(labels, [r["tolerance"] for r in honest], color="black", marker="_", s=400,
                  label="tolerance")
    right.set_yscale("log")
    right.set_title("honest workers: largest recompute difference")
    right.legend()
    fig.tight_layout()
    fig.savefig(OUT / "verification.png", dpi=100)


if __name__ == "__main__":
    main()
