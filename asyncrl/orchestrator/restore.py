"""What an orchestrator starts from: its state rebuilt from the ledger (empty on a fresh run, everything
durable after a restart), and the run directory's projections of the ledger made whole again.

The ledger is the truth (asyncrl/store/ledger.py); the orchestrator's state is a cache of it: the prompt
cursor, the prompts whose generation died with an earlier process, the ready pool, the staleness gate's
count, the next step, the live settings and the running baseline. A batch file lost between the ledger's
transaction and the file's write is written again; metrics.jsonl is rewritten whole.
"""
from __future__ import annotations

import time

from asyncrl.control import pausing
from asyncrl.control.live import settings_at
from asyncrl.files import write_atomic
from asyncrl.orchestrator.advantages import RunningBaseline
from asyncrl.rundir import RunDir


def restore(orch) -> None:
    led, run_dir = orch.ledger, RunDir(orch.run_dir)
    orch.started_at = led.get("started_at") or time.time()
    led.put("started_at", orch.started_at)
    orch.cursor = led.next_prompt_id()
    orch.paused = led.get("paused", False)  # (asyncrl ctl RUN pause: admission stops)
    pausing.record(orch.run_dir, orch.paused)
    orch.reissue = led.in_flight()  # their generation died with an earlier process
    orch.ready = []  # finished groups, a heap: (oldest version, prompt id, group)
    for group in led.ready_groups():
        orch._finished(group)
    orch.gate.admitted = led.live_groups()  # re-issued prompts keep the slot they had
    orch.next_step = led.step_count()
    orch._use_settings(settings_at(led.scheduled_changes(), orch.next_step))
    if isinstance(orch.advantages, RunningBaseline):
        orch.advantages.value = led.get("baseline")
    # (steps before `pruned_through` have no file by design: run.prune_trained)
    for step in range(led.get("pruned_through", 0), orch.next_step):
        if not run_dir.batch(step).exists():
            orch._write_batch(step, led.batch_samples(step))
    orch.committed_through = 0  # (from the trainer's checkpoints: _connect_trainer)
    write_atomic(run_dir.metrics, "".join(line + "\n" for line in led.metrics_lines()))
    orch.metrics = open(run_dir.metrics, "a")  # (appended to from here on)
    orch.last_gen = (time.monotonic(), None)
    orch.up_since, orch.cpu_at_start = time.monotonic(), time.process_time()
