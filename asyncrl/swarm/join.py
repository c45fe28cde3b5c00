"""`asyncrl worker --join URL --token T [--dir D] [--device cpu] [--threads N] [--max-bytes-per-second B]
[--give-up-after S] [--vllm-python PYTHON]`: an inference worker on a machine the run does not own.

It joins through the run's gateway (asyncrl/swarm/gateway.py), fetches the initial model's files, starts
an inference server on loopback over a directory of its own (D, shaped like a run directory: asyncrl's
engine, or vLLM's OpenAI server run by PYTHON, which reloads each version in full), and
then polls: each answer says which version to hold (fetched as a sparse patch when it is the next one and
smaller, else in full; hash-checked twice: the file's sha256, then the loaded weights' hash by the server)
and may carry a lease of work, which it generates on its server and returns a prompt at a time. The poll
is its heartbeat; a lease it stops naming is issued again elsewhere. It stops when the gateway says it is
revoked or quarantined, when its server dies, or when the gateway cannot be reached for `give_up` seconds.
"""
from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from asyncrl.config import read_run_config
from asyncrl.control.access import ensure_token, read_token
from asyncrl.files import apoll, write_atomic
from asyncrl.inference import replica
from asyncrl.inference.client import InferenceError
from asyncrl.orchestrator.replicas import client_for
from asyncrl.run.processes import start_role, start_vllm
from asyncrl.rundir import RunDir
from asyncrl.swarm.download import DownloadError, fetch

log = logging.getLogger("asyncrl.worker")
GIVE_UP = 120.0  # seconds without reaching the gateway: the run has ended or is gone


class WorkerStopped(RuntimeError):
    pass


