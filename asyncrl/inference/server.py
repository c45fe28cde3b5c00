"""The inference server role: the engine behind HTTP.

    POST /v1/completions   token ids in; token ids, per-token logprobs and versions out (with
                           "stream_groups": one JSON line per prompt as soon as its n samples are done)
    POST /v1/score         token ids in; each token's logprob under the model out, prefill only (a
                           teacher's answer in on-policy distillation: asyncrl/inference/scoring.py)
    GET  /health           200 once the model is loaded
    GET  /version          {"version": v}; with ?hash=1 also the hash of the served weights
    POST /update_weights   {"path": ..., "version": v}: load a safetensors file as version v
    GET  /stats            tokens generated, seconds busy, seconds up, rows running and waiting
    POST /pause, /resume   stop and restart stepping (requests keep queueing)
    POST /abort            end every running and waiting request now (finish_reason "abort")

The admin endpoints (update_weights, pause, resume, abort) need the run's token, and every endpoint
does when the server is bound beyond loopback; /update_weights loads only files under the run's
weights/ (asyncrl/control/access.py). One worker thread (asyncrl/inference/worker.py) owns the engine
and runs it with continuous batching; requests join the running batch at the next token
boundary. A weight update lands at a token boundary too (`policy`: interrupt, keep, abort or
finish; default inference.update_policy).

Run as `python -m asyncrl.inference.server RUN_DIR [REPLICA] [--teacher]`; replica i writes
RUN_DIR/replicas/i.json with its URL (asyncrl/inference/replica.py). One started so by hand joins a running
job's routing. With --teacher it serves teacher.path instead of the policy, as teacher i (teachers/i.json),
and never loads a version.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
import uuid
from pathlib import Path

import orjson
import torch
from aiohttp import web

from asyncrl.config import read_run_config
from asyncrl.control.access import LOOPBACK, ensure_token, inside
from asyncrl.files import write_atomic
from asyncrl.inference import replica, scoring
from asyncrl.inference.engine import Engine, SamplingParams
from asyncrl.inference.pictures import MissingImages, request_pictures
from asyncrl.inference.worker import UPDATE_POLICIES, Worker
from asyncrl.policy import lora, routing
from asyncrl.policy.model import load_policy
from asyncrl.run import event_loop
from asyncrl.run.heartbeat import Heartbeat
from asyncrl.run.role import FatalError, run_role
from asyncrl.run.sizes import longest_sequence
from asyncrl.rundir import RunDir
from asyncrl.vision.images import ImageStore
from asyncrl.vision.inputs import Pictures, is_vision

log = logging.getLogger("asyncrl.inference")


class BadRequest(ValueError):
    pass


def parse_completion_request(body: dict, vocab_size: int, max_prompt_tokens: int):
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
    cache_prefix = body.get("cache_prefix", False)
    if not isinstance(cache_prefix, bool):
        raise BadRequest(f"'cache_prefix' must be true or false, got {cache_prefix!r}")
    params = SamplingParams(max_tokens, float(temperature), float(top_p), stops, cache_prefix)
    return [p for p in prompts for _ in range(n)], params, n


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error"}}, status=status)


def _choices(samples, n: int, tokenizer, first: int = 0) -> list[dict]:
    """The response's choice of each sample; `first`: the index of the first one in the request."""
    return [
        {
            "index": i,
            "text": tokenizer.decode(s.token_ids, skip_special_tokens=True),
            "token_ids": s.token_ids,
            "logprobs": {"token_logprobs": s.logprobs},
            "versions": s.versions,
            **({"routing": routing.pack(routing.stacked(s.routes))} if s.routes else {}),
            "finish_reason": s.finish_reason,
            **({"error": s.error} if s.error else {}),
            "prompt_index": i // n,
        }
        for i, s in enumerate(samples, start=first)
    ]


def _completion_response(
    samples, n: int, prompts: list[list[int]], tokenizer, model_name: str
) -> web.Response:
    choices = _choices(samples, n, tokenizer)
    completion_tokens = sum(len(s.token_ids) for s in samples)
    return web.json_response({
        "id": f"cmpl-{uuid.uuid4().hex[:12]}", "object": "text_completion", "created": int(time.time()),
        "model": model_name, "choices": choices,
        "usage": {"prompt_tokens": sum(len(p) for p in prompts), "completion_tokens": completion_tokens},
    }, dumps=lambda body: orjson.dumps(body).decode())  # per-token logprob lists: orjson is ~10x json


ADMIN = ("/update_weights", "/pause", "/resume", "/abort")  # what changes the policy being served


def guard(token: str, everything: bool):
    """The run's token on every admin endpoint (and on every endpoint when bound beyond loopback)."""
    @web.middleware
    async def check(request: web.Request, handler):
        guarded = everything or request.path in ADMIN
        if guarded and request.headers.get("Authorization") != f"Bearer {token}":
            return _error(401, f"{request.path} needs the run's token (Authorization: Bearer, from "
                               "RUN_DIR/token)")
        return await handler(request)
    return check


