"""The joined workers' HTTP gateway, served by the orchestrator on workers.host:workers.port (its
address in RUN_DIR/gateway.json). A worker token (Authorization: Bearer) allows these and nothing else:

    POST /v1/join              {"worker", "config": the run's config, "model": its files, "served"}
    GET  /v1/versions/{v}      version v's files: {"hash", "full": {blob, size}, "patch": {.., base_version}}
    GET  /v1/blobs/{sha256}    a file by the sha256 of its bytes (HTTP Range: a fetch resumes)
    POST /v1/work              {"version": held, "working": [lease ids]}: a long poll, which is also the
                               worker's heartbeat; answers {"load": the version to hold, "work": a lease}
    POST /v1/results           {"lease", "prompt_index", "prompt_sha256", "choices"}: one prompt's samples

A revoked or quarantined worker gets 403 with the reason, an unknown token 401.
"""
from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from aiohttp import web

from asyncrl.files import sha256_of, write_atomic
from asyncrl.run.role import FatalError
from asyncrl.rundir import RunDir
from asyncrl.swarm.members import Refused
from asyncrl.transports import weights

POLL_SECONDS = 5.0  # the longest a poll is held open without work


class Blobs:
    """Files by the sha256 of their bytes, hashed once per (path, size, mtime)."""

    def __init__(self):
        self.paths: dict[str, tuple[Path, tuple]] = {}
        self.known: dict[tuple, str] = {}

    async def describe(self, path: Path) -> dict:
        stat = path.stat()
        key = (str(path), stat.st_size, stat.st_mtime_ns)
        if key not in self.known:
            self.known[key] = await asyncio.to_thread(sha256_of, path)
        self.paths[self.known[key]] = (path, key)
        return {"blob": self.known[key], "size": stat.st_size}

    def path(self, digest: str) -> Path | None:
        """The file, if it still holds those bytes (a pruned version's file is reused for a later one)."""
        path, key = self.paths.get(digest, (None, None))
        if path is None:
            return None
        try:
            stat = path.stat()
        except OSError:
            return None
        return path if (str(path), stat.st_size, stat.st_mtime_ns) == key else None


def make_app(swarm, run_dir: Path) -> web.Application:
    blobs, model_dir = Blobs(), Path(swarm.model_path)

    @web.middleware
    async def worker_only(request: web.Request, handler):
        header = request.headers.get("Authorization", "")
        try:
            request["member"] = swarm.member(header.removeprefix("Bearer ").strip())
        except Refused as e:
            return web.json_response({"error": str(e)}, status=e.status)
        return await handler(request)

    async def join(request: web.Request) -> web.Response:
        files = sorted(p for p in model_dir.iterdir() if p.is_file()) if model_dir.is_dir() else []
        model = {p.name: await blobs.describe(p) for p in files}
        return web.json_response({"worker": request["member"].name, "served": swarm.router.version,
                                  "config": json.loads(RunDir(run_dir).config.read_text()), "model": model,
                                  "lease_seconds": swarm.cfg.lease_seconds})

    async def version(request: web.Request) -> web.Response:
        v = request.match_info["v"]
        marker = weights.read_marker(run_dir, int(v)) if v.isdigit() else None
        if marker is None or not RunDir(run_dir).weights_file(int(v)).exists():
            return web.json_response({"error": f"version {v} is not published or no longer kept"}, status=404)
        full, patch = RunDir(run_dir).weights_file(int(v)), RunDir(run_dir).patch(int(v))
        answer = {"version": int(v), "hash": marker.get("serving_hash", marker["hash"]),
                  "full": await blobs.describe(full)}
        if patch.exists():
            answer["patch"] = {**await blobs.describe(patch), "base_version": int(v) - 1}
        return web.json_response(answer)

    async def blob(request: web.Request) -> web.StreamResponse:
        path = blobs.path(request.match_info["sha"])
        if path is None:
            return web.json_response({"error": "no such blob (ask for the version's files again)"},
                                     status=404)
        return web.FileResponse(path)  # (Range requests: a broken fetch resumes where it stopped)

    async def work(request: web.Request) -> web.Response:
        m, body = request["member"], await _body(request)
        held, working = body.get("version"), body.get("working", [])
        leases = isinstance(working, list) and all(isinstance(w, str) for w in working)
        if type(held) is not int or not leases:
            return web.json_response({"error": "need an int 'version' and 'working': a list of lease ids"},
                                     status=400)
        m.heard_from(held, working)

        def answer():  # (work only for a worker that holds the served version: it samples with it)
            served = swarm.router.version
            return m.take() if held >= served else None, max(served, m.wanted or 0)

        m.arrived.clear()
        lease, load = answer()
        if lease is None and load in (held, body.get("loading")):  # nothing new to say: hold the poll
            try:
                await asyncio.wait_for(m.arrived.wait(), POLL_SECONDS)
            except asyncio.TimeoutError:
                pass
            m.heard_from(held, working)
            lease, load = answer()
        return web.json_response({"load": load, "work": lease.body() if lease else None})

    async def results(request: web.Request) -> web.Response:
        m, body = request["member"], await _body(request)
        try:
            answer = swarm.deliver(m, body.get("lease"), body.get("prompt_index"),
                                   body.get("prompt_sha256", ""), body.get("choices"))
        except Refused as e:
            return web.json_response({"error": str(e)}, status=e.status)
        return web.json_response(answer)

    app = web.Application(client_max_size=64 * 2**20, middlewares=[worker_only])
    app.add_routes([web.post("/v1/join", join), web.get("/v1/versions/{v}", version),
                    web.get("/v1/blobs/{sha}", blob), web.post("/v1/work", work),
                    web.post("/v1/results", results)])
    return app


async def _body(request: web.Request) -> dict:
    try:
        body = await request.json()
    except ValueError:
        raise web.HTTPBadRequest(text='{"error": "the body is not JSON"}', content_type="application/json")
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text='{"error": "the body is not a JSON object"}',
                                 content_type="application/json")
    return body


async def serve(swarm, run_dir: Path, before: int | None = None) -> tuple[web.AppRunner, str]:
    """(the running gateway, its URL) on workers.port, else on the port `before` when it is free (where
    the workers of a restarted orchestrator look), else on a free one. A poll cut short by its worker is
    cancelled with it."""
    runner = web.AppRunner(make_app(swarm, run_dir), access_log=None, handler_cancellation=True)
    await runner.setup()
    try:
        site = web.TCPSite(runner, swarm.cfg.host, swarm.cfg.port or before or 0)
        await site.start()
    except OSError as e:
        if swarm.cfg.port:
            raise FatalError(f"workers.port: port {swarm.cfg.port} on {swarm.cfg.host} cannot be bound "
                             f"({e.strerror or e}); choose a free one, or 0 to pick one") from None
        if not before:
            raise
        site = web.TCPSite(runner, swarm.cfg.host, 0)
        await site.start()
    port = site._server.sockets[0].getsockname()[1]
    url = f"http://{swarm.cfg.host}:{port}"
    write_atomic(RunDir(run_dir).gateway, json.dumps({"url": url, "pid": os.getpid()}))
    return runner, url


async def close(runner: web.AppRunner, run_dir: Path) -> None:
    RunDir(run_dir).gateway.unlink(missing_ok=True)
    await runner.cleanup()
