"""Where a run's numbers and messages go: TensorBoard and W&B get the records metrics.jsonl gets (a
missing one is refused before the run, a failing one is dropped while the run goes on); the roles'
logs hold what `run.log_level` lets through."""
import json

import pytest
from conftest import job_config

from asyncrl.config import ConfigError, load_config
from asyncrl.observe import sinks
from asyncrl.observe.events import EventLog, read_events
from asyncrl.run.launcher import train


@pytest.mark.e2e
def test_tensorboard_and_wandb_get_every_record(tiny_model, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sinks_on = {"run.sinks": '["tensorboard", "wandb"]', "run.wandb_mode": "offline",
                "run.log_level": "warning"}
    cfg = job_config(tmp_path, tiny_model, **{"run.steps": 6, "task.eval_every": 3, **sinks_on})
    run_dir = train(cfg, log=lambda *a, **k: None)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward" in r and "step" in r]
    evals = sorted((r for r in records if "eval_accuracy" in r), key=lambda r: r["eval_version"])
    assert len(steps) == 6 and [e["eval_version"] for e in evals] == [0, 3, 6]

    board = EventAccumulator(str(run_dir / "tensorboard"))  # TensorBoard's own reader
    board.Reload()
    rewards = board.Scalars("reward")
    assert [e.step for e in rewards] == [r["step"] for r in steps]
    assert [e.value for e in rewards] == pytest.approx([r["reward"] for r in steps], rel=1e-6)
    accuracy = board.Scalars("eval_accuracy")
    assert [e.step for e in accuracy] == [e["eval_version"] for e in evals]
    assert [e.value for e in accuracy] == pytest.approx([e["eval_accuracy"] for e in evals], rel=1e-6)
    assert "time/trainer/forward_backward" in board.Tags()["scalars"]

    for role in ("trainer", "orchestrator", "inference-0"):  # warnings only: nothing went wrong, nothing said
        assert (run_dir / "logs" / f"{role}.log").read_text() == "", role

    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    log = next(runs[0].glob("run-*.wandb")).read_bytes()  # W&B's record of the run (protobuf)
    assert b"eval_accuracy" in log and b"reward" in log and cfg.run.name.encode() in log


def test_a_sink_that_is_not_installed_is_refused_with_what_to_install(monkeypatch):
    cfg = load_config(overrides={"run": {"sinks": ["tensorboard", "wandb"]}})
    sinks.check_installed(cfg)  # both are here
    monkeypatch.setitem(sinks.PACKAGES, "wandb", "wandb_is_not_installed_here")
    with pytest.raises(ConfigError, match="run.sinks asks for wandb, not installed here: pip install"):
        sinks.check_installed(cfg)
    with pytest.raises(ConfigError, match="run.sinks"):
        load_config(overrides={"run": {"sinks": ["mlflow"]}})


class Failing:
    """A sink whose backend breaks after it started (a full disk, a lost connection)."""

    def __init__(self, cfg, run_dir):
        self.writes = 0

    def write(self, record):
        self.writes += 1
        raise OSError("No space left on device")

    def close(self):
        pass


def test_a_failing_sink_is_dropped_once_and_the_others_go_on(tmp_path, monkeypatch, caplog):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setitem(sinks.KINDS, "wandb", Failing)
    cfg = load_config(overrides={"run": {"sinks": ["wandb", "tensorboard"]}})
    out = sinks.Sinks(cfg, tmp_path, EventLog(tmp_path, "orchestrator"))
    for step in range(3):
        out.write({"step": step, "reward": 0.5 + step})
    out.close()
    failed = [e for e in read_events(tmp_path) if e["event"] == "sink_failed"]
    assert [(e["sink"], e["doing"]) for e in failed] == [("wandb", "write")]
    assert "No space left on device" in failed[0]["error"]
    assert [r.levelname for r in caplog.records if "the wandb sink failed" in r.message] == ["WARNING"]
    board = EventAccumulator(str(tmp_path / "tensorboard"))
    board.Reload()
    assert [(e.step, e.value) for e in board.Scalars("reward")] == [(0, 0.5), (1, 1.5), (2, 2.5)]
