"""The trainer's weights straight into vLLM replicas over NCCL (inference.weight_transfer = "nccl").

NOT YET RUN ON A GPU. Written against vLLM 0.32's weight-transfer API (its NCCL trainer engine and
HTTP client, docs.vllm.ai/en/v0.32.0/training/weight_transfer/) on a machine without one; the tested
default is the file path, where each replica reloads the published file.

The orchestrator still decides when a replica loads a version: its vLLM client pauses the replica
(finishing what is in flight), asks this sender — an HTTP endpoint in the trainer's leader process, on
loopback, behind the run's token — to push the newest published version of at least the one it wants,
and resumes the replica at the version the sender names. The sender broadcasts the full weights the
leader already holds to publish (cast to the serving dtype, moved to the GPU one tensor at a time)
through vLLM's NCCL trainer engine, which itself drives the replica's /start_weight_update,
/update_weights and /finish_weight_update; it never touches the parameters being trained.

Each replica has its own NCCL group (the trainer rank 0, the replica's workers after it), made at its
first update and made again for a new process behind the same URL (the client's `incarnation` changes
whenever it loses the server). NCCL waits forever by default: a send that has not finished within
timeouts.weight_load is answered with an error and its group dropped (its thread may stay blocked in
NCCL); the router then treats the replica as it treats one that failed a load. vLLM checks every
tensor's name, dtype and shape against what was announced; unlike the file path, nothing hashes the
contents on arrival.
"""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch

from asyncrl.control.access import read_token
from asyncrl.files import write_atomic
from asyncrl.run.ports import free_port
from asyncrl.rundir import RunDir


def vllm_workers(args: list[str]) -> int:
    """GPU workers of one vLLM server (each a rank of its NCCL group): tensor × pipeline parallel sizes,
    from inference.vllm_args."""
    sizes = {"tensor": 1, "pipeline": 1}
    names = {"--tensor-parallel-size": "tensor", "-tp": "tensor", "--pipeline-parallel-size": "pipeline",
             "-pp": "pipeline"}
    for i, arg in enumerate(args):
        name, _, value = arg.partition("=")
        if name in names:
            sizes[names[name]] = int(value or args[i + 1])
    return sizes["tensor"] * sizes["pipeline"]


class Published:
    """vLLM's WeightSource over one published version: (name, tensor) on the GPU in the serving dtype."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device, self.dtype = device, dtype
        self.state: dict[str, torch.Tensor] = {}

    def metadata(self):
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [ParamMeta(name, self.dtype, tuple(t.shape)) for name, t in self.state.items()]

    def held_names(self):
        return None  # (one process holds all of them)

    def __iter__(self):
        for name, tensor in self.state.items():
            yield name, tensor.to(self.device, dtype=self.dtype, non_blocking=True)


class Sender:
    def __init__(self, cfg, run_dir: Path):
        self.deadline = cfg.timeouts.weight_load
        self.workers = vllm_workers(cfg.inference.vllm_args)
        self.source = Published(torch.device(cfg.trainer.device), getattr(torch, cfg.inference.dtype))
        self.latest: tuple[int, dict] | None = None  # the newest published version and its full weights
        self.groups: dict[str, tuple[str, object]] = {}  # replica URL -> (incarnation, vLLM trainer engine)
        self.lock = threading.Lock()  # one send at a time (one source, one set of GPU buffers)
        handler = type("Handler", (_Handler,), {"sender": self, "token": read_token(run_dir)})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=self.server.serve_forever, daemon=True, name="weight-sender").start()
        write_atomic(RunDir(run_dir).weight_sender, json.dumps({"url": f"http://127.0.0.1:{self.server.server_port}"}))

    def publish(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """`state`: version `version`'s full weights, which nobody modifies afterwards."""
        self.latest = (version, state)

    def send(self, replica: str, incarnation: str, at_least: int) -> int:
        """Broadcast the newest version (>= `at_least`) into the replica at URL `replica`; its number."""
        if self.latest is None or self.latest[0] < at_least:
            raise LookupError(f"the trainer has not published version {at_least} yet "
                              f"(newest: {self.latest[0] if self.latest else None})")
        version, state = self.latest
        with self.lock:
            self.source.state = state
            self._within_deadline(lambda: self._engine(replica, incarnation).send_weights(), replica)
        return version

    def _engine(self, replica: str, incarnation: str):
        """The replica's NCCL group, made (the replica's workers join inside vLLM's init call) when it has
        none or is a new process."""
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        known = self.groups.get(replica)
        if known is not None and known[0] == incarnation:
            return known[1]
        self._drop(replica)
        info = NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=free_port(),
                                   world_size=1 + self.workers, rank=0)
        client = HTTPVLLMWeightSyncClient(replica, timeout=self.deadline)
        engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=self.source)
        self.groups[replica] = (incarnation, engine)
        return engine

    def _within_deadline(self, work, replica: str) -> None:
        errors: list[BaseException] = []

        def run() -> None:
            try:
                work()
            except BaseException as e:  # reported to the caller below
                errors.append(e)

        thread = threading.Thread(target=run, daemon=True, name="nccl-send")
        thread.start()
        thread.join(self.deadline)
        if thread.is_alive() or errors:
            self.groups.pop(replica, None)  # (a group that failed or hangs is unusable: never shut down)
            if errors:
                raise errors[0]
            raise TimeoutError(f"the NCCL broadcast to {replica} did not finish within {self.deadline:.0f}s "
                               "(timeouts.weight_load); its group is abandoned")

    def _drop(self, replica: str) -> None:
        known = self.groups.pop(replica, None)
        if known is not None:
            try:
                known[1].shutdown()
            except Exception:  # (the replica's process is gone; its half of the group with it)
                pass


class _Handler(BaseHTTPRequestHandler):
    sender: Sender
    token: str | None

    def do_POST(self) -> None:
        if self.path != "/send_weights":
            return self._answer(404, {"error": f"no endpoint {self.path}"})
        if self.token and self.headers.get("Authorization") != f"Bearer {self.token}":
            return self._answer(401, {"error": "the run's token is required (asyncrl/control/access.py)"})
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            replica, incarnation = str(body["replica"]), str(body["incarnation"])
            version = int(body["version"])
        except (ValueError, KeyError, TypeError) as e:
            return self._answer(400, {"error": f"bad /send_weights request: {e!r}"})
        try:
            sent = self.sender.send(replica, incarnation, version)
        except LookupError as e:
            return self._answer(409, {"error": str(e)})
        except Exception as e:  # the broadcast failed or timed out: the client reports it
            return self._answer(500, {"error": f"{type(e).__name__}: {e}"})
        self._answer(200, {"version": sent})

    def _answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:  # (the trainer's log is for the run, not for every request)
        pass

