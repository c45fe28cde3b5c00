"""Teachers for the supervised warm start: (task item, random.Random) -> the answer a demonstration shows.

`warmstart.teacher` names one ("module:function", keyword arguments in `warmstart.teacher_params`);
none means the task's own answer. A teacher that is sometimes wrong in a consistent way leaves a
policy whose greedy answer is wrong where its samples are often right: the headroom that RL
with a verifier climbs (it learns what the reward says, not what the teacher showed).
"""
from __future__ import annotations

import random
import re

_TERM = re.compile(r"\s*([+-]?)\s*(\d+)")


def drops_overflow(entry: dict, rng: random.Random, slip: float = 0.7) -> str:
    """An arithmetic teacher who, in `slip` of its answers, writes the answer in as many columns as the
    longest term and unsigned: it drops the carry out of the top column and the minus sign (84+52 -> 36,
    25-42 -> 17); right otherwise. Its digits are always right, so the warm start learns the whole
    skill from every demonstration; what the policy inherits is a habit in its first token."""
    answer = str(entry["answer"])
    expression = entry.get("metadata", {}).get("expression")
    if not expression or rng.random() >= slip:
        return answer
    width = max((len(d) for _, d in _TERM.findall(expression)), default=len(answer))
    digits = answer.lstrip("-")
    return digits[1:] if len(digits) > width else digits

