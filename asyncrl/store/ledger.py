"""The sample ledger: one SQLite database (WAL) per run, `runs/<name>/ledger.db`.

It is the truth about every prompt and sample; the orchestrator is its only writer, and every
state change is one transaction, so a SIGKILL at any moment leaves a consistent ledger.

    prompt:  in_flight ─→ finished            (its samples recorded, in one transaction)
                      └→ dropped              (malformed row, empty or over-long prompt)
    sample:  ready ─→ batched (step k) ─→ committed (a durable checkpoint contains step k)
               └──────────┴→ dropped (too_stale, verifier_error, aborted; with the reason)

A batch becomes `committed` only once the checkpoint that contains its update is durable
(`commit_through`); batches after the last checkpoint stay `batched` and are trained again from
the same file after a trainer restart. On restart the orchestrator rebuilds its whole state from
here: the dataset cursor, the prompts to re-issue, the ready pool, the staleness gate, the metrics.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import sqlite3
from pathlib import Path

from asyncrl.control.live import settings_at
from asyncrl.rundir import RunDir
from asyncrl.trajectory import Trajectory, read_batch
from asyncrl.transports import weights

SCHEMA = """
CREATE TABLE IF NOT EXISTS prompts (
    prompt_id INTEGER PRIMARY KEY, state TEXT NOT NULL, attempts INTEGER NOT NULL, reason TEXT);
CREATE TABLE IF NOT EXISTS samples (
    id TEXT PRIMARY KEY, prompt_id INTEGER NOT NULL, state TEXT NOT NULL, step INTEGER,
    position INTEGER, oldest_version INTEGER, reward REAL, reason TEXT, data TEXT);
CREATE INDEX IF NOT EXISTS samples_state ON samples (state, step);
CREATE INDEX IF NOT EXISTS samples_prompt ON samples (prompt_id, state);
CREATE INDEX IF NOT EXISTS samples_step ON samples (step, position);
CREATE INDEX IF NOT EXISTS prompts_state ON prompts (state);
CREATE TABLE IF NOT EXISTS steps (
    step INTEGER PRIMARY KEY, state TEXT NOT NULL, digest TEXT NOT NULL, stats TEXT NOT NULL,
    metrics TEXT);
