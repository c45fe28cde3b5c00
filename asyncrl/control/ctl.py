"""`asyncrl ctl RUN_DIR ...`: steer a running job through its control API
(asyncrl/control/api.py), on loopback with the run's token.

    asyncrl ctl RUN_DIR status              step, version served, live settings, changes made
    asyncrl ctl RUN_DIR set KEY VALUE       a live change, in force from the next batch (live.py)
    asyncrl ctl RUN_DIR eval                a held-out evaluation of the version served, now
    asyncrl ctl RUN_DIR checkpoint          the trainer checkpoints after the next batch
    asyncrl ctl RUN_DIR stop                the run ends after the next batch (final checkpoint, report)
    asyncrl ctl RUN_DIR pause | resume      no new rollouts (those generating are trained) / go on
    asyncrl ctl RUN_DIR dashboard           the address of the run's page, token included (keep it private)
    asyncrl ctl RUN_DIR workers [add NAME | revoke NAME]
                                            joined workers: list them, add one (its token is
                                            shown once), revoke one
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

from asyncrl.config import ConfigError
from asyncrl.control.access import read_token
from asyncrl.files import process_exists
from asyncrl.rundir import RunDir

DEADLINE = 10.0  # seconds for the job to answer


def request(run_dir: str | Path, method: str, path: str, body: dict | None = None) -> dict:
    """The control API's answer; ConfigError saying why there is none (not running, refused, silent)."""
    where = RunDir(run_dir).control
    try:
        address = json.loads(where.read_text())
    except FileNotFoundError:
        raise ConfigError(_not_running(run_dir)) from None
    except ValueError:
        raise ConfigError(f"{where} is not the control API's address (not JSON)") from None
    if not _alive(address.get("pid")):  # (a run killed with its orchestrator leaves the file behind)
        raise ConfigError(_not_running(run_dir))
    url = address["url"]
    token = read_token(run_dir)
    if token is None:
        raise ConfigError(f"{run_dir}: the run has no token file; the control API needs it")
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url + path, data=data, method=method, headers={
        "Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=DEADLINE) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        message = json.loads(e.read() or b"{}").get("error", e.reason)
        raise ConfigError(f"the job refused: {message}") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
        reason = getattr(e, "reason", e)
        raise ConfigError(f"the job's control API at {url} did not answer ({reason}); the orchestrator may "
                          "be restarting (try again) or the run has ended") from None


def _not_running(run_dir: str | Path) -> str:
    """Why there is nothing to steer in `run_dir`: it is not a run, it ended, or no job runs it now."""
    run = RunDir(run_dir)
    if not run.config.exists():
        return f"{run_dir} is not a run directory (no {run.config.name})"
    if run.summary.exists():
        return f"{run_dir}: the run has ended (its report: {run.report_md}); there is no job to steer"
    return (f"{run_dir}: no job is running there (the orchestrator writes {run.control.name} while it runs); "
            f"`asyncrl train --resume {run_dir}` continues a stopped run")


def _alive(pid) -> bool:
    return process_exists(pid) if isinstance(pid, int) else True  # (an address without a pid: ask it)


COMMANDS = ("status", "set", "eval", "checkpoint", "stop", "pause", "resume", "dashboard", "workers")


def main(args: list[str]) -> int:
    workers = len(args) in (2, 4) and args[1:2] == ["workers"] and args[2:3] in ([], ["add"], ["revoke"])
    if len(args) < 2 or args[1] not in COMMANDS or (args[1] == "set") != (len(args) == 4) and not workers \
            or len(args) > 4 or (args[1] == "workers" and not workers):
        usage = " | ".join(COMMANDS).replace("set", "set KEY VALUE")
        usage = usage.replace("workers", "workers [add|revoke NAME]")
        raise ConfigError(f"usage: asyncrl ctl RUN_DIR {usage}")
    run_dir, command = args[0], args[1]
    if command == "workers":
        print(_workers(run_dir, args[2:]))
    elif command == "status":
        print(describe(request(run_dir, "GET", "/status")))
    elif command == "dashboard":
        request(run_dir, "GET", "/status")  # (it answers: the address is live)
        print(f"{json.loads(RunDir(run_dir).control.read_text())['url']}/?token={read_token(run_dir)}")
    elif command in ("pause", "resume"):
        answer = request(run_dir, "POST", f"/{command}")
        said = "paused: no new rollouts" if answer["paused"] else "resumed"
        print(f"{said} (assembling step {answer['step']})")
    elif command == "eval":
        version = request(run_dir, "POST", "/eval")["version"]
        print(f"evaluating version {version} (metrics.jsonl has the result)")
    else:
        body = {"key": args[2], "value": args[3]} if command == "set" else None
        answer = request(run_dir, "POST", f"/{command}", body)
        what = {"set": f"{answer['key']} = {answer['value']!r}", "checkpoint": "a checkpoint",
                "stop": f"stop (run.steps = {answer['value']})"}[command]
        print(f"{what}: recorded (change {answer['id']}), in force from the next batch assembled "
              f"(step {answer['from_step']})")
    return 0


def _workers(run_dir: str | Path, action: list[str]) -> str:
    if action:
        answer = request(run_dir, "POST", f"/workers/{action[0]}", {"name": action[1]})
        if action[0] == "revoke":
            return f"worker {answer['name']}: revoked (its work is issued again to others)"
        return (f"worker {answer['name']}: token {answer['token']}\n(shown once) the worker joins with:"
                f" asyncrl worker --join {_gateway(run_dir)} --token {answer['token']}")
    answer = request(run_dir, "GET", "/workers")
    lines = [f"{w['name']}: " + ("revoked" if w["revoked"] else "quarantined" if w["quarantined"] else
                                 "polling" if w["polling"] else "silent")
             + f", trust {w['trust']}, version {w['version']}, {w['checked']} recomputed "
               f"({w['failed']} failed), {w['rejected']} refused"
             + (f": {w['reason']}" if w["reason"] else "")
             for w in answer["workers"]]
    leases = ", ".join(f"{n} {state}" for state, n in sorted(answer["leases"].items()))
    lines = lines or ["no workers yet (asyncrl ctl RUN workers add NAME)"]
    return "\n".join(lines) + f"\nleases: {leases or 'none'}"


def _gateway(run_dir: str | Path) -> str:
    try:
        return json.loads(RunDir(run_dir).gateway.read_text())["url"]
    except (OSError, ValueError, KeyError):
        return "URL"


def describe(status: dict) -> str:
    lines = [f"step {status['step']} of {status['steps']}, version {status['served_version']} served, "
             f"{status['in_flight_groups']} groups generating, {status['ready_groups']} ready"
             + (" (PAUSED)" if status["paused"] else "")]
    lines += [f"  {key} = {value!r}" for key, value in status["settings"].items()]
    for c in status["changes"]:
        when = f"from step {c['step']}" if c["step"] is not None else "pending"
        lines.append(f"  change {c['id']}: {c['key']} = {c['value']!r} ({when})")
    return "\n".join(lines)
