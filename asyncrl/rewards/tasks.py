"""Tasks, and the verifier that scores a completion.

Tasks come from a reasoning-gym dataset (generated offline), from a JSONL file of
{"prompt": ..., "answer": ...} rows (`task.name = "jsonl"`), or from a generator function
(`task.name = "module:function"`); the last two are scored by exact match unless
`task.verifier` is set. A task item is a dict (question, answer, metadata). Index i always
names the same item (a file is read in epochs), so a run's dataset position is one integer.

Held-out items of a generated task never appear in training or in the warm start: a hash of
the item's prompt text and answer puts every distinct item on one side (`task.holdout` of them
held out), and each side draws only items of its own. (Two generator seeds alone would share
items: there are only ~8k sums of two 2-digit numbers.) A JSONL task holds out its
`task.eval_path` file. A task with few distinct items (a guessing game with 15 secrets) has an
almost empty held-out side: `task.holdout = 0` evaluates it on fresh draws instead.
"""
from __future__ import annotations

import hashlib
import json
import math
import numbers
import weakref
from pathlib import Path
from typing import Any

from asyncrl.config import ConfigError
from asyncrl.config.sections import TaskConfig
from asyncrl.plugins import import_object, read_user_text
from asyncrl.run.role import ContractError
from asyncrl.vision.images import BadImage, image_hash

_SIZE = 2**62  # reasoning-gym generates item i on demand; the size only bounds the index
_STRIDE = 1_000_000_007  # between a split's attempts at one index: a prime, so no index pattern repeats


# far more characters than any token spans: a prompt longer than this many per allowed token is refused
# without encoding it (a 10 MB row is not tokenized to learn that it is too long)
MAX_CHARS_PER_TOKEN = 1000


class BadTaskRow(ValueError):
    """This item cannot become a prompt; the run drops it, records why and goes on."""


class JsonlRows:
    """Rows of a JSONL file; a malformed row is reported when it is asked for, not at load."""

    def __init__(self, path: str):
        text = read_user_text(path, "task file (task.path / task.eval_path)")
        self.lines = [line for line in text.splitlines() if line.strip()]
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
        if (
            not isinstance(record, dict)
            or not isinstance(record.get("prompt"), str)
            or "answer" not in record
        ):
            raise BadTaskRow(f"{where} needs a string 'prompt' and an 'answer', got {self.lines[row][:80]!r}")
        if not record["prompt"].strip():
            raise BadTaskRow(f"{where} has an empty prompt")
        images = record.get("images", [])
        if not isinstance(images, list) or not all(isinstance(i, str) for i in images):
            raise BadTaskRow(f"{where}: 'images' must be a list of file paths or data URIs, "
                             f"got {images!r:.80}")
        folder = Path(self.path).parent  # (an image's path is relative to its file's folder)
        images = [i if i.startswith("data:") else str(folder / i) for i in images]
        return {"question": record["prompt"], "answer": str(record["answer"]), "metadata": {"row": row},
                **({"images": images} if images else {})}

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
            raise BadTaskRow(
                f"task generator item {index} needs a string 'question' and an 'answer', got {item!r:.80}"
            )
        return {"metadata": {}, **item, "answer": str(item["answer"])}

    score_answer = staticmethod(JsonlRows.score_answer)


def item_key(prompt: str, entry: dict[str, Any]) -> str:
    """What makes two items the same: what the policy is asked (the text and any pictures), and the
    answer that scores it."""
    key = f"{prompt}\x00{entry.get('answer')}"
    pictures = "".join(image_hash(i) if isinstance(i, bytes) else str(i) for i in entry.get("images", ()))
    return f"{key}\x00{pictures}" if pictures else key