CREATE INDEX IF NOT EXISTS steps_state ON steps (state, step);
CREATE TABLE IF NOT EXISTS evals (version INTEGER PRIMARY KEY, record TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS changes (
    id INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT NOT NULL, value TEXT NOT NULL,
    requested_at REAL NOT NULL, step INTEGER);
"""


def batch_digest(sample_ids: list[str]) -> str:
    """What the trainer and the ledger both compute for a batch: equal iff the same samples in the same
    order."""
    return hashlib.sha256("\n".join(sample_ids).encode()).hexdigest()


class Ledger:
    def __init__(self, run_dir: str | Path, timeout: float = 30.0):
        self.run_dir = RunDir(run_dir)
        self.db = sqlite3.connect(self.run_dir.ledger, timeout=timeout, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        # WAL + NORMAL: a committed transaction survives any process crash (SIGKILL included); a power
        # cut may lose the last few, never corrupt the file. FULL (an fsync per transaction) cost the
        # tiny default run ~25% more ledger time for a failure this design does not promise to survive.
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        self.db.close()

    def _tx(self, statements: list[tuple[str, tuple]]) -> None:
        with self.db:  # BEGIN … COMMIT, or ROLLBACK on error
            self.db.execute("BEGIN IMMEDIATE")
            # (a run of one statement, e.g. a group's sample rows, in one call: the per-call cost was
            # most of the ledger's)
            for sql, run in itertools.groupby(statements, key=lambda s: s[0]):
                self.db.executemany(sql, [args for _, args in run])

    def _one(self, sql: str, args: tuple = ()):
        return self.db.execute(sql, args).fetchone()

    # --- meta ---------------------------------------------------------------------------
    def get(self, key: str, default=None):
        row = self._one("SELECT value FROM meta WHERE key = ?", (key,))
        return json.loads(row[0]) if row else default

    def put(self, key: str, value) -> None:
        self._tx([("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, json.dumps(value)))])

    # --- prompts ------------------------------------------------------------------------
    def dispatch(self, prompt_ids: list[int]) -> None:
        """A group of samples of each of these prompts is being generated (again, after a restart)."""
        if prompt_ids:
            upsert = ("INSERT INTO prompts VALUES (?, 'in_flight', 1, NULL) "
                      "ON CONFLICT (prompt_id) DO UPDATE SET attempts = attempts + 1")
            self._tx([(upsert, (p,)) for p in prompt_ids])

    def drop_prompt(self, prompt_id: int, reason: str) -> None:
        self._tx([("INSERT OR REPLACE INTO prompts VALUES (?, 'dropped', 0, ?)", (prompt_id, reason))])

    def finish(self, prompt_id: int, group: list[Trajectory], dropped: list[tuple[str, str]],
               meta: dict | None = None) -> None:
        """The group's scored samples (state ready), its unusable ones (id, reason), and any
        orchestrator state that changed with it (e.g. a running baseline), atomically."""
        rows = [("INSERT INTO samples VALUES (?, ?, 'ready', NULL, NULL, ?, ?, NULL, ?)",
                 (t.id, prompt_id, t.oldest_version, t.reward, t.to_json())) for t in group]
        rows += [("INSERT INTO samples VALUES (?, ?, 'dropped', NULL, NULL, NULL, NULL, ?, NULL)",
                  (sample_id, prompt_id, reason)) for sample_id, reason in dropped]
        rows += [
            ("INSERT OR REPLACE INTO meta VALUES (?, ?)", (k, json.dumps(v))) for k, v in (meta or {}).items()
        ]
        self._tx([*rows, ("UPDATE prompts SET state = 'finished' WHERE prompt_id = ?", (prompt_id,))])

    def next_prompt_id(self) -> int:
        return self._one("SELECT COALESCE(MAX(prompt_id) + 1, 0) FROM prompts")[0]

    def in_flight(self) -> list[int]:
        return [
            r[0]
            for r in self.db.execute(
                "SELECT prompt_id FROM prompts WHERE state = 'in_flight' ORDER BY prompt_id"
            )
        ]

    def live_groups(self) -> int:
        """Groups holding a staleness-gate slot: in flight, or with samples that will be trained."""
        return self._one(
            # (one pass over samples_prompt in prompt order: no temporary B-tree of every prompt id)
            "SELECT (SELECT COUNT(*) FROM prompts WHERE state = 'in_flight') + (SELECT COUNT(DISTINCT "
            "prompt_id) FROM samples INDEXED BY samples_prompt "
            "WHERE state IN ('ready', 'batched', 'committed'))"
        )[0]

    # --- samples and batches ------------------------------------------------------------
    def ready_groups(self) -> list[list[Trajectory]]:
        groups: dict[int, list[Trajectory]] = {}
        for prompt_id, data in self.db.execute(
            "SELECT prompt_id, data FROM samples WHERE state = 'ready' ORDER BY rowid"
        ):
            groups.setdefault(prompt_id, []).append(Trajectory.from_json(data))
        return list(groups.values())

    def drop_group(self, group: list[Trajectory], reason: str) -> None:
        self._tx(
            [
                (
                    "UPDATE samples SET state = 'dropped', reason = ? WHERE id = ? AND state = 'ready'",
                    (reason, t.id),
                )
                for t in group
            ]
        )

    def note(self, sample_ids: list[str], reason: str) -> None:
        """A reason on batched samples, their state unchanged (e.g. the trainer masked them)."""
        self._tx([("UPDATE samples SET reason = ? WHERE id = ?", (reason, i)) for i in sample_ids])

    def batch(self, step: int, trajs: list[Trajectory], stats: dict) -> str:
        """Batch `step` is these samples, in this order; returns its digest."""
        digest = batch_digest([t.id for t in trajs])
        rows = [
            (
                "UPDATE samples SET state = 'batched', step = ?, position = ? "
                "WHERE id = ? AND state = 'ready'",
                (step, i, t.id),
            )
            for i, t in enumerate(trajs)
        ]
        self._tx(
            [
                *rows,
                ("INSERT INTO steps VALUES (?, 'batched', ?, ?, NULL)", (step, digest, json.dumps(stats))),
            ]
        )
        return digest

    # --- live changes (asyncrl/control/live.py) ---------------------------------------------------
    def request_change(self, key: str, value, at: float) -> int:
        """A live change, pending until the orchestrator schedules it at a step; returns its id."""
        with self.db:
            cur = self.db.execute("INSERT INTO changes (key, value, requested_at) VALUES (?, ?, ?)",
                                  (key, json.dumps(value), at))
        return cur.lastrowid

    def schedule_changes(self, step: int) -> list[tuple[str, object]]:
        """Every pending change takes effect at `step` (atomically); returns them as (key, value)."""
        pending = self.db.execute("SELECT id, key, value FROM changes WHERE step IS NULL ORDER BY id")
        pending = pending.fetchall()
        if pending:  # (the orchestrator is the only writer: nothing is added between the read and this)
            self._tx([("UPDATE changes SET step = ? WHERE id = ?", (step, i)) for i, _, _ in pending])
        return [(key, json.loads(value)) for _, key, value in pending]

    def changes(self) -> list[dict]:
        """Every change in the order made: id, key, value, requested_at, step (None while pending)."""
        rows = self.db.execute("SELECT id, key, value, requested_at, step FROM changes ORDER BY id")
        return [{"id": i, "key": k, "value": json.loads(v), "requested_at": t, "step": s}
                for i, k, v, t, s in rows]

    def scheduled_changes(self) -> list[tuple[int, str, object]]:
        """(step, key, value) of the changes that have taken effect, in the order made."""
        return _scheduled(self.db)

    def step_count(self) -> int:
        """Batches assembled so far (steps 0 … count − 1)."""
        return self._one("SELECT COUNT(*) FROM steps")[0]

    def batch_samples(self, step: int) -> list[Trajectory]:
        return [Trajectory.from_json(r[0]) for r in self.db.execute(
            "SELECT data FROM samples WHERE step = ? ORDER BY position", (step,))]

    def step_stats(self, step: int) -> dict:
        row = self._one("SELECT stats FROM steps WHERE step = ?", (step,))
        return json.loads(row[0]) if row else {}

    def commit_through(self, checkpoint_step: int, prune_below: int = 0) -> int:
        """Steps < checkpoint_step are in a durable checkpoint: their samples are committed. With
        `prune_below` (the oldest checkpoint kept: no restart trains a step before it again), the batch
        files of the steps before it are deleted; the ledger keeps their samples whole."""
        with self.db:
            self.db.execute("BEGIN IMMEDIATE")
            n = self.db.execute("UPDATE samples SET state = 'committed' WHERE state = 'batched' AND step < ?",
                                (checkpoint_step,)).rowcount
            self.db.execute(
                "UPDATE steps SET state = 'committed' WHERE state = 'batched' AND step < ?",
                (checkpoint_step,),
            )
            pruned = self.get("pruned_through", 0)
            prune_below = min(prune_below, checkpoint_step)
            if prune_below > pruned:  # (from where the last prune stopped: a step's cost stays flat)
                self.db.execute("INSERT OR REPLACE INTO meta VALUES ('pruned_through', ?)",
                                (json.dumps(prune_below),))
        for step in range(pruned, prune_below):  # (after the commit: a crash between leaves files, not holes)
            self.run_dir.batch(step).unlink(missing_ok=True)
        return n

    # --- metrics ------------------------------------------------------------------------
    def record_step(self, version: int, metrics: dict) -> None:
        """Version `version` is served and step version−1's metrics are final, atomically."""
        self._tx([("UPDATE steps SET metrics = ? WHERE step = ?", (json.dumps(metrics), version - 1)),
                  ("INSERT OR REPLACE INTO meta VALUES ('served_version', ?)", (json.dumps(version),))])

    def record_eval(self, record: dict) -> None:
        self._tx(
            [("INSERT OR REPLACE INTO evals VALUES (?, ?)", (record["eval_version"], json.dumps(record)))]
        )

    def metrics_lines(self) -> list[str]:
        """metrics.jsonl's lines, in order: each recorded step, and each evaluation after the step it
        follows. The stored JSON text itself: a resume of a long run neither parses nor re-encodes it."""
        return [line for (line,) in self.db.execute(
            "SELECT line FROM (SELECT step + 1 AS version, 0 AS eval, metrics AS line FROM steps WHERE "
            "metrics IS NOT NULL UNION ALL SELECT version, 1, record FROM evals) ORDER BY version, eval")]


def read_changes(run_dir: str | Path) -> list[dict]:
    """The run's scheduled live changes (step, key, value), read-only; [] for a ledger without any."""
    path = RunDir(run_dir).ledger
    if not path.exists():
        return []
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return [{"step": step, "key": key, "value": value} for step, key, value in _scheduled(db)]
    finally:
        db.close()


def _scheduled(db) -> list[tuple[int, str, object]]:
    """(step, key, value) of the scheduled changes, in the order made ([] for a ledger from before them)."""
    if not db.execute("SELECT 1 FROM sqlite_master WHERE name = 'changes'").fetchone():
        return []
    rows = db.execute("SELECT step, key, value FROM changes WHERE step IS NOT NULL ORDER BY id")
    return [(step, key, json.loads(value)) for step, key, value in rows]


def audit(run_dir: str | Path, max_staleness: int, distilled: bool = False) -> dict:
    """Counts that prove nothing was lost or used twice; `problems` lists every violation found.
    `max_staleness`: the run's configured bound (live changes to it are read from the ledger); `distilled`:
    the run has a teacher, so every trained sample must carry its teacher's logprobs."""
    db = sqlite3.connect(f"file:{RunDir(run_dir).ledger}?mode=ro", uri=True)
    count = lambda sql, args=(): db.execute(sql, args).fetchone()[0]  # noqa: E731
    states = dict(db.execute("SELECT state, COUNT(*) FROM samples GROUP BY state").fetchall())
    reasons = dict(
        db.execute("SELECT reason, COUNT(*) FROM samples WHERE state = 'dropped' GROUP BY reason").fetchall()
    )
    prompt_reasons = dict(
        db.execute("SELECT reason, COUNT(*) FROM prompts WHERE state = 'dropped' GROUP BY reason").fetchall()
    )
    out = {
        "prompts": count("SELECT COUNT(*) FROM prompts"),
        "prompts_in_flight": count("SELECT COUNT(*) FROM prompts WHERE state = 'in_flight'"),
        "prompts_dropped": prompt_reasons,
        "reissued_prompts": count("SELECT COUNT(*) FROM prompts WHERE attempts > 1"),
        "samples": sum(states.values()),
        "samples_by_state": states,
        "samples_dropped": reasons,
        "steps": count("SELECT COUNT(*) FROM steps"),
        "steps_committed": count("SELECT COUNT(*) FROM steps WHERE state = 'committed'"),
    }
    problems = []
    # (NOT IN: SQLite builds the subquery's set once; a correlated NOT EXISTS scanned every sample per
    # prompt, with no index on samples.prompt_id: 440 s at 1000 default steps)
    gaps = count("SELECT COUNT(*) FROM prompts WHERE state = 'finished' AND prompt_id NOT IN "
                 "(SELECT prompt_id FROM samples)")
    if gaps:
        problems.append(f"{gaps} finished prompts have no samples recorded")
    holes = count("SELECT MAX(prompt_id) + 1 - COUNT(*) FROM prompts") or 0
    if holes:
        problems.append(f"{holes} prompt ids between 0 and the cursor were never dispatched")
    changes = _scheduled(db)  # (each step is held to the max_staleness in force when it was assembled)
    bound = {step: settings_at(changes, step).get("rollout.max_staleness", max_staleness)
             for (step,) in db.execute("SELECT step FROM steps")}
    trained = db.execute("SELECT step, oldest_version FROM samples WHERE step IS NOT NULL")
    stale = sum(1 for step, oldest in trained if step - oldest > bound.get(step, max_staleness))
    if stale:
        problems.append(f"{stale} trained samples exceed max_staleness = {max_staleness}")
    out["stale_samples_trained"] = stale
    batch_problems, out["trained_twice"], unscored_in_files = _check_batches(db, run_dir, distilled)
    problems += batch_problems
    if distilled:  # a token for a token: one teacher logprob per token, in the ledger and in the batch files
        unscored = count("SELECT COUNT(*) FROM samples WHERE step IS NOT NULL AND json_array_length(data, "
                         "'$.teacher_logprobs') IS NOT json_array_length(data, '$.tokens')")
        out["trained_without_teacher"] = unscored + unscored_in_files
        if out["trained_without_teacher"]:
            problems.append(f"{out['trained_without_teacher']} trained samples have no teacher logprobs for "
                            "every token")
    if out["trained_twice"]:
        problems.append(f"{out['trained_twice']} samples appear in more than one batch")
    out["problems"] = problems
    db.close()
    return out


def _check_batches(db, run_dir: str | Path, distilled: bool) -> tuple[list[str], int, int]:
    """Each batch against its digest, the digest its version was trained on, and the file the trainer read,
    a batch at a time in step order (memory stays one batch's at any run length). Returns the problems,
    the samples in batch files that their step's ledger batch does not hold (a sample trained twice), and
    with `distilled` the file samples without a teacher logprob per token."""
    problems, extra, unscored = [], 0, 0
    digests = dict(db.execute("SELECT step, digest FROM steps").fetchall())
    files = dict(RunDir(run_dir).batch_files())
    rows = db.execute("SELECT step, id FROM samples WHERE step IS NOT NULL ORDER BY step, position")
    ledger = ((step, [i for _, i in group]) for step, group in itertools.groupby(rows, key=lambda r: r[0]))
    current = next(ledger, None)
    for step in sorted(digests.keys() | files.keys()):
        while current is not None and current[0] < step:
            current = next(ledger, None)
        ids = current[1] if current is not None and current[0] == step else []
        if step in digests:
            if batch_digest(ids) != digests[step]:
                problems.append(f"batch {step} in the ledger does not match its digest")
            marker = weights.read_marker(run_dir, step + 1)
            if marker is not None and marker.get("batch_digest") != digests[step]:
                problems.append(f"version {step + 1} was trained on a batch other than the ledger's "
                                f"batch {step}")
        if step in files:
            read = read_batch(files[step])
            extra += len(read) - len({t.id for t in read} & set(ids))
            if distilled:
                unscored += sum(t.teacher_logprobs is None or len(t.teacher_logprobs) != len(t.tokens)
                                for t in read)
    return problems, extra, unscored
