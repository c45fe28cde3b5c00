"""The roles as processes: start one, stop them, and the supervisor that keeps them alive.

Each role is `python -m <module> RUN_DIR` with its own thread count and log file: the trainer, the
orchestrator and inference replicas `inference-0` ... `inference-{N-1}` (inference.replicas). With
run.launcher = "ray" the trainer and the replicas run inside Ray actors (asyncrl/ray_roles.py) and are
supervised the same way. A role that dies or hangs is restarted and picks up from the run directory
(the trainer from its last checkpoint, the orchestrator from the ledger, a replica from the version
the orchestrator has it load); one that keeps dying stops the run with its last log lines.
"""
from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from asyncrl import heartbeat
from asyncrl.config import Config
from asyncrl.events import EventLog
from asyncrl.fatal import FATAL_EXIT, failure_file, read_failure
from asyncrl.files import poll, write_atomic
from asyncrl.inference import replica
from asyncrl.ray_roles import trainer_info_file

MODULES = {"trainer": "asyncrl.trainer.main", "orchestrator": "asyncrl.orchestrator"}


class RunError(RuntimeError):
    pass


def role_names(cfg: Config) -> list[str]:
    return [replica.role(i) for i in range(cfg.inference.replicas)] + ["trainer", "orchestrator"]


def command(role: str, run_dir: Path) -> list[str]:
    index = replica.index_of(role)
    if index is not None:
        return [sys.executable, "-m", "asyncrl.inference.server", str(run_dir), str(index)]
    return [sys.executable, "-m", MODULES[role], str(run_dir)]


try:  # Linux: a child can ask the kernel for a signal when its parent dies
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):
    _PRCTL = None
_PR_SET_PDEATHSIG = 1


def _die_with_launcher(launcher: int):
    """preexec_fn of every role: SIGTERM when the launcher dies, however it dies (SIGKILL, OOM, a
    closed terminal), so no role outlives it to write into a run that a --resume starts again."""
    def bind() -> None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != launcher:  # it died between the fork and the line above
            os._exit(1)
    return bind if _PRCTL is not None else None


def spawn(cmd: list[str], **kwargs) -> subprocess.Popen:
    """A role's process: its own session (a Ctrl-C reaches the launcher, which stops it), and bound
    to the launcher's life."""
    return subprocess.Popen(cmd, start_new_session=True, preexec_fn=_die_with_launcher(os.getpid()), **kwargs)


def role_env(threads: int, **extra: str) -> dict:
    return dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", **extra)


def start_role(role: str, run_dir: Path, threads: int, **env: str) -> subprocess.Popen:
    log = open(run_dir / "logs" / f"{role}.log", "a")  # a restarted role appends: its crash stays readable
    return spawn(command(role, run_dir), stdout=log, stderr=subprocess.STDOUT, env=role_env(threads, **env))


