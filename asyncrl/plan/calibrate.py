"""Rates from a measured run: `asyncrl plan --calibrate RUN_DIR`.

Everything comes from what the run recorded (metrics.jsonl, the ledger): the built-in engine's
cost lines (seconds per decode step against its rows, per prefill against its tokens, summed over
replicas: asyncrl/observe/fit.py), a version's load per replica, the trainer's busy seconds per
step against the step's tokens (a least-squares line over the steps after the first, whose
start-up it leaves out), the orchestrator's CPU per group, and the time from a version's marker to
admission hearing it is served (every replica loaded it, the step recorded), less the load. The
workload is the run's own groups (asyncrl/plan/workload.py).
"""
from __future__ import annotations

from pathlib import Path

from asyncrl.config import read_run_config
from asyncrl.observe.fit import LinearFit, solve
from asyncrl.observe.report import read_metrics
from asyncrl.plan.rates import Rates
from asyncrl.plan.workload import Workload


class CalibrationError(ValueError):
    pass


def calibrate(run_dir: str | Path) -> tuple[Rates, Workload, dict]:
    """(rates, workload, the layout it ran on) of a finished or stopped run."""
    run_dir = Path(run_dir)
    cfg = read_run_config(run_dir)
    steps, _ = read_metrics(run_dir)
    if len(steps) < 3:
        raise CalibrationError(f"{run_dir}: {len(steps)} step records; calibrating needs 3 or more")
    last = steps[-1]
    if "decode_fit" not in last or "serve_seconds" not in last:
        raise CalibrationError(
            f"{run_dir}: its metrics hold no engine cost lines (decode_fit) or serve_seconds: a run of the "
            "built-in engine made by this version of asyncrl is needed (vLLM replicas do not report them)")
    replicas, versions = last.get("replicas_routed", 1) or 1, last["version"]
    decode_base, decode_per_row = solve(last["decode_fit"])
    prefill_base, prefill_per_token = solve(last["prefill_fit"])
    load = last.get("time/inference/load_weights", 0.0) / (versions * replicas)
    step_base, step_per_token = _trainer_line(steps)
    groups = sum(r["samples"] for r in steps) / cfg.rollout.group_size
    rates = Rates(
        decode_base=decode_base, decode_per_row=decode_per_row,
        prefill_base=prefill_base, prefill_per_token=prefill_per_token,
        load_seconds=load,
        step_base=step_base, step_per_token=step_per_token * cfg.trainer.ranks,  # (one rank's)
        group_seconds=last.get("time/orchestrator/cpu", 0.0) / max(groups, 1),
        # (the last record holds the serving of the versions before it)
        handoff_seconds=max(last["serve_seconds"] / (versions - 1) - load, 0.0),
        source=str(run_dir),
    )
    layout = {"replicas": replicas, "ranks": cfg.trainer.ranks, "inference_threads": cfg.inference.threads,
              "trainer_threads": cfg.trainer.threads, "max_staleness": cfg.rollout.max_staleness,
              "update_policy": cfg.inference.update_policy}
    return rates, Workload.from_run(run_dir), layout


def _trainer_line(steps: list[dict]) -> tuple[float, float]:
    """Busy seconds per step against its tokens (the first step, with the trainer's start-up, left out)."""
    fit = LinearFit()
    for before, record in zip(steps[1:], steps[2:]):
        busy = record["trainer_busy_seconds"] - before["trainer_busy_seconds"]
        if busy > 0:
            fit.add(record.get("train_tokens", record.get("completion_tokens", 0)), busy)
    return solve(fit.sums)
