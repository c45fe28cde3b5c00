"""Verifiers that read a final answer out of a reply (`task.verifier = "asyncrl.rewards.verifiers:NAME"`)."""
from __future__ import annotations

import re

_INTEGER = re.compile(r"-?\d+")


def last_number(completion: str, entry: dict) -> float:
    """1 if the last integer in the reply is the answer, else 0: a reply may show its work first
    ("8+7=15, ..., so 1385"), and only its result counts (the GSM8K convention)."""
    numbers = _INTEGER.findall(completion)
    return float(bool(numbers) and numbers[-1] == str(entry["answer"]).strip())


# How a chat model states a result: "**42**", "\boxed{42}", "= 42", "is 42", "equals 42", "answer: 42"
_STATED = re.compile(
    r"(?:\\boxed\{\s*|\*\*\s*|=\s*|\bis\s+|\bequals\s+|\banswer:?\s*)(-?\d[\d,]*)(?![\d.]*\d)", re.IGNORECASE)


def stated_answer(completion: str, entry: dict) -> float:
    """1 if the result the reply states is the answer: the number after its last "=", "is", "equals",
    "answer:", "**" or "\\boxed{" (a pretrained chat model's own way of giving a result: "53 + 66 is 119,
    which is the sum of 53 and 66" states 119, where the last number is 66), else its last integer."""
    stated = [m.replace(",", "") for m in _STATED.findall(completion)]
    numbers = stated or _INTEGER.findall(completion)
    return float(bool(numbers) and numbers[-1] == str(entry["answer"]).strip())