def make_app(worker: Worker, tokenizer, model_name: str, cfg, run_dir: Path) -> web.Application:
    engine = worker.engine
    weights_root = RunDir(run_dir).weights
    vocab = engine.model.get_input_embeddings().num_embeddings
    max_prompt_tokens, load_timeout = cfg.inference.max_prompt_tokens, cfg.timeouts.weight_load
    max_scored_tokens = max(longest_sequence(cfg)[0], max_prompt_tokens) + scoring.HINT_TOKENS
    config = engine.model.config
    pictures = Pictures(model_name, config) if is_vision(config) else None  # (images in: asyncrl/vision)
    store, image_token = ImageStore(run_dir), getattr(config, "image_token_id", None)

    async def completions(request: web.Request) -> web.Response:
        try:
            body = await request.json()
            prompts, params, n = parse_completion_request(body, vocab, max_prompt_tokens)
            shown = request_pictures(body, prompts[::n], pictures, store, image_token)
        except MissingImages as e:  # (the client sends the request again with their bytes)
            return web.json_response({"error": {"message": str(e), "missing_images": e.digests}}, status=409)
        except (ValueError, json.JSONDecodeError) as e:  # (BadRequest is one)
            return _error(400, str(e))
        images = [pics for pics in shown for _ in range(n)] if shown else None
        if len(prompts) > cfg.inference.max_waiting_sequences:  # (a 429 would be retried forever)
            return _error(400, f"{len(prompts)} sequences can never wait in this server's queue "
                               f"(inference.max_waiting_sequences = {cfg.inference.max_waiting_sequences})")
        if worker.waiting() + len(prompts) > cfg.inference.max_waiting_sequences:
            return _error(
                429,
                f"{worker.waiting()} sequences are already waiting "
                f"(inference.max_waiting_sequences = {cfg.inference.max_waiting_sequences}); retry later",
            )
        if body.get("stream_groups"):
            return await stream_groups(request, prompts, params, n, images)
        request_done = worker.call("generate", prompts, params, None, 1, images)
        try:
            samples = await request_done
        except asyncio.CancelledError:  # the client went away: its rows stop generating
            worker.call("cancel", request_done)
            raise
        with worker.phases("respond"):
            return _completion_response(samples, n, prompts, tokenizer, model_name)

    async def stream_groups(request: web.Request, prompts: list[list[int]], params, n: int, images):
        """One line of JSON per prompt, {"prompt_index": i, "choices": [its n samples]}, as soon as its n
        samples are done: many groups in one request (one HTTP exchange, not one each) and none waits
        for another."""
        finished: asyncio.Queue = asyncio.Queue()
        request_done = worker.call("generate", prompts, params,
                                   lambda i, samples: finished.put_nowait((i, samples)), n, images)
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        try:
            await response.prepare(request)
            for _ in range(len(prompts) // n):
                i, samples = await finished.get()
                with worker.phases("respond"):
                    choices = _choices(samples, n, tokenizer, first=i * n)
                    line = orjson.dumps({"prompt_index": i, "choices": choices})
                await response.write(line + b"\n")
        except (asyncio.CancelledError, ConnectionResetError):  # the client went away: its rows stop
            worker.call("cancel", request_done)
            raise
        await response.write_eof()
        return response

    async def score(request: web.Request) -> web.Response:
        try:
            seqs, starts, top_k = scoring.parse_score_request(await request.json(), vocab, max_scored_tokens)
        except (scoring.ScoreRequestError, json.JSONDecodeError) as e:
            return _error(400, str(e))
        answer = await worker.call("score", seqs, starts, top_k)
        return web.json_response({"scores": answer}, dumps=lambda body: orjson.dumps(body).decode())

    async def update_weights(request: web.Request) -> web.Response:
        """{"path": full safetensors, "version": v, optional "patch" + "base_version" (a sparse
        patch onto the version held now), "hash" (weights.state_hash of the result), "policy"}."""
        body = await request.json()
        path, version, policy = body.get("path"), body.get("version"), body.get("policy")
        # (a replica staged by Ray may hold only the patch: the full file is sent if the patch misses)
        given = [p for p in (path, body.get("patch")) if isinstance(p, str)]
        if not (isinstance(path, str) and any(Path(p).is_file() for p in given) and isinstance(version, int)):
            return _error(400, f"need an existing 'path' (or 'patch') and an int 'version', got {body}")
        if not all(inside(p, weights_root) for p in (path, body.get("patch") or path)):
            return _error(400, f"a server loads only files under its run's weights/: refusing {path} "
                               f"(patch {body.get('patch')}; allowed: {weights_root})")
        if policy not in (None, *UPDATE_POLICIES):
            return _error(400, f"'policy' must be one of {', '.join(UPDATE_POLICIES)}, got {policy!r}")
        fut = worker.call("update", body)
        try:
            await asyncio.wait_for(fut, load_timeout)
        except asyncio.TimeoutError:
            return web.json_response(
                {"error": {"message": f"loading version {version} from {path} took over {load_timeout}s"}},
                status=504,
            )
        except Exception as e:
            return web.json_response(
                {"error": {"message": f"loading version {version} from {path} failed: {e}"}}, status=500
            )
        return web.json_response(fut.result())

    async def version(request: web.Request) -> web.Response:
        if request.query.get("hash"):  # on the engine thread, between steps: never mid-update
            return web.json_response(await worker.call("hash"))
        return web.json_response({"version": engine.version})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "version": engine.version})

    async def stats(request: web.Request) -> web.Response:
        return web.json_response(
            {
                "tokens_generated": engine.tokens_generated,
                "tokens_discarded": engine.tokens_discarded,
                "tokens_prefilled": engine.tokens_prefilled,
                "tokens_reused": engine.tokens_reused,
                "busy_seconds": worker.phases.seconds["generate"],
                "score_seconds": worker.phases.seconds.get("score", 0.0),
                "uptime_seconds": time.monotonic() - worker.started,
                "phases": dict(worker.phases.seconds),
                "version": engine.version,
                "running": len(engine.running),
                "decode_fit": engine.decode_fit.sums,  # (sums: they add across replicas)
                "prefill_fit": engine.prefill_fit.sums,
                "waiting": worker.waiting(),
            }
        )

    def admin(name: str):
        async def handler(request: web.Request) -> web.Response:
            return web.json_response(await worker.call(name))
        return handler

    token = ensure_token(run_dir)
    app = web.Application(client_max_size=64 * 2**20,
                          middlewares=[guard(token, cfg.inference.host not in LOOPBACK)])
    app.add_routes(
        [
            web.post("/v1/completions", completions),
            web.post("/v1/score", score),
            web.post("/update_weights", update_weights),
            web.get("/version", version),
            web.get("/health", health),
            web.get("/stats", stats),
            web.post("/pause", admin("pause")),
            web.post("/resume", admin("resume")),
            web.post("/abort", admin("abort")),
        ]
    )
    return app


