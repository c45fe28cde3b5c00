"""`asyncrl train` and `--resume`: check the inputs, plan threads, prepare the run directory, run
the roles under the supervisor (asyncrl/run/supervisor.py) with a progress line, write the report.
"""
from __future__ import annotations

import json
import shutil
import signal
import threading
import time
from pathlib import Path

from asyncrl.config import (
    Config,
    ConfigError,
    config_changes,
    load_config,
    merge_config,
    parse_overrides,
    read_run_config,
    save_config,
)
from asyncrl.control.access import ensure_token
from asyncrl.observe.events import EventLog
from asyncrl.observe.progress import Progress
from asyncrl.plugins import check_directory
from asyncrl.run.lock import run_lock
from asyncrl.run.preflight import check_inputs
from asyncrl.run.processes import RunError
from asyncrl.run.resume_check import check_resumable
from asyncrl.run.supervisor import Supervisor
from asyncrl.run.threads import plan_threads
from asyncrl.rundir import RunDir
from asyncrl.store.checkpoint import check_storage

__all__ = ["RunError", "Stopped", "check_inputs", "prepare_run_dir", "resume", "train"]

def check_run_dir(cfg: Config) -> None:
    """Whether the run may use its directory: asked before any input check, warm start or planning."""
    run_dir = cfg.run_dir
    check_directory(run_dir, "the run directory (run.root / run.name)")
    if run_dir.exists():
        if not cfg.run.overwrite:
            raise ConfigError(
                f"run directory {run_dir} already exists; choose another --run.name or pass "
                "--run.overwrite true"
            )
        if any(run_dir.iterdir()) and not is_run_dir(run_dir):
            raise ConfigError(f"--run.overwrite: {run_dir} is not an asyncrl run directory (it has no run "
                              "config.json); refusing to delete it")
    if trainer_storage(cfg) is not None:
        check_storage(trainer_storage(cfg), cfg.run.overwrite)


def trainer_storage(cfg: Config) -> Path | None:
    """<run.storage>/<run.name> when the run sets run.storage (else its checkpoints are in the run dir)."""
    return Path(cfg.run.storage) / cfg.run.name if cfg.run.storage else None


def prepare_run_dir(cfg: Config) -> Path:
    run_dir = cfg.run_dir
    check_run_dir(cfg)
    for old in (run_dir, trainer_storage(cfg)):
        if old is not None and old.exists():
            shutil.rmtree(old)
    (RunDir(run_dir).logs).mkdir(parents=True)
    save_config(cfg, RunDir(run_dir).config)
    ensure_token(run_dir)
    return run_dir


def is_run_dir(path: Path) -> bool:
    """Whether `path` holds an asyncrl run (what --run.overwrite may delete): the config.json every run
    writes before anything else."""
    try:
        saved = json.loads((RunDir(path).config).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(saved, dict) and {"run", "rollout", "trainer"} <= saved.keys()


class Stopped(RunError):
    """The launcher was told to stop (SIGTERM or Ctrl-C); `asyncrl train --resume` continues the run."""


def _stop_on_sigterm(signum, frame):
    raise Stopped(f"stopped by signal {signum}")


def launch(cfg: Config, run_dir: Path, log=print, fresh: bool = False) -> None:
    """Run the roles to the end; `fresh`: a new run, not a resume."""
    hosts = None
    if cfg.run.launcher == "ray":  # the trainer and the replicas in Ray actors
        from asyncrl.cluster.ray_roles import RayHosts

        hosts = RayHosts(cfg, run_dir, log, fresh)
    supervisor = Supervisor(cfg, run_dir, log, hosts)
    progress = Progress(run_dir, cfg.run.steps)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _stop_on_sigterm)  # stop the roles on the way out
    try:
        supervisor.start_all()
        while not supervisor.finished():
            progress.poll()
            time.sleep(0.2)
    finally:
        progress.poll(final=True)  # (what happened last: the drops that tripped the breaker, say)
        progress.close()
        # a second Ctrl-C or SIGTERM while the roles stop would leave them half-stopped: it waits
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            supervisor.stop()
        finally:
            RunDir(run_dir).control.unlink(missing_ok=True)  # (an orchestrator killed in the stop leaves it)
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def check_placement(cfg: Config) -> None:
    """Where the roles will run can take them: under run.launcher = "ray", Ray and its cluster."""
    if cfg.run.launcher == "ray":
        from asyncrl.cluster.ray_roles import check_cluster

        check_cluster(cfg)


