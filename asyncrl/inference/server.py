"""The inference server role: the engine behind HTTP.

    POST /v1/completions   token ids in; token ids, per-token logprobs and versions out
    GET  /health           200 once the model is loaded
    GET  /version          {"version": v}; with ?hash=1 also the sha256 of the served weights
    POST /update_weights   {"path": ..., "version": v}: load a safetensors file as version v
    GET  /stats            tokens generated, seconds busy, seconds up

One worker thread owns the engine. Requests queue up; the worker takes every waiting request
with the same sampling settings into one batch. A weight update waits for the batch in flight,
then loads, so every token of a batch carries one version.

Run as `python -m asyncrl.inference.server RUN_DIR`; it writes RUN_DIR/inference.json with its URL.
"""
from __future__ import annotations

import asyncio
import json
import os
import queue
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from aiohttp import web

from asyncrl import weights
from asyncrl.config import read_run_config
from asyncrl.inference.engine import Engine, SamplingParams
from asyncrl.model import load_policy


@dataclass
class _Job:
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    prompts: list[list[int]] | None = None  # a generation job
    params: SamplingParams | None = None
    weights_path: str | None = None  # or a weight-update job
    version: int = 0


class Worker:
    """The thread that runs the engine, one job (batch or weight load) at a time."""

    def __init__(self, engine: Engine, max_sequences: int):
        self.engine = engine
        self.max_sequences = max_sequences
        self.jobs: queue.Queue[_Job] = queue.Queue()
        self.busy_seconds = 0.0
        self.started = time.monotonic()
        threading.Thread(target=self._run, daemon=True, name="engine").start()

    def submit(self, job: _Job) -> asyncio.Future:
        self.jobs.put(job)
        return job.future

    def _next_batch(self, first: _Job) -> tuple[list[_Job], list[_Job]]:
        """`first` plus every queued generation job with the same params; the rest go back."""
        batch, rest, size = [first], [], len(first.prompts)
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return batch, rest
            if job.prompts is not None and job.params == first.params and size + len(job.prompts) <= self.max_sequences:
                batch.append(job)
                size += len(job.prompts)
            else:
                rest.append(job)

    def _run(self) -> None:
        pending: list[_Job] = []
        while True:
            job = pending.pop(0) if pending else self.jobs.get()
            start = time.monotonic()
            if job.weights_path is not None:
                self._finish([job], lambda: self._load(job))
            else:
                batch, rest = self._next_batch(job)
                pending = rest + pending
                self._finish(batch, lambda: self._generate(batch))
            self.busy_seconds += time.monotonic() - start

    def _load(self, job: _Job) -> list[dict]:
        self.engine.load_state(weights.load(job.weights_path), job.version)
        return [{"version": job.version}]

    def _generate(self, batch: list[_Job]) -> list:
        prompts = [p for job in batch for p in job.prompts]
        samples = self.engine.generate(prompts, batch[0].params)
        out, i = [], 0
        for job in batch:
            out.append(samples[i : i + len(job.prompts)])
            i += len(job.prompts)
        return out

    @staticmethod
    def _finish(jobs: list[_Job], work) -> None:
        try:
            results = work()
        except Exception as e:  # the error goes to the callers; the worker lives on
            for job in jobs:
                job.loop.call_soon_threadsafe(_set_exception, job.future, e)
            return
        for job, result in zip(jobs, results):
            job.loop.call_soon_threadsafe(_set_result, job.future, result)


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: Exception) -> None:
    if not fut.done():
        fut.set_exception(exc)


class BadRequest(ValueError):
    pass


