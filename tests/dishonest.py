"""Dishonest joined workers, for the verification tests and benchmarks/verification.py. Each is asyncrl's
own worker (asyncrl/swarm/join.py) that changes what it returns in one way:

    token     one token of each sample changed (its logprob kept)
    version   loads only every 4th version but claims each (logprobs from an older version)
    model     never loads a version: serves the warm start and claims the current one
    inflate   logprobs scaled by 0.7 (samples look likelier than they were)
    replay    returns earlier samples of other prompts, once it has some, as this prompt's
    foreign   also answers work it was not given (a lease id it was never issued)

Run as `python tests/dishonest.py KIND --join URL --token T --dir D [...]` (the worker's options).
"""
from __future__ import annotations

import json
import random
import sys

from asyncrl.cli import _take
from asyncrl.swarm.join import Worker


class Dishonest(Worker):
    kind = "honest"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rng = random.Random(7)
        self.claimed = 0  # the version it says it holds
        self.kept: list[list[dict]] = []  # earlier groups (replay)

    def outgoing(self, work: dict, i: int, choices: list[dict]) -> list[dict]:
        return [self.change(work, c) if c["finish_reason"] != "abort" else c for c in choices]

    def change(self, work: dict, c: dict) -> dict:
        return c


class OneToken(Dishonest):
    def change(self, work, c):
        tokens = list(c["token_ids"])
        k = self.rng.randrange(max(len(tokens) - 1, 1))  # (not the stop token: the cheap check would see it)
        vocab = json.loads((self.workdir / "model" / "config.json").read_text())["vocab_size"]
        tokens[k] = (tokens[k] + 1 + self.rng.randrange(vocab - 1)) % vocab  # (another, in the vocabulary)
        return {**c, "token_ids": tokens}


class Lagging(Dishonest):
    """Loads every `every`-th version only, and relabels its samples with the version it claims."""
    every = 4

    async def _load(self, version: int) -> None:
        if version % self.every == 0:
            await super()._load(version)
        self.held = version  # (claimed: the gateway then gives it work)
        self.loaded.set()
        self.loading = None

    def change(self, work, c):
        return {**c, "versions": [self.held] * len(c["versions"])}


class OtherModel(Lagging):
    every = 10**9


class Inflate(Dishonest):
    def change(self, work, c):
        return {**c, "logprobs": {"token_logprobs": [0.7 * x for x in c["logprobs"]["token_logprobs"]]}}


class Replay(Dishonest):
    def outgoing(self, work, i, choices):
        if len(self.kept) < 4:
            self.kept.append(choices)
            return choices
        old = self.kept.pop(0)
        self.kept.append(choices)
        return [{**c, "versions": [max(work["version"], v) for v in c["versions"]]} for c in old]


class Foreign(Dishonest):
    async def _send(self, work, i, choices):
        await super()._send(work, i, choices)
        name, epoch, n = work["lease"].rsplit(".", 2)
        await super()._send({**work, "lease": f"{name}.{epoch}.{int(n) + 1000}"}, i, choices)


KINDS = {"honest": Dishonest, "token": OneToken, "version": Lagging, "model": OtherModel, "inflate": Inflate,
         "replay": Replay, "foreign": Foreign}

if __name__ == "__main__":
    from asyncrl.swarm.join import main

    sys.exit(main(sys.argv[2:], _take, KINDS[sys.argv[1]]))
