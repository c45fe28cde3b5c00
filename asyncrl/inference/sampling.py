"""What a request asks of the sampler, and one step of sampling: a token and its logprob per row."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    cache_prefix: bool = False  # keep the finished sequence's KV for the request that continues it


def sample_rows(logits: torch.Tensor, temps: torch.Tensor, top_ps: torch.Tensor, gen: torch.Generator):
    """(tokens, logprobs) for one step, each row with its own temperature (0 = greedy) and top-p."""
    greedy = temps == 0
    logprobs = torch.log_softmax(logits.float() / torch.where(greedy, 1.0, temps)[:, None], dim=-1)
    probs = logprobs.exp()
    if bool((top_ps < 1).any()):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > top_ps[:, None]
        probs = torch.zeros_like(probs).scatter(1, order, sorted_probs.masked_fill(outside, 0.0))
    tokens = torch.where(greedy, logprobs.argmax(-1), torch.multinomial(probs, 1, generator=gen).squeeze(1))
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)
