"""The local launcher: start the three roles as processes, supervise them, show progress, report.

Each role is `python -m <module> RUN_DIR` with its own thread count and log file. A role that
dies or hangs is restarted and picks up from the run directory (the trainer from its last
checkpoint, the orchestrator from the ledger); one that keeps dying stops the run with its last
log lines. `resume` continues a stopped run from the same directory.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from asyncrl import heartbeat
from asyncrl.config import (Config, ConfigError, config_changes, load_config, merge_config, parse_overrides,
                            read_run_config, save_config)
from asyncrl.events import EventLog

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
    from asyncrl.rewards.tasks import load_tasks

    if not Path(cfg.model.path).exists():
        if (cfg.model.path == DEFAULT_MODEL or cfg.warmstart.demos) and cfg.model.warmstart_if_missing:
            from asyncrl.warmstart import warmstart

            log(f"{cfg.model.path} is missing: building the tiny policy first")
            warmstart(cfg, cfg.model.path, log=log)
        else:
            _check_hub_model(cfg.model.path)
    load_tasks(cfg.task)
    agents = {path for path in cfg.agent_paths().values() if path}
    if agents:
        from asyncrl.agents.runner import chat_template, load_agent

        for path in agents:
            load_agent(path)
        chat_template(cfg.agent.chat_template)
    get_objective(cfg.objective.name, cfg.objective.import_path)


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


def _role_env(threads: int, **extra: str) -> dict:
    return dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", **extra)


def start_role(role: str, run_dir: Path, threads: int, **env: str) -> subprocess.Popen:
    log = open(run_dir / "logs" / f"{role}.log", "a")  # a restarted role appends: its crash stays readable
    return subprocess.Popen([sys.executable, "-m", ROLES[role], str(run_dir)], stdout=log,
                            stderr=subprocess.STDOUT, env=_role_env(threads, **env), start_new_session=True)


def start_vllm(cfg: Config, run_dir: Path, threads: int, port: int = 0) -> subprocess.Popen:
    """vLLM's OpenAI server on loopback; its URL goes to inference.json at once (the
    orchestrator waits for /health within timeouts.startup)."""
    import socket

    port = cfg.inference.port or port
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
    log = open(run_dir / "logs" / "inference.log", "a")
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


def wait_for_inference(proc: subprocess.Popen, run_dir: Path, deadline: float) -> None:
    start = time.monotonic()
    while not (run_dir / "inference.json").exists():
        if proc.poll() is not None:
            log = run_dir / "logs" / "inference.log"
            raise RunError(f"the inference process exited with code {proc.returncode}; last lines of {log}:\n{tail(log)}")
        if time.monotonic() - start > deadline:
            raise RunError(f"the inference server did not start within {deadline:.0f}s (timeouts.startup); "
                           f"see {run_dir / 'logs' / 'inference.log'}")
        time.sleep(0.05)


class Supervisor:
    """Starts the roles and keeps them alive: a role that exits with an error, or stops beating
    for timeouts.heartbeat, is restarted (each role resumes from the run directory on its own);
    past run.max_restarts restarts of one role the run stops with that role's last log lines."""

    def __init__(self, cfg: Config, run_dir: Path, log=print):
        self.cfg, self.run_dir, self.log = cfg, run_dir, log
        self.procs: dict[str, subprocess.Popen] = {}
        self.restarts = {role: 0 for role in ROLES}
        self.started: dict[str, float] = {}
        self.events = EventLog(run_dir, "supervisor")
        self.spare: subprocess.Popen | None = None  # asyncrl/standby.py, see run.warm_spare
        self.spare_failed = False

    def start(self, role: str) -> None:
        threads = 1 if role == "orchestrator" else self.cfg.role_threads(role)
        env = {}
        if role == "inference":
            env = {"ASYNCRL_INFERENCE_PORT": str(_previous_port(self.run_dir)),
                   "ASYNCRL_INCARNATION": str(self.restarts[role])}
        if role == "inference" and self.cfg.inference.engine == "vllm":
            self.procs[role] = start_vllm(self.cfg, self.run_dir, threads, int(env["ASYNCRL_INFERENCE_PORT"]))
        elif self.spare is not None and self.spare.poll() is None:
            order = {"role": role, "env": {**env, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}}
            self.spare.stdin.write(json.dumps(order) + "\n")
            self.spare.stdin.close()
            self.procs[role], self.spare = self.spare, None  # a new spare once every role beats again
        else:
            self.procs[role] = start_role(role, self.run_dir, threads, **env)
        self.started[role] = time.monotonic()
        pids = {r: p.pid for r, p in self.procs.items()}
        (self.run_dir / "pids.json.tmp").write_text(json.dumps(pids))
        os.replace(self.run_dir / "pids.json.tmp", self.run_dir / "pids.json")

    def start_all(self) -> None:
        (self.run_dir / "inference.json").unlink(missing_ok=True)  # (from an earlier launch) written anew once bound
        shutil.rmtree(self.run_dir / "heartbeats", ignore_errors=True)
        self.start("inference")
        wait_for_inference(self.procs["inference"], self.run_dir, self.cfg.timeouts.startup)
        self.start("trainer")
        self.start("orchestrator")

    def _start_spare_when_settled(self) -> None:
        """A spare importing torch slows every role's start on a small machine: it waits for their first beats."""
        if self.spare is not None and self.spare.poll() is not None:  # it died on its own: go cold from now on
            self.log(f"supervisor: the warm spare exited with code {self.spare.returncode} (logs/standby.log); "
                     "restarts will start cold")
            self.spare, self.spare_failed = None, True
        beating = [r for r in self.procs if not (r == "inference" and self.cfg.inference.engine == "vllm")]
        wanted = self.cfg.run.warm_spare == "always" or (self.cfg.run.warm_spare == "after_failure"
                                                         and any(self.restarts.values()))
        if wanted and not self.spare_failed and self.spare is None and all(heartbeat.age(self.run_dir, r) is not None
                                                                   for r in beating):
            log = open(self.run_dir / "logs" / "standby.log", "a")
            self.spare = subprocess.Popen([sys.executable, "-m", "asyncrl.standby", str(self.run_dir)],
                                          stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, text=True,
                                          env=_role_env(1), start_new_session=True)

    def finished(self) -> bool:
        """Check every role once; True when the trainer and the orchestrator have both completed."""
        self._start_spare_when_settled()
        for role, proc in self.procs.items():
            code = proc.poll()
            if code == 0 and role != "inference":
                continue
            if code is not None:
                self._restart(role, f"exited with code {code}")
            elif (stuck := self._stuck(role)) is not None:
                proc.kill()
                proc.wait()
                self._restart(role, stuck)
        return all(self.procs[r].poll() == 0 for r in ("trainer", "orchestrator"))

    def _stuck(self, role: str) -> str | None:
        """Why a live role counts as stuck: no first beat within timeouts.startup, or silent for timeouts.heartbeat."""
        if role == "inference" and self.cfg.inference.engine == "vllm":
            return None  # vLLM beats no file of ours; its process and /health are what we have
        silent = heartbeat.age(self.run_dir, role)
        if silent is None:
            waited = time.monotonic() - self.started[role]
            return f"did not start within {waited:.0f}s (timeouts.startup); killed" if waited > self.cfg.timeouts.startup else None
        return f"no heartbeat for {silent:.0f}s (timeouts.heartbeat); killed" if silent > self.cfg.timeouts.heartbeat else None

    def _restart(self, role: str, why: str) -> None:
        log = self.run_dir / "logs" / f"{role}.log"
        if self.restarts[role] >= self.cfg.run.max_restarts:
            self.events.write("role_failed", target=role, why=why, restarts=self.restarts[role])
            raise RunError(f"the {role} {why} after {self.restarts[role]} restarts (run.max_restarts); "
                           f"last lines of {log}:\n{tail(log)}")
        self.restarts[role] += 1
        self.log(f"supervisor: the {role} {why}; restarting it ({self.restarts[role]}/{self.cfg.run.max_restarts})")
        self.events.write("role_restarted", target=role, why=why, restart=self.restarts[role])
        heartbeat.heartbeat_file(self.run_dir, role).unlink(missing_ok=True)
        self.start(role)

    def stop(self) -> None:
        stop({**self.procs, **({"spare": self.spare} if self.spare else {})})


