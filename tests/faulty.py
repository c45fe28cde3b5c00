"""User code that misbehaves, for the fault and bad-input tests (imported by role processes)."""
import os
import time
from pathlib import Path

from reasoning_gym.utils import compute_decimal_reward

from asyncrl.objectives.ppo_clip import loss as ppo_clip

calls = 0


def flaky_verifier(completion: str, entry: dict) -> float:
    """Raises on every third item."""
    if entry["metadata"]["source_index"] % 3 == 0:
        raise ValueError(f"cannot parse {completion!r}")
    return compute_decimal_reward(completion.strip(), oracle_answer=entry["answer"])


def hang_or_nan_verifier(completion: str, entry: dict) -> float:
    """Hangs on every fifth item, answers NaN on the next one, scores the rest."""
    index = entry["metadata"]["source_index"]
    if index % 5 == 0:
        time.sleep(3600)
    if index % 5 == 1:
        return float("nan")
    return compute_decimal_reward(completion.strip(), oracle_answer=entry["answer"])


def nan_every_other_loss(inp, cfg):
    global calls
    calls += 1
    per_token, metrics = ppo_clip(inp, cfg)
    return (per_token * float("nan") if calls % 2 == 0 else per_token), metrics


def exploding_loss(inp, cfg):
    raise RuntimeError("objective exploded")


def _first_caller_waits(seconds: float) -> None:
    """The first trainer process to get here (across restarts: a flag file) sleeps `seconds`."""
    flag = Path(os.environ["ASYNCRL_TEST_FLAG"])
    if not flag.exists():
        flag.touch()
        time.sleep(seconds)


def hang_once_loss(inp, cfg):
    """The first trainer process to call it hangs; after a restart it trains normally."""
    _first_caller_waits(3600)
    return ppo_clip(inp, cfg)


def by_word(completion: str, entry: dict) -> float:
    """Hangs on "hang", raises on "raise", spends 0.05 s of CPU on "burn", scores anything else 1."""
    if completion == "hang":
        time.sleep(3600)
    if completion == "raise":
        raise ValueError("asked to")
    start = time.process_time()
    while completion == "burn" and time.process_time() - start < 0.05:
        pass
    return 1.0


def always_raises(completion: str, entry: dict) -> float:
    return 1 / 0


def returns_text(completion: str, entry: dict) -> float:
    return "correct"


def detached_loss(inp, cfg):
    per_token, metrics = ppo_clip(inp, cfg)
    return per_token.detach(), metrics


def slow_once_loss(inp, cfg):
    """The first trainer process to call it takes 12 s over one step (a long step, not a hang)."""
    _first_caller_waits(12)
    return ppo_clip(inp, cfg)


def crashing_loss(inp, cfg):
    """The trainer process dies (as a segfault or the OOM killer would end it): a restart may help."""
    print("trainer: crashed on purpose", flush=True)
    os._exit(1)
