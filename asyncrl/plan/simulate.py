"""A run on simulated time: the orchestrator's own rules, the roles as rate models.

What runs here is the orchestrator's code, not a copy: admission asks the run's `StalenessGate`
(`may_start`), a wave is cut and ordered by `waves.schedule` and each part goes to the least-loaded
replica as the router sends it, finished groups enter the ready pool and leave it for a batch
through `staleness.offer` / `take` (too stale: dropped, the slot given back), and a version is
served once every replica has loaded it, one version after another, as the follow loop does.
The replicas are asyncrl/plan/replica.py; the trainer trains batch k once it is written, for
`step_base + step_per_token · tokens / ranks` seconds, and publishes version k + 1.

The measures are the run report's: samples/s up to the time the last version is served, and the
mean over steps of a batch's mean staleness.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from asyncrl.orchestrator import staleness, waves
from asyncrl.orchestrator.staleness import StalenessGate
from asyncrl.plan.rates import Rates
from asyncrl.plan.replica import Replica, Sequence
from asyncrl.plan.workload import Workload


@dataclass
class Group:
    prompt_id: int
    episodes: list
    left: int = 0  # samples not yet finished
    oldest: int | None = None  # the oldest version among its samples' first tokens
    seqs: list = field(default_factory=list)
    part: object = None


@dataclass
class Part:
    groups: list[Group]
    left: int
    after: Part | None = None  # sent once this one has delivered every group
    then: list = field(default_factory=list)
    replica: Replica | None = None


class Simulation:
    def __init__(self, cfg, rates: Rates, workload: Workload, replicas: int = 1, ranks: int = 1,
                 seed: int = 0):
        self.cfg, self.rates, self.workload, self.ranks = cfg, rates, workload, ranks
        ro = cfg.rollout
        self.now, self.events, self.order = 0.0, [], itertools.count()
        self.gate = StalenessGate(ro.prompts_per_step, ro.max_staleness)
        self.needed = cfg.run.steps * ro.prompts_per_step
        self.replicas = [Replica(i, self) for i in range(replicas)]
        self.episodes, self.prompt_ids = workload.groups(ro.group_size, seed), itertools.count()
        self.served, self.running, self.ready = 0, 0, []
        self.batch, self.dropped, self.next_batch = [], 0, 0
        self.batches: dict[int, tuple[int, list[int], int]] = {}  # step -> (tokens, staleness, dropped)
        self.trainer_step, self.trainer_busy, self.training = 0, 0.0, False
        self.published: list[int] = []
        self.loading = False
        self.records: list[dict] = []

    def at(self, delay: float, fn) -> None:
        heapq.heappush(self.events, (self.now + delay, next(self.order), fn))

    def run(self) -> dict:
        self.admit()
        while self.events and len(self.records) < self.cfg.run.steps:
            self.now, _, fn = heapq.heappop(self.events)
            fn()
        if len(self.records) < self.cfg.run.steps:
            raise ValueError(f"plan: the simulated run stopped at version {len(self.records)} of "
                             f"{self.cfg.run.steps} with nothing left to do: no group can start (check "
                             "rollout.max_concurrent_groups and inference.max_batch_sequences against "
                             "rollout.group_size)")
        return summary(self)

    # --- admission and waves ------------------------------------------------------------------
    def admit(self) -> None:
        wave: list[tuple[int, Group]] = []  # (prompt id, group): what waves.schedule cuts
        most = self.cfg.rollout.max_concurrent_groups
        while self.gate.may_start(self.served, self.running + len(wave), most, self.needed):
            self.gate.admit()
            pid = next(self.prompt_ids)
            episodes = next(self.episodes)
            wave.append((pid, Group(pid, episodes, left=len(episodes))))
        if not wave:
            return
        self.running += len(wave)
        parts: list[Part] = []
        for groups, before in waves.schedule(wave, len(self.replicas), self.cfg):
            after = parts[before] if before is not None else None
            parts.append(Part([g for _, g in groups], len(groups), after))
            if parts[-1].after is None:
                self._send(parts[-1])
            else:
                parts[-1].after.then.append(parts[-1])

    def _send(self, part: Part) -> None:
        replica = min(self.replicas, key=lambda r: (r.in_flight, r.index))
        part.replica = replica
        replica.in_flight += sum(g.left for g in part.groups)
        seqs = []
        for group in part.groups:
            group.part = part
            for episode in group.episodes:
                seqs.append(Sequence(group, list(episode.turns), episode.prompt, shared_key=id(group)))
            group.seqs = seqs[-len(group.episodes):]
        replica.add(seqs)

    def turn_done(self, replica: Replica, seq: Sequence) -> None:
        group = seq.group
        group.oldest = seq.oldest if group.oldest is None else min(group.oldest, seq.oldest)
        if seq.turn + 1 < len(seq.turns):  # an agent's tool call: the next turn comes back later
            seq.turn += 1
            seq.left, seq.cached = seq.turns[seq.turn], True
            seq.context += self.workload.tool_tokens
            self.at(self.workload.tool_seconds, lambda: replica.add([seq]))
            return
        group.left -= 1
        if group.left == 0:
            self.at(self.rates.group_seconds, lambda: self._finished(group))

    def _finished(self, group: Group) -> None:
        part = group.part
        part.left -= 1
        if part.left == 0:
            part.replica.in_flight -= sum(len(g.episodes) for g in part.groups)
            for later in part.then:
                self._send(later)
        self.running -= 1
        staleness.offer(self.ready, group.oldest, group.prompt_id, group)
        self.assemble()
        self.admit()

    # --- assembly and training ------------------------------------------------------------------
    def assemble(self) -> None:
        per_step = self.cfg.rollout.prompts_per_step
        while self.ready and self.next_batch < self.cfg.run.steps:
            _, group, fresh = staleness.take(self.ready, self.gate, self.next_batch)
            if not fresh:
                self.dropped += 1
                self.gate.release()
                continue
            self.batch.append(group)
            if len(self.batch) == per_step:
                seqs = [s for g in self.batch for s in g.seqs]
                tokens = sum(sum(s.turns) for s in seqs)
                stale = [self.next_batch - s.oldest for s in seqs]
                self.batches[self.next_batch] = (tokens, stale, self.dropped)
                self.batch, self.dropped, self.next_batch = [], 0, self.next_batch + 1
                self._train()

    def _train(self) -> None:
        if self.training or self.trainer_step not in self.batches:
            return
        tokens = self.batches[self.trainer_step][0]
        seconds = self.rates.step_base + self.rates.step_per_token * tokens / self.ranks
        self.training, self.trainer_busy = True, self.trainer_busy + seconds
        self.at(seconds, self._trained)

    def _trained(self) -> None:
        self.training, self.trainer_step = False, self.trainer_step + 1
        self.published.append(self.trainer_step)  # version k + 1 = the weights after step k
        self._follow()
        self._train()

    # --- follow: each version served in turn ------------------------------------------------------
    def _follow(self) -> None:
        if self.loading or not self.published:
            return
        self.loading, version = True, self.published.pop(0)
        left = [len(self.replicas)]

        def loaded() -> None:
            left[0] -= 1
            if left[0] == 0:
                self._served(version)

        self.at(self.rates.handoff_seconds, lambda: [r.load(version, loaded) for r in self.replicas])

    def _served(self, version: int) -> None:
        self.served, self.loading = version, False
        tokens, stale, dropped = self.batches[version - 1]
        self.records.append({"version": version, "time": self.now, "samples": len(stale), "tokens": tokens,
                             "staleness_mean": sum(stale) / len(stale), "staleness": stale,
                             "dropped_stale_groups": dropped})
        self.admit()
        self._follow()


def summary(sim: Simulation) -> dict:
    records, end = sim.records, sim.records[-1]["time"]
    stale = [s for r in records for s in r["staleness"]]
    return {
        "steps": len(records),
        "seconds": round(end, 3),
        "samples_per_s": round(sum(r["samples"] for r in records) / max(end, 1e-9), 2),
        "staleness_mean": round(sum(r["staleness_mean"] for r in records) / len(records), 3),
        "staleness_hist": {str(k): stale.count(k) for k in sorted(set(stale))},
        "dropped_stale_groups": sum(r["dropped_stale_groups"] for r in records),
        "trainer_busy_fraction": round(sim.trainer_busy / max(end, 1e-9), 3),
        "inference_busy_fraction": round(
            sum(min(r.busy_seconds, end) for r in sim.replicas) / len(sim.replicas) / max(end, 1e-9), 3),
        "times": [round(r["time"], 6) for r in records],
    }


def simulate(cfg, rates: Rates, workload: Workload, replicas: int = 1, ranks: int = 1, seed: int = 0) -> dict:
    return Simulation(cfg, rates, workload, replicas, ranks, seed).run()
