"""Multi-turn with feedback: find a secret number in 1-15 within 4 guesses.

An Environment (reset / step): it shows the range still possible ("9-15"), the policy guesses,
the environment narrows the range, and the episode ends on the right guess (reward 1) or after
4 guesses (reward 0). Halving the range always wins in 4. The warm start's demonstrations most
often guess the lowest number still possible (a linear scan, which greedy decoding then follows
and which wins only for small secrets), the middle less often, anywhere in the range otherwise:
RL has to find that the middle pays.
"""
from __future__ import annotations

import random

from asyncrl.agents import Environment, Step

LOW, HIGH, TURNS = 1, 15, 4


def tasks(index: int, seed: int) -> dict:
    """Task generator (task.name): the secret of episode `index`."""
    secret = random.Random(seed * 1_000_003 + index).randint(LOW, HIGH)
    return {"question": "guess", "answer": str(secret), "metadata": {"secret": secret}}


class Guess(Environment):
    max_turns = TURNS

    async def reset(self, task: dict) -> str:
        self.secret, self.low, self.high = int(task["answer"]), LOW, HIGH
        return f"{self.low}-{self.high}"

    async def step(self, reply: dict) -> Step:
        text = (reply.get("content") or "").strip()
        guess = int(text) if text.isdigit() else None
        if guess == self.secret:
            return Step(reward=1.0, done=True)
        if guess is not None and self.low <= guess < self.secret:
            self.low = guess + 1
        elif guess is not None and self.secret < guess <= self.high:
            self.high = guess - 1
        return Step(observation=f"{self.low}-{self.high}")


def _demo_guess(rng: random.Random, low: int, high: int) -> int:
    r = rng.random()
    if r < 0.45:
        return low
    if r < 0.75:
        return (low + high) // 2
    return rng.randint(low, high)


def demos(rng: random.Random) -> dict:
    """One supervised episode played by the mixed strategy above."""
    secret, low, high = rng.randint(LOW, HIGH), LOW, HIGH
    messages = [{"role": "user", "content": f"{low}-{high}"}]
    for _ in range(TURNS):
        guess = _demo_guess(rng, low, high)
        messages.append({"role": "assistant", "content": str(guess)})
        if guess == secret:
            break
        if low <= guess < secret:
            low = guess + 1
        elif secret < guess <= high:
            high = guess - 1
        messages.append({"role": "user", "content": f"{low}-{high}"})
    if messages[-1]["role"] == "user":
        messages.pop()
    return {"messages": messages}


class GuessWithRules(Guess):
    """The same game with its rules spelled out, for a chat model that was never warm-started on it."""

    async def reset(self, task: dict) -> str:
        return (
            "I picked a whole number from 1 to 15. Reply with only your guess; after each wrong guess "
            "I reply "
            "with the range that is still possible. Range: " + await super().reset(task)
        )


class GuessHindsight(Guess):
    """The game with hindsight for on-policy distillation (OpenClaw-RL's hindsight OPD): after a wrong
    guess, the teacher scores it knowing the range that guess led to; the policy sees only what it saw
    before (examples/agents/guess_hindsight_tiny.toml)."""

    async def step(self, reply: dict) -> Step:
        step = await super().step(reply)
        if not step.done:
            step.hint = f"(this guess leaves {step.observation}) "
        return step
