"""The joined workers of a run: who may join, what they return, and when they are shut out.

A worker's token names it (asyncrl/swarm/roster.py); on its first poll it becomes a replica of the router
(index 1000 and up), routed once it holds the served version. Every group it returns passes the cheap
checks (asyncrl/swarm/checks.py): a refused sample is dropped (reason "refused") and costs the worker
trust. A random share of its accepted samples (by its trust: asyncrl/swarm/trust.py) is recomputed by
the trusted model (asyncrl/swarm/recompute.py) while the samples are scored; a scored group with a
sample being recomputed is held out of the ready pool until the verdict. A recompute that disagrees
costs trust. Below workers.quarantine_below the worker is quarantined: out of routing, its work
issued again elsewhere, its groups still in the ready pool dropped, and its unverified samples in batches
not yet trained masked by the trainer (asyncrl/swarm/quarantine.py). Events and the ledger say which
and why.
"""
from __future__ import annotations

import asyncio
import json
import random
import secrets
from pathlib import Path

from asyncrl.swarm import quarantine
from asyncrl.swarm.checks import GroupRefused, Limits, Seen, check_group
from asyncrl.swarm.recompute import DRIFT, TOLERANCE, Recomputer, Sample
from asyncrl.swarm.remote import JoinedWorker
from asyncrl.swarm.roster import Roster
from asyncrl.swarm.trust import START, Trust

FIRST_INDEX = 1000  # joined workers' replica indices (the run's own replicas count from 0)
KEPT = ("token_ids", "logprobs", "versions", "finish_reason")  # what is read of a worker's sample


