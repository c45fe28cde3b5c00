"""run.launcher = "ray": the trainer and the inference replicas run inside Ray actors.

Each such role gets a `RoleHost` actor (ray_host.py), placed in a bundle of the run's placement
group (placing is waited on with run.ray_placement_timeout: a group the cluster cannot place would wait
forever); a trainer of M ranks gets M bundles, one per rank. `RemoteRole` gives the supervisor the part
of a local process's interface it uses, so it treats local and remote roles alike. Without run.storage
the trainer's bundles ask for the driver's node: it reads and writes the run directory there; with it,
the trainer lives in <run.storage>/<name> on any node that mounts it. A replica gets a scratch directory
of its own on whatever node it lands, holding only its config and token: its weights arrive through
Ray's object store (`RoleHost.stage`, fed by asyncrl/transports/staging.py), and its URL comes back to
the run directory through the supervisor. The orchestrator stays a local process and the ledger's only
writer.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from asyncrl.cluster.ray_host import NAMESPACE, RoleHost
from asyncrl.config import Config, ConfigError
from asyncrl.control.access import read_token
from asyncrl.files import write_atomic
from asyncrl.inference import replica
from asyncrl.rundir import RunDir


class RemoteRole:
    """A role in a RoleHost, with the part of subprocess.Popen's interface the supervisor uses. A host
    that cannot be reached (its node died) counts as a role that exited with -9."""

    def __init__(self, host, name: str, pid: int, role: str):
        import ray

        self.ray, self.host, self.name, self.pid, self.role = ray, host, name, pid, role
        self.returncode: int | None = None
        self.synced: dict | None = None

    def _ask(self, call, default, timeout: float = 10.0):
        try:
            return self.ray.get(call, timeout=timeout)
        except (self.ray.exceptions.RayActorError, self.ray.exceptions.GetTimeoutError):
            return default

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._ask(self.host.poll.remote(), -9)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        self._ask(self.host.signal.remote(signum), None)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        code = self._ask(self.host.wait.remote(timeout or 0.0), -9, (timeout or 0.0) + 10.0)
        if code is None:
            raise subprocess.TimeoutExpired(self.role, timeout)
        self.returncode = code
        return code

    def heartbeat_age(self) -> float | None:
        return self._ask(self.host.heartbeat_age.remote(), None)

    def tail(self) -> str:
        return self._ask(self.host.tail.remote(), f"(the {self.role}'s host is gone: no log)")

    def sync_info(self, path: Path) -> None:
        """Copy the replica's URL file to `path` once it has written it, with what reaches its host."""
        if self.synced is not None:
            return
        info = self._ask(self.host.info.remote(), None)
        if info is not None:
            self.synced = {**info, "actor": self.name, "host": self.host._actor_id.hex(),
                           "namespace": NAMESPACE, "ray_address": self.ray.get_runtime_context().gcs_address}
            path.parent.mkdir(exist_ok=True)
            write_atomic(path, json.dumps(self.synced))


