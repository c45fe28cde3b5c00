"""The token record of one episode: every token in order, each either sampled by the policy
(loss mask 1, with its logprob and the version that sampled it) or not (prompt, tool output,
environment text, chat-template glue: mask 0).

Tokens are only ever appended: sampled ids exactly as the engine returned them, other text
encoded once when it enters. Nothing already recorded is decoded and encoded again, so the
trainer sees the very tokens the engine sampled, across any number of turns.
"""
from __future__ import annotations

from dataclasses import dataclass, field


class EpisodeLimit(RuntimeError):
    """The episode used its turns or tokens; it ends here (truncated) and is still trained on."""


class EpisodeAborted(RuntimeError):
    """The inference server aborted a turn (a weight update with update_policy = "abort")."""


@dataclass
class Limits:
    max_turns: int            # policy calls per episode
    max_tokens: int           # tokens in the whole record (the model's context)
    max_tokens_per_turn: int  # default and cap of one call's completion


@dataclass
class Episode:
    limits: Limits
    tokens: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: int = 0
    turn_rewards: list[float] = field(default_factory=list)
    tool_calls: list[dict] = field(default_factory=list)  # {name, seconds, error}
    final_text: str = ""        # the policy's last reply (what a verifier scores by default)
    finish_reason: str | None = None
    truncated: str | None = None  # why the episode hit a limit
    server_lost: bool = False   # a call found the inference server gone: the episode must be redone
    last_turn: tuple[int, int] | None = None  # where the policy's latest sampled span lies in `tokens`
    # hindsight distillation: {"start", "end", "text"} per turn given a hint (asyncrl/orchestrator/teacher.py)
    hints: list[dict] = field(default_factory=list)
    # a MoE policy's routing of every token up to the latest turn's (that turn's prompt was the whole
    # record before it: the engine routed it all)
    routing: dict | None = None
    images: list[str] = field(default_factory=list)  # a vision-language policy's, by hash, in token order

    def add_context(self, ids: list[int]) -> None:
        self.tokens += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def add_sampled(self, ids: list[int], logprobs: list[float], versions: list[int]) -> None:
        self.last_turn = (len(self.tokens), len(self.tokens) + len(ids))
        self.tokens += ids
        self.loss_mask += [1] * len(ids)
        self.logprobs += logprobs
        self.versions += versions

    def start_turn(self, asked: int | None, incoming: int) -> int:
        """Count a policy call that adds `incoming` context tokens; its completion budget, or EpisodeLimit."""
        room = self.limits.max_tokens - len(self.tokens) - incoming
        if self.turns >= self.limits.max_turns:
            self._limit(f"turn limit reached ({self.limits.max_turns} policy calls; agent.max_turns)")
        if room <= 0:
            self._limit(f"token limit reached ({len(self.tokens) + incoming} of {self.limits.max_tokens}; "
                        "agent.max_episode_tokens)")
        self.turns += 1
        return min(asked or self.limits.max_tokens_per_turn, self.limits.max_tokens_per_turn, room)

    def _limit(self, why: str):
        self.truncated = why
        raise EpisodeLimit(f"episode limit: {why}")

    def hint(self, text: str) -> None:
        """A hint for the teacher about the policy's latest turn, built from what came after it (on-policy
        distillation in hindsight: the teacher scores that turn with the hint in its context)."""
        if self.last_turn is None:
            raise ValueError("ctx.hint(): the policy has not taken a turn yet, so there is nothing to hint")
        if not isinstance(text, str):
            raise TypeError(f"ctx.hint() takes text, got {type(text).__name__}")
        start, end = self.last_turn
        if end > start:
            self.hints = [h for h in self.hints if h["start"] != start] + [{"start": start, "end": end,
                                                                           "text": text}]

    @property
    def sampled_tokens(self) -> int:
        return sum(self.loss_mask)
