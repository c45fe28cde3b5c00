"""Steering a running job: live changes over the control API, recorded in the ledger with the step
they took effect at, and replayed by a restarted or resumed run."""
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from conftest import job_args, job_config
from test_recovery import RUN, assert_nothing_lost

from asyncrl.config import ConfigError, load_config, read_run_config
from asyncrl.control import ctl
from asyncrl.control.live import LIVE_KEYS, actions_at, check_change, settings_at, with_settings
from asyncrl.files import poll
from asyncrl.observe.events import read_events
from asyncrl.run.chaos import pid_of, steps_recorded
from asyncrl.rundir import RunDir
from asyncrl.store.ledger import Ledger, audit
from asyncrl.trainer.main import lr_schedule
from asyncrl.trajectory import Trajectory, read_batch, read_header, write_batch


def test_a_change_is_checked_against_the_live_keys_and_the_config_rules():
    cfg = load_config()  # 200 steps
    assert check_change(cfg, "trainer.lr", "5e-5", 10) == 5e-5
    assert check_change(cfg, "rollout.max_staleness", "0", 10) == 0
    with pytest.raises(ConfigError, match="cannot change while the run goes on; live keys: trainer.lr"):
        check_change(cfg, "model.path", "elsewhere", 10)
    with pytest.raises(ConfigError, match="trainer.lr = -1"):
        check_change(cfg, "trainer.lr", "-1", 10)
    with pytest.raises(ConfigError, match="rollout.max_tokens"):
        check_change(cfg, "rollout.max_tokens", "many", 10)
    with pytest.raises(ConfigError, match="without a KL anchor"):
        check_change(cfg, "objective.kl_coef", "0.1", 10)
    anchored = with_settings(cfg, {"objective.kl_coef": 0.05})
    assert check_change(anchored, "objective.kl_coef", "0.1", 10) == 0.1
    assert set(LIVE_KEYS) >= {"task.eval_every", "run.steps"}
    # run.steps: the batch the change is scheduled with is trained, so the run ends after it at the soonest
    assert check_change(cfg, "run.steps", "11", 10) == 11 and check_change(cfg, "run.steps", "500", 10) == 500
    with pytest.raises(ConfigError, match="after 11 steps at the earliest"):
        check_change(cfg, "run.steps", "10", 10)
    with pytest.raises(ConfigError, match="assembled its last batch"):  # nothing would take effect
        check_change(cfg, "trainer.lr", "5e-5", 200)
    # what was in force at a step: the latest change scheduled at or before it
    changes = [(3, "trainer.lr", 1e-5), (3, "rollout.max_tokens", 4), (7, "trainer.lr", 2e-5)]
    assert settings_at(changes, 2) == {}
    assert settings_at(changes, 5) == {"trainer.lr": 1e-5, "rollout.max_tokens": 4}
    assert settings_at(changes, 7) == {"trainer.lr": 2e-5, "rollout.max_tokens": 4}
    changes.append((5, "checkpoint", True))  # an action: done at its step only, never a setting
    assert actions_at(changes, 5) == ["checkpoint"] and actions_at(changes, 6) == []
    assert "checkpoint" not in settings_at(changes, 9)


def test_changes_are_pending_until_scheduled_and_batches_carry_theirs(tmp_path):
    ledger = Ledger(tmp_path)
    first = ledger.request_change("trainer.lr", 1e-5, at=1.0)
    ledger.request_change("rollout.max_staleness", 3, at=2.0)
    assert [c["step"] for c in ledger.changes()] == [None, None]
    assert ledger.schedule_changes(5) == [("trainer.lr", 1e-5), ("rollout.max_staleness", 3)]
    assert ledger.schedule_changes(6) == []  # each change is scheduled once
    assert ledger.scheduled_changes() == [(5, "trainer.lr", 1e-5), (5, "rollout.max_staleness", 3)]
    assert ledger.changes()[0]["id"] == first
    ledger.close()
    sample = Trajectory(id="0-0", group_id="0", task="t", prompt_id=0, tokens=[1, 2], loss_mask=[0, 1],
                        logprobs=[0.0, -0.5], versions=[-1, 4])
    write_batch(tmp_path, 5, [sample], {"trainer.lr": 1e-5}, ["checkpoint"])
    write_batch(tmp_path, 4, [sample])
    header = read_header(RunDir(tmp_path).batch(5))
    assert header == {"settings": {"trainer.lr": 1e-5}, "actions": ["checkpoint"]}
    assert read_header(RunDir(tmp_path).batch(4)) == {"settings": {}, "actions": []}
    assert [t.id for t in read_batch(RunDir(tmp_path).batch(5))] == ["0-0"]


