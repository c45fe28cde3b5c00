"""Joined workers (asyncrl/swarm/): the cheap checks, trust, the trainer's mask, a resumable hash-checked
fetch, and a real run on loopback with workers that die, join late on a slow link, and cheat."""
import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from conftest import job_args

from asyncrl.control.ctl import request
from asyncrl.files import poll, sha256_of
from asyncrl.observe.events import read_events
from asyncrl.rundir import RunDir
from asyncrl.store.ledger import audit
from asyncrl.swarm import quarantine
from asyncrl.swarm.checks import GroupRefused, Limits, Seen, check_group, prompt_digest
from asyncrl.swarm.download import DownloadError, fetch
from asyncrl.swarm.trust import Trust
from asyncrl.trajectory import Trajectory

TESTS = Path(__file__).parent
LIMITS = Limits(vocab_size=100, max_tokens=4, stop_ids=frozenset({2}), issued_version=5, newest_version=6)
PROMPT = prompt_digest([7, 8, 9])


def sample(tokens=(10, 11, 2), logprobs=(-0.5, -0.25, -0.125), versions=(5, 5, 6), finish="stop") -> dict:
    return {"token_ids": list(tokens), "logprobs": {"token_logprobs": list(logprobs)},
            "versions": list(versions), "finish_reason": finish}


def test_cheap_checks_refuse_each_kind_of_impossible_sample():
    bad = {
        "a token outside the vocabulary": sample(tokens=(10, 100, 2)),
        "a logprob that is positive or not finite": sample(logprobs=(-0.5, 0.25, -0.1)),
        "nan": sample(logprobs=(-0.5, float("nan"), -0.1)),
        "a version outside [5, 6]": sample(versions=(4, 5, 5)),
        "unpublished": sample(versions=(5, 7, 7)),
        "over max_tokens": sample(tokens=(10, 11, 12, 13, 2), logprobs=(-1,) * 5, versions=(5,) * 5),
        "not a stop token": sample(tokens=(10, 11, 12)),
        "not max_tokens": sample(finish="length"),
        "lengths": sample(versions=(5, 5)),
        "finish_reason": sample(finish="eos"),
    }
    reasons = check_group([sample(), *bad.values()], 1 + len(bad), PROMPT, PROMPT, LIMITS, Seen())
    assert reasons[0] is None
    assert all(reasons[1:]), dict(zip(bad, reasons[1:]))
    assert "outside the vocabulary" in reasons[1] and "version outside" in reasons[5]
    with pytest.raises(GroupRefused, match="not the prompt given"):
        check_group([sample()], 1, PROMPT, prompt_digest([7, 8]), LIMITS, Seen())
    with pytest.raises(GroupRefused, match="for a group of 2"):
        check_group([sample()], 2, PROMPT, PROMPT, LIMITS, Seen())


def test_a_sample_returned_for_another_prompt_is_refused_and_the_same_prompt_may_repeat():
    seen, other = Seen(), prompt_digest([1, 2, 3])
    assert check_group([sample(), sample()], 2, PROMPT, PROMPT, LIMITS, seen) == [None, None]  # (one group)
    assert check_group([sample()], 1, PROMPT, PROMPT, LIMITS, seen) == [None]  # the same prompt again
    relabelled = sample(versions=(6, 6, 6))  # (a replay claims the current version: still the same floats)
    assert "another prompt" in check_group([relabelled], 1, other, other, LIMITS, seen)[0]
    certain = sample(logprobs=(0.0, 0.0, -1e-7))  # nothing random in it: not told from a replay, kept
    assert check_group([certain], 1, PROMPT, PROMPT, LIMITS, seen) == [None]
    assert check_group([certain], 1, other, other, LIMITS, seen) == [None]


def test_trust_quarantines_a_cheat_fast_and_checks_a_proven_worker_less():
    new = Trust()
    assert new.fraction(0.1) == 0.4
    new.failed_recompute()
    assert not new.out(0.2)
    new.failed_recompute()
    assert new.out(0.2)  # two recomputes that disagree
    cheap = Trust()
    cheap.failed_cheap()
    assert cheap.out(0.2)  # one impossible sample
    proven = Trust()
    for _ in range(60):
        proven.passed()
    assert proven.fraction(0.1) == 0.05
    proven.failed_recompute()
    proven.failed_recompute()
    assert not proven.out(0.2)  # a proven worker survives two (honest noise is far below the tolerance)
    proven.excess, proven.tokens = 0.5, 199
    assert proven.drift() is None  # (too few tokens to tell)
    proven.tokens = 250
    assert proven.drift() == 0.002