def held_out(key: str, fraction: float) -> bool:
    """Whether an item is on the held-out side of the split (the same on every machine)."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") < fraction * 2**64


class TaskSource:
    """Items, prompts and scores of one dataset; `side` is "train" or "eval" of the holdout split."""

    def __init__(self, cfg: TaskConfig, seed: int | None = None, path: str | None = None, side: str = "train",
                 score_only: bool = False):
        """`score_only`: for a verifier worker, which only scores: with a verifier named, no dataset is
        built (and reasoning-gym, ~2 s of CPU to import, is not imported)."""
        self.cfg, self.side = cfg, side
        self._verifier = import_object(cfg.verifier, "task.verifier") if cfg.verifier else None
        if score_only and self._verifier is not None:
            return
        self.split = cfg.name != "jsonl" and 0 < cfg.holdout < 1
        if self.split:  # candidates per index: one of its side turns up in all but ~e^-40 of indices
            share = cfg.holdout if side == "eval" else 1 - cfg.holdout
            self.tries = math.ceil(40 / share)
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
            raise ConfigError(
                f"task.name = {cfg.name!r}: {e}. Known datasets include: {known}, ..."
            ) from None
        except TypeError as e:  # unknown parameter
            raise ConfigError(f"task.params = {cfg.params!r} do not fit dataset {cfg.name!r}: {e}") from None

    def item(self, index: int) -> dict[str, Any]:
        if not self.split:
            return self._generate(index)
        # item i is generator item i when it is on this side (as without a split)
        for attempt in range(self.tries):
            entry = self._generate(index + attempt * _STRIDE)
            if held_out(item_key(self.prompt(entry), entry), self.cfg.holdout) == (self.side == "eval"):
                return entry
        raise BadTaskRow(f"{self.cfg.name} item {index}: none of {self.tries} generated items falls on the "
                         f"{self.side} side of the split (task.holdout = {self.cfg.holdout})")

    def _generate(self, index: int) -> dict[str, Any]:
        try:
            return self.dataset[index]
        except BadTaskRow:
            raise
        except Exception as e:  # a generator that fails on one index
            raise BadTaskRow(
                f"{self.cfg.name} item {index} cannot be generated: {type(e).__name__}: {e}"
            ) from None

    def prompt(self, entry: dict[str, Any]) -> str:
        expression = entry.get("metadata", {}).get("expression")
        if self.cfg.prompt_format == "compact" and expression:
            return expression.replace(" ", "") + "="
        if not entry["question"].strip():
            raise BadTaskRow(f"item {entry.get('metadata', {})} has an empty prompt")
        return entry["question"]

    def prompt_ids(self, entry: dict[str, Any], tokenizer) -> list[int]:
        """The prompt's token ids: a user turn of the tokenizer's chat template (task.chat), else plain
        text."""
        text = self.prompt(entry)
        ids = encode_prompt(tokenizer, text, self.cfg.chat)
        unknown = tokenizer.unk_token_id
        if unknown is not None and unknown in ids:  # (a char-level vocabulary; byte-level BPE has none)
            missing = sorted(c for c in set(text) if unknown in tokenizer.encode(c, add_special_tokens=False))
            raise BadTaskRow(f"{self.where(entry)}: the prompt has characters the tokenizer cannot encode: "
                             f"{''.join(missing)!r} (in {text[:60]!r})")
        return ids

    def where(self, entry: dict[str, Any], index: int | None = None) -> str:
        """Where an item comes from, for an error message: the file and row, else the dataset and index."""
        row = entry.get("metadata", {}).get("row")
        if isinstance(self.dataset, JsonlRows) and row is not None:
            return f"{self.dataset.path} row {row + 1}"
        return f"{self.cfg.name} item" + (f" {index}" if index is not None else "")

    def score(self, completion: str, entry: dict[str, Any]) -> float:
        """Reward; may raise (the caller records the error against the sample). A verifier that returns
        something other than a number breaks its contract: ContractError, which stops the run."""
        if self._verifier is None:
            return float(self.dataset.score_answer(completion.strip(), entry))
        value = self._verifier(completion, entry)
        reward = as_number(value)
        if reward is None:
            raise ContractError(f"task.verifier = {self.cfg.verifier!r} returned {type(value).__name__} "
                                f"{value!r:.60}; a verifier must return a number (the reward)")
        return reward


def servable_prompt(tasks, index: int, tokenizer, limit: int, images=None) -> tuple[dict, list[int]]:
    """(item `index` with its "prompt" text, the prompt's token ids); BadTaskRow if the item is
    malformed, empty, or longer than `limit` (inference.max_prompt_tokens) tokens. The one row check
    of every reader of a task: training, evaluation, the warm start, the thread planner. `images`: a
    vision-language policy's ImagePrompts (asyncrl/vision/prompts.py); None for a text-only one."""
    return checked_prompt(tasks, tasks.item(index), tokenizer, limit, index, images)


def prompt_text(tasks, entry: dict, limit: int, index: int | None = None) -> str:
    """The item's prompt text; BadTaskRow if it is too long for `limit` tokens whatever the tokenizer
    (checked without encoding it: for readers that have no tokenizer yet, and so that a huge row
    costs nothing)."""
    text = tasks.prompt(entry)
    if len(text) > MAX_CHARS_PER_TOKEN * limit:
        raise BadTaskRow(f"{tasks.where(entry, index)}: the prompt has {len(text)} characters, more than "
                         f"inference.max_prompt_tokens = {limit} tokens can hold")
    return text


def checked_prompt(tasks, entry: dict, tokenizer, limit: int, index: int | None = None, images=None
                   ) -> tuple[dict, list[int]]:
    """servable_prompt for an item already read (`index`: where it came from, for the message). A row
    with images leaves with their hashes ("image_hashes") in place of the images."""
    entry = {**entry, "prompt": prompt_text(tasks, entry, limit, index)}  # what an agent is asked
    refs = entry.pop("images", None)
    if refs and images is None:
        raise BadTaskRow(f"{tasks.where(entry, index)} shows {len(refs)} image(s), but the policy is a "
                         "text-only model")
    if not refs:
        prompt = tasks.prompt_ids(entry, tokenizer)
    else:
        try:
            prompt, entry["image_hashes"] = images.prompt(tasks, entry, refs)
        except BadImage as e:
            raise BadTaskRow(f"{tasks.where(entry, index)}: {e}") from None
    if len(prompt) > limit:
        raise BadTaskRow(f"{tasks.where(entry, index)}: the prompt has {len(prompt)} tokens; "
                         f"inference.max_prompt_tokens is {limit}")
    return entry, prompt


def as_number(value) -> float | None:
    """A reward as a float: any real number (bool, numpy and one-element tensor scalars included);
    None for what is not one (a string, None, a list), which breaks a reward function's contract."""
    numeric = isinstance(value, numbers.Real) or hasattr(value, "__float__")
    if isinstance(value, (str, bytes)) or not numeric:
        return None
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):  # (a tensor of many elements)
        return None


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    if not chat:
        return _encode(tokenizer, text, special=True)
    if not tokenizer.chat_template:
        raise ConfigError(
            f"task.chat is on but the tokenizer of {tokenizer.name_or_path!r} has no chat template; "
            "set task.chat = false to send prompts as plain text"
        )
    frame = _chat_frame(tokenizer)
    if frame is not None:
        rendered = frame[0] + text + frame[1]
    else:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                 add_generation_prompt=True, tokenize=False)
    return _encode(tokenizer, rendered, special=False)


