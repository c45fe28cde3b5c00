"""Getting a version's weights to a replica before it is told to load them.

A replica on this machine reads them from the run directory. A replica under Ray (run.launcher = "ray")
may be on a node without it: the version's file (or its sparse patch) goes into Ray's object store once,
whatever the number of replicas, and the actor hosting each replica fetches it to its node, checks its
sha256 and writes it into the replica's own directory (asyncrl/cluster/ray_host.py); the replica then loads
it from there as from any run directory, and checks the weights' hash as always.
"""
from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

from asyncrl.inference.client import InferenceError, InferenceUnavailable
from asyncrl.transports import weights


class Stager:
    def __init__(self, run_dir: Path, timeout: float, fetch=None):
        """`fetch(version, kind)`: (object ref, sha256) of a version put by the trainer's own host, when the
        trainer is on another node (asyncrl/transports/trainer_link.py); else the run directory's file
        is put here."""
        self.run_dir, self.timeout, self.fetch = run_dir, timeout, fetch
        self.refs: dict[tuple[int, str], tuple] = {}  # (version, "full" | "patch") -> (object ref, sha256)
        self.actors: dict[str, object] = {}  # by the host actor's id
        self.ray = None

    async def body(self, info: dict, version: int, marker: dict, patch: bool) -> dict:
        """The /update_weights body for the replica described by `info` (its replicas/<i>.json)."""
        if self.fetch is None:
            local = weights.load_request(self.run_dir, version, marker, patch)
            if "actor" not in info:
                return local
            actor = self._actor(info)
            kind = "patch" if "patch" in local else "full"
            ref, digest = await self._put(version, kind, Path(local.get("patch") or local["path"]))
        else:  # (a patch was published with the version when its marker has its fraction)
            kind = "patch" if patch and "patch_fraction" in marker else "full"
            if (version, kind) not in self.refs:
                self.refs[(version, kind)] = await self.fetch(version, kind)
            ref, digest = self.refs[(version, kind)]
            actor = self._actor(info)
        served_hash = marker.get("serving_hash", marker["hash"])
        try:
            return await asyncio.wait_for(actor.stage.remote(version, kind, [ref], digest, served_hash),
                                          timeout=self.timeout)
        except asyncio.TimeoutError:
            raise InferenceError(f"replica {info['actor']} did not fetch version {version} within "
                                 f"{self.timeout:.0f}s (timeouts.weight_load)") from None
        except self.ray.exceptions.RayActorError as e:  # its node or its host died: a dead replica
            self.actors.pop(info["host"], None)
            raise InferenceUnavailable(f"replica {info['actor']} is gone: {e}") from None
        except self.ray.exceptions.RayTaskError as e:  # (the copy may be lost with the trainer's host)
            self.refs.pop((version, kind), None)
            raise InferenceError(f"replica {info['actor']} could not stage version {version}: {e}") from None

    async def _put(self, version: int, kind: str, path: Path) -> tuple[object, str]:
        if (version, kind) not in self.refs:
            def put():
                data = path.read_bytes()
                return self.ray.put(data), hashlib.sha256(data).hexdigest()
            self.refs[(version, kind)] = await asyncio.to_thread(put)
        return self.refs[(version, kind)]

    def _actor(self, info: dict):
        if self.ray is None:
            import ray

            if not ray.is_initialized():
                ray.init(address=info["ray_address"], namespace=info["namespace"], log_to_driver=False,
                         logging_level="WARNING")
            self.ray = ray
        if info["host"] not in self.actors:  # (a replica whose host died has a new one: a new id)
            self.actors[info["host"]] = self.ray.get_actor(info["actor"], namespace=info["namespace"])
        return self.actors[info["host"]]

    def forget_before(self, version: int) -> None:
        """Free the object-store copies of versions no replica will load again."""
        for key in [k for k in self.refs if k[0] < version]:
            del self.refs[key]

    def close(self) -> None:
        self.refs.clear()
        if self.ray is not None:
            self.ray.shutdown()