def test_the_trainer_masks_only_unverified_samples_of_a_quarantined_worker(tmp_path):
    def traj(i: str, worker=None, check=None) -> Trajectory:
        info = {k: v for k, v in (("worker", worker), ("check", check)) if v}
        return Trajectory(id=i, group_id=i, task="t", prompt_id=0, tokens=[1, 2, 3], loss_mask=[0, 1, 1],
                          logprobs=[0.0, -1.0, -1.0], versions=[-1, 0, 0], reward=1.0,
                          advantages=[0.0, 1.0, 1.0], info=info)
    batch = [traj("own"), traj("cheat", "eve"), traj("checked", "eve", "c1"), traj("other", "bob")]
    assert quarantine.mask(tmp_path, batch) == []
    quarantine.add(tmp_path, "eve", "two recomputes disagreed", {"c1"})
    assert quarantine.mask(tmp_path, batch) == ["cheat"]
    assert batch[1].loss_mask == [0, 0, 0] and batch[1].advantages == [0.0, 0.0, 0.0]
    assert batch[0].loss_mask == batch[2].loss_mask == batch[3].loss_mask == [0, 1, 1]


def test_a_fetch_resumes_where_it_stopped_and_refuses_bytes_that_are_not_their_hash(tmp_path):
    data = os.urandom(300_000)
    (tmp_path / "blob").write_bytes(data)
    ranges = []

    async def main():
        async def handler(request):
            ranges.append(request.headers.get("Range"))
            return web.FileResponse(tmp_path / "blob")

        app = web.Application()
        app.add_routes([web.get("/blob", handler)])
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/blob"
        digest = sha256_of(tmp_path / "blob")
        (tmp_path / "got.part").write_bytes(data[:100_000])  # (a transfer that broke a third of the way)
        async with aiohttp.ClientSession() as session:
            await fetch(session, url, digest, len(data), tmp_path / "got", rate=2_000_000)
            with pytest.raises(DownloadError, match="do not hash"):
                await fetch(session, url, "0" * 64, len(data), tmp_path / "wrong")
        await runner.cleanup()

    asyncio.run(main())
    assert (tmp_path / "got").read_bytes() == data and ranges[0] == "bytes=100000-"
    assert not (tmp_path / "wrong").exists() and not (tmp_path / "wrong.part").exists()


TOKENS: dict[str, str] = {}


def start_run(tmp_path: Path, model: str, **overrides) -> tuple[subprocess.Popen, Path]:
    """A run through the CLI that takes joined workers, once its gateway and control API are up."""
    args = job_args(tmp_path, model, **{"task.eval_size": 0, "workers.enabled": True, **overrides})
    proc = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    run_dir = tmp_path / "runs" / "job"
    try:
        poll(lambda: RunDir(run_dir).gateway.exists() and RunDir(run_dir).control.exists(), 120,
             "the gateway")
    except BaseException:
        proc.kill()
        raise
    return proc, run_dir


