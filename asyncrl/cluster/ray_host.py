"""One role's process on one node, under run.launcher = "ray": the `RoleHost` actor.

The host starts the role as the same process the local launcher starts, bound to the host's life, and
answers the supervisor's questions about it (exit code, heartbeat age, last log lines). It also carries
the channels that replace shared files: a replica's weights arrive through `stage` (from the object
store, sha256-checked), the trainer's batches through `receive_batch` and its versions leave through
`put_version` (asyncrl/transports/trainer_link.py). A trainer of several ranks is one host per rank:
the leader's host starts the others, each in its own bundle of the run's placement group, and stops the
whole group when any of them dies.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from asyncrl.files import write_atomic
from asyncrl.inference import replica
from asyncrl.run import heartbeat
from asyncrl.run.ports import free_port
from asyncrl.rundir import RunDir
from asyncrl.transports import weights

NAMESPACE = "asyncrl"
KEEP_STAGED = 2  # versions a replica's directory keeps (the held one and the one it loads)


class RoleHost:
    """One role's process on one node (a Ray actor: `ray.remote(RoleHost)`)."""

    def __init__(self, role: str, run_dir: str | None, config: str, token: str, fresh: bool = False,
                 group=None, rank: int = 0):
        """`run_dir`: the run directory, when this node shares it (the trainer without run.storage); else
        the trainer's directory in run.storage (it outlives this host: checkpoints, published versions,
        delivered batches), or a replica's scratch directory. `fresh`: the first host of a new run.
        `group`: the run's placement group, where the trainer's leader places its other ranks; `rank` > 0:
        such a rank, in the leader's directory (`run_dir`)."""
        self.role, self.rank, self.group = role, rank, group
        self.log_name = f"{role}.rank{rank}" if rank else role
        self.proc: subprocess.Popen | None = None
        self.followers: list = []  # the leader's: a host per other rank
        self.scratch = False
        self.published: dict[tuple[int, str], tuple] = {}  # the trainer's: (version, kind) -> (ref, sha256)
        if run_dir is not None:
            self.dir = Path(run_dir)
            if not (RunDir(self.dir).config).exists():  # (a rank on a node that does not mount it)
                raise FileNotFoundError(
                    f"trainer rank {rank} on node {socket.gethostname()} cannot see {self.dir}: the ranks of "
                    "a trainer on several nodes share its directory, so run.storage must be a path every "
                    "trainer node mounts (or pin the trainer to one node with trainer.ray_resources)")
            return
        tree = json.loads(config)  # its run directory is its own: no path leads to the driver's
        if role == "trainer":
            self.dir = Path(tree["run"]["storage"]) / tree["run"]["name"]
            _claim(self.dir, fresh, tree["run"]["overwrite"])
            tree["run"]["root"] = tree["run"]["storage"]
        else:
            self.dir, self.scratch = Path(tempfile.mkdtemp(prefix=f"asyncrl-{role}-")), True
            tree["run"].update(root=str(self.dir.parent), name=self.dir.name)
        (RunDir(self.dir).logs).mkdir(parents=True, exist_ok=True)
        write_atomic(RunDir(self.dir).config, json.dumps(tree))
        write_atomic(RunDir(self.dir).token, token)
        os.chmod(RunDir(self.dir).token, 0o600)

    def start(self, threads: int, env: dict) -> int:
        from asyncrl.run.processes import command, role_env, spawn

        if self.rank == 0:
            RunDir(self.dir).heartbeat(self.role).unlink(missing_ok=True)
        server = replica.server_of(self.role)
        if server is not None:
            replica.info_path(self.dir, server[1], server[0]).unlink(missing_ok=True)
        if self.role == "trainer" and self.rank == 0 and self._config()["trainer"]["ranks"] > 1:
            env = {**env, **self._start_followers(threads, env)}
        log = open(RunDir(self.dir).log(self.log_name), "a")
        self.proc = spawn(command(self.role, self.dir), stdout=log, stderr=subprocess.STDOUT,
                          env=role_env(threads, **env))
        return self.proc.pid

    def _config(self) -> dict:
        return json.loads((RunDir(self.dir).config).read_text())

    # --- a trainer of several ranks: the leader's host starts and watches the others ------------------
    def _start_followers(self, threads: int, env: dict) -> dict:
        """Ranks 1..M-1, each in a host of its own in bundles 1..M-1 of the run's placement group (on
        whatever nodes hold them), joining a group whose rank 0 is this host's process; returns the
        environment that makes it so (asyncrl/trainer/ranks.py: join_group)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from asyncrl.trainer.ranks import HOSTED_ENV, RANK_ENV

        self._stop_followers()  # a restart: the whole group starts again
        group_env = {"MASTER_ADDR": ray.util.get_node_ip_address(), "MASTER_PORT": str(free_port("")),
                     HOSTED_ENV: "1"}
        me, cfg = ray.get_runtime_context().get_actor_name(), self._config()
        for rank in range(1, cfg["trainer"]["ranks"]):
            strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=rank)
            host = ray.remote(RoleHost).options(
                name=f"{me}.rank{rank}", namespace=NAMESPACE, num_cpus=0, scheduling_strategy=strategy,
                max_concurrency=4).remote(self.role, str(self.dir), "", "", rank=rank)
            self.followers.append(host)
            ray.get(host.start.remote(threads, {**env, **group_env, RANK_ENV: str(rank)}),
                    timeout=cfg["timeouts"]["startup"])
        return {**group_env, RANK_ENV: "0"}

    def _dead_follower(self) -> int | None:
        """The exit code of a rank that failed (its host gone: -9), having stopped the group; else None."""
        import ray

        for rank, host in enumerate(self.followers, 1):
            try:
                code = ray.get(host.poll.remote(), timeout=5)
            except ray.exceptions.RayActorError:
                code = -9
            except ray.exceptions.GetTimeoutError:
                continue
            if code:  # (0: it finished the run's last step, as the leader will)
                with open(RunDir(self.dir).log(self.log_name), "a") as log:
                    log.write(f"trainer: rank {rank} exited with code {code}; the group stops with it\n")
                self.proc.kill()
                self.proc.wait()
                self._stop_followers()
                return code
        return None

    def _stop_followers(self) -> None:
        import ray

        for host in self.followers:
            try:
                ray.get(host.close.remote(), timeout=10)
            except ray.exceptions.RayError:
                pass
            ray.kill(host)
        self.followers = []

    def node(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def poll(self) -> int | None:
        code = self.proc.poll()
        if code is None and self.followers:
            return self._dead_follower()
        if code and self.followers:  # the leader failed: no rank waits on it until its collective times out
            self._stop_followers()
        return code

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
        from asyncrl.run.processes import tail

        return tail(RunDir(self.dir).log(self.log_name), lines)

    def log_text(self) -> str:
        path = RunDir(self.dir).log(self.log_name)
        return path.read_text(errors="replace")[-2**20:] if path.exists() else ""

    def info(self) -> dict | None:
        """The trainer's directory; a replica's replicas/<i>.json, a teacher's teachers/<i>.json (bound to
        every interface, its URL names this node)."""
        import ray

        server = replica.server_of(self.role)
        if server is None:  # the trainer: and the node of each rank
            nodes = [self.node()] + [ray.get(host.node.remote(), timeout=10) for host in self.followers]
            return {"dir": str(self.dir), "node": ray.util.get_node_ip_address(), "rank_nodes": nodes}
        info = replica.read_info(self.dir, server[1], server[0])
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
        path = (RunDir(self.dir).patch if kind == "patch" else RunDir(self.dir).weights_file)(version)
        path.parent.mkdir(exist_ok=True)
        write_atomic(path, data)
        weights.prune(self.dir, version, KEEP_STAGED)
        body = {"path": str(RunDir(self.dir).weights_file(version)), "version": version, "hash": state_hash}
        if kind == "patch":
            body.update(patch=str(path), base_version=version - 1)
        return body

    # --- the trainer's channel (asyncrl/transports/trainer_link.py) --------------------------------
    def receive_batch(self, step: int, refs: list, digest: str) -> bool:
        """Batch `step` from the orchestrator into this directory (kept if it is there already: a batch
        re-sent after a restart is the same batch)."""
        import ray

        path = RunDir(self.dir).batch(step)
        if path.exists() and _sha256(path.read_bytes()) == digest:
            return True
        data = ray.get(refs[0])
        if _sha256(data) != digest:
            raise ValueError(f"batch {step} arrived with another sha256 than it was sent with")
        write_atomic(path, data)
        return True

    def wait_version(self, version: int, timeout: float) -> dict | None:
        """Version `version`'s marker once the trainer has published it; None if not within `timeout`."""
        path = RunDir(self.dir).marker(version)
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
            path = (RunDir(self.dir).patch if kind == "patch" else RunDir(self.dir).weights_file)(version)
            data = path.read_bytes()
            for old in [k for k in self.published if k[0] < version - KEEP_STAGED]:
                del self.published[old]
            self.published[(version, kind)] = [ray.put(data)], _sha256(data)
        return self.published[(version, kind)]

    def checkpoints(self, verify: bool) -> list[int]:
        """Steps of the complete checkpoints (each file checked against its manifest if `verify`)."""
        from asyncrl.store import checkpoint

        return checkpoint.valid_steps(RunDir(self.dir).checkpoints, verify=verify)

    def events_since(self, offset: int) -> tuple[str, int]:
        """The role's events.jsonl from byte `offset` on (whole lines), and the offset after them."""
        path = RunDir(self.dir).events
        if not path.exists():
            return "", offset
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read(2**20)
        text = text[: text.rfind(b"\n") + 1]
        return text.decode(errors="replace"), offset + len(text)

    def close(self) -> None:
        self._stop_followers()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.scratch:
            shutil.rmtree(self.dir, ignore_errors=True)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()



def _claim(path: Path, fresh: bool, overwrite: bool) -> None:
    """The trainer's directory in run.storage, on this node: a new run finds it empty, or deletes an earlier
    run's when told to (asyncrl/store/checkpoint.py: check_storage)."""
    from asyncrl.store.checkpoint import check_storage

    if fresh and check_storage(path, overwrite, f" (on node {socket.gethostname()})"):
        shutil.rmtree(path)


