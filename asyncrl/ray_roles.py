"""run.launcher = "ray": the trainer and the inference replicas run inside Ray actors.

Each such role gets a `RoleHost` actor, placed in a bundle of the run's placement group (placing is
waited on with run.ray_placement_timeout: a group the cluster cannot place would wait forever). The
host starts the role as the same process the local launcher starts, bound to the host's life, and
answers the supervisor's questions about it (exit code, heartbeat age, last log lines), so the
supervisor treats local and remote roles alike. The trainer's bundle asks for the driver's node: it
reads and writes the run directory there. A replica gets a scratch directory of its own on whatever
node it lands, holding only its config and token: its weights arrive through Ray's object store
(`RoleHost.stage`, fed by asyncrl/orchestrator/staging.py), and its URL comes back to the run directory
through the supervisor. The orchestrator stays a local process and the ledger's only writer.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from asyncrl import heartbeat, weights
from asyncrl.access import read_token
from asyncrl.config import Config, ConfigError
from asyncrl.files import write_atomic
from asyncrl.inference import replica
from asyncrl.trajectory import batch_path

NAMESPACE = "asyncrl"
KEEP_STAGED = 2  # versions a replica's directory keeps (the held one and the one it loads)


def trainer_info_file(run_dir: Path) -> Path:
    """Where the trainer's host is (its actor and directory), copied to the run directory for the
    orchestrator's link to the trainer."""
    return Path(run_dir) / "trainer.json"