class Worker:
    def __init__(self, url: str, token: str, workdir: Path, device: str = "cpu", threads: int = 1,
                 rate: float | None = None, give_up: float = GIVE_UP, vllm_python: str | None = None):
        self.url, self.workdir, self.device, self.threads = url.rstrip("/"), Path(workdir), device, threads
        self.rate, self.give_up, self.token, self.vllm_python = rate, give_up, token, vllm_python
        self.held, self.loading = 0, None  # the version the server holds; the one being fetched
        self.running: set[str] = set()  # leases being worked on
        self.tasks: set[asyncio.Task] = set()
        self.loaded = asyncio.Event()  # a version finished loading: tell the gateway at once
        self.stopped: Exception | None = None

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=60)
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {self.token}"},
                                         timeout=timeout) as self.session:
            joined = await self._call("POST", "/v1/join", {})
            log.info(f"worker {joined['worker']}: joined {self.url}, version {joined['served']} served")
            await self._mirror(joined)
            server = self._start_server(joined["config"])
            try:
                info = await apoll(lambda: replica.read_info(self.workdir, 0), 300,
                                   f"worker: its inference server wrote no {RunDir(self.workdir).replica(0)}")
                cfg = read_run_config(self.workdir)
                async with client_for(cfg, info["url"], read_token(self.workdir), self.workdir) as self.local:
                    await self.local.wait_healthy(600)
                    await self._poll(server)
            finally:
                for task in self.tasks:
                    task.cancel()
                await asyncio.gather(*self.tasks, return_exceptions=True)
                server.terminate()
                server.wait(30)

    async def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        """One gateway call, retried through a lost connection for `give_up` seconds; 401/403: stop."""
        end = time.monotonic() + self.give_up
        while True:
            try:
                async with self.session.request(method, self.url + path, json=body) as resp:
                    answer = await resp.json(content_type=None)
                    if resp.status in (401, 403):
                        raise WorkerStopped(f"the gateway refuses this worker: {answer.get('error')}")
                    if resp.status != 200:
                        raise InferenceError(f"the gateway answered {path} with {resp.status}: {answer}")
                    return answer
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                if time.monotonic() > end:
                    raise WorkerStopped(f"the gateway {self.url} unreachable for {self.give_up:.0f}s: "
                                        f"{e}") from None
                await asyncio.sleep(1.0)

    # --- the model and the server --------------------------------------------------------------------
    async def _mirror(self, joined: dict) -> None:
        model = self.workdir / "model"
        model.mkdir(parents=True, exist_ok=True)
        for name, blob in joined["model"].items():
            await fetch(self.session, f"{self.url}/v1/blobs/{blob['blob']}", blob["blob"], blob["size"],
                        model / name, self.rate)

    def _start_server(self, config: dict) -> subprocess.Popen:
        config["model"]["path"] = str(self.workdir / "model")
        config["inference"].update(host="127.0.0.1", port=0, device=self.device, threads=self.threads,
                                   engine="vllm" if self.vllm_python else "builtin", weight_transfer="files")
        if self.vllm_python:  # (vLLM reports no per-token versions: a version lands between requests)
            config["inference"].update(vllm_python=self.vllm_python, update_policy="finish")
        config["run"]["storage"] = ""
        RunDir(self.workdir).weights.mkdir(exist_ok=True)
        RunDir(self.workdir).logs.mkdir(exist_ok=True)
        RunDir(self.workdir).replica(0).unlink(missing_ok=True)
        ensure_token(self.workdir)
        write_atomic(RunDir(self.workdir).config, json.dumps(config))
        # (either dies with this process: asyncrl/run/processes.py)
        if self.vllm_python:
            return start_vllm(read_run_config(self.workdir), self.workdir, self.threads, 0)
        return start_role(replica.role(0), self.workdir, self.threads)

    async def _load(self, version: int) -> None:
        """Fetch `version` (a patch from the one held when there is one and it is smaller) and load it."""
        try:
            files = await self._call("GET", f"/v1/versions/{version}")
            run = RunDir(self.workdir)
            body = {"path": str(run.weights_file(version)), "version": version, "hash": files["hash"]}
            patch = files.get("patch") if not self.vllm_python else None  # (vLLM reloads whole files)
            if patch and patch["base_version"] == self.held and patch["size"] < files["full"]["size"]:
                await self._blob(patch, run.patch(version))
                body.update(patch=str(run.patch(version)), base_version=self.held)
            else:
                await self._blob(files["full"], run.weights_file(version))
            try:
                await self.local.update_weights(body, 600)
            except InferenceError:
                if "patch" not in body:
                    raise
                await self._blob(files["full"], run.weights_file(version))
                body.pop("patch"), body.pop("base_version")
                await self.local.update_weights(body, 600)
            self.held = version
            self.loaded.set()
            for old in range(max(0, version - 8), version):
                run.weights_file(old).unlink(missing_ok=True)
                run.patch(old).unlink(missing_ok=True)
        except (InferenceError, DownloadError) as e:  # (pruned or reused meanwhile: the next poll says)
            log.warning(f"worker: loading version {version} failed: {e}")
            await asyncio.sleep(1.0)  # (not a poll loop at full speed)
        finally:
            self.loading = None

    async def _blob(self, blob: dict, dest: Path) -> None:
        await fetch(self.session, f"{self.url}/v1/blobs/{blob['blob']}", blob["blob"], blob["size"], dest,
                    self.rate)

    # --- work ---------------------------------------------------------------------------------
    async def _poll(self, server: subprocess.Popen) -> None:
        while True:
            if server.poll() is not None:
                raise WorkerStopped(f"its inference server exited ({server.returncode}): "
                                    f"{RunDir(self.workdir).log('inference-0')}")
            if self.stopped:
                raise self.stopped
            self.loaded.clear()
            body = {"version": self.held, "working": sorted(self.running), "loading": self.loading}
            poll = asyncio.ensure_future(self._call("POST", "/v1/work", body))
            woken = asyncio.ensure_future(self.loaded.wait())
            await asyncio.wait([poll, woken], return_when=asyncio.FIRST_COMPLETED)
            woken.cancel()
            if not poll.done():  # a version loaded: say so now rather than at the poll's end
                poll.cancel()
                await asyncio.gather(poll, return_exceptions=True)
                continue
            answer = poll.result()
            if answer["load"] > self.held and self.loading is None:
                self.loading = answer["load"]
                self._spawn(self._load(answer["load"]))
            if answer["work"]:
                self._spawn(self._work(answer["work"]))

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() and not self.stopped:
            self.stopped = task.exception()

    async def _work(self, work: dict) -> None:
        self.running.add(work["lease"])
        sends = []
        try:
            def arrived(i: int, choices: list[dict]) -> None:
                sends.append(asyncio.ensure_future(self._send(work, i, choices)))

            await self.local.complete_groups(work["prompts"], work["n"], work["max_tokens"],
                                             work["temperature"], work["top_p"], arrived)
            await asyncio.gather(*sends)
        except InferenceError as e:  # (the lease expires and is issued again elsewhere)
            log.warning(f"worker: lease {work['lease']} failed: {e}")
        finally:
            self.running.discard(work["lease"])

    async def _send(self, work: dict, i: int, choices: list[dict]) -> None:
        body = {"lease": work["lease"], "prompt_index": i, "prompt_sha256": work["prompt_sha256"][i],
                "choices": self.outgoing(work, i, choices)}
        try:
            await self._call("POST", "/v1/results", body)
        except InferenceError as e:  # (410: given before the orchestrator restarted, and issued again)
            log.warning(f"worker: the gateway refused lease {work['lease']} prompt {i}: {e}")

    def outgoing(self, work: dict, i: int, choices: list[dict]) -> list[dict]:
        """The samples as returned (a test's dishonest worker changes them here)."""
        return choices


def main(args: list[str], take, kind=Worker) -> int:
    """`kind`: the Worker class to run (a test's dishonest one)."""
    url, token = take(args, "--join", True), take(args, "--token", True)
    workdir = take(args, "--dir", True) or "worker"
    device, threads = take(args, "--device", True) or "cpu", take(args, "--threads", True) or "1"
    rate = take(args, "--max-bytes-per-second", True)
    give_up = take(args, "--give-up-after", True) or str(int(GIVE_UP))
    vllm_python = take(args, "--vllm-python", True)
    numbers = [x for x in (threads, rate, give_up) if x is not None]
    if not url or not token or args or not all(x.isdigit() for x in numbers):
        from asyncrl.errors import ConfigError

        raise ConfigError("usage: asyncrl worker --join URL --token T [--dir DIR] [--device cpu] "
                          "[--threads N] [--max-bytes-per-second B] [--give-up-after SECONDS] "
                          "[--vllm-python PYTHON]")
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(asctime)s %(levelname)s %(message)s")
    try:
        worker = kind(url, token, Path(workdir), device, int(threads), int(rate) if rate else None,
                      float(give_up), vllm_python)
        asyncio.run(worker.run())
    except WorkerStopped as e:
        print(f"asyncrl worker: stopped: {e}", file=sys.stderr)
        return 1
    return 0