def start_worker(run_dir: Path, name: str, kind: str = "honest", *extra: str) -> subprocess.Popen:
    """A worker process (its inference server dies with it) in a session of its own."""
    token = TOKENS[name] = request(run_dir, "POST", "/workers/add", {"name": name})["token"]
    url = json.loads(RunDir(run_dir).gateway.read_text())["url"]
    return subprocess.Popen([sys.executable, str(TESTS / "dishonest.py"), kind, "--join", url,
                             "--token", token, "--dir", str(run_dir.parent / name), "--give-up-after", "5",
                             *extra],
                            stdout=open(run_dir.parent / f"{name}.log", "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def join_paused(run_dir: Path, workers: dict, deadline: float = 240) -> dict[str, subprocess.Popen]:
    """Workers started while the run is paused; it resumes once each polls holding the served version."""
    request(run_dir, "POST", "/pause")
    started = {name: start_worker(run_dir, name, *how) for name, how in workers.items()}

    def ready() -> bool:
        served = request(run_dir, "GET", "/status")["served_version"]
        listed = {w["name"]: w for w in request(run_dir, "GET", "/workers")["workers"]}
        return all(listed[n]["routed"] and listed[n]["version"] == served for n in workers)

    poll(ready, deadline, lambda: f"workers ready: {request(run_dir, 'GET', '/workers')}")
    request(run_dir, "POST", "/resume")
    return started


def gateway_status(run_dir: Path, token: str) -> tuple[int, str]:
    url = json.loads(RunDir(run_dir).gateway.read_text())["url"]
    req = urllib.request.Request(f"{url}/v1/join", data=b"{}", method="POST",
                                 headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, ""
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())["error"]


def ctl_output(run_dir: Path, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "asyncrl.cli", "ctl", str(run_dir), *args],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def leases(run_dir: Path) -> dict[tuple[str, str], int]:
    db = sqlite3.connect(f"file:{RunDir(run_dir).ledger}?mode=ro", uri=True)
    rows = db.execute("SELECT worker, state, COUNT(*) FROM leases GROUP BY worker, state").fetchall()
    db.close()
    return {(w, s): n for w, s, n in rows}


def stop_holding_work(worker: subprocess.Popen, run_dir: Path, name: str) -> None:
    """SIGSTOP the worker at a moment it holds a lease (tried again if it answered in between)."""
    for _ in range(100):
        poll(lambda: leases(run_dir).get((name, "issued")), 60, f"{name} to hold work")
        os.killpg(worker.pid, signal.SIGSTOP)
        time.sleep(0.3)
        if leases(run_dir).get((name, "issued")):
            return
        os.killpg(worker.pid, signal.SIGCONT)
    raise AssertionError(f"{name} never held work when stopped")


@pytest.mark.long
@pytest.mark.e2e
def test_a_worker_dies_holding_work_and_a_cheat_joins_late_on_a_slow_link(tiny_model, tmp_path):
    """One worker is frozen, then killed, while it holds work: its lease expires and its groups go
    elsewhere; it is revoked. A second joins mid-run fetching at 8 MB/s (a 4-MB version in ~0.5 s, within
    the 5-s grace) and cheats (a token changed in every sample): it is quarantined. The run ends with a
    clean audit, and none of the cheat's unverified samples is trained after the quarantine."""
    proc, run_dir = start_run(tmp_path, tiny_model, **{
        "run.steps": 30, "rollout.max_staleness": 2, "trainer.checkpoint_every": 10,
        "workers.lease_seconds": 3, "workers.verify_fraction": 0.25, "workers.load_grace_seconds": 5})
    workers = {}
    try:
        workers = join_paused(run_dir, {"doomed": ("honest",)})
        stop_holding_work(workers["doomed"], run_dir, "doomed")
        os.killpg(workers["doomed"].pid, signal.SIGKILL)
        poll(lambda: leases(run_dir).get(("doomed", "expired")), 60, "the dead worker's lease to expire")
        request(run_dir, "POST", "/workers/revoke", {"name": "doomed"})
        assert gateway_status(run_dir, TOKENS["doomed"]) == (403, "worker doomed is revoked")
        assert gateway_status(run_dir, "w-not-a-token")[0] == 401
        assert "doomed: revoked" in ctl_output(run_dir, "workers")
        workers.update(join_paused(run_dir, {"cheat": ("token", "--max-bytes-per-second", "8000000")}))
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-3000:]
    finally:
        for w in [proc, *workers.values()]:
            if w.poll() is None:
                os.killpg(w.pid, signal.SIGKILL) if w is not proc else w.kill()
    report = audit(run_dir, 2)
    assert report["problems"] == [] and report["steps_committed"] == 30, report
    assert set(report["samples_dropped"]) <= {"too_stale", "refused", "quarantined"}, report
    assert leases(run_dir).get(("doomed", "expired"), 0) >= 1  # its work went elsewhere
    shut = [e for e in read_events(run_dir) if e["event"] == "worker_quarantined"]
    assert [e["worker"] for e in shut] == ["cheat"] and "recomputed samples disagreed" in shut[0]["reason"]
    db = sqlite3.connect(f"file:{RunDir(run_dir).ledger}?mode=ro", uri=True)
    verified = set(quarantine.read(run_dir)["cheat"]["verified"])
    late_trained = [i for i, reason, check in db.execute(
        "SELECT id, reason, json_extract(data, '$.info.check') FROM samples WHERE step > ? AND "
        "json_extract(data, '$.info.worker') = 'cheat'", (shut[0]["version"] + 3,))  # (η + 1 after)
        if reason != "quarantined_masked" and check not in verified]
    assert late_trained == [], late_trained