def _previous_port(run_dir: Path) -> int:
    try:
        return int(json.loads((run_dir / "inference.json").read_text())["url"].rsplit(":", 1)[1])
    except (FileNotFoundError, ValueError, KeyError, IndexError):
        return 0


class Progress:
    """Reads new lines of metrics.jsonl and keeps one live line on the console."""

    def __init__(self, run_dir: Path, steps: int, out=sys.stdout):
        self.path, self.steps, self.out = run_dir / "metrics.jsonl", steps, out
        # a resumed run's earlier steps were shown by the launch that ran them
        self.offset = self.path.stat().st_size if self.path.exists() else 0
        self.step, self.eval = None, None
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


class Stopped(RunError):
    """The launcher was told to stop (SIGTERM or Ctrl-C); `asyncrl train --resume` continues the run."""


def _stop_on_sigterm(signum, frame):
    raise Stopped(f"stopped by signal {signum}")


def launch(cfg: Config, run_dir: Path, log=print) -> None:
    supervisor = Supervisor(cfg, run_dir, log)
    progress = Progress(run_dir, cfg.run.steps)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _stop_on_sigterm)  # stop the roles on the way out
    try:
        supervisor.start_all()
        while not supervisor.finished():
            progress.poll()
            time.sleep(0.2)
        progress.poll()
        if progress.tty:
            print()
    finally:
        supervisor.stop()