class Refused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Swarm:
    def __init__(self, cfg, run_dir: Path, router, ledger, events, tokenizer):
        self.cfg, self.run_dir, self.router, self.events = cfg.workers, run_dir, router, events
        self.request_deadline = cfg.timeouts.http  # the longest a lease may be held
        self.model_path, self.tokenizer = cfg.model.path, tokenizer
        self.roster = Roster(ledger.db)
        self.members: dict[str, JoinedWorker] = {}
        self.seen = Seen()
        self.recomputer = Recomputer(cfg.model.path, run_dir, keep=cfg.rollout.max_staleness + 4,
                                     device=self.cfg.verify_device)
        self.unchecked = 0  # samples drawn for a recompute that could not have one (reported sparingly)
        self.tolerance = self.cfg.tolerance or TOLERANCE.get(cfg.inference.dtype, TOLERANCE["bfloat16"])
        self.max_drift = self.cfg.max_drift or DRIFT.get(cfg.inference.dtype, DRIFT["bfloat16"])
        self.rng = random.Random(cfg.run.seed + 35)
        self.epoch = secrets.token_hex(4)  # in every lease id: a lease from before a restart is known as such
        self.verified: dict[str, set[str]] = {}  # by worker: its samples a recompute passed
        self.verdicts: dict[str, list[tuple[float, float]]] = {}  # by worker: (mean, most) of each recompute
        self.checks: set[asyncio.Task] = set()
        self.vocab_size = _vocab_size(cfg.model.path, tokenizer)
        self.pending: set[str] = set()  # checks not yet done
        self.held: list[list] = []  # scored groups waiting for their checks
        # the orchestrator's: a group into the ready pool (async), a group dropped, a quarantine
        self.offer = self.drop = self.on_quarantine = None

    # --- membership ----------------------------------------------------------------------------
    def member(self, token: str) -> JoinedWorker:
        """The worker this token names, joining it to routing on first sight; Refused if it may not."""
        record = self.roster.who(token)
        if record is None:
            raise Refused(401, "this worker token is not one of the run's (asyncrl ctl RUN workers)")
        for state in ("revoked", "quarantined"):
            if record[state]:
                raise Refused(403, f"worker {record['name']} is {state}" +
                              (f": {record['reason']}" if record["reason"] else ""))
        m = self.members.get(record["name"])
        if m is None:
            trust = Trust(record["trust"], record["checked"], record["failed"], record["rejected"])
            m = self.members[record["name"]] = JoinedWorker(record["name"], self, trust)
            index = FIRST_INDEX + len(self.members) - 1
            self.router.add(index, {"url": m.url, "worker": m.name}, m)
            self.events.write("worker_joined", worker=m.name, replica=index, trust=round(trust.score, 3))
        return m

    def add(self, name: str) -> str:
        return self.roster.add(name, START)

    def revoke(self, name: str) -> None:
        self.roster.revoke(name)
        if name in self.members:
            self._shut_out(self.members[name], "revoked")
        self.events.write("worker_revoked", worker=name)

    def listing(self) -> list[dict]:
        routed = {r.client.name for r in self.router.routed() if "worker" in r.info}
        listed = []
        for w in self.roster.all():
            m = self.members.get(w["name"])
            listed.append({**w, "trust": round(m.trust.score if m else w["trust"], 3),
                           "routed": w["name"] in routed, "polling": bool(m and m.alive()),
                           "version": m.held if m else None})
        return listed

    # --- what a worker returns -------------------------------------------------------------------
    def deliver(self, m: JoinedWorker, lease_id, index, named: str, choices) -> dict:
        """Prompt `index` of lease `lease_id`: its samples checked, then handed to the group's waiter."""
        lease = m.leases.get(lease_id) if isinstance(lease_id, str) else None
        if lease is None and isinstance(lease_id, str) and lease_id.startswith(f"{m.name}.") \
                and not lease_id.startswith(f"{m.name}.{self.epoch}."):  # (its work was issued again)
            raise Refused(410, f"lease {lease_id} was given before the orchestrator restarted: not taken")
        if lease is None or type(index) is not int or not 0 <= index < len(lease.prompts) \
                or index in lease.delivered:
            self._cheap_failure(m, f"answered work it was not given (lease {lease_id!r}, prompt {index!r})")
            raise Refused(409, f"lease {lease_id!r} prompt {index!r} is not work this worker holds")
        p = lease.params
        limits = Limits(self.vocab_size, p["max_tokens"], frozenset([self.tokenizer.eos_token_id,
                                                                     *p["stop_token_ids"]]),
                        lease.issued_version, max(self.router.version, m.wanted or 0))
        try:
            reasons = check_group(choices, p["n"], lease.digests[index], named, limits, self.seen)
        except GroupRefused as e:
            self._cheap_failure(m, str(e))
            raise Refused(400, str(e)) from None
        refused = {k: r for k, r in enumerate(reasons) if r}
        if refused:
            self._cheap_failure(m, next(iter(refused.values())), len(refused))
        if m.shut_out:
            raise Refused(403, f"worker {m.name} is {m.shut_out}")
        lease.delivered.add(index)
        m.samples += len(choices)
        drawn: set[tuple] = set()  # the completions of this group drawn for a recompute
        out = [self._refused(m, r) if r else self._accepted(m, lease, index, c, drawn)
               for c, r in zip(choices, reasons)]
        lease.on_group(index, out)
        if len(lease.delivered) == len(lease.prompts):
            m.finish(lease)
        return {"accepted": len(out) - len(refused), "refused": refused}

    def _refused(self, m: JoinedWorker, reason: str) -> dict:
        return {"finish_reason": "abort", "refused": True, "token_ids": [], "versions": [], "text": "",
                "logprobs": {"token_logprobs": []}, "error": f"joined worker {m.name}: refused: {reason}"}

    def _accepted(self, m: JoinedWorker, lease, index: int, c: dict, drawn: set) -> dict:
        """The sample as the run takes it: its text decoded here (a worker's text is not read), its worker
        named, and perhaps a recompute scheduled (not of a completion its group has drawn already: two
        identical samples are one piece of evidence, and counted twice a bfloat16 worker's one unusual
        answer cost it two failures)."""
        c = {k: c[k] for k in KEPT}
        c.update(text=self.tokenizer.decode(c["token_ids"], skip_special_tokens=True), worker=m.name)
        m.tokens += len(c["token_ids"])
        again = tuple(c["token_ids"]) in drawn
        if c["finish_reason"] != "abort" and not again \
                and self.rng.random() < m.trust.fraction(self.cfg.verify_fraction):
            drawn.add(tuple(c["token_ids"]))
            c["check"] = f"{lease.id}.{index}.{len(lease.delivered)}.{self.rng.getrandbits(32):08x}"
            self.pending.add(c["check"])
            task = asyncio.get_running_loop().create_task(
                self._verify(m, c["check"], lease.prompts[index], c, lease.params["temperature"]))
            self.checks.add(task)
            task.add_done_callback(self.checks.discard)
        return c

    # --- verification and quarantine ---------------------------------------------------------------
    async def _verify(self, m: JoinedWorker, check: str, prompt: list[int], c: dict, temperature: float):
        try:
            await self._judge(m, check, prompt, c, temperature)
        finally:
            self.pending.discard(check)
            await self._release()

    async def _judge(self, m: JoinedWorker, check: str, prompt: list[int], c: dict, temperature: float):
        verdict = await self.recomputer.check(Sample(prompt, c["token_ids"], c["logprobs"]["token_logprobs"],
                                                     c["versions"], temperature))
        if m.shut_out:  # (checks queued before it was shut out: nothing more to learn)
            return
        if verdict.error:
            self.unchecked += 1
            if self.unchecked in (1, 10) or self.unchecked % 100 == 0:  # (not an event per sample)
                self.events.write("samples_unchecked", worker=m.name, samples=self.unchecked,
                                  error=verdict.error)
            return
        self.verdicts.setdefault(m.name, []).append((verdict.mean, verdict.most))
        m.trust.excess += verdict.excess
        m.trust.tokens += verdict.tokens
        if verdict.fails(self.tolerance):
            m.trust.failed_recompute()
            self.events.write("recompute_failed", worker=m.name, check=check, mean=round(verdict.mean, 5),
                              most=round(verdict.most, 5), tolerance=self.tolerance,
                              trust=round(m.trust.score, 3))
        else:
            m.trust.passed()
            self.verified.setdefault(m.name, set()).add(check)
        self._save(m)
        drift = m.trust.drift()
        if m.trust.out(self.cfg.quarantine_below) and not m.shut_out:
            self.quarantine(m, f"{m.trust.failed} of {m.trust.checked} recomputed samples disagreed (mean "
                               f"|Δ logprob| {verdict.mean:.4f}, tolerance {self.tolerance})")
        elif drift is not None and drift > self.max_drift and not m.shut_out:
            self.quarantine(m, f"its claimed logprobs exceed the trusted model's by {drift:.4f} nats per "
                               f"token over {m.trust.tokens} recomputed tokens (max_drift {self.max_drift})")

    def _cheap_failure(self, m: JoinedWorker, reason: str, samples: int = 1) -> None:
        m.trust.failed_cheap(samples)
        self.events.write("samples_refused", worker=m.name, samples=samples, reason=reason,
                          trust=round(m.trust.score, 3))
        self._save(m)
        if m.trust.out(self.cfg.quarantine_below) and not m.shut_out:
            self.quarantine(m, f"a cheap check failed: {reason}")

    def _save(self, m: JoinedWorker) -> None:
        t = m.trust
        self.roster.save_trust(m.name, t.score, t.checked, t.failed, t.rejected)

    def quarantine(self, m: JoinedWorker, reason: str) -> None:
        self.roster.quarantine(m.name, reason)
        quarantine.add(self.run_dir, m.name, reason, self.verified.get(m.name, set()))
        self._shut_out(m, f"quarantined: {reason}")
        self.events.write("worker_quarantined", worker=m.name, reason=reason, trust=round(m.trust.score, 3),
                          checked=m.trust.checked, failed=m.trust.failed, rejected=m.trust.rejected,
                          version=self.router.version, first_version=m.first_version)
        self.on_quarantine(m.name)
        for group in [g for g in self.held if self.refuses(g)]:
            self.held.remove(group)
            self.drop(group)

    def _shut_out(self, m: JoinedWorker, why: str) -> None:
        m.drop_all(why)
        for r in self.router.replicas.values():
            if r.client is m:
                self.router.unroute(r, RuntimeError(why), f"worker {m.name}")

    def admit(self, group) -> bool:
        """Whether a scored group may go into the ready pool now: not if its worker is quarantined (dropped)
        or one of its samples is being recomputed (held until the verdict)."""
        if self.refuses(group):
            self.drop(group)
            return False
        if any(t.info.get("check") in self.pending for t in group):
            self.held.append(group)
            return False
        return True

    async def _release(self) -> None:
        """Held groups whose checks are done: dropped if their worker was quarantined, else offered."""
        waiting, done = [], []
        for g in self.held:  # (by identity: comparing groups would compare every trajectory's fields)
            (waiting if any(t.info.get("check") in self.pending for t in g) else done).append(g)
        self.held = waiting
        for group in done:
            if self.refuses(group):
                self.drop(group)
            else:
                await self.offer(group)

    def refuses(self, group) -> bool:
        """Whether a finished group comes from a quarantined worker and is not all verified."""
        worker = group[0].info.get("worker") if group else None
        m = self.members.get(worker)
        return bool(m and m.shut_out and m.shut_out.startswith("quarantined")
                    and any(t.info.get("check") not in self.verified.get(worker, ()) for t in group))

    async def close(self) -> None:
        for task in list(self.checks):
            task.cancel()
        await asyncio.gather(*self.checks, return_exceptions=True)
        self.events.write("workers_summary", recompute_seconds=round(self.recomputer.seconds, 3),
                          tolerance=self.tolerance, max_drift=self.max_drift,
                          workers={name: self._summary(m) for name, m in self.members.items()})

    def _summary(self, m: JoinedWorker) -> dict:
        """What a worker returned and how its checks went: for the report and benchmarks/verification.py."""
        verdicts = self.verdicts.get(m.name, [])

        def quantiles(i: int) -> dict:
            values = sorted(v[i] for v in verdicts)
            at = lambda q: round(values[min(int(q * len(values)), len(values) - 1)], 6)  # noqa: E731
            return {"p50": at(0.5), "p99": at(0.99), "max": at(1.0)} if values else {}

        t = m.trust
        return {"samples": m.samples, "tokens": m.tokens, "checked": t.checked, "failed": t.failed,
                "drift": round(t.excess / t.tokens, 7) if t.tokens else None, "recomputed_tokens": t.tokens,
                "refused": t.rejected, "trust": round(t.score, 3), "shut_out": m.shut_out,
                "mean_diff": quantiles(0), "most_diff": quantiles(1)}


def _vocab_size(model_path: str, tokenizer) -> int:
    """The engine samples over the model's logits: its config's vocab_size (at least the tokenizer's)."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
        return max(int(config.get("vocab_size") or 0), len(tokenizer))
    except (OSError, ValueError):  # (a hub name: the tokenizer's size)
        return len(tokenizer)