def parse_completion_request(body: dict, vocab_size: int, max_prompt_tokens: int, eos_id: int | None):
    """(prompts repeated n times, SamplingParams, n) from an OpenAI-style completions body."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        prompts = prompt
    else:
        raise BadRequest("'prompt' must be a non-empty list of token ids or a list of such lists")
    for p in prompts:
        if not p or not all(isinstance(t, int) and 0 <= t < vocab_size for t in p):
            raise BadRequest(f"prompt token ids must be integers in [0, {vocab_size}) and non-empty")
        if len(p) > max_prompt_tokens:
            raise BadRequest(f"prompt has {len(p)} tokens; the limit is {max_prompt_tokens}")
    n, max_tokens = body.get("n", 1), body.get("max_tokens", 16)
    temperature, top_p = body.get("temperature", 1.0), body.get("top_p", 1.0)
    if not isinstance(n, int) or n < 1:
        raise BadRequest(f"'n' must be a positive integer, got {n!r}")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise BadRequest(f"'max_tokens' must be a positive integer, got {max_tokens!r}")
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise BadRequest(f"'temperature' must be >= 0, got {temperature!r}")
    if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise BadRequest(f"'top_p' must be in (0, 1], got {top_p!r}")
    stops = tuple(body.get("stop_token_ids") or ())
    params = SamplingParams(max_tokens, float(temperature), float(top_p), stops)
    return [p for p in prompts for _ in range(n)], params, n


def make_app(worker: Worker, tokenizer, model_name: str, max_prompt_tokens: int, load_timeout: float) -> web.Application:
    engine = worker.engine
    vocab = engine.model.get_input_embeddings().num_embeddings

    async def completions(request: web.Request) -> web.Response:
        try:
            body = await request.json()
            prompts, params, n = parse_completion_request(body, vocab, max_prompt_tokens, engine.eos_id)
        except (BadRequest, json.JSONDecodeError) as e:
            return web.json_response({"error": {"message": str(e), "type": "invalid_request_error"}}, status=400)
        loop = asyncio.get_running_loop()
        samples = await worker.submit(_Job(loop.create_future(), loop, prompts=prompts, params=params))
        choices = [
            {
                "index": i,
                "text": tokenizer.decode(s.token_ids, skip_special_tokens=True),
                "token_ids": s.token_ids,
                "logprobs": {"token_logprobs": s.logprobs},
                "versions": s.versions,
                "finish_reason": s.finish_reason,
                "prompt_index": i // n,
            }
            for i, s in enumerate(samples)
        ]
        completion_tokens = sum(len(s.token_ids) for s in samples)
        return web.json_response({
            "id": f"cmpl-{uuid.uuid4().hex[:12]}", "object": "text_completion", "created": int(time.time()),
            "model": model_name, "choices": choices,
            "usage": {"prompt_tokens": sum(len(p) for p in prompts), "completion_tokens": completion_tokens},
        })

    async def update_weights(request: web.Request) -> web.Response:
        body = await request.json()
        path, version = body.get("path"), body.get("version")
        if not isinstance(path, str) or not Path(path).is_file() or not isinstance(version, int):
            return web.json_response({"error": {"message": f"need an existing 'path' and an int 'version', got {body}"}}, status=400)
        loop = asyncio.get_running_loop()
        fut = worker.submit(_Job(loop.create_future(), loop, weights_path=path, version=version))
        try:
            await asyncio.wait_for(fut, load_timeout)
        except asyncio.TimeoutError:
            return web.json_response({"error": {"message": f"loading version {version} from {path} took over {load_timeout}s"}}, status=504)
        except Exception as e:
            return web.json_response({"error": {"message": f"loading version {version} from {path} failed: {e}"}}, status=500)
        return web.json_response({"version": engine.version})

    async def version(request: web.Request) -> web.Response:
        out = {"version": engine.version}
        if request.query.get("hash"):
            out["hash"] = weights.state_hash(weights.model_state(engine.model))
        return web.json_response(out)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "version": engine.version})

    async def stats(request: web.Request) -> web.Response:
        return web.json_response({
            "tokens_generated": engine.tokens_generated, "busy_seconds": worker.busy_seconds,
            "uptime_seconds": time.monotonic() - worker.started, "version": engine.version,
        })

    app = web.Application(client_max_size=64 * 2**20)
    app.add_routes([
        web.post("/v1/completions", completions), web.post("/update_weights", update_weights),
        web.get("/version", version), web.get("/health", health), web.get("/stats", stats),
    ])
    return app


async def serve(run_dir: Path) -> None:
    cfg = read_run_config(run_dir)
    torch.set_num_threads(cfg.role_threads("inference"))
    model, tokenizer = load_policy(cfg.model.path)
    engine = Engine(model, tokenizer.pad_token_id, tokenizer.eos_token_id, seed=cfg.run.seed)
    worker = Worker(engine, cfg.inference.max_batch_sequences)
    app = make_app(worker, tokenizer, cfg.model.path, cfg.inference.max_prompt_tokens, cfg.timeouts.weight_load)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.inference.host, cfg.inference.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    url = f"http://{cfg.inference.host}:{port}"
    info = run_dir / "inference.json"
    info.with_suffix(".tmp").write_text(json.dumps({"url": url, "pid": os.getpid()}))
    os.replace(info.with_suffix(".tmp"), info)
    print(f"inference: serving {cfg.model.path} at {url} with {torch.get_num_threads()} threads", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(serve(Path(sys.argv[1])))
