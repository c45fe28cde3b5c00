"""The roles as processes: start one, stop them, and the supervisor that keeps them alive.

Each role runs as `python -m <module> RUN_DIR` would, with its own thread count and log file, forked
from the run's role starter (starter.py; a new interpreter with run.fork_roles = false): the trainer, the
orchestrator and inference replicas `inference-0` ... `inference-{N-1}` (inference.replicas). With
run.launcher = "ray" the trainer and the replicas run inside Ray actors (asyncrl/cluster/ray_roles.py) and are
supervised the same way. A role that dies or hangs is restarted and picks up from the run directory
(the trainer from its last checkpoint, the orchestrator from the ledger, a replica from the version
the orchestrator has it load); one that keeps dying stops the run with its last log lines.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from asyncrl.config import Config
from asyncrl.files import poll, write_atomic
from asyncrl.inference import replica
from asyncrl.observe.events import EventLog
from asyncrl.run import heartbeat
from asyncrl.run.memory import MemoryWatch
from asyncrl.run.processes import RunError, role_env, start_role, start_vllm, stop, tail
from asyncrl.run.role import FATAL_EXIT, read_failure
from asyncrl.run.starter import ForkedRole, Starter
from asyncrl.rundir import RunDir


def role_names(cfg: Config) -> list[str]:
    """The servers first (the trainer and the orchestrator start once they serve), then those two."""
    teachers = [replica.role(i, "teacher") for i in range(cfg.teacher.started_here)]
    return [replica.role(i) for i in range(cfg.inference.replicas)] + teachers + ["trainer", "orchestrator"]


def _served(run_dir: Path, role: str) -> bool:
    kind, index = replica.server_of(role)
    return replica.read_info(run_dir, index, kind) is not None


def wait_for_replicas(supervisor: "Supervisor", deadline: float) -> None:
    """Until every server (replica, teacher) has written its URL: one that exits first stops the run with
    its log."""
    servers = {r: p for r, p in supervisor.procs.items() if replica.server_of(r) is not None}

    def started() -> bool:
        for role, proc in servers.items():
            if proc.poll() is not None:
                raise RunError(f"the {role} process exited with code {proc.returncode}; last lines of its "
                               f"log ({supervisor.log_path(role)}):\n{supervisor.tail(role)}")
            supervisor.sync_info(role)
        return all(_served(supervisor.run_dir, r) for r in servers)

    try:
        poll(started, deadline, "")
    except TimeoutError:
        late = [r for r in servers if not _served(supervisor.run_dir, r)]
        raise RunError(f"{', '.join(late)} did not start within {deadline:.0f}s (timeouts.startup); see "
                       + ", ".join(str(supervisor.log_path(r)) for r in late)) from None


class Supervisor:
    """Starts the roles and keeps them alive: a role that exits with an error, or stops beating
    for timeouts.heartbeat, is restarted (each role resumes from the run directory on its own);
    past run.max_restarts restarts of one role the run stops with that role's last log lines."""

    def __init__(self, cfg: Config, run_dir: Path, log=print, hosts=None):
        """`hosts`: where the trainer and the replicas run under run.launcher = "ray" (a RayHosts of
        asyncrl/cluster/ray_roles.py: place(), start(role, threads, env) -> a process-like handle,
        close()); None: local processes."""
        self.cfg, self.run_dir, self.log = cfg, run_dir, log
        self.procs: dict = {}  # role -> subprocess.Popen, or a ray_roles.RemoteRole under Ray
        self.restarts = {role: 0 for role in role_names(cfg)}
        self.started: dict[str, float] = {}
        self.events = EventLog(run_dir, "supervisor")
        self.starter: Starter | None = None  # starter.py
        self.forking = cfg.run.fork_roles  # (off for the rest of the run once the starter fails)
        self.hosts = hosts
        self.memory = MemoryWatch()

    def _vllm(self, role: str) -> bool:
        server = replica.server_of(role)
        engine = {"inference": self.cfg.inference.engine, "teacher": self.cfg.teacher.engine}
        return server is not None and engine[server[0]] == "vllm"

    def start(self, role: str) -> None:
        kind, index = replica.server_of(role) or ("trainer", None)
        threads = 1 if role == "orchestrator" else self.cfg.role_threads(kind)
        env = {}
        if index is not None:
            info = replica.read_info(self.run_dir, index, kind) or {}
            env = {"ASYNCRL_INFERENCE_PORT": str(_port(info.get("url"))),
                   "ASYNCRL_INCARNATION": str(self.restarts[role])}
        if self._vllm(role):
            port = int(env["ASYNCRL_INFERENCE_PORT"])
            self.procs[role] = start_vllm(self.cfg, self.run_dir, threads, index, port, kind)
        elif self.hosts is not None and role != "orchestrator":
            self.procs[role] = self.hosts.start(role, threads, env)
        else:
            self.procs[role] = self._fork(role, role_env(threads, **env)) or start_role(role, self.run_dir,
                                                                                       threads, **env)
        self.started[role] = time.monotonic()
        pids = {r: p.pid for r, p in self.procs.items()}
        write_atomic(RunDir(self.run_dir).pids, json.dumps(pids))

    def start_all(self) -> None:
        # (from an earlier launch) written anew once bound
        shutil.rmtree(RunDir(self.run_dir).replicas, ignore_errors=True)
        shutil.rmtree(RunDir(self.run_dir).teachers, ignore_errors=True)
        RunDir(self.run_dir).trainer_info.unlink(missing_ok=True)
        RunDir(self.run_dir).failure.unlink(missing_ok=True)
        shutil.rmtree(RunDir(self.run_dir).heartbeats, ignore_errors=True)
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
        server = replica.server_of(role)
        self.procs[role].sync_info(RunDir(self.run_dir).trainer_info if server is None
                                   else replica.info_path(self.run_dir, server[1], server[0]))

    def log_path(self, role: str) -> Path:
        return RunDir(self.run_dir).log(role)

    def tail(self, role: str) -> str:
        proc = self.procs.get(role)
        return proc.tail() if hasattr(proc, "tail") else tail(self.log_path(role))

    def _fork(self, role: str, env: dict) -> ForkedRole | None:
        """The role forked by the run's starter (started on first use); None when forking is off or the
        starter failed (from then on every start is cold, and the console says why once)."""
        if not self.forking:
            return None
        if self.starter is None or not self.starter.alive():
            self.starter = Starter(self.run_dir, role_env(1))
        try:
            return self.starter.start(role, env, self.cfg.timeouts.startup)
        except (RuntimeError, TimeoutError) as e:
            self.log(f"supervisor: {e} (logs/starter.log); roles start cold from now on")
            self.events.write("starter_failed", why=str(e))
            self.starter.close(grace=0)
            self.forking = False
            return None

    def finished(self) -> bool:
        """Check every role once; True when the trainer and the orchestrator have both completed."""
        self.memory.sample(self.procs)
        for role, proc in list(self.procs.items()):
            code = proc.poll()
            if code == 0 and role in ("trainer", "orchestrator"):  # (done; a server never ends on its own)
                continue
            if code is None:
                self.sync_info(role)
            if code == FATAL_EXIT:  # a restart would meet the same error: the run ends with its sentence
                failure = read_failure(self.run_dir) or {"error": f"exited with code {code}"}
                self.events.write("role_failed", target=role, why=failure["error"])
                raise RunError(f"the {role} stopped the run: {failure['error']} (log: {self.log_path(role)})")
            if (oom := self.memory.verdict(role, code)) is not None:  # a restart would die the same way
                self.events.write("role_failed", target=role, why=oom)
                raise RunError(f"the {role} {oom}; {memory_drivers(self.cfg, role)}")
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
        RunDir(self.run_dir).heartbeat(role).unlink(missing_ok=True)
        self.start(role)

    def stop(self) -> None:
        try:
            stop(self.procs)
        finally:
            if self.starter is not None:
                self.starter.close()
            if self.hosts is not None:
                self.hosts.close()


