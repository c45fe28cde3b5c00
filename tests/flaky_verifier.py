"""A user verifier that raises on some items, for the bad-input tests."""
from reasoning_gym.utils import compute_decimal_reward


def score(completion: str, entry: dict) -> float:
    if entry["metadata"]["source_index"] % 3 == 0:
        raise ValueError(f"cannot parse {completion!r}")
    return compute_decimal_reward(completion.strip(), oracle_answer=entry["answer"])