class RayHosts:
    """The run's placement group and the RoleHost actors in it."""

    def __init__(self, cfg: Config, run_dir: Path, log=print, fresh: bool = False):
        """`fresh`: a new run (not a resume), whose trainer directory in run.storage must be new too."""
        import ray  # (asyncrl/run/preflight.py has said it is missing, if it is)

        self.ray, self.cfg, self.run_dir, self.log, self.fresh = ray, cfg, run_dir, log, fresh
        _connect(cfg, log)
        self.hosts: dict[str, object] = {}
        self.group = None
        # bundles 0..M-1: the trainer's ranks (its leader's host places the others); then the replicas
        ranks = cfg.trainer.ranks
        self.bundle_of = {"trainer": 0, **{replica.role(i): ranks + i for i in range(cfg.inference.replicas)}}
        first_teacher = ranks + cfg.inference.replicas  # then the teachers the run starts
        self.bundle_of.update({replica.role(i, "teacher"): first_teacher + i
                               for i in range(cfg.teacher.started_here)})

    def place(self) -> None:
        from ray.util.placement_group import placement_group

        cfg = self.cfg
        # without run.storage the trainer shares the run directory: it must run on this node
        here = {} if cfg.run.storage else {f"node:{self.ray.util.get_node_ip_address()}": 0.001}
        rank_bundle = {"CPU": cfg.role_threads("trainer"), **here, **cfg.trainer.ray_resources}
        bundles = [rank_bundle] * cfg.trainer.ranks
        replica_bundle = {"CPU": cfg.role_threads("inference"), **cfg.inference.ray_resources}
        bundles += [replica_bundle] * cfg.inference.replicas
        teacher_bundle = {"CPU": cfg.role_threads("teacher"), **cfg.teacher.ray_resources}
        bundles += [teacher_bundle] * cfg.teacher.started_here
        self.group = placement_group(bundles, strategy="PACK", name=f"asyncrl-{cfg.run.name}")
        try:
            self.ray.get(self.group.ready(), timeout=cfg.run.ray_placement_timeout)
        except self.ray.exceptions.GetTimeoutError:
            self.ray.util.remove_placement_group(self.group)
            raise ConfigError(
                f"Ray could not place the run's roles within {cfg.run.ray_placement_timeout:.0f}s "
                f"(run.ray_placement_timeout): each of the trainer's {cfg.trainer.ranks} rank(s) needs "
                f"{bundles[0]} (its threads and trainer.ray_resources; on this node without run.storage) "
                f"and each of {cfg.inference.replicas} inference "
                f"replica(s) {replica_bundle} (inference.threads and inference.ray_resources), each of "
                f"{cfg.teacher.started_here} teacher(s) {teacher_bundle} (teacher.threads and "
                "teacher.ray_resources); the cluster "
                f"has {self.ray.available_resources()} free. Nothing ran: the same command with "
                "--run.overwrite true starts again") from None
        self.log(f"ray: placed the trainer's {cfg.trainer.ranks} rank(s), {cfg.inference.replicas} "
                 f"inference replica(s) and {cfg.teacher.started_here} teacher(s): {bundles}")

    def start(self, role: str, threads: int, env: dict) -> RemoteRole:
        """Start `role` in its host (a new host if it has none or its host died)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        host, name = self.hosts.get(role, (None, None))
        try:
            pid = self.ray.get(host.start.remote(threads, env), timeout=60) if host else None
        except self.ray.exceptions.RayActorError:  # its node died: a new host, in the group's bundle
            pid = None
        if pid is None:
            strategy = PlacementGroupSchedulingStrategy(self.group,
                                                        placement_group_bundle_index=self.bundle_of[role])
            name = f"{self.cfg.run.name}.{role}.{time.monotonic_ns()}"
            actor = self.ray.remote(RoleHost).options(
                name=name, namespace=NAMESPACE, num_cpus=0, scheduling_strategy=strategy, max_concurrency=8)
            shared = role == "trainer" and not self.cfg.run.storage
            host = actor.remote(role, str(self.run_dir.resolve()) if shared else None, self._config(),
                                read_token(self.run_dir), fresh=self.fresh and role not in self.hosts,
                                group=self.group if role == "trainer" else None)
            self.hosts[role] = host, name
            pid = self.ray.get(host.start.remote(threads, env), timeout=self.cfg.timeouts.startup)
        return RemoteRole(host, name, pid, role)

    def _config(self) -> str:
        """The run's config for a host without the run directory: the model path made absolute."""
        tree = json.loads((RunDir(self.run_dir).config).read_text())
        for section in ("model", "teacher"):
            if tree[section]["path"] and Path(tree[section]["path"]).exists():
                tree[section]["path"] = str(Path(tree[section]["path"]).resolve())
        return json.dumps(tree)

    def close(self) -> None:
        """Keep each remote log in the run directory; free the hosts, the group and a cluster we started."""
        for role, (host, _) in self.hosts.items():
            try:
                text = self.ray.get(host.log_text.remote(), timeout=10)
                if text and (role != "trainer" or self.cfg.run.storage):
                    (RunDir(self.run_dir).log(role)).write_text(text)
                self.ray.get(host.close.remote(), timeout=10)
            except (self.ray.exceptions.RayError, OSError):
                pass
            self.ray.kill(host)
        if self.group is not None:
            self.ray.util.remove_placement_group(self.group)
        self.ray.shutdown()


def _connect(cfg: Config, log) -> None:
    """Attach to the cluster (run.ray_address), or start one on this machine when none is up."""
    import ray

    if ray.is_initialized():
        return
    quiet = {"log_to_driver": False, "logging_level": "WARNING", "namespace": NAMESPACE}
    address = cluster_address(cfg.run.ray_address)
    if address is not None:
        ray.init(address=address, **quiet)
        log(f"ray: attached to the cluster at {address}")
        return
    # logical CPUs: at least what the roles ask for, even on a machine with fewer cores
    cpus = max(cfg.role_threads("trainer") + cfg.role_threads("inference") * cfg.inference.replicas
               + cfg.role_threads("teacher") * cfg.teacher.started_here, os.cpu_count() or 1)
    ray.init(num_cpus=cpus, object_store_memory=256 * 2**20, include_dashboard=False, **quiet)
    log(f"ray: started a local cluster for this run ({cpus} logical CPUs)")


def check_cluster(cfg: Config) -> None:
    """Ray is installed and the cluster run.ray_address names answers (before any role starts)."""
    try:
        import ray  # noqa: F401
    except ImportError:
        raise ConfigError("run.launcher = \"ray\" needs Ray: pip install 'asyncrl[ray]'") from None
    cluster_address(cfg.run.ray_address)  # (an address nobody answers would hold ray.init for minutes)


def cluster_address(setting: str) -> str | None:
    """The GCS address to attach to, None to start a cluster; probed first, because `ray.init` waits
    minutes on an address nobody answers."""
    if setting == "local":
        return None
    where = f"run.ray_address = {setting!r}"
    address = setting
    if setting == "auto":
        current = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"  # what `ray start` leaves
        address = os.environ.get("RAY_ADDRESS") or (current.read_text().strip() if current.exists() else None)
        if not address:
            return None
        where = f"the Ray cluster this machine last started ({address}, from RAY_ADDRESS or {current})"
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except (OSError, ValueError):
        raise ConfigError(f"{where}: no Ray cluster answers there (`ray status` checks; `ray stop` clears a "
                          "dead one; run.ray_address = \"local\" starts one for this run)") from None
    return address