def memory_drivers(cfg: Config, role: str) -> str:
    """The settings that drive `role`'s memory, with their values: what to lower."""
    from asyncrl.run.sizes import longest_sequence, minibatch_rows

    tokens, what = longest_sequence(cfg)
    if role == "trainer":
        return (f"its memory grows with a minibatch's {minibatch_rows(cfg)} sequences "
                f"(rollout.prompts_per_step x rollout.group_size / trainer.minibatches) of up to {tokens} "
                f"tokens ({what}): lower those, raise trainer.minibatches, or set "
                "trainer.activation_checkpointing = true")
    if replica.index_of(role, "teacher") is not None:
        return (f"its memory is the teacher model ({cfg.teacher.path}) and one scoring forward of up to "
                f"{tokens} tokens a row: lower teacher.max_concurrent or serve it in a smaller teacher.dtype")
    if replica.index_of(role) is not None:
        inf = cfg.inference
        return (f"its memory grows with the running batch: inference.max_batch_sequences = "
                f"{inf.max_batch_sequences}, inference.max_batch_tokens = {inf.max_batch_tokens} (rows x "
                f"longest row), sequences of up to {tokens} tokens ({what}): lower those")
    return (f"its memory grows with the groups in flight: rollout.max_concurrent_groups = "
            f"{cfg.rollout.max_concurrent_groups} x rollout.group_size = {cfg.rollout.group_size}")


def _port(url: str | None) -> int:
    """The port a restarted replica asks for: its predecessor's (the orchestrator keeps the URL)."""
    try:
        return int(url.rsplit(":", 1)[1])
    except (AttributeError, ValueError, IndexError):
        return 0
