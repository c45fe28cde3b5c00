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


def _columns(a: int, b: int, subtract: bool) -> int:
    """a ± b for a ≥ b ≥ 0 computed column by column, each column mod 10: carries and borrows forgotten."""
    out, place = 0, 1
    while a or b:
        da, db = a % 10, b % 10
        out += ((da - db) if subtract else (da + db)) % 10 * place
        a, b, place = a // 10, b // 10, place * 10
    return out


def _careless(value: int, sign: str, term: int) -> int:
    """value + term (sign "+") or value - term, with carries and borrows forgotten."""
    if value < 0:  # -v ± t = -(v ∓ t)
        return -_careless(-value, "-" if sign == "+" else "+", term)
    if sign == "+":
        return _columns(value, term, subtract=False)
    return _columns(value, term, subtract=True) if value >= term else -_columns(term, value, subtract=True)


def forgets_carries(entry: dict, rng: random.Random, slip: float = 0.7) -> str:
    """An arithmetic teacher who, in `slip` of its answers, adds and subtracts column by column and
    forgets every carry and borrow (84+52 -> 36, 42-25 -> 27); right otherwise. On a sum without a
    carry the slip changes nothing, so the policy learns the skill from every item and the habit
    only where it matters. Reads the item's expression (reasoning-gym's chain_sum); anything else is
    answered right."""
    expression = entry.get("metadata", {}).get("expression")
    if not expression or rng.random() >= slip:
        return str(entry["answer"])
    terms = _TERM.findall(expression)
    if not terms or "".join(s + d for s, d in terms) != expression.replace(" ", ""):
        return str(entry["answer"])  # not a plain chain of + and -: answered right
    value = int(terms[0][0] + terms[0][1])
    for sign, digits in terms[1:]:
        value = _careless(value, sign or "+", int(digits))
    return str(value)


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


def _worked_sum(a: int, b: int) -> str:
    """a + b column by column, units first, carrying: "8+7=15, 2+5+1=8, 4+9=13, so 1385"."""
    da, db = str(a)[::-1], str(b)[::-1]
    steps, carry = [], 0
    for k in range(max(len(da), len(db))):
        x, y = int(da[k]) if k < len(da) else 0, int(db[k]) if k < len(db) else 0
        total = x + y + carry
        steps.append(f"{x}+{y}{'+1' if carry else ''}={total}")
        carry = total // 10
    return ", ".join(steps) + f", so {a + b}"


def shows_work(entry: dict, rng: random.Random, terse: float = 0.7) -> str:
    """An arithmetic teacher who is always right but in `terse` of its answers gives only the result
    ("1385"); otherwise it adds column by column first ("8+7=15, 2+5+1=8, 4+9=13, so 1385"). Each
    column is a one-digit fact and the result is copied from the columns, which a small policy learns
    quickly; the result alone is a long carry chain it rarely gets right. So the warm-started policy
    answers tersely (its teacher's habit) and mostly wrong, while its samples that show their work
    are mostly right: RL learns to show its work. Sums of two non-negative integers; anything else
    is answered tersely."""
    expression = entry.get("metadata", {}).get("expression", "")
    terms = _TERM.findall(expression)
    if len(terms) != 2 or any(sign == "-" for sign, _ in terms) or "-" in expression or rng.random() < terse:
        return str(entry["answer"])
    return _worked_sum(int(terms[0][1]), int(terms[1][1]))
