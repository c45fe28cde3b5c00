"""A task of long prompts and short answers: a two-digit sum after a long, irrelevant preamble.

The question opens with an inventory of 12 made-up items (~120 tokens with the default policy's
tokenizer), different for every item, then, on a line of its own, asks for a sum that does not depend
on it: `red cups, ..., gold keys\n37+12=` -> `49` (1-3 tokens). Long
problem statements with short verifiable answers are a common shape of RL post-training data; every
sample of a group carries the whole prompt, so it is where training a group's shared prompt once
(asyncrl/trainer/logprobs.py) earns its keep.

    task.name = "examples/long_prompt.py:sums_after_preamble"   task.prompt_format = "question"
    (the "compact" format would keep only the expression: the sum without its preamble)
"""
from __future__ import annotations

import random

COLOURS = ["red", "blue", "green", "gold", "grey", "pink", "teal", "jade", "ruby", "sand", "iron", "salt"]
THINGS = ["cups", "keys", "maps", "pens", "hats", "bags", "rugs", "jars", "nets", "oars", "kites", "bells"]
PREAMBLE_ITEMS = 12


def sums_after_preamble(index: int, seed: int) -> dict:
    rng = random.Random(f"long-prompt-{seed}-{index}")
    # (no digits in it: numbers there would be distractors a 1M-parameter policy cannot learn to skip)
    preamble = ", ".join(f"{rng.choice(COLOURS)} {rng.choice(THINGS)}" for _ in range(PREAMBLE_ITEMS))
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    # (the expression: what the warm start's teacher reads, asyncrl/rewards/teachers.py)
    # (the sum on its own line: tokenized as the default task's compact prompt, so that a warm start from
    # the default policy, warmstart.base, begins with the skill and only learns to look past the preamble)
    return {"question": f"{preamble}\n{a}+{b}=", "answer": str(a + b),
            "metadata": {"expression": f"{a} + {b}"}}