class RoleHost:
    """One role's process on one node (a Ray actor: `ray.remote(RoleHost)`)."""

    def __init__(self, role: str, run_dir: str | None, config: str, token: str, fresh: bool = False):
        """`run_dir`: the run directory, when this node shares it (the trainer without run.storage); else
        the trainer's directory in run.storage (it outlives this host: checkpoints, published versions,
        delivered batches), or a replica's scratch directory. `fresh`: the first host of a new run."""
        self.role = role
        self.proc: subprocess.Popen | None = None
        self.scratch = False
        self.published: dict[tuple[int, str], tuple] = {}  # the trainer's: (version, kind) -> (ref, sha256)
        if run_dir is not None:
            self.dir = Path(run_dir)
            return
        tree = json.loads(config)  # its run directory is its own: no path leads to the driver's
        if role == "trainer":
            self.dir = Path(tree["run"]["storage"]) / tree["run"]["name"]
            _claim(self.dir, fresh, tree["run"]["overwrite"])
            tree["run"]["root"] = tree["run"]["storage"]
        else:
            self.dir, self.scratch = Path(tempfile.mkdtemp(prefix=f"asyncrl-{role}-")), True
            tree["run"].update(root=str(self.dir.parent), name=self.dir.name)
        (self.dir / "logs").mkdir(parents=True, exist_ok=True)
        write_atomic(self.dir / "config.json", json.dumps(tree))
        write_atomic(self.dir / "token", token)
        os.chmod(self.dir / "token", 0o600)

    def start(self, threads: int, env: dict) -> int:
        from asyncrl.supervisor import command, role_env, spawn

        heartbeat.heartbeat_file(self.dir, self.role).unlink(missing_ok=True)
        index = replica.index_of(self.role)
        if index is not None:
            replica.info_file(self.dir, index).unlink(missing_ok=True)
        log = open(self.dir / "logs" / f"{self.role}.log", "a")
        self.proc = spawn(command(self.role, self.dir), stdout=log, stderr=subprocess.STDOUT,
                          env=role_env(threads, **env))
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def signal(self, signum: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signum)

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def heartbeat_age(self) -> float | None:
        return heartbeat.age(self.dir, self.role)

    def tail(self, lines: int = 15) -> str:
        from asyncrl.supervisor import tail

        return tail(self.dir / "logs" / f"{self.role}.log", lines)

    def log_text(self) -> str:
        path = self.dir / "logs" / f"{self.role}.log"
        return path.read_text(errors="replace")[-2**20:] if path.exists() else ""

    def info(self) -> dict | None:
        """The trainer's directory; a replica's replicas/<i>.json (bound to every interface, its URL names
        this node)."""
        import ray

        if replica.index_of(self.role) is None:
            return {"dir": str(self.dir), "node": ray.util.get_node_ip_address()}
        info = replica.read_info(self.dir, replica.index_of(self.role))
        if info is not None and "://0.0.0.0:" in info["url"]:
            info["url"] = info["url"].replace("0.0.0.0", ray.util.get_node_ip_address())
        return info

    def stage(self, version: int, kind: str, refs: list, digest: str, state_hash: str) -> dict:
        """Fetch version `version` (its full file or its patch) from the object store into this replica's
        directory; returns the /update_weights body that loads it."""
        import ray

        data = ray.get(refs[0])
        if _sha256(data) != digest:
            raise ValueError(f"version {version} ({kind}) arrived with another sha256 than it was sent with")
        path = (weights.patch_file if kind == "patch" else weights.weights_file)(self.dir, version)
        path.parent.mkdir(exist_ok=True)
        write_atomic(path, data)
        weights.prune(self.dir, version, KEEP_STAGED)
        body = {"path": str(weights.weights_file(self.dir, version)), "version": version, "hash": state_hash}
        if kind == "patch":
            body.update(patch=str(path), base_version=version - 1)
        return body

    # --- the trainer's channel (asyncrl/orchestrator/trainer_link.py) --------------------------------
    def receive_batch(self, step: int, refs: list, digest: str) -> bool:
        """Batch `step` from the orchestrator into this directory (kept if it is there already: a batch
        re-sent after a restart is the same batch)."""
        import ray

        path = batch_path(self.dir, step)
        if path.exists() and _sha256(path.read_bytes()) == digest:
            return True
        data = ray.get(refs[0])
        if _sha256(data) != digest:
            raise ValueError(f"batch {step} arrived with another sha256 than it was sent with")
        write_atomic(path, data)
        return True

    def wait_version(self, version: int, timeout: float) -> dict | None:
        """Version `version`'s marker once the trainer has published it; None if not within `timeout`."""
        path = weights.marker_file(self.dir, version)
        deadline = time.monotonic() + timeout
        while not path.exists():
            if time.monotonic() > deadline:
                return None
            time.sleep(0.005)
        return weights.read_marker(self.dir, version)

    def put_version(self, version: int, kind: str) -> tuple[list, str]:
        """Version `version`'s full file or patch in the object store, once (returned in a list: Ray would
        resolve a bare reference)."""
        import ray

        if (version, kind) not in self.published:
            path = (weights.patch_file if kind == "patch" else weights.weights_file)(self.dir, version)
            data = path.read_bytes()
            for old in [k for k in self.published if k[0] < version - KEEP_STAGED]:
                del self.published[old]
            self.published[(version, kind)] = [ray.put(data)], _sha256(data)
        return self.published[(version, kind)]

    def checkpoints(self, verify: bool) -> list[int]:
        """Steps of the complete checkpoints (each file checked against its manifest if `verify`)."""
        from asyncrl import checkpoint

        return checkpoint.valid_steps(checkpoint.checkpoints_dir(self.dir), verify=verify)

    def events_since(self, offset: int) -> tuple[str, int]:
        """The role's events.jsonl from byte `offset` on (whole lines), and the offset after them."""
        path = self.dir / "events.jsonl"
        if not path.exists():
            return "", offset
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read(2**20)
        text = text[: text.rfind(b"\n") + 1]
        return text.decode(errors="replace"), offset + len(text)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.scratch:
            shutil.rmtree(self.dir, ignore_errors=True)


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
        import ray  # (asyncrl/preflight.py has said it is missing, if it is)

        self.ray, self.cfg, self.run_dir, self.log, self.fresh = ray, cfg, run_dir, log, fresh
        _connect(cfg, log)
        self.hosts: dict[str, object] = {}
        self.group = None
        self.bundle_of = {"trainer": 0, **{replica.role(i): i + 1 for i in range(cfg.inference.replicas)}}

    def place(self) -> None:
        from ray.util.placement_group import placement_group

        cfg = self.cfg
        # without run.storage the trainer shares the run directory: it must run on this node
        here = {} if cfg.run.storage else {f"node:{self.ray.util.get_node_ip_address()}": 0.001}
        trainer_cpus = cfg.role_threads("trainer") * cfg.trainer.ranks
        bundles = [{"CPU": trainer_cpus, **here, **cfg.trainer.ray_resources}]
        replica_bundle = {"CPU": cfg.role_threads("inference"), **cfg.inference.ray_resources}
        bundles += [replica_bundle] * cfg.inference.replicas
        self.group = placement_group(bundles, strategy="PACK", name=f"asyncrl-{cfg.run.name}")
        try:
            self.ray.get(self.group.ready(), timeout=cfg.run.ray_placement_timeout)
        except self.ray.exceptions.GetTimeoutError:
            self.ray.util.remove_placement_group(self.group)
            raise ConfigError(
                f"Ray could not place the run's roles within {cfg.run.ray_placement_timeout:.0f}s "
                f"(run.ray_placement_timeout): the trainer needs {bundles[0]} (its threads and "
                f"trainer.ray_resources, on this node) and each of {cfg.inference.replicas} inference "
                f"replica(s) {replica_bundle} (inference.threads and inference.ray_resources); the cluster "
                f"has {self.ray.available_resources()} free. Nothing ran: the same command with "
                "--run.overwrite true starts again") from None
        self.log(f"ray: placed the trainer and {cfg.inference.replicas} inference replica(s): {bundles}")

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
                                read_token(self.run_dir), fresh=self.fresh and role not in self.hosts)
            self.hosts[role] = host, name
            pid = self.ray.get(host.start.remote(threads, env), timeout=self.cfg.timeouts.startup)
        return RemoteRole(host, name, pid, role)

    def _config(self) -> str:
        """The run's config for a host without the run directory: the model path made absolute."""
        tree = json.loads((self.run_dir / "config.json").read_text())
        if Path(tree["model"]["path"]).exists():
            tree["model"]["path"] = str(Path(tree["model"]["path"]).resolve())
        return json.dumps(tree)

    def close(self) -> None:
        """Keep each remote log in the run directory; free the hosts, the group and a cluster we started."""
        for role, (host, _) in self.hosts.items():
            try:
                text = self.ray.get(host.log_text.remote(), timeout=10)
                if text and (role != "trainer" or self.cfg.run.storage):
                    (self.run_dir / "logs" / f"{role}.log").write_text(text)
                self.ray.get(host.close.remote(), timeout=10)
            except (self.ray.exceptions.RayError, OSError):
                pass
            self.ray.kill(host)
        if self.group is not None:
            self.ray.util.remove_placement_group(self.group)
        self.ray.shutdown()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _claim(path: Path, fresh: bool, overwrite: bool) -> None:
    """The trainer's directory in run.storage, on this node: a new run finds it empty, or deletes an earlier
    run's when told to (asyncrl/checkpoint.py: check_storage)."""
    from asyncrl.checkpoint import check_storage

    if fresh and check_storage(path, overwrite, f" (on node {socket.gethostname()})"):
        shutil.rmtree(path)


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
    cpus = max(cfg.role_threads("trainer") + cfg.role_threads("inference") * cfg.inference.replicas,
               os.cpu_count() or 1)
    ray.init(num_cpus=cpus, object_store_memory=256 * 2**20, include_dashboard=False, **quiet)
    log(f"ray: started a local cluster for this run ({cpus} logical CPUs)")


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
