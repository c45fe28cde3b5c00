"""Tasks, and the verifier that scores a completion.

Tasks come from a reasoning-gym dataset (generated offline), from a JSONL file of
{"prompt": ..., "answer": ...} rows (`task.name = "jsonl"`), or from a generator function
(`task.name = "module:function"`); the last two are scored by exact match unless
`task.verifier` is set. A task item is a dict (question, answer, metadata). Index i always
names the same item (a file is read in epochs), so a run's dataset position is one integer.
"""
from __future__ import annotations

import json
from typing import Any

from asyncrl.config import ConfigError, TaskConfig
from asyncrl.imports import import_object

_SIZE = 10**9  # reasoning-gym generates item i on demand; the size only bounds the index


class BadTaskRow(ValueError):
    """This item cannot become a prompt; the run drops it, records why and goes on."""


class JsonlRows:
    """Rows of a JSONL file; a malformed row is reported when it is asked for, not at load."""

    def __init__(self, path: str):
        try:
            self.lines = [line for line in open(path).read().splitlines() if line.strip()]
        except OSError as e:
            raise ConfigError(f"task file {path!r} (task.path / task.eval_path) cannot be read: {e}") from None
        if not self.lines:
            raise ConfigError(f"task file {path!r} (task.path / task.eval_path) has no rows")
        self.path = path

    def __getitem__(self, index: int) -> dict[str, Any]:
        row = index % len(self.lines)
        where = f"{self.path} row {row + 1}"
        try:
            record = json.loads(self.lines[row])
        except json.JSONDecodeError as e:
            raise BadTaskRow(f"{where} is not valid JSON: {e}") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or "answer" not in record:
            raise BadTaskRow(f"{where} needs a string 'prompt' and an 'answer', got {self.lines[row][:80]!r}")
        if not record["prompt"].strip():
            raise BadTaskRow(f"{where} has an empty prompt")
        return {"question": record["prompt"], "answer": str(record["answer"]), "metadata": {"row": row}}

    @staticmethod
    def score_answer(completion: str, entry: dict) -> float:
        return float(completion.strip() == entry["answer"].strip())


class GeneratedTasks:
    """Items from a user's generator `(index, seed) -> {"question", "answer", "metadata"}`."""

    def __init__(self, path: str, seed: int):
        self.generate, self.seed = import_object(path, "task.name"), seed

    def __getitem__(self, index: int) -> dict[str, Any]:
        item = self.generate(index, self.seed)
        if not isinstance(item, dict) or not isinstance(item.get("question"), str) or "answer" not in item:
            raise BadTaskRow(f"task generator item {index} needs a string 'question' and an 'answer', got {item!r:.80}")
        return {"metadata": {}, **item, "answer": str(item["answer"])}

    score_answer = staticmethod(JsonlRows.score_answer)


class TaskSource:
    """Items, prompts and scores of one dataset."""

    def __init__(self, cfg: TaskConfig, seed: int | None = None, path: str | None = None):
        self.cfg = cfg
        self._verifier = import_object(cfg.verifier, "task.verifier") if cfg.verifier else None
        if cfg.name == "jsonl":
            self.dataset = JsonlRows(path or cfg.path)
            return
        if ":" in cfg.name:
            self.dataset = GeneratedTasks(cfg.name, cfg.seed if seed is None else seed)
            return
        import reasoning_gym

        try:
            self.dataset = reasoning_gym.create_dataset(
                cfg.name, size=_SIZE, seed=cfg.seed if seed is None else seed, **cfg.params
            )
        except ValueError as e:  # unknown name
            known = ", ".join(sorted(reasoning_gym.factory.DATASETS)[:20])
            raise ConfigError(f"task.name = {cfg.name!r}: {e}. Known datasets include: {known}, ...") from None
        except TypeError as e:  # unknown parameter
            raise ConfigError(f"task.params = {cfg.params!r} do not fit dataset {cfg.name!r}: {e}") from None

    def item(self, index: int) -> dict[str, Any]:
        try:
            return self.dataset[index]
        except BadTaskRow:
            raise
        except Exception as e:  # a generator that fails on one index
            raise BadTaskRow(f"{self.cfg.name} item {index} cannot be generated: {type(e).__name__}: {e}") from None

    def prompt(self, entry: dict[str, Any]) -> str:
        expression = entry.get("metadata", {}).get("expression")
        if self.cfg.prompt_format == "compact" and expression:
            return expression.replace(" ", "") + "="
        if not entry["question"].strip():
            raise BadTaskRow(f"item {entry.get('metadata', {})} has an empty prompt")
        return entry["question"]

    def score(self, completion: str, entry: dict[str, Any]) -> float:
        """Reward in [0, 1]; may raise (the caller records the error against the sample)."""
        if self._verifier is not None:
            return float(self._verifier(completion, entry))
        return float(self.dataset.score_answer(completion.strip(), entry))


class MixedTasks:
    """Several tasks as one source (task.mix): item i comes from the task a seeded draw by weight
    picks for i, and carries that task's label in entry["task"] for prompts, scores and metrics."""

    def __init__(self, cfg: TaskConfig, seed: int, held_out: bool):
        self.seed, self.tags, self.weights, self.sources = seed, [], [], {}
        for mix in cfg.mix:
            sub = TaskConfig(name=mix.name, path=mix.path, eval_path=mix.eval_path, params=mix.params,
                             prompt_format=mix.prompt_format, verifier=mix.verifier, seed=cfg.seed)
            source = load_tasks(sub, held_out, seed)
            if source is None:  # no held-out rows for this task
                continue
            self.sources[mix.tag] = source
            self.tags.append(mix.tag)
            self.weights.append(mix.weight)

    def item(self, index: int) -> dict[str, Any]:
        import random

        tag = random.Random(f"{self.seed}-{index}").choices(self.tags, self.weights)[0]
        return {**self.sources[tag].item(index), "task": tag}

    def prompt(self, entry: dict[str, Any]) -> str:
        return self.sources[entry["task"]].prompt(entry)

    def score(self, completion: str, entry: dict[str, Any]) -> float:
        return self.sources[entry["task"]].score(completion, entry)


def load_tasks(cfg: TaskConfig, held_out: bool = False, seed: int | None = None) -> TaskSource | MixedTasks | None:
    """The training (or held-out) items `cfg` describes; None when there is no held-out set."""
    seed = seed if seed is not None else cfg.eval_seed if held_out else cfg.seed
    if cfg.mix:
        mixed = MixedTasks(cfg, seed, held_out)
        return mixed if mixed.tags else None
    if held_out and cfg.name == "jsonl" and not cfg.eval_path:
        return None
    return TaskSource(cfg, seed=seed, path=cfg.eval_path if held_out else None)
