"""The joined workers on record, in the run's ledger (the orchestrator is its only writer).

    workers  name, the hash of its token (the token itself is shown once), when added / revoked /
             quarantined and why, its trust score and counts of checked, failed and rejected samples
    leases   each piece of work given to a worker: which prompts, when, and how it ended (returned,
             expired: issued again elsewhere, or refused)

A token is 32 random bytes; the ledger keeps only its sha256, so a copied ledger admits no one.
"""
from __future__ import annotations

import hashlib
import json
import secrets
import time

SCHEMA = """
CREATE TABLE IF NOT EXISTS workers (
    name TEXT PRIMARY KEY, token_sha256 TEXT NOT NULL UNIQUE, added REAL NOT NULL, revoked REAL,
    quarantined REAL, reason TEXT, trust REAL NOT NULL, checked INTEGER NOT NULL, failed INTEGER NOT NULL,
    rejected INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS leases (
    id TEXT PRIMARY KEY, worker TEXT NOT NULL, prompts TEXT NOT NULL, issued REAL NOT NULL, version INTEGER,
    state TEXT NOT NULL, ended REAL, reason TEXT);
"""
NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
FIELDS = ("name", "added", "revoked", "quarantined", "reason", "trust", "checked", "failed", "rejected")


class RosterError(ValueError):
    pass


def _sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Roster:
    def __init__(self, db):
        """`db`: the ledger's connection (asyncrl/store/ledger.py)."""
        self.db = db
        self.db.executescript(SCHEMA)
        # (a restarted orchestrator: what was given out before is issued again, by the router)
        self._tx("UPDATE leases SET state = 'expired', ended = ?, reason = 'the orchestrator restarted' "
                 "WHERE state = 'issued'", (time.time(),))

    def _tx(self, sql: str, args: tuple) -> None:
        with self.db:
            self.db.execute(sql, args)

    def add(self, name: str, trust: float) -> str:
        """A new worker's token (shown once: the ledger keeps its hash)."""
        if not name or len(name) > 64 or not set(name) <= NAME_CHARS:
            raise RosterError(f"a worker's name is 1-64 of letters, digits, '.', '_', '-': got {name!r}")
        if self.get(name):
            raise RosterError(f"worker {name!r} exists already (revoke it and add another name)")
        token = "w-" + secrets.token_urlsafe(32)
        self._tx("INSERT INTO workers VALUES (?, ?, ?, NULL, NULL, NULL, ?, 0, 0, 0)",
                 (name, _sha(token), time.time(), trust))
        return token

    def revoke(self, name: str) -> None:
        if not self.get(name):
            raise RosterError(f"no worker {name!r}; the workers: {', '.join(w['name'] for w in self.all())}")
        self._tx("UPDATE workers SET revoked = COALESCE(revoked, ?) WHERE name = ?", (time.time(), name))

    def quarantine(self, name: str, reason: str) -> None:
        self._tx("UPDATE workers SET quarantined = ?, reason = ? WHERE name = ? AND quarantined IS NULL",
                 (time.time(), reason, name))

    def who(self, token: str) -> dict | None:
        """The worker this token names, whatever its state (None: no worker has it)."""
        row = self.db.execute(f"SELECT {', '.join(FIELDS)} FROM workers WHERE token_sha256 = ?",
                              (_sha(token),)).fetchone()
        return dict(zip(FIELDS, row)) if row else None

    def get(self, name: str) -> dict | None:
        row = self.db.execute(f"SELECT {', '.join(FIELDS)} FROM workers WHERE name = ?", (name,)).fetchone()
        return dict(zip(FIELDS, row)) if row else None

    def all(self) -> list[dict]:
        return [dict(zip(FIELDS, r)) for r in self.db.execute(f"SELECT {', '.join(FIELDS)} FROM workers "
                                                              "ORDER BY added")]

    def save_trust(self, name: str, trust: float, checked: int, failed: int, rejected: int) -> None:
        self._tx("UPDATE workers SET trust = ?, checked = ?, failed = ?, rejected = ? WHERE name = ?",
                 (trust, checked, failed, rejected, name))

    # --- leases ------------------------------------------------------------------------------
    def issue(self, lease: str, worker: str, prompts: list, version: int) -> None:
        self._tx("INSERT INTO leases VALUES (?, ?, ?, ?, ?, 'issued', NULL, NULL)",
                 (lease, worker, json.dumps(prompts), time.time(), version))

    def end(self, lease: str, state: str, reason: str | None = None) -> None:
        """state: returned, expired (issued again elsewhere) or refused."""
        self._tx("UPDATE leases SET state = ?, ended = ?, reason = ? WHERE id = ? AND state = 'issued'",
                 (state, time.time(), reason, lease))

    def leases(self) -> dict[str, int]:
        return dict(self.db.execute("SELECT state, COUNT(*) FROM leases GROUP BY state").fetchall())
