"""The sample ledger: states, commits, what a restart rebuilds, and the audit that catches violations."""
import json
import sqlite3

from asyncrl.store.ledger import Ledger, audit
from asyncrl.trajectory import Trajectory, write_batch


def traj(prompt_id: int, k: int, version: int, reward: float = 1.0) -> Trajectory:
    return Trajectory(id=f"{prompt_id}-{k}", group_id=str(prompt_id), task="t", prompt_id=prompt_id,
                      tokens=[1, 2, 3], loss_mask=[0, 1, 1], logprobs=[0.0, -1.0, -1.0],
                      versions=[-1, version, version], reward=reward)


def test_a_group_moves_from_dispatch_to_commit(tmp_path):
    led = Ledger(tmp_path)
    led.dispatch([0])
    led.dispatch([1])
    assert led.in_flight() == [0, 1] and led.live_groups() == 2 and led.next_prompt_id() == 2
    led.finish(0, [traj(0, 0, 0), traj(0, 1, 0)], [("0-2", "verifier_error")])
    led.dispatch([1])  # re-issued after a restart: one prompt row, two attempts
    assert led.in_flight() == [1]
    assert [t.id for g in led.ready_groups() for t in g] == ["0-0", "0-1"]
    group = led.ready_groups()[0]
    led.batch(0, group, {"reward": 1.0})
    write_batch(tmp_path, 0, group)
    assert led.ready_groups() == [] and [t.id for t in led.batch_samples(0)] == ["0-0", "0-1"]
    assert led.commit_through(0) == 0  # no checkpoint contains step 0 yet
    assert led.commit_through(1) == 2
    report = audit(tmp_path, max_staleness=1)
    assert report["problems"] == [] and report["reissued_prompts"] == 1
    assert report["samples_by_state"] == {"committed": 2, "dropped": 1}
    assert report["samples_dropped"] == {"verifier_error": 1}


def test_a_sample_cannot_be_recorded_twice(tmp_path):
    led = Ledger(tmp_path)
    led.dispatch([0])
    led.finish(0, [traj(0, 0, 0)], [])
    try:
        led.finish(0, [traj(0, 0, 0)], [])
    except sqlite3.IntegrityError:
        pass
    else:
        raise AssertionError("a second record of sample 0-0 was accepted")
    assert audit(tmp_path, 1)["samples"] == 1  # the failed transaction left nothing behind


def test_too_stale_groups_give_their_gate_slot_back(tmp_path):
    led = Ledger(tmp_path)
    for p in range(3):
        led.dispatch([p])
        led.finish(p, [traj(p, 0, 0)], [])
    led.drop_group(led.ready_groups()[0], "too_stale")
    assert led.live_groups() == 2
    assert audit(tmp_path, 1)["samples_dropped"] == {"too_stale": 1}


def test_audit_catches_a_stale_sample_and_a_sample_in_two_batches(tmp_path):
    led = Ledger(tmp_path)
    led.dispatch([0])
    led.finish(0, [traj(0, 0, version=0)], [])
    led.batch(5, led.ready_groups()[0], {})
    write_batch(tmp_path, 5, [traj(0, 0, 0)])
    write_batch(tmp_path, 6, [traj(0, 0, 0)])
    report = audit(tmp_path, max_staleness=4)
    assert report["stale_samples_trained"] == 1 and report["trained_twice"] == 1
    assert len(report["problems"]) == 2


def test_metrics_are_a_projection_of_the_ledger(tmp_path):
    led = Ledger(tmp_path)
    led.record_eval({"eval_version": 0, "eval_accuracy": 0.4})
    for step in range(2):
        led.dispatch([step])
        led.finish(step, [traj(step, 0, step)], [])
        led.batch(step, led.ready_groups()[0], {"reward": 1.0})
        led.record_step(step + 1, {"step": step, "version": step + 1})
    led.record_eval({"eval_version": 2, "eval_accuracy": 0.5})
    lines = led.metrics_lines()
    assert [r.get("step", r.get("eval_version")) for r in map(json.loads, lines)] == [0, 0, 1, 2]
    assert led.get("served_version") == 2
    led.record_eval({"eval_version": 2, "eval_accuracy": 0.6})  # a restarted orchestrator evaluates v2 again
    led.close()
    again = Ledger(tmp_path)  # what a restarted orchestrator rewrites metrics.jsonl from
    assert [json.loads(line) for line in again.metrics_lines()] == [
        {"eval_version": 0, "eval_accuracy": 0.4}, {"step": 0, "version": 1},
        {"step": 1, "version": 2}, {"eval_version": 2, "eval_accuracy": 0.6}]


def test_an_event_that_keeps_happening_is_counted_not_repeated(tmp_path):
    from asyncrl.observe.events import REPEATS, EventLog, read_events

    log = EventLog(tmp_path, "orchestrator")
    for i in range(100_000):
        log.write("sample_dropped", reason="verifier_error", error="boom", sample=i)
    for i in range(3):
        log.write("sample_dropped", reason="bad_output", sample=i)
    events = read_events(tmp_path)
    kept = [e for e in events if e["event"] == "sample_dropped"]
    assert len(kept) == REPEATS + 3  # every kind's first REPEATS in full
    assert [e["sample"] for e in kept[:REPEATS]] == list(range(REPEATS))
    counts = [e["count"] for e in events if e["event"] == "repeated"]
    assert counts == [REPEATS + 1, 10 * REPEATS, 100 * REPEATS, 1000 * REPEATS]
    assert (tmp_path / "events.jsonl").stat().st_size < 100_000


def _audit_work(run_dir, steps: int, monkeypatch) -> int:
    """SQLite virtual-machine instructions (in thousands) the audit of a `steps`-step ledger runs: a count,
    the same on every machine and every run."""
    run_dir.mkdir()
    led = Ledger(run_dir)
    for step in range(steps):
        prompts = [4 * step + k for k in range(4)]
        led.dispatch(prompts)
        for p in prompts:
            led.finish(p, [traj(p, k, step) for k in range(4)], [])
        led.batch(step, [t for g in led.ready_groups() for t in g], {})
    led.close()
    work = [0]
    connect = sqlite3.connect

    def counted(*args, **kwargs):
        db = connect(*args, **kwargs)
        db.set_progress_handler(lambda: work.__setitem__(0, work[0] + 1), 1000)
        return db

    monkeypatch.setattr(sqlite3, "connect", counted)
    assert audit(run_dir, max_staleness=1)["problems"] == []
    monkeypatch.setattr(sqlite3, "connect", connect)
    return work[0]


def test_the_audit_grows_with_the_run_not_its_square(tmp_path, monkeypatch):
    """A correlated query per prompt (or per step) made a 1000-step audit take twice the run."""
    small = _audit_work(tmp_path / "a", 100, monkeypatch)
    large = _audit_work(tmp_path / "b", 400, monkeypatch)
    assert large < 6 * small, (small, large)  # linear (n log n): ~4x; the per-prompt scans gave ~16x
