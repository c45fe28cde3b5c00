"""A worker's trust score: how much of its work is checked, and when it is shut out.

A new worker starts at 0.5. Each recompute it passes moves the score a twentieth of the way to 1;
a failed recompute takes 0.25 (a model that differs grossly fails every check, so it is out after its
second: honest noise stays under the tolerance by a margin measured in docs/untrusted.md); a failed
cheap check takes 0.5 (a token outside the vocabulary or a positive logprob is no accident). Below
`quarantine_below` the worker is quarantined. So is one whose drift (the mean over all its recomputed
tokens of claimed minus recomputed logprob) exceeds `workers.max_drift`: a sample-by-sample tolerance
must cover an honest engine's worst float noise (vLLM's kernels differ from the trusted forward pass by
up to ~0.01 per token on the tiny policy), while a model a few steps old differs by as little; noise has
no sign and averages out, a different sampler's excess does not (its mean is a KL divergence, > 0).

The share of its samples recomputed is four times the base fraction while the score is under 0.7 (new
or suspect: about its first 10 checks), the base fraction up to 0.9, and half of it above (proven: about
45 passed checks in a row). A group with a sample drawn for a recompute waits for the verdict before a
batch may take it (asyncrl/swarm/members.py), so a new worker's work is nearly all checked before any of
it is trained.
"""
from __future__ import annotations

from dataclasses import dataclass

START = 0.5
PASS_STEP = 0.05  # of the distance to 1
RECOMPUTE_PENALTY = 0.25
CHEAP_PENALTY = 0.5
SUSPECT, PROVEN = 0.7, 0.9
DRIFT_TOKENS = 200  # recomputed tokens before a worker's drift is judged


@dataclass
class Trust:
    score: float = START
    checked: int = 0  # samples recomputed
    failed: int = 0  # of them, failed
    rejected: int = 0  # samples refused by a cheap check
    excess: float = 0.0  # sum over recomputed tokens of (claimed - recomputed logprob)
    tokens: int = 0

    def drift(self) -> float | None:
        """Nats per token by which its claimed logprobs exceed the trusted model's, once there are
        DRIFT_TOKENS to tell: ~0 for an honest engine (float noise has no sign), KL(its sampler ||
        the claimed version) for one that samples from another model, more for inflated logprobs."""
        return self.excess / self.tokens if self.tokens >= DRIFT_TOKENS else None

    def passed(self) -> None:
        self.checked += 1
        self.score += PASS_STEP * (1 - self.score)

    def failed_recompute(self) -> None:
        self.checked += 1
        self.failed += 1
        self.score = max(0.0, self.score - RECOMPUTE_PENALTY)

    def failed_cheap(self, samples: int = 1) -> None:
        self.rejected += samples
        self.score = max(0.0, self.score - CHEAP_PENALTY)

    def fraction(self, base: float) -> float:
        """The share of this worker's samples to recompute."""
        if self.score < SUSPECT:
            return min(1.0, 4 * base)
        return base / 2 if self.score > PROVEN else base

    def out(self, threshold: float) -> bool:
        return self.score < threshold
