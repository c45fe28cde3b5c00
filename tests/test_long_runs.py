"""A run's length must not slow its steps: every statement the ledger makes in a step is an index search,
never a scan of a table that grows with the run (benchmarks/long_runs.py measures it at 1k-100k steps);
the dashboard reads events.jsonl on from where it stopped."""
import json

from test_ledger import traj

from asyncrl.observe.dashboard import RestartCount
from asyncrl.store.ledger import Ledger

GROWING = ("prompts", "samples", "steps")


def a_step(led: Ledger, step: int, prompts: int = 4) -> None:
    """The ledger's statements of one step, in the orchestrator's order."""
    first = led.next_prompt_id()
    led.dispatch(list(range(first, first + prompts)))
    for p in range(first, first + prompts):
        led.finish(p, [traj(p, k, step) for k in range(2)], [(f"{p}-2", "verifier_error")])
    led.drop_group(led.ready_groups()[-1], "too_stale")
    led.batch(step, [t for g in led.ready_groups() for t in g], {})
    led.record_step(step + 1, {"step": step, "version": step + 1})
    led.commit_through(step + 1, prune_below=step)  # (run.prune_trained: the oldest kept checkpoint)


def test_every_statement_of_a_step_searches_an_index(tmp_path):
    led = Ledger(tmp_path)
    for step in range(3):
        a_step(led, step)
    statements = []
    led.db.set_trace_callback(statements.append)
    a_step(led, 3)
    led.db.set_trace_callback(None)
    queries = [s for s in statements if s.split()[0].upper() in ("SELECT", "UPDATE", "INSERT", "DELETE")]
    assert len(queries) > 10
    linear = [(sql, detail) for sql in queries for *_, detail in led.db.execute("EXPLAIN QUERY PLAN " + sql)
              if grows_with_the_run(detail)]
    assert linear == []


def grows_with_the_run(detail: str) -> bool:
    """A plan step that visits rows in proportion to a growing table: a scan, or a search with a range
    and no equality to narrow it (`rowid<?`: every earlier step). `SEARCH prompts` bare is MAX(prompt_id)."""
    words = detail.split()
    if len(words) < 2 or words[1] not in GROWING:
        return False
    return words[0] == "SCAN" or (words[0] == "SEARCH" and "(" in detail and "=?" not in detail)


def test_the_rule_above_catches_a_range_over_every_earlier_step():
    assert grows_with_the_run("SEARCH steps USING INTEGER PRIMARY KEY (rowid<?)")
    assert grows_with_the_run("SCAN samples")
    assert not grows_with_the_run("SEARCH steps USING INDEX steps_state (state=? AND step<?)")


def test_the_dashboard_reads_only_the_events_added_since_its_last_poll(tmp_path):
    events = tmp_path / "events.jsonl"
    restarted = lambda role: json.dumps({"event": "role_restarted", "target": role}) + "\n"  # noqa: E731
    events.write_text(restarted("trainer") + json.dumps({"event": "dropped"}) + "\n" + restarted("trainer"))
    counts = RestartCount(events)
    assert counts.counts() == {"trainer": 2}
    with open(events, "a") as f:
        f.write(restarted("inference-0") + restarted("inference-0")[:10])  # the second: half written
    assert counts.counts() == {"trainer": 2, "inference-0": 1}
    assert counts.tail.offset == events.stat().st_size - 10
    with open(events, "a") as f:
        f.write(restarted("inference-0")[10:])
    assert counts.counts() == {"trainer": 2, "inference-0": 2}