def _status(run_dir) -> dict:
    return ctl.request(run_dir, "GET", "/status")


def start_run(tmp_path, model, **overrides) -> tuple[subprocess.Popen, object]:
    """A run of RUN (with `overrides`) through the CLI, once its control API answers and 2 steps are done."""
    args = [sys.executable, "-m", "asyncrl.cli", "train", *job_args(tmp_path, model, **{**RUN, **overrides})]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run_dir = tmp_path / "runs" / "job"
    try:
        poll(lambda: RunDir(run_dir).control.exists() and steps_recorded(run_dir) >= 2, 300,
             "the run to start")
    except BaseException:
        proc.kill()
        raise
    return proc, run_dir


@pytest.mark.long
@pytest.mark.e2e
def test_live_changes_survive_killed_roles_and_a_resume(tiny_model, tmp_path):
    """lr and η are changed mid-run; the trainer and the orchestrator are SIGKILLed after the change,
    the run is SIGTERMed and resumed: every step trained under the settings in force at it (restarted
    trainers replay their versions bit-identically), every sample once, none staler than its step's η."""
    cfg = job_config(tmp_path, tiny_model, **RUN)
    proc, run_dir = start_run(tmp_path, tiny_model)
    try:
        url = json.loads(RunDir(run_dir).control.read_text())["url"]
        with pytest.raises(urllib.error.HTTPError) as refused:  # no token, no answer
            urllib.request.urlopen(url + "/status", timeout=10)
        assert refused.value.code == 401
        with pytest.raises(ConfigError, match="live keys"):
            ctl.request(run_dir, "POST", "/set", {"key": "rollout.group_size", "value": "8"})
        ctl.request(run_dir, "POST", "/set", {"key": "trainer.lr", "value": "3e-5"})
        ctl.request(run_dir, "POST", "/set", {"key": "rollout.max_staleness", "value": "2"})
        # (two requests: a batch may begin between them, so each has its own step)
        def scheduled() -> list[int] | None:  # (in the order made: the last scheduled, all are)
            changes = _status(run_dir)["changes"]
            return [c["step"] for c in changes] if changes[-1]["step"] is not None else None

        lr_at, eta_at = poll(scheduled, 120, "the changes to take effect")
        changed_at = max(lr_at, eta_at)
        assert _status(run_dir)["settings"]["trainer.lr"] == 3e-5
        poll(lambda: steps_recorded(run_dir) >= changed_at + 3, 300, "steps after the change")
        for role in ("trainer", "orchestrator"):
            os.kill(pid_of(run_dir, role), signal.SIGKILL)
        poll(lambda: steps_recorded(run_dir) >= 20, 300, "the restarted roles to go on")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 143, out[-3000:]
    finally:
        proc.kill()
    resumed = subprocess.run([sys.executable, "-m", "asyncrl.cli", "train", "--resume", str(run_dir)],
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]

    events = read_events(run_dir)
    assert {e["target"] for e in events if e["event"] == "role_restarted"} >= {"trainer", "orchestrator"}
    assert all(e["identical"] for e in events if e["event"] == "version_replayed")
    # each change scheduled once
    assert sorted({e["step"] for e in events if e["event"] == "settings_changed"}) == sorted({lr_at, eta_at})
    factor = lr_schedule(read_run_config(run_dir))
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "lr" in record:
            base = 3e-5 if record["step"] >= lr_at else cfg.trainer.lr
            assert record["lr"] == pytest.approx(base * factor(record["step"]), rel=1e-9), record["step"]
    for step in range(cfg.run.steps):
        expected = {**({"trainer.lr": 3e-5} if step >= lr_at else {}),
                    **({"rollout.max_staleness": 2} if step >= eta_at else {})}
        assert read_header(RunDir(run_dir).batch(step))["settings"] == expected
    assert_nothing_lost(run_dir)  # (the audit holds each step to the η in force at it)
    assert " INFO trainer: done, 28 steps" in (run_dir / "logs" / "trainer.log").read_text()  # (level info)