def plan_threads(cfg: Config, log=print) -> tuple[Config, dict | None]:
    """(cfg with the unset thread counts of the CPU roles chosen from measured rates, the plan).

    Only where there is a choice: a CPU trainer and the built-in engine, on a machine with more than
    one core (asyncrl/threads.py). The plan is cached per model, task and batch
    shape under run.root; a planner that fails leaves the static split (config.role_threads)."""
    if (cfg.trainer.device != "cpu" or cfg.inference.engine != "builtin"
            or (cfg.trainer.threads and cfg.inference.threads) or (os.cpu_count() or 1) < 2):
        return cfg, None
    plan = _cached_plan(cfg)
    if plan is None:
        log("planning threads: timing one step's generation and training at each thread count ...")
        tmp = Path(cfg.run.root) / f".plan-{os.getpid()}.json"
        tmp.parent.mkdir(parents=True, exist_ok=True)
        save_config(cfg, tmp)
        try:
            out = subprocess.run([sys.executable, "-m", "asyncrl.threads", str(tmp)], capture_output=True, text=True,
                                 timeout=cfg.timeouts.startup, env=_role_env(os.cpu_count() or 1))
            plan = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else None
        except (subprocess.TimeoutExpired, ValueError, IndexError):
            out, plan = None, None
        finally:
            tmp.unlink(missing_ok=True)
        if plan is None:
            why = "\n".join(out.stderr.splitlines()[-5:]) if out else f"timed out ({cfg.timeouts.startup:.0f}s)"
            log(f"planning threads failed; using the static split: {why}")
            return cfg, None
        _cache_plan(cfg, plan)
    cfg = cfg.model_copy(deep=True)
    cfg.inference.threads = cfg.inference.threads or plan["inference"]
    cfg.trainer.threads = cfg.trainer.threads or plan["trainer"]
    return cfg, plan


