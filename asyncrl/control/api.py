"""The running job's control API: HTTP on loopback, the run's token on every request. `asyncrl ctl`
(asyncrl/control/ctl.py) is its client.

    GET  /status            the step being assembled, the version served, the live settings in force,
                            every change made (with the step it took effect at, or pending)
    POST /set {key, value}  a live change (asyncrl/control/live.py), `value` as on the command line: recorded
                            in the ledger at once, in force from the next batch assembled
    POST /eval              a held-out evaluation of the version served, now
    POST /checkpoint        the trainer checkpoints after the next batch scheduled (recorded like a change)
    POST /stop              the run ends after the next batch scheduled: run.steps = its step + 1
    POST /pause, /resume    no new rollouts / rollouts again (asyncrl/control/pausing.py)
    GET  /workers           joined workers (asyncrl/swarm/): state, trust, counts
    POST /workers/add {name}, /workers/revoke {name}
                            a worker's token (shown once), or its token revoked and its work reissued
    GET  /                  the dashboard page (asyncrl/observe/dashboard.py)

The orchestrator serves it (it owns the ledger and the step boundaries); its address is in
RUN_DIR/control.json while it runs. A restarted orchestrator serves it again on a new port.
"""
from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from aiohttp import web

from asyncrl.config import ConfigError
from asyncrl.control import pausing
from asyncrl.control.access import read_token
from asyncrl.control.live import LIVE_KEYS, check_change, check_open, setting, with_settings
from asyncrl.files import write_atomic
from asyncrl.observe import dashboard
from asyncrl.rundir import RunDir


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def make_app(orch) -> web.Application:
    token = read_token(orch.run_dir)

    @web.middleware
    async def check(request: web.Request, handler):
        signing_in = request.path == "/" and "token" in request.query  # (the page checks it)
        if not signing_in and not dashboard.authorized(request, token):
            return _error(401, "the control API needs the run's token (Authorization: Bearer, from "
                               "RUN_DIR/token; for the page, the address `asyncrl ctl RUN dashboard` prints)")
        return await handler(request)

    async def status(request: web.Request) -> web.Response:
        return web.json_response({
            "step": orch.next_step, "steps": orch.cfg.run.steps, "served_version": orch.router.version,
            "in_flight_groups": len(orch.in_flight), "ready_groups": len(orch.ready), "paused": orch.paused,
            "settings": {k: setting(orch.cfg, k) for k in LIVE_KEYS}, "changes": orch.ledger.changes(),
        })

    def pending() -> dict:
        changes = orch.ledger.changes()
        return {c["key"]: c["value"] for c in changes if c["step"] is None and c["key"] in LIVE_KEYS}

    def record(key: str, value) -> web.Response:
        change_id = orch.ledger.request_change(key, value, orch._now())
        orch.events.write("change_requested", id=change_id, key=key, value=value)
        # (the batch being assembled has its settings: the change is scheduled with the next one)
        return web.json_response({"id": change_id, "key": key, "value": value,
                                  "from_step": orch.next_step + 1})

    def checked(key: str, text: str) -> web.Response:
        try:  # against the settings the change will meet: those in force plus the pending ones
            value = check_change(with_settings(orch.cfg, pending()), key, text, orch.next_step + 1)
        except ConfigError as e:
            return _error(400, str(e))
        return record(key, value)

    async def set_setting(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the body must be JSON: {\"key\": ..., \"value\": ...}")
        key, text = (body.get("key"), body.get("value")) if isinstance(body, dict) else (None, None)
        if not isinstance(key, str) or not isinstance(text, str):
            return _error(400, "the body must be {\"key\": \"section.name\", \"value\": \"text\"}")
        return checked(key, text)

    async def stop(request: web.Request) -> web.Response:
        """The run ends after the batch the request is scheduled with: run.steps = that step + 1."""
        return checked("run.steps", str(orch.next_step + 2))

    async def checkpoint_now(request: web.Request) -> web.Response:
        try:
            check_open(with_settings(orch.cfg, pending()), orch.next_step + 1)
        except ConfigError as e:
            return _error(400, str(e))
        return record("checkpoint", True)

    async def pause(request: web.Request) -> web.Response:
        return await set_paused(True)

    async def resume(request: web.Request) -> web.Response:
        return await set_paused(False)

    async def set_paused(on: bool) -> web.Response:
        """Admission stops (groups generating finish and are trained) or goes on; kept in the ledger."""
        if orch.paused != on:
            orch.paused = on
            orch.ledger.put("paused", on)
            pausing.record(orch.run_dir, on)
            orch.events.write("paused" if on else "resumed", step=orch.next_step)
            await orch._notify()
        return web.json_response({"paused": on, "step": orch.next_step})

    async def evaluate(request: web.Request) -> web.Response:
        if orch.evaluator is None:
            return _error(409, "this run has no held-out evaluation (task.eval_size = 0)")
        orch.evals.append(asyncio.create_task(orch.evaluate()))
        return web.json_response({"version": orch.router.version})

    async def workers(request: web.Request) -> web.Response:
        if orch.swarm is None:
            return _error(409, "this run takes no joined workers (workers.enabled = false)")
        if request.method == "GET":
            return web.json_response({"workers": orch.swarm.listing(), "leases": orch.swarm.roster.leases()})
        try:
            name = (await request.json())["name"]
            if request.match_info["action"] == "add":
                return web.json_response({"name": name, "token": orch.swarm.add(name)})
            orch.swarm.revoke(name)
            return web.json_response({"name": name, "revoked": True})
        except (ValueError, KeyError, TypeError) as e:  # (RosterError is a ValueError)
            return _error(400, str(e) if isinstance(e, ValueError) else "the body must be {\"name\": ...}")

    app = web.Application(middlewares=[check])
    app.add_routes([web.get("/status", status), web.post("/set", set_setting), web.post("/eval", evaluate),
                    web.post("/stop", stop), web.post("/checkpoint", checkpoint_now),
                    web.post("/pause", pause), web.post("/resume", resume), web.get("/workers", workers),
                    web.post("/workers/{action:add|revoke}", workers),
                    *dashboard.routes(orch, token)])
    return app


async def serve(orch) -> web.AppRunner:
    """Start the API on a free loopback port and say where in control.json."""
    runner = web.AppRunner(make_app(orch), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    address = {"url": f"http://127.0.0.1:{port}", "pid": os.getpid()}
    write_atomic(RunDir(orch.run_dir).control, json.dumps(address))
    return runner


async def close(runner: web.AppRunner, run_dir: Path) -> None:
    RunDir(run_dir).control.unlink(missing_ok=True)
    await runner.cleanup()
