"""The same client surface over a vLLM OpenAI-compatible server (inference.engine = "vllm").

vLLM takes token ids in and, with `return_token_ids` and `logprobs=0`, gives token ids and the
sampled tokens' logprobs out (start it with `--logprobs-mode processed_logprobs` so they are
those of the sampling distribution, as the built-in engine's are). It has no notion of policy
versions, so this client keeps the version: a weight update pauses vLLM until the requests in
flight finish (pause mode "wait"), reloads the weights from the version's directory through
`/collective_rpc` (`reload_weights`; needs VLLM_SERVER_DEV_MODE=1, and is the path that works on
vLLM's CPU build), and resumes; new requests wait for the update. Every token of a request is
therefore sampled by the version current when the request started: the "finish" policy.
Interrupting mid-request would need per-token versions, which vLLM does not report.

With trainer.lora a version is adapters: the client loads each into vLLM as a LoRA adapter of its own
name (`/v1/load_lora_adapter`, from a PEFT directory beside the version's file; the server is started with
`--enable-lora` and VLLM_ALLOW_RUNTIME_LORA_UPDATING), asks for completions under that name, and unloads
the previous one; version 0 is the base model.

With inference.weight_transfer = "nccl" the reload is replaced by a push: between the pause and the
resume the client asks the trainer's weight sender (asyncrl/transports/weight_sender.py; not yet run on a
GPU) to broadcast its newest version into this server, and records the version it names.
"""
from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from pathlib import Path

from asyncrl.inference.client import InferenceClient, InferenceError
from asyncrl.policy import routing


def version_dir(weights_path: str) -> str:
    """vLLM reloads from a model directory: v000007.safetensors -> v000007/model.safetensors."""
    path = Path(weights_path)
    directory = path.with_suffix("")
    directory.mkdir(exist_ok=True)
    link = directory / "model.safetensors"
    if not link.exists():
        os.symlink(os.path.relpath(path, directory), link)
    return str(directory)


def adapter_dir(weights_path: str) -> str:
    """vLLM loads an adapter from a PEFT directory: v000007.safetensors -> v000007.lora/ holding it as
    adapter_model.safetensors beside the run's adapter_config.json (both links)."""
    path = Path(weights_path)
    directory = path.with_suffix(".lora")
    directory.mkdir(exist_ok=True)
    for name, target in (("adapter_model.safetensors", path), ("adapter_config.json",
                                                              path.parent / "adapter_config.json")):
        if not (directory / name).exists():
            os.symlink(os.path.relpath(target, directory), directory / name)
    return str(directory)