@pytest.mark.long
@pytest.mark.e2e
def test_a_run_is_lengthened_checkpointed_on_request_and_stopped(tiny_model, tmp_path):
    """run.steps 28 -> 40, temperature 1 -> 0.7 and a checkpoint asked for early on; past step 28 the run
    is stopped: it ends after the batch the stop was scheduled with, checkpointed there, everything it
    trained committed, every batch sampled at the temperature its step trains at."""
    cfg = job_config(tmp_path, tiny_model, **RUN)
    proc, run_dir = start_run(tmp_path, tiny_model)
    try:
        longer = ctl.request(run_dir, "POST", "/set", {"key": "run.steps", "value": "40"})
        ctl.request(run_dir, "POST", "/set", {"key": "rollout.temperature", "value": "0.7"})
        asked = ctl.request(run_dir, "POST", "/checkpoint")
        poll(lambda: steps_recorded(run_dir) >= 30, 300, "the run to go past its first length")
        stop = ctl.request(run_dir, "POST", "/stop")
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-3000:]
    finally:
        proc.kill()
    lengthen, cooler, checkpoint, stopped = Ledger(run_dir).changes()
    assert (lengthen["key"], lengthen["value"], checkpoint["key"]) == ("run.steps", 40, "checkpoint")
    # (three requests: a batch may begin between them, so each has its own step)
    assert lengthen["step"] <= cooler["step"] <= checkpoint["step"] < 28
    for step in range(stop["value"]):  # each batch drawn at the temperature its step trains with
        expected = 0.7 if step >= cooler["step"] else 1.0
        assert {t.info["temperature"] for t in read_batch(RunDir(run_dir).batch(step))} == {expected}, step
    end = stop["value"]
    assert (stopped["key"], stopped["value"], stopped["step"]) == ("run.steps", end, end - 1)
    assert 30 < end < 40
    assert stop["from_step"] == end - 1 and f"/{end} " in out and "step 40/" not in out
    records = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
               if "step" in r}
    assert sorted(records) == list(range(end))  # trained exactly to the stop
    assert asked["from_step"] == checkpoint["step"]
    assert "checkpoint_stall_seconds" in records[checkpoint["step"]]  # the checkpoint asked for
    report = audit(run_dir, cfg.rollout.max_staleness)
    assert report["problems"] == [] and report["steps"] == report["steps_committed"] == end
    assert set(report["samples_dropped"]) <= {"too_stale", "temperature_changed"}
    assert report["samples_by_state"]["committed"] == end * 8 * 4
    assert report["samples_by_state"].get("batched", 0) == 0 and longer["value"] == 40


def test_the_report_marks_each_change_where_it_took_effect(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from asyncrl.observe.report import mark_changes
    from asyncrl.store.ledger import read_changes

    assert read_changes(tmp_path) == []  # no ledger: no changes
    ledger = Ledger(tmp_path)
    ledger.request_change("trainer.lr", 3e-5, at=1.0)
    ledger.schedule_changes(2)
    ledger.request_change("rollout.max_staleness", 2, at=2.0)  # pending: not on the report
    ledger.close()
    changes = read_changes(tmp_path)
    assert changes == [{"step": 2, "key": "trainer.lr", "value": 3e-5}]
    steps = [{"step": s, "time": 10.0 * s} for s in range(4)]
    fig, axes = plt.subplots(1, 3)
    mark_changes(axes, steps, changes)
    assert [[line.get_xdata()[0] for line in ax.lines] for ax in axes] == [[20.0], [2], [20.0]]
    assert axes[1].texts[0].get_text() == "lr=3e-05"
    plt.close(fig)


@pytest.mark.long
@pytest.mark.e2e
def test_a_paused_run_outlasts_its_deadlines_and_goes_on(tiny_model, tmp_path):
    """Paused for longer than every wait's deadline (15 s here): nothing times out, nothing restarts, no
    step is trained while paused (once the groups already generating are), and after resume the run
    ends with nothing lost."""
    proc, run_dir = start_run(tmp_path, tiny_model, **{"timeouts.batch": 15, "timeouts.train_step": 15})
    try:
        assert ctl.request(run_dir, "POST", "/pause")["paused"] is True
        poll(lambda: _status(run_dir)["in_flight_groups"] == 0, 60, "the groups generating to finish")
        time.sleep(6)  # (the batches they filled train: 2 at most, ~0.3 s each here)
        before = steps_recorded(run_dir)
        time.sleep(20)  # past every deadline
        assert steps_recorded(run_dir) == before < 28 and _status(run_dir)["paused"] is True
        assert "(PAUSED)" in ctl.describe(_status(run_dir))
        assert ctl.request(run_dir, "POST", "/resume")["paused"] is False
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-3000:]
    finally:
        proc.kill()
    events = read_events(run_dir)
    assert [e["event"] for e in events if e["event"] in ("paused", "resumed")] == ["paused", "resumed"]
    assert not [e for e in events if e["event"] == "role_restarted"]
    assert_nothing_lost(run_dir)
