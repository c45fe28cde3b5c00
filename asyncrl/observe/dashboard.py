"""The dashboard: a page the control API serves (same loopback port, same token), drawn in the browser
from what the API answers (asyncrl/observe/page/: plain HTML and JS, uPlot vendored, no build step).

    GET /?token=T        sets the token as a cookie (same-site only) and sends the browser to /
    GET /                the page; GET /static/NAME its files
    GET /metrics?offset=B   the records metrics.jsonl holds after byte B, and the offset to ask next
    GET /roles           each role: pid, seconds since its heartbeat, restarts so far

`asyncrl ctl RUN dashboard` prints the URL with the token.
"""
from __future__ import annotations

import json
from pathlib import Path

import orjson
from aiohttp import web

from asyncrl.observe.progress import Tail
from asyncrl.run import heartbeat
from asyncrl.rundir import RunDir

PAGE = Path(__file__).resolve().parent / "page"
STATIC = {"app.js": "application/javascript", "vendor/uPlot.iife.min.js": "application/javascript",
          "vendor/uPlot.min.css": "text/css", "style.css": "text/css"}
COOKIE = "asyncrl_token"


def authorized(request: web.Request, token: str) -> bool:
    return bool(token) and (request.headers.get("Authorization") == f"Bearer {token}"
                            or request.cookies.get(COOKIE) == token)


def routes(orch, token: str) -> list:
    async def page(request: web.Request) -> web.StreamResponse:
        if request.query.get("token"):
            if request.query["token"] != token:
                return web.Response(status=401, text="wrong token")
            response = web.HTTPSeeOther("/")  # (the token leaves the address bar and the history)
            response.set_cookie(COOKIE, token, httponly=True, samesite="Strict")
            raise response
        return web.FileResponse(PAGE / "index.html")

    async def static(request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if name not in STATIC:
            raise web.HTTPNotFound()
        return web.FileResponse(PAGE / name, headers={"Content-Type": STATIC[name]})

    async def metrics(request: web.Request) -> web.Response:
        try:
            offset = max(0, int(request.query.get("offset", "0")))
        except ValueError:
            return web.json_response({"error": "offset must be a byte count"}, status=400)
        tail = Tail(RunDir(orch.run_dir).metrics, from_end=False)  # (complete lines only, from `offset`)
        tail.offset = offset
        records = tail.records()
        # (orjson writes a NaN metric, e.g. an empty batch's KL, as null: JSON has no NaN)
        body = orjson.dumps({"records": records, "offset": tail.offset})
        return web.Response(body=body, content_type="application/json")

    restarts = RestartCount(RunDir(orch.run_dir).events)

    async def roles(request: web.Request) -> web.Response:
        return web.json_response(role_status(orch.run_dir, restarts.counts()))

    return [web.get("/", page), web.get("/static/{name:.+}", static), web.get("/metrics", metrics),
            web.get("/roles", roles)]


class RestartCount:
    """Restarts per role, from events.jsonl read on from where the last poll stopped: a page polls every
    few seconds, and reading the whole file each time grew with the run's length."""

    def __init__(self, events: Path):
        self.tail, self.restarts = Tail(events, from_end=False), {}

    def counts(self) -> dict[str, int]:
        for record in self.tail.records():
            if record.get("event") == "role_restarted":
                target = record.get("target")
                self.restarts[target] = self.restarts.get(target, 0) + 1
        return self.restarts


def role_status(run_dir: Path, restarts: dict[str, int]) -> list[dict]:
    """pid, seconds since the last heartbeat, and restarts, per role the launcher started."""
    try:
        pids = json.loads((RunDir(run_dir).pids).read_text())
    except (OSError, ValueError):
        pids = {}
    return [{"role": role, "pid": pid, "heartbeat_age": heartbeat.age(run_dir, role),
             "restarts": restarts.get(role, 0)} for role, pid in sorted(pids.items())]