def _plan_key(cfg: Config) -> str:
    import hashlib

    model = Path(cfg.model.path)
    stamp = max((p.stat().st_mtime for p in model.glob("*.safetensors")), default=0) if model.is_dir() else 0
    t, ro = cfg.task, cfg.rollout  # what the measured step's cost depends on
    shape = [cfg.model.path, stamp, t.name, t.path, t.params, t.prompt_format, [m.model_dump(mode="json") for m in t.mix],
             ro.prompts_per_step, ro.group_size, ro.max_tokens, ro.temperature, cfg.objective.name, cfg.objective.prox,
             ro.max_staleness > 0, cfg.trainer.minibatches, cfg.inference.dtype, os.cpu_count()]
    return hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _plans(cfg: Config) -> tuple[Path, dict]:
    """(the plan cache under run.root, the plans in it by key); an unreadable cache is empty."""
    path = Path(cfg.run.root) / ".thread_plans.json"
    try:
        return path, json.loads(path.read_text())
    except (OSError, ValueError):
        return path, {}


def _cached_plan(cfg: Config) -> dict | None:
    return _plans(cfg)[1].get(_plan_key(cfg))


def _cache_plan(cfg: Config, plan: dict) -> None:
    path, plans = _plans(cfg)
    plans[_plan_key(cfg)] = plan
    path.write_text(json.dumps(plans, indent=1))


def train(cfg: Config, log=print) -> Path:
    """Run a whole training job; returns the run directory (with its report)."""
    check_inputs(cfg, log)
    cfg, plan = plan_threads(cfg, log)
    run_dir = prepare_run_dir(cfg)
    if plan is not None:
        (run_dir / "threads.json").write_text(json.dumps(plan, indent=1))
        log(f"threads: inference {plan['inference']}, trainer {plan['trainer']} (predicted seconds per step: "
            f"{plan['predicted_step_seconds']})")
        if cfg.rollout.max_staleness > 0 and not plan["overlap_pays"]:
            log("threads: on this machine the roles alternating (max_staleness 0, each phase on its fastest thread "
                "count) is predicted to be faster than overlapping them; asynchrony pays here only through stragglers")
    log(f"run {run_dir}: {cfg.run.steps} steps x {cfg.rollout.prompts_per_step} prompts x {cfg.rollout.group_size} samples, "
        f"max_staleness {cfg.rollout.max_staleness}, objective {cfg.objective.name}, "
        f"threads: inference {cfg.role_threads('inference')}, trainer {cfg.role_threads('trainer')}")
    return _run(cfg, run_dir, log)


def resume(run_dir: str | Path, overrides: list[str] | None = None, force: bool = False, log=print) -> Path:
    """Continue a stopped run in its own directory: the trainer from its newest valid checkpoint,
    the orchestrator from the ledger. A config change that would alter what the run computes is
    refused unless `force`; the difference is shown either way."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.json").exists():
        raise ConfigError(f"{run_dir} is not a run directory (no config.json); nothing to resume")
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
    check_inputs(new, log)
    save_config(new, run_dir / "config.json")
    EventLog(run_dir, "launcher").write("run_resumed", changes=meaning + harmless, forced=bool(meaning))
    log(f"resuming {run_dir}: {new.run.steps} steps")
    return _run(new, run_dir, log)


def _run(cfg: Config, run_dir: Path, log) -> Path:
    from asyncrl.ledger import audit
    from asyncrl.report import write_report

    start = time.monotonic()
    launch(cfg, run_dir, log)
    summary = write_report(run_dir)
    summary["wall_seconds"] = round(time.monotonic() - start, 1)
    summary["ledger"] = audit(run_dir, cfg.rollout.max_staleness)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    log((run_dir / "report.md").read_text())
    if summary["ledger"]["problems"]:
        raise RunError("the ledger audit found problems: " + "; ".join(summary["ledger"]["problems"]))
    return run_dir
