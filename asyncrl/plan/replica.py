"""A simulated inference replica: the built-in engine's continuous batching on a rate model.

Each step admits waiting sequences up to the batch's row limit (one prefill for the distinct
prompts among them, as the engine shares a prompt's rows among its G samples), then decodes one
token for every running row; a sequence leaves the batch when its turn's tokens are out. A new
version is applied at a step boundary under the run's update policy, as the engine's `reload`
does: keep (caches kept), interrupt (running rows re-prefilled), abort (they start over), finish
(admission stops until the batch drains).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass
class Sequence:
    group: object  # the simulator's group: told when the episode's last turn ends
    turns: list[int]  # tokens to generate in each turn
    context: int  # tokens before the next one sampled (prompt + generated + tool replies)
    turn: int = 0
    left: int = 0  # tokens still to generate in this turn
    oldest: int | None = None  # the version that sampled its first token
    cached: bool = False  # its context is in the prefix cache (an agent's later turn)
    shared_key: object = field(default=None)  # sequences with one key share one prefill row

    def __post_init__(self):
        self.left = self.turns[0]


class Replica:
    def __init__(self, index: int, sim):
        self.index, self.sim, self.rates = index, sim, sim.rates
        self.max_rows, self.policy = sim.cfg.inference.max_batch_sequences, sim.cfg.inference.update_policy
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.version, self.busy, self.in_flight, self.busy_seconds = 0, False, 0, 0.0
        self.run: tuple | None = None  # decoding under way: (start, seconds per step, rows, seconds before)
        self.epoch = 0  # of the run's end event: a cut run's earlier end is ignored
        self.pending: tuple[int, object] | None = None  # (version, called once it is loaded)

    def add(self, seqs: list[Sequence]) -> None:
        self.waiting.extend(seqs)
        self._wake()

    def load(self, version: int, loaded) -> None:
        self.pending = (version, loaded)
        self._wake()

    def _wake(self) -> None:
        """New work is admitted, or a version applied, at the next token boundary."""
        if not self.busy:
            self.busy = True
            self.sim.at(0.0, self._step)
        elif self.run is not None:
            self._cut_run()

    # Decoding runs from one event to the next: with nothing arriving, the batch decodes until its
    # first sequence ends in one event (k steps at once), cut short at a token boundary when
    # something arrives. Exact, and a long answer costs a few events, not one per token.
    def _step(self) -> None:
        before = self._apply_update()
        if not (self.pending and self.policy == "finish"):  # (a finish update drains first)
            before += self._admit()
        if not self.running:
            self.busy = before > 0
            if self.busy:
                self.busy_seconds += before
                self.sim.at(before, self._step)
            return
        per = self.rates.decode_base + self.rates.decode_per_row * len(self.running)
        steps = min(s.left for s in self.running)
        self.run = (self.sim.now + before, per, list(self.running), before)
        self._end_run_after(steps)

    def _end_run_after(self, steps: int) -> None:
        start, per, stepped, before = self.run
        self.epoch += 1
        epoch = self.epoch
        self.sim.at(start + steps * per - self.sim.now, lambda: epoch == self.epoch and self._ran(steps))

    def _cut_run(self) -> None:
        start, per, stepped, _ = self.run
        done = max(1, math.ceil((self.sim.now - start) / per - 1e-9))  # (the step under way finishes)
        if done < min(s.left for s in stepped):
            self._end_run_after(done)

    def _ran(self, steps: int) -> None:
        start, per, stepped, before = self.run
        self.run = None
        self.busy_seconds += before + steps * per
        for seq in stepped:
            seq.left -= steps
            seq.context += steps
        self.running = [s for s in self.running if s.left > 0]
        for seq in stepped:
            if seq.left == 0:
                self.sim.turn_done(self, seq)
        self._step()

    def _apply_update(self) -> float:
        if not self.pending or (self.policy == "finish" and self.running):
            return 0.0
        (version, loaded), self.pending = self.pending, None
        cost = self.rates.load_seconds
        if self.running and self.policy in ("interrupt", "abort"):
            for seq in self.running if self.policy == "abort" else []:  # (start over from the prompt)
                seq.context -= seq.turns[seq.turn] - seq.left
                seq.left, seq.oldest = seq.turns[seq.turn], version
            cost += self._prefill_cost(sum(s.context for s in self.running))
        self.version = version
        self.sim.at(cost, loaded)
        return cost

    def _admit(self) -> float:
        room = self.max_rows - len(self.running)
        if room <= 0 or not self.waiting:
            return 0.0
        admitted = [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]
        fed, seen = 0, set()
        for seq in admitted:
            if seq.oldest is None:
                seq.oldest = self.version
            if seq.cached:  # (the engine's prefix cache: only the tool's reply is new)
                fed += self.sim.workload.tool_tokens + 1
            elif seq.shared_key not in seen:
                seen.add(seq.shared_key)
                fed += seq.context
        self.running.extend(admitted)
        return self._prefill_cost(fed)

    def _prefill_cost(self, tokens: int) -> float:
        return self.rates.prefill_base + self.rates.prefill_per_token * tokens if tokens else 0.0
