"""The local launcher: start the three roles as processes, watch them, show progress, report.

Each role is `python -m <module> RUN_DIR` with its own thread count and log file. If a role
dies, the others are stopped and the dead role's last log lines are shown; the run directory
keeps everything written so far.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from asyncrl.config import Config, ConfigError, save_config

ROLES = {
    "inference": "asyncrl.inference.server",
    "trainer": "asyncrl.trainer.main",
    "orchestrator": "asyncrl.orchestrator.main",
}
DEFAULT_MODEL = "models/tiny-chain-sum"


class RunError(RuntimeError):
    pass


def prepare_run_dir(cfg: Config) -> Path:
    run_dir = cfg.run_dir
    if run_dir.exists():
        if not cfg.run.overwrite:
            raise ConfigError(
                f"run directory {run_dir} already exists; choose another --run.name or pass --run.overwrite true"
            )
        shutil.rmtree(run_dir)
    (run_dir / "logs").mkdir(parents=True)
    save_config(cfg, run_dir / "config.json")
    return run_dir


def check_inputs(cfg: Config, log=print) -> None:
    """Fail before any process starts: model, task and objective must all resolve."""
    from asyncrl.objectives import get_objective
    from asyncrl.rewards.tasks import TaskSource

    if not Path(cfg.model.path).exists():
        if cfg.model.path == DEFAULT_MODEL and cfg.model.warmstart_if_missing:
            from asyncrl.warmstart import warmstart

            log(f"{DEFAULT_MODEL} is missing: building the tiny default policy first")
            warmstart(cfg, DEFAULT_MODEL, log=log)
        else:
            _check_hub_model(cfg.model.path)
    TaskSource(cfg.task)
    try:
        get_objective(cfg.objective.name, cfg.objective.import_path)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"objective.import_path = {cfg.objective.import_path!r} cannot be imported: {e}") from None


def _check_hub_model(name: str) -> None:
    """A model.path that is not a local directory must at least resolve on the hub (or its cache)."""
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(name)
    except Exception as e:
        raise ConfigError(
            f"model.path = {name!r} is not a local directory and cannot be loaded as a hub model "
            f"({type(e).__name__}); run `asyncrl warmstart` for the tiny default or fix the path"
        ) from None


def start_role(role: str, run_dir: Path, threads: int) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    log = open(run_dir / "logs" / f"{role}.log", "w")
    return subprocess.Popen([sys.executable, "-m", ROLES[role], str(run_dir)], stdout=log,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)


def start_vllm(cfg: Config, run_dir: Path, threads: int) -> subprocess.Popen:
    """vLLM's OpenAI server on loopback; its URL goes to inference.json at once (the
    orchestrator waits for /health within timeouts.startup)."""
    import socket

    port = cfg.inference.port
    if port == 0:
        with socket.socket() as s:
            s.bind((cfg.inference.host, 0))
            port = s.getsockname()[1]
    cmd = [cfg.inference.vllm_python or sys.executable, "-m", "vllm.entrypoints.openai.api_server",
           "--model", cfg.model.path, "--host", cfg.inference.host, "--port", str(port),
           "--dtype", cfg.inference.dtype, "--logprobs-mode", "processed_logprobs",
           "--seed", str(cfg.run.seed), *cfg.inference.vllm_args]
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
               OMP_NUM_THREADS=str(threads))
    log = open(run_dir / "logs" / "inference.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    (run_dir / "inference.json").write_text(json.dumps({"url": f"http://{cfg.inference.host}:{port}", "engine": "vllm"}))
    return proc


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text().splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def stop(procs: dict[str, subprocess.Popen], grace: float = 5.0) -> None:
    for p in procs.values():
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs.values():
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _dead_role_error(role: str, proc: subprocess.Popen, run_dir: Path) -> RunError:
    log = run_dir / "logs" / f"{role}.log"
    return RunError(f"the {role} process exited with code {proc.returncode}; last lines of {log}:\n{tail(log)}")


def wait_for_inference(proc: subprocess.Popen, run_dir: Path, deadline: float) -> None:
    start = time.monotonic()
    while not (run_dir / "inference.json").exists():
        if proc.poll() is not None:
            raise _dead_role_error("inference", proc, run_dir)
        if time.monotonic() - start > deadline:
            raise RunError(f"the inference server did not start within {deadline:.0f}s (timeouts.startup); "
                           f"see {run_dir / 'logs' / 'inference.log'}")
        time.sleep(0.05)


class Progress:
    """Reads new lines of metrics.jsonl and keeps one live line on the console."""

    def __init__(self, run_dir: Path, steps: int, out=sys.stdout):
        self.path, self.steps, self.out = run_dir / "metrics.jsonl", steps, out
        self.offset, self.step, self.eval = 0, None, None
        self.tty = out.isatty()

    def poll(self) -> None:
        if not self.path.exists():
            return
        with open(self.path) as f:
            f.seek(self.offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind("\n") + 1]
        self.offset += len(complete)
        changed = False
        for line in complete.splitlines():
            record = json.loads(line)
            if "eval_accuracy" in record:
                self.eval = record
            else:
                self.step = record
            changed = True
        # On a terminal the line is rewritten in place; in a log, one line per ~5% of the run.
        every = 1 if self.tty else max(1, self.steps // 20)
        if changed and self.step and (self.step["step"] + 1) % every == 0:
            self.show()

    def show(self) -> None:
        s = self.step
        ev = f" | eval {self.eval['eval_accuracy']:.1%}@v{self.eval['eval_version']}" if self.eval else ""
        line = (f"step {s['step'] + 1}/{self.steps} | reward {s.get('reward', 0):.3f} | acc {s.get('accuracy', 0):.1%}{ev}"
                f" | stale {s.get('staleness_mean', 0):.2f} (max {s.get('staleness_max', 0)})"
                f" | gen {s['gen_tokens_per_s']:.0f} tok/s | train {s.get('train_tokens_per_s', 0):.0f} tok/s"
                f" | {s['time']:.0f}s")
        print(("\r" + line.ljust(120)) if self.tty else line, end="" if self.tty else "\n", file=self.out, flush=True)


def launch(cfg: Config, run_dir: Path, log=print) -> None:
    procs: dict[str, subprocess.Popen] = {}
    progress = Progress(run_dir, cfg.run.steps)
    try:
        if cfg.inference.engine == "vllm":
            procs["inference"] = start_vllm(cfg, run_dir, cfg.role_threads("inference"))
        else:
            procs["inference"] = start_role("inference", run_dir, cfg.role_threads("inference"))
        wait_for_inference(procs["inference"], run_dir, cfg.timeouts.startup)
        procs["trainer"] = start_role("trainer", run_dir, cfg.role_threads("trainer"))
        procs["orchestrator"] = start_role("orchestrator", run_dir, 1)
        while procs["orchestrator"].poll() is None or procs["trainer"].poll() is None:
            for role, proc in procs.items():
                if proc.poll() not in (None, 0):
                    raise _dead_role_error(role, proc, run_dir)
            progress.poll()
            time.sleep(0.2)
        for role in ("trainer", "orchestrator"):
            if procs[role].returncode != 0:
                raise _dead_role_error(role, procs[role], run_dir)
        progress.poll()
        if progress.tty:
            print()
    finally:
        stop(procs)


def train(cfg: Config, log=print) -> Path:
    """Run a whole training job; returns the run directory (with its report)."""
    from asyncrl.report import write_report

    check_inputs(cfg, log)
    run_dir = prepare_run_dir(cfg)
    log(f"run {run_dir}: {cfg.run.steps} steps x {cfg.rollout.prompts_per_step} prompts x {cfg.rollout.group_size} samples, "
        f"max_staleness {cfg.rollout.max_staleness}, objective {cfg.objective.name}, "
        f"threads: inference {cfg.role_threads('inference')}, trainer {cfg.role_threads('trainer')}")
    start = time.monotonic()
    launch(cfg, run_dir, log)
    summary = write_report(run_dir)
    summary["wall_seconds"] = round(time.monotonic() - start, 1)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    log((run_dir / "report.md").read_text())
    return run_dir