def train(cfg: Config, log=print) -> Path:
    """Run a whole training job; returns the run directory (with its report)."""
    with run_lock(cfg.run_dir):
        return _train(cfg, log)


def _train(cfg: Config, log) -> Path:
    check_run_dir(cfg)
    cfg = check_inputs(cfg, log)
    check_placement(cfg)
    cfg, plan = plan_threads(cfg, log)
    run_dir = prepare_run_dir(cfg)
    if plan is not None:
        (RunDir(run_dir).thread_plan).write_text(json.dumps(plan, indent=1))
        log(f"threads: inference {plan['inference']}, trainer {plan['trainer']} (predicted seconds per step: "
            f"{plan['predicted_step_seconds']})")
        if cfg.rollout.max_staleness > 0 and not plan["overlap_pays"]:
            log(
                "threads: on this machine the roles alternating (max_staleness 0, each phase on its fastest "
                "thread count) is predicted to be faster than overlapping them; asynchrony pays here only "
                "through stragglers"
            )
    log(
        f"run {run_dir}: {cfg.run.steps} steps x {cfg.rollout.prompts_per_step} prompts x "
        f"{cfg.rollout.group_size} samples, "
        f"max_staleness {cfg.rollout.max_staleness}, objective {cfg.objective.name}, "
        f"threads: inference {cfg.role_threads('inference')}, trainer {cfg.role_threads('trainer')}"
    )
    return _run(cfg, run_dir, log, fresh=True)


def resume(run_dir: str | Path, overrides: list[str] | None = None, force: bool = False, log=print) -> Path:
    """Continue a stopped run in its own directory: the trainer from its newest valid checkpoint,
    the orchestrator from the ledger. A config change that would alter what the run computes is
    refused unless `force`; the difference is shown either way."""
    run_dir = Path(run_dir)
    if not (RunDir(run_dir).config).exists():
        raise ConfigError(f"{run_dir} is not a run directory (no config.json); nothing to resume")
    with run_lock(run_dir):
        return _resume(run_dir, overrides, force, log)


def _resume(run_dir: Path, overrides: list[str] | None, force: bool, log) -> Path:
    old = read_run_config(run_dir)
    tree = merge_config(old.model_dump(mode="json"), parse_overrides(list(overrides or [])))
    tree["run"].update(root=str(run_dir.parent), name=run_dir.name)  # the directory may have moved
    new = load_config(overrides=tree)
    meaning, harmless = config_changes(old, new)
    if meaning and not force:
        raise ConfigError(f"resuming {run_dir} with these changes would change what the run computes:\n  "
                          + "\n  ".join(meaning) + "\npass --force to resume anyway")
    for line in meaning + harmless:
        log(f"resume: {line}")
    new = check_inputs(new, log)
    check_placement(new)
    check_resumable(run_dir, log)
    save_config(new, RunDir(run_dir).config)
    ensure_token(run_dir)  # (a run from before tokens)
    EventLog(run_dir, "launcher").write("run_resumed", changes=meaning + harmless, forced=bool(meaning))
    log(f"resuming {run_dir}: {new.run.steps} steps")
    return _run(new, run_dir, log)


def _run(cfg: Config, run_dir: Path, log, fresh: bool = False) -> Path:
    from asyncrl.observe.report import write_report
    from asyncrl.store.ledger import audit

    start = time.monotonic()
    launch(cfg, run_dir, log, fresh)
    summary = write_report(run_dir)
    summary["wall_seconds"] = round(time.monotonic() - start, 1)
    summary["ledger"] = audit(run_dir, cfg.rollout.max_staleness, cfg.teacher.enabled)
    (RunDir(run_dir).summary).write_text(json.dumps(summary, indent=2))
    log((RunDir(run_dir).report_md).read_text())
    if summary["ledger"]["problems"]:
        raise RunError("the ledger audit found problems: " + "; ".join(summary["ledger"]["problems"]))
    return run_dir
