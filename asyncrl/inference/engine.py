"""The built-in generation engine: batched sampling from an HF causal LM with a KV cache.

Prompts are left-padded into one batch; each step feeds only the newest token and reuses the
cache. Finished rows leave the batch (and the cache) at once, so a few long completions do not
make every row pay for them. Each sampled token comes with its logprob under the sampling
distribution (logits / temperature, before top-p truncation) and the weight version that sampled it.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class Sample:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = "length"


def _left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return ids, mask


def _sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, their logprobs) for one step of a batch of last-position logits."""
    if params.temperature == 0:
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        tokens = logprobs.argmax(dim=-1)
        return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)
    logprobs = torch.log_softmax(logits.float() / params.temperature, dim=-1)
    probs = logprobs.exp()
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > params.top_p
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter(1, order, sorted_probs)
    tokens = torch.multinomial(probs, 1, generator=gen).squeeze(1)
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)


def _cache_kwarg(model) -> str:
    """transformers >= 5.2x names the KV cache argument `cache`; older releases `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class Engine:
    """Holds the policy and its version; generates for a batch of prompts at a time."""

    def __init__(self, model, pad_token_id: int, eos_token_id: int | None, seed: int = 0):
        self.model = model.eval()
        self.pad_id = pad_token_id
        self.eos_id = eos_token_id
        self.version = 0
        self.generator = torch.Generator().manual_seed(seed)
        self.tokens_generated = 0
        self._cache_arg = _cache_kwarg(model)

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Sample]:
        stops = set(params.stop_token_ids) | ({self.eos_id} if self.eos_id is not None else set())
        samples = [Sample() for _ in prompts]
        ids, mask = _left_pad(prompts, self.pad_id)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        live = torch.arange(len(prompts))  # which sample each batch row belongs to
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        cache, logits = out[self._cache_arg], out.logits[:, -1]
        next_pos = positions[:, -1]
        for step in range(params.max_tokens):
            tokens, logprobs = _sample(logits, params, self.generator)
            keep = []
            for row, (tok, lp) in enumerate(zip(tokens.tolist(), logprobs.tolist())):
                sample = samples[live[row]]
                sample.token_ids.append(tok)
                sample.logprobs.append(lp)
                sample.versions.append(self.version)
                if tok in stops:
                    sample.finish_reason = "stop"
                else:
                    keep.append(row)
            self.tokens_generated += len(tokens)
            if not keep or step == params.max_tokens - 1:
                break
            if len(keep) < len(live):  # finished rows leave the batch and the cache
                rows = torch.tensor(keep)
                cache.batch_select_indices(rows)
                live, tokens, mask, next_pos = live[rows], tokens[rows], mask[rows], next_pos[rows]
            mask = torch.cat([mask, torch.ones((len(live), 1), dtype=torch.long)], dim=1)
            next_pos = next_pos + 1
            out = self.model(
                input_ids=tokens[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                use_cache=True, **{self._cache_arg: cache},
            )
            cache, logits = out[self._cache_arg], out.logits[:, -1]
        return samples

    def load_state(self, state: dict[str, torch.Tensor], version: int) -> None:
        self.model.load_state_dict(state, strict=False)
        self.version = version
