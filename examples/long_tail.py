"""A task whose answers have a long-tailed length: reverse a digit string.

Most strings are short (2-6 digits); one in eight is long (16-30 digits). The answer is as long
as the question, so the completion length follows the same distribution: a synchronous batch of
128 samples almost always holds a long one and waits for it, while the average sample is short.
That is where continuous batching and asynchronous rollout earn their keep (ROLL Flash, AReaL).

    task.name = "examples/long_tail.py:reverse_digits"   (exact match, no partial credit)
"""
from __future__ import annotations

import random

SHORT, LONG, LONG_SHARE = (2, 6), (16, 30), 1 / 8


def reverse_digits(index: int, seed: int) -> dict:
    rng = random.Random(f"reverse-{seed}-{index}")
    low, high = LONG if rng.random() < LONG_SHARE else SHORT
    digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(low, high)))
    return {"question": f"rev:{digits}=", "answer": digits[::-1], "metadata": {"length": len(digits)}}


def stutters(entry: dict, rng: random.Random, slip: float = 0.7) -> str:
    """A warm-start teacher (warmstart.teacher) that in `slip` of its answers writes the last digit
    twice (rev:123= -> 3211): every digit right, one habit at the end that an exact-match reward
    takes away, the headroom RL climbs on this task (docs/performance.md, vs TRL)."""
    answer = entry["answer"]
    return answer + answer[-1] if rng.random() < slip else answer