class VLLMClient(InferenceClient):
    def __init__(self, url: str, timeout: float, model: str, sender: Path | None = None,
                 token: str | None = None, adapters: bool = False, routes: bool = False):
        """`sender`: the trainer's weight_sender.json, when versions are broadcast over NCCL (`token`: the
        run's, which the sender asks for). `adapters` (trainer.lora): versions are LoRA adapters. `routes`
        (trainer.routing_replay): each choice carries the experts vLLM routed its tokens to."""
        super().__init__(url, timeout)
        self.model = self.base_model = model  # what completions ask for: the base, or a version's adapter
        self.adapters, self.routes = adapters, routes
        self.sender, self.token = sender, token
        self.incarnation = uuid.uuid4().hex  # a new one whenever the server may be a new process
        self.current_version = 0
        self.updating = asyncio.Event()
        self.updating.set()  # set = no update in progress
        self.tokens_generated = 0
        self.in_flight = 0
        self.busy_since: float | None = None
        self.busy_seconds = 0.0
        self.started = time.monotonic()

    def _track(self, delta: int) -> None:
        """Busy time = wall time with at least one request in flight (vLLM reports no such thing)."""
        now = time.monotonic()
        if self.in_flight and self.busy_since is not None:
            self.busy_seconds += now - self.busy_since
        self.in_flight += delta
        self.busy_since = now

    async def complete(
        self, prompts, n, max_tokens, temperature, top_p=1.0, stop_token_ids=None, cache_prefix=False
    ) -> list[dict]:
        # (cache_prefix: vLLM caches prefixes by itself, automatic prefix caching)
        await self.updating.wait()
        version = self.current_version
        body = {"model": self.model, "prompt": prompts, "n": n, "max_tokens": max_tokens,
                "temperature": temperature, "top_p": top_p, "logprobs": 0, "return_token_ids": True,
                "stop_token_ids": stop_token_ids or [], "skip_special_tokens": True}
        self._track(+1)
        try:
            out = await self._call("POST", "/v1/completions", "a completion request", json=body)
        finally:
            self._track(-1)
        choices = []
        for i, c in enumerate(sorted(out["choices"], key=lambda c: c["index"])):
            ids = c.get("token_ids")
            if ids is None:
                raise InferenceError(
                    f"vLLM at {self.url} returned no token_ids; it needs return_token_ids support "
                    "(vLLM >= 0.10.2)"
                )
            choices.append({
                "index": i, "text": c["text"], "token_ids": ids,
                "logprobs": {"token_logprobs": c["logprobs"]["token_logprobs"]},
                "versions": [version] * len(ids), "finish_reason": c["finish_reason"], "prompt_index": i // n,
                **({"routing": self._routing(c)} if self.routes else {}),
            })
        self.tokens_generated += sum(len(c["token_ids"]) for c in choices)
        return choices

    def _routing(self, choice: dict) -> dict:
        """The choice's routed experts (prompt and completion, all but the last token), packed as the
        built-in engine packs them."""
        if not choice.get("routed_experts"):
            raise InferenceError(f"vLLM at {self.url} returned no routed_experts: trainer.routing_replay "
                                 "needs it started with --enable-return-routed-experts (vLLM >= 0.22)")
        return routing.from_npy(choice["routed_experts"])

    async def complete_groups(self, prompts, n, max_tokens, temperature, top_p, on_group) -> None:
        """A request per prompt, all at once: vLLM answers a request when all of its prompts are done."""
        async def one(i: int, prompt: list[int]) -> None:
            on_group(i, await self.complete([prompt], n, max_tokens, temperature, top_p))

        tasks = [asyncio.ensure_future(one(i, p)) for i, p in enumerate(prompts)]
        try:
            await asyncio.gather(*tasks)
        finally:  # (on the first failure the others stop: what was not delivered is asked again)
            for task in tasks:
                task.cancel()

    async def update_weights(self, body: dict, timeout: float) -> dict:
        version = body["version"]
        self.updating.clear()
        try:
            await self._call("POST", "/pause?mode=wait", f"pausing before version {version}", timeout)
            if self.sender is not None:
                version = await self._pushed(version, timeout)
            elif self.adapters:
                await self._swap_adapter(version, body["path"], timeout)
            else:
                rpc = {"method": "reload_weights", "kwargs": {"weights_path": version_dir(body["path"])}}
                await self._call(
                    "POST", "/collective_rpc", f"reloading weights version {version}", timeout, json=rpc
                )
            await self._call("POST", "/resume", f"resuming after version {version}", timeout)
            self.current_version = version
        finally:
            self.updating.set()
        return {"version": version, "loaded_from": "full"}

    async def _swap_adapter(self, version: int, path: str, timeout: float) -> None:
        """Load version `version`'s adapters under the name v<version>, serve it, unload the one before."""
        name, before = f"v{version}", self.model
        load = {"lora_name": name, "lora_path": adapter_dir(path)}
        try:  # (vLLM answers these two in plain text)
            await self._call("POST", "/v1/load_lora_adapter", f"loading adapters of version {version}",
                             timeout, json=load, text=True)
        except InferenceError as e:  # a retry of a load that landed: vLLM has the name already
            if "already" not in str(e):
                raise
        self.model = name
        if before not in (self.base_model, name):  # (the requests of the old one are done: paused)
            await self._call("POST", "/v1/unload_lora_adapter", f"unloading adapters {before}", timeout,
                             json={"lora_name": before}, text=True)

    async def _pushed(self, version: int, timeout: float) -> int:
        """Have the trainer broadcast its newest version (>= `version`) into this server; that version."""
        try:
            where = json.loads(self.sender.read_text())["url"]
        except (OSError, ValueError, KeyError):
            raise InferenceError(f"the trainer's weight sender has not said where it listens "
                                 f"({self.sender}); version {version} cannot reach {self.url}") from None
        request = {"replica": self.url, "incarnation": self.incarnation, "version": version}
        async with InferenceClient(where, timeout, self.token) as trainer:
            what = f"broadcasting version {version} to {self.url} over NCCL (the trainer's weight sender)"
            out = await trainer._call("POST", "/send_weights", what, timeout, json=request)
        return int(out["version"])

    async def version(self, with_hash: bool = False) -> dict:
        return {"version": self.current_version}

    def forget_version(self) -> None:
        """After a lost connection the server may be a fresh one, and vLLM cannot say which version it
        holds: take it for version 0 (what a started server loads: model.path, no adapter). The router then
        loads the served version into it whenever that is not 0. (-1 here stamped every sample of a run
        still at version 0 with -1: all dropped as too stale.)"""
        self.current_version = 0
        self.model = self.base_model
        self.incarnation = uuid.uuid4().hex

    async def stats(self) -> dict:
        self._track(0)
        return {"tokens_generated": self.tokens_generated, "busy_seconds": self.busy_seconds,
                "uptime_seconds": time.monotonic() - self.started, "version": self.current_version}

    async def _call(
        self, method: str, endpoint: str, what: str, timeout: float | None = None, **kwargs
    ) -> dict:
        out = await super()._call(method, endpoint, what, timeout, **kwargs)
        return out if out is not None else {}
