"""`asyncrl plan`: what a layout will do before it is rented (docs/planner.md).

    asyncrl plan --calibrate RUN_DIR [--out RATES.json]
        fit the rates of a finished run (asyncrl/plan/calibrate.py) and replay it: predicted against
        measured samples/s and staleness
    asyncrl plan [CONFIG.toml] --rates RATES.json [--workload WORKLOAD.json | --workload-run RUN_DIR]
                 [--replicas N] [--ranks N] [--etas 0,1,4,16] [--devices N] [--section.key value ...]
        predict the config's run at each η; with --devices N, at every split of N devices between
        inference replicas and trainer ranks, and recommend one
"""
from __future__ import annotations

import json
import sys

from asyncrl.config import ConfigError, load_config
from asyncrl.plan.calibrate import CalibrationError, calibrate
from asyncrl.plan.rates import Rates
from asyncrl.plan.simulate import simulate
from asyncrl.plan.workload import Workload

NEAR_BEST = 0.95  # the recommendation: the least staleness within this share of the best samples/s


def main(args: list[str], take) -> int:
    run_dir = take(args, "--calibrate", True)
    if run_dir is not None:
        return _calibrate(run_dir, take(args, "--out", True))
    rates_path = take(args, "--rates", True)
    if rates_path is None:
        raise ConfigError("asyncrl plan needs --rates RATES.json (from asyncrl plan --calibrate RUN_DIR) or "
                          "--calibrate RUN_DIR")
    workload_path, workload_run = take(args, "--workload", True), take(args, "--workload-run", True)
    replicas, ranks, devices = (_count(take(args, flag, True), flag) for flag in ("--replicas", "--ranks",
                                                                                   "--devices"))
    etas = _etas(take(args, "--etas", True) or "0,1,2,4,8,16")
    config_path = args.pop(0) if args and not args[0].startswith("--") else None
    cfg = load_config(config_path, args)
    try:
        rates = Rates.read(rates_path)
        workload = (Workload.read(workload_path) if workload_path else
                    calibrate(workload_run)[1] if workload_run else Workload())
    except (ValueError, CalibrationError) as e:
        raise ConfigError(str(e)) from None
    layouts = ([(r, devices - r) for r in range(1, devices)] if devices else
               [(replicas or cfg.inference.replicas, ranks or cfg.trainer.ranks)])
    if devices is not None and devices < 2:
        raise ConfigError("--devices needs at least 2: one for inference, one for the trainer")
    rows, total = [], len(layouts) * len(etas)
    for r, k in layouts:
        for eta in etas:
            at = cfg.model_copy(deep=True)
            at.rollout.max_staleness = eta
            print(f"simulating {len(rows) + 1}/{total}: {r} replica(s), {k} rank(s), η = {eta}",
                  file=sys.stderr)
            try:
                rows.append({"replicas": r, "ranks": k, "eta": eta, **simulate(at, rates, workload, r, k)})
            except ValueError as e:
                raise ConfigError(str(e)) from None
    print(table(rows, cfg.run.steps))
    print(recommend(rows))
    return 0


def _calibrate(run_dir: str, out: str | None) -> int:
    from asyncrl.observe.report import read_metrics, summarize

    try:
        rates, workload, layout = calibrate(run_dir)
    except (CalibrationError, FileNotFoundError) as e:
        raise ConfigError(str(e)) from None
    from asyncrl.config import read_run_config

    cfg = read_run_config(run_dir)
    predicted = simulate(cfg, rates, workload, layout["replicas"], layout["ranks"])
    measured = summarize(*read_metrics(run_dir))
    rounded = {k: round(v, 6) if isinstance(v, float) else v for k, v in vars(rates).items()}
    print(json.dumps(rounded, indent=1))
    print(f"layout: {layout}")
    for key in ("samples_per_s", "staleness_mean", "trainer_busy_fraction", "inference_busy_fraction"):
        print(f"{key:>24}: measured {measured[key]:>9.3f}   replayed {predicted[key]:>9.3f}")
    if out:
        rates.write(out)
        print(f"wrote {out}")
    return 0


def _count(value: str | None, flag: str) -> int | None:
    if value is None:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"{flag} must be a whole number ≥ 1, got {value!r}")
    return int(value)


def _etas(value: str) -> list[int]:
    try:
        etas = [int(v) for v in value.split(",")]
    except ValueError:
        raise ConfigError(f"--etas must be whole numbers separated by commas, got {value!r}") from None
    if any(e < 0 for e in etas):
        raise ConfigError(f"--etas must be ≥ 0, got {value!r}")
    return etas


def table(rows: list[dict], steps: int) -> str:
    lines = [f"| replicas | ranks | η | samples/s | staleness mean | dropped groups | inference busy | "
             f"trainer busy | time to {steps} steps |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['replicas']} | {r['ranks']} | {r['eta']} | {r['samples_per_s']:.1f} | "
                     f"{r['staleness_mean']:.2f} | {r['dropped_stale_groups']} | "
                     f"{r['inference_busy_fraction']:.2f} | {r['trainer_busy_fraction']:.2f} | "
                     f"{_duration(r['seconds'])} |")
    return "\n".join(lines)


def recommend(rows: list[dict]) -> str:
    best = max(rows, key=lambda r: r["samples_per_s"])
    pick = min((r for r in rows if r["samples_per_s"] >= NEAR_BEST * best["samples_per_s"]),
               key=lambda r: (r["eta"], -r["samples_per_s"]))
    return (f"\nrecommended: {pick['replicas']} inference replica(s), {pick['ranks']} trainer rank(s), "
            f"max_staleness {pick['eta']}: {pick['samples_per_s']:.1f} samples/s, staleness mean "
            f"{pick['staleness_mean']:.2f}, inference busy {pick['inference_busy_fraction']:.0%}, "
            f"trainer busy {pick['trainer_busy_fraction']:.0%} (the least η within {NEAR_BEST:.0%} of the "
            f"best, "
            f"{best['samples_per_s']:.1f} samples/s at η = {best['eta']})")


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 3600 else f"{seconds / 3600:.1f} h"
