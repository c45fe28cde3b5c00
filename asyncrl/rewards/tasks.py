"""Tasks generated offline by reasoning-gym, and the verifier that scores a completion.

A task item is the dataset's dict (question, answer, metadata). Index i of a seeded dataset is
always the same item, so a run's dataset position is one integer.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable

from asyncrl.config import ConfigError, TaskConfig

_SIZE = 10**9  # reasoning-gym generates item i on demand; the size only bounds the index


def _import(path: str, what: str) -> Callable:
    module, _, name = path.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"{what} = {path!r} cannot be imported as 'module:function': {e}") from None


class TaskSource:
    """Items, prompts and scores of one reasoning-gym dataset."""

    def __init__(self, cfg: TaskConfig, seed: int | None = None):
        import reasoning_gym

        self.cfg = cfg
        try:
            self.dataset = reasoning_gym.create_dataset(
                cfg.name, size=_SIZE, seed=cfg.seed if seed is None else seed, **cfg.params
            )
        except ValueError as e:  # unknown name
            known = ", ".join(sorted(reasoning_gym.factory.DATASETS)[:20])
            raise ConfigError(f"task.name = {cfg.name!r}: {e}. Known datasets include: {known}, ...") from None
        except TypeError as e:  # unknown parameter
            raise ConfigError(f"task.params = {cfg.params!r} do not fit dataset {cfg.name!r}: {e}") from None
        self._verifier = _import(cfg.verifier, "task.verifier") if cfg.verifier else None

    def item(self, index: int) -> dict[str, Any]:
        return self.dataset[index]

    def prompt(self, entry: dict[str, Any]) -> str:
        expression = entry.get("metadata", {}).get("expression")
        if self.cfg.prompt_format == "compact" and expression:
            return expression.replace(" ", "") + "="
        return entry["question"]

    def score(self, completion: str, entry: dict[str, Any]) -> float:
        """Reward in [0, 1]; may raise (the caller records the error against the sample)."""
        if self._verifier is not None:
            return float(self._verifier(completion, entry))
        return float(self.dataset.score_answer(completion.strip(), entry))