def _encode(tokenizer, text: str, special: bool) -> list[int]:
    """The tokenizer's ids for `text`; a fast tokenizer's Rust encoder is called directly (the Python
    wrapper around it was most of the orchestrator's tokenizing time, for the same ids)."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is None:
        return tokenizer(text, add_special_tokens=special)["input_ids"]
    return backend.encode(text, add_special_tokens=special).ids


# Contents the chat template must pass through verbatim before its frame is reused for every prompt:
# surrounding whitespace (a template that strips it), newlines, and Jinja's own delimiters.
_PROBES = ("probe", "  two words \n", "{{ x }} {% y %}", "\n\nlast line\n")
_FRAMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> (template, frame or None)


def _chat_frame(tokenizer) -> tuple[str, str] | None:
    """(text before, text after) the user's content in the template's rendering of one user turn, when
    the template inserts the content verbatim (then rendering is string concatenation, not a Jinja run
    per prompt); None when it transforms the content."""
    template, frame = _FRAMES.get(tokenizer, (None, None))
    if template != tokenizer.chat_template:
        def render(content: str) -> str:
            return tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                 add_generation_prompt=True, tokenize=False)

        head, _, tail = render("\x00").partition("\x00")
        frame = (head, tail) if all(render(p) == head + p + tail for p in _PROBES) else None
        _FRAMES[tokenizer] = (tokenizer.chat_template, frame)
    return frame


class MixedTasks:
    """Several tasks as one source (task.mix): item i comes from the task a seeded draw by weight
    picks for i, and carries that task's label in entry["task"] for prompts, scores and metrics."""

    def __init__(self, cfg: TaskConfig, seed: int, held_out: bool, score_only: bool = False):
        self.seed, self.tags, self.weights, self.sources = seed, [], [], {}
        for mix in cfg.mix:
            sub = TaskConfig(name=mix.name, path=mix.path, eval_path=mix.eval_path, params=mix.params,
                             prompt_format=mix.prompt_format, verifier=mix.verifier, seed=cfg.seed,
                             holdout=cfg.holdout if mix.holdout is None else mix.holdout, chat=cfg.chat)
            source = load_tasks(sub, held_out, seed, score_only)
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

    def prompt_ids(self, entry: dict[str, Any], tokenizer) -> list[int]:
        return self.sources[entry["task"]].prompt_ids(entry, tokenizer)

    def where(self, entry: dict[str, Any], index: int | None = None) -> str:
        return self.sources[entry["task"]].where(entry, index)

    def score(self, completion: str, entry: dict[str, Any]) -> float:
        return self.sources[entry["task"]].score(completion, entry)


def load_tasks(
    cfg: TaskConfig, held_out: bool = False, seed: int | None = None, score_only: bool = False
) -> TaskSource | MixedTasks | None:
    """The training (or held-out) items `cfg` describes; None when there is no held-out set.
    `score_only`: see TaskSource."""
    seed = seed if seed is not None else cfg.eval_seed if held_out else cfg.seed
    if cfg.mix:
        mixed = MixedTasks(cfg, seed, held_out, score_only)
        return mixed if mixed.tags else None
    if held_out and cfg.name == "jsonl" and not cfg.eval_path:
        return None
    return TaskSource(cfg, seed=seed, path=cfg.eval_path if held_out else None,
                      side="eval" if held_out else "train", score_only=score_only)


def eval_entries(tasks: TaskSource | MixedTasks, size: int) -> list[dict[str, Any]]:
    """Up to `size` distinct held-out items, the same on every call: the first ones of the held-out
    stream, bad rows skipped. A task with fewer distinct held-out items gives what it has (the
    stream is read up to 20x `size` items)."""
    entries, seen = [], set()
    for index in range(20 * size):
        if len(entries) == size:
            break
        try:
            entry = tasks.item(index)
            key = item_key(tasks.prompt(entry), entry)
        except BadTaskRow:  # a bad held-out row is left out of the denominator
            continue
        if key not in seen:
            seen.add(key)
            entries.append(entry)
    return entries
