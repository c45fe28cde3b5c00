"""The keys and values of finished agent turns, kept for the episode's next turn.

An agent episode's next request is the whole conversation so far: the previous turn's prompt, its
answer, then what the environment said. Its first part went through the model already, when the
previous turn was generated; the engine keeps that turn's keys and values here (a request asks for it
with `cache_prefix`), and the next turn prefills only the tokens after them. Entries are least recently
used out within a budget of tokens, taken (not copied) by the turn that continues them, and all dropped
when new weights arrive unless running rows keep their caches too (update_policy "keep").
"""
from __future__ import annotations

from collections import OrderedDict

import torch


class PrefixCache:
    def __init__(self, budget_tokens: int):
        self.budget = budget_tokens
        self.entries: OrderedDict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = OrderedDict()
        self.tokens = 0  # held, all entries together

    def put(self, tokens: tuple[int, ...], layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """`layers`: each layer's (keys, values) of `tokens`, [1, heads, len(tokens), head_dim]."""
        if not self.budget or len(tokens) > self.budget:
            return
        if tokens in self.entries:
            self.tokens -= len(tokens)
        self.entries[tokens] = layers
        self.entries.move_to_end(tokens)
        self.tokens += len(tokens)
        while self.tokens > self.budget:
            old, _ = self.entries.popitem(last=False)
            self.tokens -= len(old)

    def take(self, prompt: list[int]) -> tuple[int, list] | None:
        """The longest entry that is a proper prefix of `prompt` (at least one token of the prompt must be
        fed to get its next-token logits), removed from the cache: (its length, its layers)."""
        best = None
        for key in self.entries:
            if len(key) < len(prompt) and (best is None or len(key) > len(best)) and \
                    tuple(prompt[:len(key)]) == key:
                best = key
        if best is None:
            return None
        self.tokens -= len(best)
        return len(best), self.entries.pop(best)

    def clear(self) -> None:
        self.entries.clear()
        self.tokens = 0
