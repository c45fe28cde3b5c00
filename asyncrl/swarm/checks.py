"""The cheap checks every sample from a joined worker passes before it may be scored: each costs a pass
over the sample's numbers, no model.

A sample is refused when its tokens leave the vocabulary, a logprob is positive or not finite, the
lists' lengths disagree, a version was not published or is older than the version served when the work
was given (a worker holds the served version before it gets work), it is longer than max_tokens, its
finish reason does not match its end (a "stop" ends on a stop token, a "length" is max_tokens long), or
it repeats a sample returned before for another prompt (same tokens and logprob bits, whatever versions
it claims: the same floats from two contexts do not happen by chance). The same prompt may honestly get
the same sample again (a task that repeats an item, a confident policy): such a repeat is a valid sample
and is kept, as are samples whose logprobs are all ~0 (nothing random in them to tell a replay by).
A group is refused whole when the worker names a prompt other than the one it was given or returns a
number of samples other than n.
"""
from __future__ import annotations

import hashlib
import math
import struct
from collections import OrderedDict
from dataclasses import dataclass

REMEMBERED = 500_000  # sample digests kept for the replay check (~60 MB at most)


class GroupRefused(ValueError):
    pass


@dataclass
class Limits:
    vocab_size: int
    max_tokens: int
    stop_ids: frozenset[int]
    issued_version: int  # served when the work was given
    newest_version: int  # published now


def prompt_digest(prompt: list[int]) -> str:
    return hashlib.sha256(struct.pack(f"<{len(prompt)}i", *prompt)).hexdigest()


class Seen:
    """The prompt of each sample accepted so far, by the sample's digest (the newest REMEMBERED)."""

    def __init__(self, size: int = REMEMBERED):
        self.size, self.prompts = size, OrderedDict()

    def add(self, digests: list[str], prompt: str) -> None:
        for d in digests:
            self.prompts[d] = prompt
        while len(self.prompts) > self.size:
            self.prompts.popitem(last=False)

    def elsewhere(self, digest: str | None, prompt: str) -> bool:
        return digest is not None and self.prompts.get(digest, prompt) != prompt


NOTHING_RANDOM = 1e-4  # a sample whose logprobs sum to less than this (in magnitude) is not digested


def sample_digest(choice: dict) -> str | None:
    if -sum(choice["logprobs"]["token_logprobs"]) < NOTHING_RANDOM:
        return None
    h = hashlib.sha256()
    h.update(repr(choice["token_ids"]).encode())
    h.update(struct.pack(f"<{len(choice['token_ids'])}d", *choice["logprobs"]["token_logprobs"]))
    return h.hexdigest()


def check_group(choices, n: int, given: str, named: str, limits: Limits, seen: Seen) -> list[str | None]:
    """Each choice's reason to refuse it (None: accepted). GroupRefused: the whole group is refused."""
    if named != given:
        raise GroupRefused(f"returned samples for prompt {named[:12]}…, not the prompt given ({given[:12]}…)")
    if not isinstance(choices, list) or len(choices) != n:
        raise GroupRefused(f"returned {len(choices) if isinstance(choices, list) else choices!r} samples "
                           f"for a group of {n}")
    reasons = [check_sample(c, limits) for c in choices]
    digests = [sample_digest(c) if r is None and c["finish_reason"] != "abort" else None
               for c, r in zip(choices, reasons)]
    reasons = [r or ("repeats a sample returned for another prompt" if seen.elsewhere(d, given) else None)
               for r, d in zip(reasons, digests)]
    seen.add([d for d, r in zip(digests, reasons) if d is not None and r is None], given)
    return reasons


def check_sample(c, limits: Limits) -> str | None:
    if not isinstance(c, dict):
        return f"a sample is {type(c).__name__}, not an object"
    tokens, versions, reason = c.get("token_ids"), c.get("versions"), c.get("finish_reason")
    logprobs = c["logprobs"].get("token_logprobs") if isinstance(c.get("logprobs"), dict) else None
    if reason not in ("stop", "length", "abort"):
        return f"finish_reason {reason!r} is not stop, length or abort"
    if not all(isinstance(x, list) for x in (tokens, logprobs, versions)):
        return "token_ids, logprobs.token_logprobs and versions must be lists"
    if not len(tokens) == len(logprobs) == len(versions):
        return f"{len(tokens)} tokens, {len(logprobs)} logprobs and {len(versions)} versions"
    if reason == "abort":
        return None  # (not a sample: never scored or trained)
    if not tokens:
        return "an empty completion"
    if len(tokens) > limits.max_tokens:
        return f"{len(tokens)} tokens, over max_tokens = {limits.max_tokens}"
    if not all(type(t) is int and 0 <= t < limits.vocab_size for t in tokens):
        return f"a token outside the vocabulary [0, {limits.vocab_size})"
    if not all(type(x) in (int, float) and math.isfinite(x) and x <= 0 for x in logprobs):
        return "a logprob that is positive or not finite"
    if not all(type(v) is int and limits.issued_version <= v <= limits.newest_version for v in versions):
        return (f"a version outside [{limits.issued_version}, {limits.newest_version}] (served when the work "
                "was given, published now)")
    if reason == "stop" and tokens[-1] not in limits.stop_ids:
        return f"finish_reason stop after token {tokens[-1]}, not a stop token"
    if reason == "length" and len(tokens) != limits.max_tokens:
        return f"finish_reason length after {len(tokens)} tokens, not max_tokens = {limits.max_tokens}"
    return None