def start_vllm(cfg: Config, run_dir: Path, threads: int, index: int, port: int = 0) -> subprocess.Popen:
    """Replica `index` as vLLM's OpenAI server on loopback; its URL goes to replicas/<index>.json at once
    (the orchestrator waits for /health within timeouts.startup)."""
    from asyncrl.ports import free_port

    port = cfg.inference.port + index if cfg.inference.port else port
    if port == 0:
        port = free_port(cfg.inference.host)
    cmd = [cfg.inference.vllm_python or sys.executable, "-m", "vllm.entrypoints.openai.api_server",
           "--model", cfg.model.path, "--host", cfg.inference.host, "--port", str(port),
           "--dtype", cfg.inference.dtype, "--logprobs-mode", "processed_logprobs",
           "--seed", str(cfg.run.seed), *cfg.inference.vllm_args]
    if cfg.inference.weight_transfer == "nccl":  # (the trainer broadcasts: asyncrl/trainer/weight_sender.py)
        cmd += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
    env = dict(
        os.environ,
        VLLM_SERVER_DEV_MODE="1",
        VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        OMP_NUM_THREADS=str(threads),
    )
    log = open(run_dir / "logs" / f"{replica.role(index)}.log", "a")
    proc = spawn(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    replica.info_file(run_dir, index).parent.mkdir(exist_ok=True)
    write_atomic(replica.info_file(run_dir, index),
                 json.dumps({"url": f"http://{cfg.inference.host}:{port}", "engine": "vllm"}))
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


def wait_for_replica(proc: subprocess.Popen, run_dir: Path, deadline: float, index: int = 0) -> str:
    """The URL of replica `index` started on its own (tests, benchmarks), once it serves."""
    def started() -> dict | None:
        if proc.poll() is not None:
            log = run_dir / "logs" / f"{replica.role(index)}.log"
            raise RunError(f"the inference process exited with code {proc.returncode}; last lines of {log}:\n"
                           f"{tail(log)}")
        return replica.read_info(run_dir, index)

    try:
        return poll(started, deadline, "")["url"]
    except TimeoutError:
        raise RunError(f"the inference server did not start within {deadline:.0f}s") from None


def wait_for_replicas(supervisor: "Supervisor", deadline: float) -> None:
    """Until every replica has written its URL: one that exits first stops the run with its log."""
    replicas = {r: p for r, p in supervisor.procs.items() if replica.index_of(r) is not None}

    def started() -> bool:
        for role, proc in replicas.items():
            if proc.poll() is not None:
                raise RunError(f"the {role} process exited with code {proc.returncode}; last lines of its "
                               f"log ({supervisor.log_path(role)}):\n{supervisor.tail(role)}")
            supervisor.sync_info(role)
        return all(replica.read_info(supervisor.run_dir, replica.index_of(r)) for r in replicas)

    try:
        poll(started, deadline, "")
    except TimeoutError:
        late = [r for r in replicas if not replica.read_info(supervisor.run_dir, replica.index_of(r))]
        raise RunError(f"{', '.join(late)} did not start within {deadline:.0f}s (timeouts.startup); see "
                       + ", ".join(str(supervisor.log_path(r)) for r in late)) from None


class Supervisor:
    """Starts the roles and keeps them alive: a role that exits with an error, or stops beating
    for timeouts.heartbeat, is restarted (each role resumes from the run directory on its own);
    past run.max_restarts restarts of one role the run stops with that role's last log lines."""

    def __init__(self, cfg: Config, run_dir: Path, log=print, fresh: bool = False):
        self.cfg, self.run_dir, self.log = cfg, run_dir, log
        self.procs: dict = {}  # role -> subprocess.Popen, or a ray_roles.RemoteRole under Ray
        self.restarts = {role: 0 for role in role_names(cfg)}
        self.started: dict[str, float] = {}
        self.events = EventLog(run_dir, "supervisor")
        self.spare: subprocess.Popen | None = None  # asyncrl/standby.py, see run.warm_spare
        self.spare_failed = False
        self.hosts = None  # the Ray actors that host roles (run.launcher = "ray")
        if cfg.run.launcher == "ray":
            from asyncrl.ray_roles import RayHosts

            self.hosts = RayHosts(cfg, run_dir, log, fresh)

    def _vllm(self, role: str) -> bool:
        return replica.index_of(role) is not None and self.cfg.inference.engine == "vllm"

    def start(self, role: str) -> None:
        index = replica.index_of(role)
        kind = "trainer" if index is None else "inference"
        threads = 1 if role == "orchestrator" else self.cfg.role_threads(kind)
        env = {}
        if index is not None:
            info = replica.read_info(self.run_dir, index) or {}
            env = {"ASYNCRL_INFERENCE_PORT": str(_port(info.get("url"))),
                   "ASYNCRL_INCARNATION": str(self.restarts[role])}
        if self._vllm(role):
            port = int(env["ASYNCRL_INFERENCE_PORT"])
            self.procs[role] = start_vllm(self.cfg, self.run_dir, threads, index, port)
        elif self.hosts is not None and role != "orchestrator":
            self.procs[role] = self.hosts.start(role, threads, env)
        elif self.spare is not None and self.spare.poll() is None:
            order = {
                "role": role,
                "env": {**env, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)},
            }
            self.spare.stdin.write(json.dumps(order) + "\n")
            self.spare.stdin.close()
            self.procs[role], self.spare = self.spare, None  # a new spare once every role beats again
        else:
            self.procs[role] = start_role(role, self.run_dir, threads, **env)
        self.started[role] = time.monotonic()
        pids = {r: p.pid for r, p in self.procs.items()}
        write_atomic(self.run_dir / "pids.json", json.dumps(pids))

    def start_all(self) -> None:
        # (from an earlier launch) written anew once bound
        shutil.rmtree(self.run_dir / "replicas", ignore_errors=True)
        trainer_info_file(self.run_dir).unlink(missing_ok=True)
        failure_file(self.run_dir).unlink(missing_ok=True)
        shutil.rmtree(self.run_dir / "heartbeats", ignore_errors=True)
        if self.hosts is not None:
            self.hosts.place()
        for role in role_names(self.cfg)[:-2]:
            self.start(role)
        wait_for_replicas(self, self.cfg.timeouts.startup)
        self.start("trainer")
        self.sync_info("trainer")
        self.start("orchestrator")

    def sync_info(self, role: str) -> None:
        """A role under Ray says where it is on its own node (a replica its URL, the trainer its directory
        and host): copy that here, for the orchestrator."""
        if self.hosts is None or role == "orchestrator" or self._vllm(role):
            return
        index = replica.index_of(role)
        self.procs[role].sync_info(trainer_info_file(self.run_dir) if index is None
                                   else replica.info_file(self.run_dir, index))

    def log_path(self, role: str) -> Path:
        return self.run_dir / "logs" / f"{role}.log"

    def tail(self, role: str) -> str:
        proc = self.procs.get(role)
        return proc.tail() if hasattr(proc, "tail") else tail(self.log_path(role))

    def _start_spare_when_settled(self) -> None:
        """A spare importing torch slows every role's start on a small machine: it waits for their first
        beats."""
        if (
            self.spare is not None and self.spare.poll() is not None
        ):  # it died on its own: go cold from now on
            self.log(
                f"supervisor: the warm spare exited with code {self.spare.returncode} (logs/standby.log); "
                "restarts will start cold"
            )
            self.spare, self.spare_failed = None, True
        beating = [r for r in self.procs if not self._vllm(r)]
        wanted = self.cfg.run.warm_spare == "always" or (self.cfg.run.warm_spare == "after_failure"
                                                         and any(self.restarts.values()))
        if (
            wanted
            and not self.spare_failed
            and self.spare is None
            and all(heartbeat.age(self.run_dir, r) is not None for r in beating)
        ):
            log = open(self.run_dir / "logs" / "standby.log", "a")
            self.spare = spawn([sys.executable, "-m", "asyncrl.standby", str(self.run_dir)],
                               stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, text=True,
                               env=role_env(1))

    def finished(self) -> bool:
        """Check every role once; True when the trainer and the orchestrator have both completed."""
        if self.hosts is None:
            self._start_spare_when_settled()
        for role, proc in list(self.procs.items()):
            code = proc.poll()
            if code == 0 and replica.index_of(role) is None:
                continue
            if code is None:
                self.sync_info(role)
            if code == FATAL_EXIT:  # a restart would meet the same error: the run ends with its sentence
                failure = read_failure(self.run_dir) or {"error": f"exited with code {code}"}
                self.events.write("role_failed", target=role, why=failure["error"])
                raise RunError(f"the {role} stopped the run: {failure['error']} (log: {self.log_path(role)})")
            if code is not None:
                self._restart(role, f"exited with code {code}")
            elif (stuck := self._stuck(role)) is not None:
                proc.kill()
                proc.wait()
                self._restart(role, stuck)
        return all(self.procs[r].poll() == 0 for r in ("trainer", "orchestrator"))

    def _stuck(self, role: str) -> str | None:
        """Why a live role counts as stuck: no first beat within timeouts.startup, or silent for
        timeouts.heartbeat."""
        if self._vllm(role):
            return None  # vLLM beats no file of ours; its process and /health are what we have
        proc = self.procs[role]
        silent = proc.heartbeat_age() if hasattr(proc, "heartbeat_age") else heartbeat.age(self.run_dir, role)
        if silent is None:
            waited = time.monotonic() - self.started[role]
            return (
                f"did not start within {waited:.0f}s (timeouts.startup); killed"
                if waited > self.cfg.timeouts.startup
                else None
            )
        return (
            f"no heartbeat for {silent:.0f}s (timeouts.heartbeat); killed"
            if silent > self.cfg.timeouts.heartbeat
            else None
        )

    def _restart(self, role: str, why: str) -> None:
        if self.restarts[role] >= self.cfg.run.max_restarts:
            self.events.write("role_failed", target=role, why=why, restarts=self.restarts[role])
            raise RunError(f"the {role} {why} after {self.restarts[role]} restarts (run.max_restarts); "
                           f"last lines of {self.log_path(role)}:\n{self.tail(role)}")
        self.restarts[role] += 1
        self.log(
            f"supervisor: the {role} {why}; restarting it ({self.restarts[role]}/{self.cfg.run.max_restarts})"
        )
        self.events.write("role_restarted", target=role, why=why, restart=self.restarts[role])
        heartbeat.heartbeat_file(self.run_dir, role).unlink(missing_ok=True)
        self.start(role)

    def stop(self) -> None:
        try:
            stop({**self.procs, **({"spare": self.spare} if self.spare else {})})
        finally:
            if self.hosts is not None:
                self.hosts.close()


def _port(url: str | None) -> int:
    """The port a restarted replica asks for: its predecessor's (the orchestrator keeps the URL)."""
    try:
        return int(url.rsplit(":", 1)[1])
    except (AttributeError, ValueError, IndexError):
        return 0
