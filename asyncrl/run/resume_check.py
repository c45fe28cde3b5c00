"""Before `--resume` starts any role: what the roles will rely on must agree, else it is repaired or
the resume is refused in one sentence.

The roles trust the run directory: the orchestrator rebuilds its state from the ledger, the
trainer starts from the newest valid checkpoint, and the served version's weights are loaded by
file. A directory damaged while the run was stopped (a deleted ledger, a truncated weights file,
a torn batch) would otherwise make them wait on each other in silence. Checked here:

  ledger     present and readable, and at least as far on as the newest checkpoint (else the
             orchestrator would re-draw batches the trainer has already trained): refused.
  weights    every published version from the served one on matches its marker's hash; one that
             does not is re-published from the checkpoint of that step, or, past the newest
             checkpoint, deleted with its marker so the trainer publishes it again; else refused.
  batches    a batch after the newest checkpoint that does not parse is deleted: the orchestrator
             writes it again from the ledger.
"""
from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from asyncrl.config import ConfigError
from asyncrl.rundir import CheckpointFiles, RunDir
from asyncrl.store import checkpoint
from asyncrl.trajectory import read_batch
from asyncrl.transports import weights


def check_resumable(run_dir: Path, log=print) -> None:
    newest = checkpoint.latest(run_dir, log=lambda m: log(f"resume: {m}"))
    trained = int(newest.name.removeprefix("step_")) if newest else 0
    published = RunDir(run_dir).published_versions()
    served = _check_ledger(run_dir, trained, published)
    _check_weights(run_dir, published, served, trained, log)
    _check_batches(run_dir, trained, log)


def _check_ledger(run_dir: Path, trained: int, published: list[int]) -> int:
    """The version the ledger says is served; ConfigError if the ledger cannot carry the run on."""
    path = RunDir(run_dir).ledger
    if not path.exists():
        if trained or published:
            raise ConfigError(
                f"cannot resume {run_dir}: its ledger ({path}) is missing but the run has published "
                f"versions up to {max(published, default=0)} (checkpoint step {trained}); the "
                "record of which samples were trained is gone: start a new run (or restore ledger.db)")
        return 0
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            batched = db.execute("SELECT COUNT(*) FROM steps").fetchone()[0]
            row = db.execute("SELECT value FROM meta WHERE key = 'served_version'").fetchone()
        finally:
            db.close()
    except sqlite3.Error as e:
        raise ConfigError(f"cannot resume {run_dir}: its ledger {path} cannot be read ({e})") from None
    if batched < trained:
        raise ConfigError(
            f"cannot resume {run_dir}: its ledger records {batched} batches but checkpoint "
            f"step_{trained:06d} has trained {trained}: the ledger is older than the checkpoints (was "
            "ledger.db replaced, or its -wal file deleted?)")
    return json.loads(row[0]) if row else 0


def _check_weights(run_dir: Path, published: list[int], served: int, trained: int, log) -> None:
    for version in [v for v in published if v >= served and v > 0]:
        # (the trainer keeps every version from the served one on: pruning stays η + 2 behind)
        path = RunDir(run_dir).weights_file(version)
        marker = weights.read_marker(run_dir, version)
        if _matches(path, marker["hash"]):
            continue
        ckpt = RunDir(run_dir).checkpoint(version)
        if ckpt.exists() and checkpoint.verify_checkpoint(ckpt) is None:
            state = weights.load(CheckpointFiles(ckpt).weights)
            if weights.state_hash(state) == marker["hash"]:
                weights.publish(run_dir, version, state, {k: v for k, v in marker.items() if k != "hash"})
                log(f"resume: {path.name} did not match its hash; re-published from {ckpt.name}")
                continue
        if version > trained:  # the trainer trains this step again and publishes it anew
            for f in (path, RunDir(run_dir).patch(version), RunDir(run_dir).marker(version)):
                f.unlink(missing_ok=True)
            log(f"resume: {path.name} did not match its hash; the trainer publishes version {version} again")
            continue
        raise ConfigError(
            f"cannot resume {run_dir}: {path} does not match its hash (truncated or overwritten) and no "
            f"checkpoint holds version {version} to re-publish it from")


def _matches(path: Path, digest: str) -> bool:
    try:
        return weights.state_hash(weights.load(path)) == digest
    except Exception:  # truncated, missing, not safetensors: all mean "not these weights"
        return False


def _check_batches(run_dir: Path, trained: int, log) -> None:
    """Batches the trainer will read (from the newest checkpoint's step on) must parse."""
    for _, path in RunDir(run_dir).batch_files():
        step = int(path.stem.removeprefix("step_"))
        if step < trained:
            continue
        try:
            read_batch(path)
        except (ValueError, KeyError, TypeError):
            path.unlink()
            log(f"resume: batch {step} was unreadable; the orchestrator writes it again from the ledger")
