"""Prefill-only scoring: the per-token logprobs of given token ids under the served model.

    POST /v1/score  {"sequences": [[ids], ...], "start": [s, ...], "top_k": k}
                    -> {"scores": [{"logprobs": [...], "top": [[ids], [logprobs]] per position}, ...]}

Sequence i is scored from position start[i] on (default 1: every token but the first): logprob j of its
answer is log π(ids[start + j] | ids[:start + j]) at temperature 1, the model's own distribution. With
top_k the answer also holds, per scored position, the k likeliest tokens and their logprobs. This is what
a teacher does in on-policy distillation (docs/distillation.md); any replica answers it.
"""
from __future__ import annotations

import torch

# The most [positions, vocabulary] float32 logits one forward call makes (256 MiB): a 150k vocabulary
# times a long batch would be the server's peak memory many times over.
LOGIT_VALUES = 2**26
MAX_TOP_K = 64
HINT_TOKENS = 256  # a hindsight hint's most tokens: a scored sequence may be this much longer than a sample


class ScoreRequestError(ValueError):
    pass


def parse_score_request(body: dict, vocab_size: int, max_tokens: int) -> tuple[list, list[int], int]:
    """(sequences, starts, top_k) from a /v1/score body, or ScoreRequestError saying what is wrong."""
    seqs = body.get("sequences")
    if not (isinstance(seqs, list) and seqs and all(isinstance(s, list) and len(s) >= 2 for s in seqs)):
        raise ScoreRequestError("'sequences' must be a non-empty list of token-id lists, each of 2 or more")
    for s in seqs:
        if not all(isinstance(t, int) and 0 <= t < vocab_size for t in s):
            raise ScoreRequestError(f"token ids must be integers in [0, {vocab_size})")
        if len(s) > max_tokens:
            raise ScoreRequestError(f"a sequence has {len(s)} tokens; the limit is {max_tokens}")
    starts = body.get("start", 1)
    starts = [starts] * len(seqs) if isinstance(starts, int) else starts
    if not (isinstance(starts, list) and len(starts) == len(seqs)
            and all(isinstance(a, int) and 1 <= a < len(s) for a, s in zip(starts, seqs))):
        raise ScoreRequestError("'start' must be an int or one int per sequence, each in [1, its length)")
    top_k = body.get("top_k", 0)
    if not isinstance(top_k, int) or not 0 <= top_k <= MAX_TOP_K:
        raise ScoreRequestError(f"'top_k' must be an integer in [0, {MAX_TOP_K}], got {top_k!r}")
    return seqs, starts, top_k


@torch.inference_mode()
def score(model, pad_id: int, seqs: list[list[int]], starts: list[int], top_k: int) -> list[dict]:
    """Each sequence's scores, in the order given; rows of similar length go through the model together."""
    vocab = model.get_output_embeddings().weight.shape[0]
    device = model.get_output_embeddings().weight.device
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    out: list[dict | None] = [None] * len(seqs)
    lo = 0
    while lo < len(order):
        hi = lo + 1  # as many rows as fit the logit budget at the widest row's length
        while hi < len(order) and (hi - lo + 1) * len(seqs[order[hi]]) * vocab <= LOGIT_VALUES:
            hi += 1
        rows = order[lo:hi]
        width = len(seqs[rows[-1]])
        ids = torch.tensor([seqs[i] + [pad_id] * (width - len(seqs[i])) for i in rows], device=device)
        attention = torch.tensor([[1] * len(seqs[i]) + [0] * (width - len(seqs[i])) for i in rows],
                                 device=device)
        logits = model(input_ids=ids, attention_mask=attention).logits.float()  # (right padding)
        logp = torch.log_softmax(logits[:, :-1], dim=-1)  # position t predicts token t + 1
        for j, i in enumerate(rows):
            out[i] = _answer(logp[j], ids[j, 1:], starts[i] - 1, len(seqs[i]) - 1, top_k)
        lo = hi
    return out


def _answer(logp: torch.Tensor, targets: torch.Tensor, first: int, last: int, top_k: int) -> dict:
    """One sequence's answer from its positions first .. last - 1 (predicting tokens first+1 .. last)."""
    rows = logp[first:last]
    answer = {"logprobs": rows.gather(1, targets[first:last, None]).squeeze(1).tolist()}
    if top_k:
        values, ids = rows.topk(top_k, dim=-1)
        answer["top"] = [[i, v] for i, v in zip(ids.tolist(), values.tolist())]
    return answer
