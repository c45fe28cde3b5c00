"""--resume verifies a damaged run directory before any role starts: repair, or refuse in one sentence.
Built by hand (a ledger, a checkpoint, weights, batches), so each damage is exact and no run is needed."""
import hashlib
import json
import sqlite3

import pytest
import torch

from asyncrl.config import ConfigError
from asyncrl.run.resume_check import check_resumable
from asyncrl.rundir import RunDir
from asyncrl.store.ledger import SCHEMA
from asyncrl.trajectory import Trajectory, write_batch
from asyncrl.transports import weights

STATE = {"w": torch.arange(6, dtype=torch.float32)}


def checkpoint(run_dir, step: int, state=STATE) -> None:
    from safetensors.torch import save_file

    path = run_dir / "checkpoints" / f"step_{step:06d}"
    path.mkdir(parents=True)
    save_file(state, str(path / "model.safetensors"))
    files = {"model.safetensors": hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()}
    (path / "manifest.json").write_text(json.dumps({"step": step, "files": files}))


def ledger(run_dir, batched: int, served: int) -> None:
    db = sqlite3.connect(run_dir / "ledger.db")
    db.executescript(SCHEMA)
    db.executemany("INSERT INTO steps VALUES (?, 'batched', '', '{}', NULL)", [(k,) for k in range(batched)])
    db.execute("INSERT INTO meta VALUES ('served_version', ?)", (json.dumps(served),))
    db.commit()
    db.close()


def publish(run_dir, version: int) -> dict:
    state = {"w": STATE["w"] + version}
    weights.publish(run_dir, version, state, {"step": version - 1})
    return state


@pytest.fixture
def run_dir(tmp_path):
    """A run stopped after publishing versions 1..6, checkpointed at step 4, serving version 5."""
    for v in range(1, 7):
        state = publish(tmp_path, v)
        if v == 4:
            checkpoint(tmp_path, 4, state)
    ledger(tmp_path, batched=6, served=5)
    for step in range(6):
        sample = Trajectory(f"{step}-0", str(step), "t", step, [1, 2], [0, 1], [0.0, -1.0], [-1, 0], 1.0)
        write_batch(tmp_path, step, [sample])
    return tmp_path


def test_an_intact_run_passes_untouched(run_dir):
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}
    check_resumable(run_dir, log=pytest.fail)
    assert before == {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}


def test_a_missing_ledger_is_refused(run_dir):
    (run_dir / "ledger.db").unlink()
    with pytest.raises(ConfigError, match="ledger .* is missing but the run has published versions up to 6"):
        check_resumable(run_dir)


def test_a_ledger_older_than_the_checkpoints_is_refused(run_dir):
    (run_dir / "ledger.db").unlink()
    ledger(run_dir, batched=2, served=1)
    with pytest.raises(ConfigError, match="records 2 batches but checkpoint step_000004 has trained 4"):
        check_resumable(run_dir)


def test_damaged_weights_are_republished_from_their_checkpoint_or_by_the_trainer(run_dir):
    (run_dir / "ledger.db").unlink()
    ledger(run_dir, batched=6, served=4)  # the orchestrator loads 4, then 5 and 6
    said = []
    for v in (4, 6):  # 4 has a checkpoint of its own; 6 is past the newest checkpoint
        f = RunDir(run_dir).weights_file(v)
        f.write_bytes(f.read_bytes()[:40])
    check_resumable(run_dir, log=said.append)
    republished = weights.load(RunDir(run_dir).weights_file(4))
    assert weights.state_hash(republished) == weights.read_marker(run_dir, 4)["hash"]
    assert not RunDir(run_dir).marker(6).exists() and not RunDir(run_dir).weights_file(6).exists()
    assert weights.read_marker(run_dir, 5) is not None  # intact: kept
    assert any("re-published from step_000004" in s for s in said)
    assert any("publishes version 6 again" in s for s in said)


def test_damaged_weights_with_nothing_to_rebuild_them_from_are_refused(run_dir):
    (run_dir / "ledger.db").unlink()
    ledger(run_dir, batched=6, served=3)  # version 3 is served, and no checkpoint holds it
    f = RunDir(run_dir).weights_file(3)
    f.write_bytes(b"")
    with pytest.raises(ConfigError, match="v000003.safetensors does not match its hash .* no checkpoint"):
        check_resumable(run_dir)


def test_a_torn_batch_is_left_for_the_orchestrator_to_write_again(run_dir):
    torn = RunDir(run_dir).batch(5)
    torn.write_text('{"id": "5-0", "tok')
    check_resumable(run_dir, log=lambda *_: None)
    assert not torn.exists() and RunDir(run_dir).batch(4).exists()
