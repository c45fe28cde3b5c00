"""Verifiers that read a final answer out of a reply (`task.verifier = "asyncrl.rewards.verifiers:NAME"`)."""
from __future__ import annotations

import re

_INTEGER = re.compile(r"-?\d+")


def last_number(completion: str, entry: dict) -> float:
    """1 if the last integer in the reply is the answer, else 0: a reply may show its work first
    ("8+7=15, ..., so 1385"), and only its result counts (the GSM8K convention)."""
    numbers = _INTEGER.findall(completion)
    return float(bool(numbers) and numbers[-1] == str(entry["answer"]).strip())