async def _bind(runner: web.AppRunner, host: str, port: int, asked: bool) -> web.TCPSite:
    """A restarted server takes its predecessor's port (clients keep their URL) when it is free. A port
    the user `asked` for (inference.port) is that port or none: FatalError."""
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
    except OSError as e:
        if asked:
            raise FatalError(f"inference.port: port {port} on {host} cannot be bound ({e.strerror or e}); "
                             "choose free ports (replica i takes port + i), or 0 to pick them") from None
        if port == 0:
            raise
        log.warning(f"inference: port {port} is taken; picking a free one")
        site = web.TCPSite(runner, host, 0)
        await site.start()
    return site


async def serve(run_dir: Path, index: int = 0, teacher: bool = False) -> None:
    cfg = read_run_config(run_dir)
    kind = "teacher" if teacher else "inference"
    model_path, dtype = ((cfg.teacher.path, cfg.teacher.dtype) if teacher
                         else (cfg.model.path, cfg.inference.dtype))
    torch.set_num_threads(cfg.role_threads(kind))
    model, tokenizer = load_policy(model_path)
    model = model.to(getattr(torch, dtype)).to(cfg.inference.device)
    incarnation = int(os.environ.get("ASYNCRL_INCARNATION", "0"))  # a restarted server: new samples
    engine = Engine(
        model,
        tokenizer.pad_token_id,
        tokenizer.eos_token_id,
        seed=cfg.run.seed + 1000 * incarnation + 1_000_003 * index,  # (replicas: streams of their own)
        max_sequences=cfg.inference.max_batch_sequences,
        max_tokens=cfg.inference.max_batch_tokens,
        prefix_cache_tokens=cfg.inference.prefix_cache_tokens,
    )
    beats = Heartbeat(run_dir, replica.role(index, kind))
    adapters = lora.Merged(model, cfg.trainer.lora) if cfg.trainer.lora.rank and not teacher else None
    worker = Worker(engine, asyncio.get_running_loop(), cfg.inference.update_policy, beats, adapters)
    app = make_app(worker, tokenizer, model_path, cfg, run_dir)
    # handler_cancellation: a request whose client disconnects is cancelled, and with it its sequences
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    previous = int(os.environ.get("ASYNCRL_INFERENCE_PORT", "0"))
    asked = cfg.inference.port and not teacher  # (teachers take free ports)
    port = cfg.inference.port + index if asked else previous
    site = await _bind(runner, cfg.inference.host, port, asked=bool(asked))
    port = site._server.sockets[0].getsockname()[1]
    url = f"http://{cfg.inference.host}:{port}"
    info = replica.info_path(run_dir, index, kind)
    info.parent.mkdir(exist_ok=True)
    write_atomic(info, json.dumps({"url": url, "pid": os.getpid()}))
    log.info(f"{kind} {index}: serving {model_path} at {url} with {torch.get_num_threads()} threads")
    await asyncio.Event().wait()


if __name__ == "__main__":
    is_teacher = "--teacher" in sys.argv
    args = [a for a in sys.argv[1:] if a != "--teacher"]
    index = int(args[1]) if len(args) > 1 else 0
    run_role(replica.role(index, "teacher" if is_teacher else "inference"), args[0],
             lambda: event_loop.run(serve(Path(args[0]), index, is_teacher)))
