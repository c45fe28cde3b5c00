"""Per-token logprobs and entropies of a batch under the model, with as little compute and memory as
gives the same numbers.

Three savings, each tested to change nothing (tests/test_logprobs.py):
- **length buckets**: rows go through the model in runs of similar length, each cut to its longest
  row, so a long-tailed batch is not padded to its longest row;
- **shared prefixes** (Prefix Grouper, 2025): the G samples of a group share their prompt (agent
  episodes: at least their first turn), so the prompt goes through the model once, its keys and values
  kept in the graph, and each sample's own tokens attend to them — the prompt's forward and backward
  are done once per group instead of G times;
- **a chunked output layer**: logits over the vocabulary are made a chunk of positions at a time and
  reduced at once to log π(target) and the entropy, so `[B, T, V]` float logits never exist.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict

import torch
from torch.utils.checkpoint import checkpoint

from asyncrl.inference import kv
from asyncrl.policy import routing
from asyncrl.vision import inputs as vision

# A forward call's fixed cost in tokens' worth of compute: rows are only split into length buckets, and
# prompts only shared, when the tokens saved outweigh the extra calls.
CALL_COST_TOKENS = 256
# The most [tokens, vocabulary] float32 values a chunk of the output layer holds at once (256 MiB): logits
# over a 150k vocabulary for a whole batch would be the trainer's peak memory, many times over.
CHUNK_VALUES = 2**26


def _plan(lengths: list[int]) -> tuple[list[list[int]], float]:
    """(length buckets, their cost): row indices grouped into runs of similar length, minimising
    Σ rows × longest + CALL_COST_TOKENS per group. Exact by dynamic programming over the distinct lengths
    (sorted, a group is a contiguous range)."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    widths = sorted(set(lengths))
    ends = [sum(1 for n in lengths if n <= w) for w in widths]  # rows with length <= widths[j]
    best, cut = [0.0] + [float("inf")] * len(widths), [0] * (len(widths) + 1)
    for j in range(1, len(widths) + 1):
        for i in range(j):
            cost = best[i] + (ends[j - 1] - (ends[i - 1] if i else 0)) * widths[j - 1] + CALL_COST_TOKENS
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], len(widths)
    while j:
        i = cut[j]
        groups.append(order[(ends[i - 1] if i else 0): ends[j - 1]])
        j = i
    return groups[::-1], best[-1]


def length_buckets(lengths: list[int]) -> list[list[int]]:
    """Row indices in runs of similar length (a long-tailed batch padded to its longest row wastes most of
    its compute on padding)."""
    return _plan(lengths)[0]


def token_logprobs(model, batch: dict, temperature: float, entropy_grad: bool = False, buckets: bool = True,
                   chunk_values: int = CHUNK_VALUES, share_prefixes: bool = True):
    """(log π(target) per position, entropy per position), [B, T-1] each, padded with zeros; temperature as
    the engine sampled. Without `buckets` every row goes through one forward call (the trainer's ranks need
    the same number of calls each) and no prompt is shared. The entropy keeps its graph only when a bonus
    needs its gradient. A batch with "top_ids" ([B, T-1, k]: a teacher's top-k at each position) gets a
    third tensor, log π of those ids [B, T-1, k], from the same logits."""
    lengths = batch["attention"].sum(-1).tolist()
    if "pictures" in batch:  # a vision-language policy: every call below slices these (once per batch)
        fed = vision.inputs(model, batch["tokens"], batch["attention"], batch["pictures"])
        batch = {**batch, "embeds": fed["inputs_embeds"], "positions": fed["position_ids"]}
    # (a teacher's top-k ids may differ between rows over the same tokens, a hinted turn's say: not shared)
    shared = shared_prefixes(batch, lengths) if buckets and share_prefixes and "top_ids" not in batch else []
    grouped = {r for _, members in shared for r in members}
    plain = [r for r in range(len(lengths)) if r not in grouped]
    parts = []  # (rows, logp, entropy)
    runs = length_buckets([lengths[r] for r in plain]) if buckets else [list(range(len(plain)))]
    for run in runs if plain else []:
        rows = [plain[i] for i in run]
        parts.append((rows, *_forward(model, batch, rows, lengths, temperature, entropy_grad, chunk_values)))
    if shared:
        parts.append(_shared_forward(model, batch, shared, lengths, temperature, entropy_grad, chunk_values))
    rows = [r for part in parts for r in part[0]]
    back = torch.tensor(rows, device=batch["tokens"].device).argsort()  # part order -> batch order
    outputs = tuple(torch.cat([p[i] for p in parts])[back] for i in (1, 2, 3))
    return outputs if "top_ids" in batch else outputs[:2]


def _forward(model, batch, rows, lengths, temperature, entropy_grad, chunk_values):
    """The rows in one call, cut to their longest."""
    idx = torch.tensor(rows, device=batch["tokens"].device)
    w = int(max(lengths[r] for r in rows))
    tokens, attention = batch["tokens"][idx, :w], batch["attention"][idx, :w]
    targets = torch.nn.functional.pad(tokens[:, 1:], (0, 1))  # (the last position predicts nothing)
    targets = _with_top(batch, targets, idx[:, None], torch.arange(w, device=idx.device)[None])
    cols = torch.arange(w, device=idx.device)[None]
    with chunked_head(model, targets, temperature, entropy_grad, chunk_values), \
            _replaying(model, batch, idx[:, None], cols):
        out = model(**_fed(batch, idx[:, None], cols), attention_mask=attention).logits[:, :-1]
    return _outputs(out, batch["tokens"].shape[1] - 1, entropy_grad)


def _fed(batch: dict, rows: torch.Tensor, cols: torch.Tensor, text_positions: torch.Tensor | None = None
         ) -> dict:
    """The model's inputs for the tokens at [rows, cols]: their ids (and `text_positions`, if given), or for
    a vision-language policy their embeddings, images included, and their 3-D positions."""
    if "embeds" in batch:
        return {"inputs_embeds": batch["embeds"][rows, cols],
                "position_ids": batch["positions"][:, rows, cols]}
    return {"input_ids": batch["tokens"][rows, cols],
            **({"position_ids": text_positions} if text_positions is not None else {})}


def _replaying(model, batch: dict, rows: torch.Tensor, cols: torch.Tensor):
    """Within the block the model's routers take the engine's experts for the tokens at [rows, cols] (a
    forward over them, flattened as the MoE blocks do), when the batch has them (routing replay)."""
    if "routing" not in batch:
        return contextlib.nullcontext()
    chosen = batch["routing"][rows, cols]  # [b, w, layers, k]
    return routing.replay(model, chosen.permute(2, 0, 1, 3).reshape(chosen.shape[2], -1, chosen.shape[3]))


def _with_top(batch: dict, targets: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """[b, w] targets as [b, w, 1 + k] with the teacher's top-k ids at those positions, when the batch has
    them (position p's ids are batch["top_ids"][:, p]); unchanged otherwise."""
    if "top_ids" not in batch:
        return targets
    top = batch["top_ids"]
    return torch.cat([targets[..., None], top[rows, cols.clamp(max=top.shape[1] - 1)]], -1)


def _outputs(out: torch.Tensor, width: int, entropy_grad: bool):
    """(logp, entropy, top-k logp) padded to `width` positions, from the head's [B, T, 1 + k + 1]."""
    pad = (0, width - out.shape[1])
    entropy = out[..., -1] if entropy_grad else out[..., -1].detach()
    top = torch.nn.functional.pad(out[..., 1:-1], (0, 0) + pad)
    return torch.nn.functional.pad(out[..., 0], pad), torch.nn.functional.pad(entropy, pad), top


def shared_prefixes(batch: dict, lengths: list[int]) -> list[tuple[int, list[int]]]:
    """(q, rows) for each group whose rows share their first q + 1 tokens (q >= 1): the prompt part that
    goes through the model once. Each row keeps at least one token of its own (the one after the shared
    part may differ, and its logit comes from the last shared position's). [] when sharing would not save
    more than its extra calls cost."""
    members = defaultdict(list)
    for row, group in enumerate(batch["groups"].tolist()):
        members[group].append(row)
    shared = []
    for rows in members.values():
        if len(rows) < 2:
            continue
        shortest = min(lengths[r] for r in rows)
        block = batch["tokens"][rows, :shortest]
        same = (block == block[:1]).all(0)
        common = shortest if bool(same.all()) else int(same.int().argmin())
        if common - 1 >= 1:
            shared.append((common - 1, rows))
    if not shared:
        return []
    grouped = {r for _, rows in shared for r in rows}
    plain = [lengths[r] for r in range(len(lengths)) if r not in grouped]
    suffixes = [lengths[r] - q for q, rows in shared for r in rows]
    cost = (_plan(plain)[1] if plain else 0) + len(shared) * max(q for q, _ in shared) + CALL_COST_TOKENS \
        + _plan(suffixes)[1]
    return shared if cost < _plan(lengths)[1] else []


def _shared_forward(model, batch, shared, lengths, temperature, entropy_grad, chunk_values):
    """Each group's shared tokens in one call for all groups (right-padded), keys and values kept; then
    every row's own tokens, in length buckets, attending to its group's: (rows, logp, entropy)."""
    tokens, device = batch["tokens"], batch["tokens"].device
    width = tokens.shape[1] - 1
    qs = torch.tensor([q for q, _ in shared], device=device)
    first = torch.tensor([rows[0] for _, rows in shared], device=device)
    q_max = int(qs.max())
    prefix_attention = (torch.arange(q_max, device=device)[None] < qs[:, None]).long()
    prefix_targets = _with_top(batch, tokens[first, 1:q_max + 1], first[:, None],
                               torch.arange(q_max, device=device)[None])
    with chunked_head(model, prefix_targets, temperature, entropy_grad, chunk_values), \
            _replaying(model, batch, first[:, None], torch.arange(q_max, device=device)[None]):
        prefix = model(**_fed(batch, first[:, None], torch.arange(q_max, device=device)[None]),
                       attention_mask=prefix_attention, use_cache=True)
    cache_arg = kv.cache_kwarg(model)
    prefix_kv = kv.tensors(prefix[cache_arg])
    members = [(g, r) for g, (_, rows) in enumerate(shared) for r in rows]
    own = [lengths[r] - shared[g][0] for g, r in members]  # tokens after the shared part, >= 1
    order, logp_rows, entropy_rows, top_rows = [], [], [], []
    for run in length_buckets(own):
        groups = torch.tensor([members[i][0] for i in run], device=device)
        rows = torch.tensor([members[i][1] for i in run], device=device)
        cols = qs[groups][:, None] + torch.arange(max(own[i] for i in run), device=device)[None]
        valid = cols < torch.tensor([lengths[members[i][1]] for i in run], device=device)[:, None]
        targets = _with_top(batch, tokens[rows[:, None], (cols + 1).clamp(max=width)], rows[:, None], cols)
        cache = kv.build([(k[groups], v[groups]) for k, v in prefix_kv], model.config, spare=None)
        with chunked_head(model, targets, temperature, entropy_grad, chunk_values), \
                _replaying(model, batch, rows[:, None], cols.clamp(max=width)):
            out = model(**_fed(batch, rows[:, None], cols.clamp(max=width), cols),
                        attention_mask=torch.cat([prefix_attention[groups], valid.long()], 1),
                        use_cache=True, **{cache_arg: cache}).logits
        for j, i in enumerate(run):  # the shared positions' outputs, then the row's own
            g, r = members[i]
            row = torch.cat([prefix.logits[g, :shared[g][0]], out[j, :own[i] - 1]])
            logp, entropy, top = _outputs(row[None], width, entropy_grad)
            order.append(r)
            logp_rows.append(logp)
            entropy_rows.append(entropy)
            top_rows.append(top)
    return order, torch.cat(logp_rows), torch.cat(entropy_rows), torch.cat(top_rows)


@contextlib.contextmanager
def chunked_head(model, targets: torch.Tensor, temperature: float, entropy_grad: bool, chunk_values: int):
    """Within the block the model's output layer returns [B, T, 2] — each position's log π(target) and
    entropy — instead of [B, T, V] logits ([B, T, K + 1] for targets [B, T, K]: log π of each). It stays
    the model's own layer, called inside the model's forward (so FSDP has its weight gathered), and works
    through chunks of positions, each (when there are several) under activation checkpointing: only the
    hidden states are kept for the backward pass."""
    head = model.get_output_embeddings()
    chunk = max(1, chunk_values // head.weight.shape[0])
    left_out = vision.placeholders(model.config)  # (as the engine samples: without the image tokens)
    left_out = torch.tensor(left_out, device=head.weight.device) if left_out else None

    per_position = targets.shape[2] if targets.dim() == 3 else 1

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        flat, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1, per_position)
        parts = []
        for lo in range(0, flat.shape[0], chunk):
            h, t = flat[lo:lo + chunk], flat_targets[lo:lo + chunk]
            if torch.is_grad_enabled() and flat.shape[0] > chunk:  # (one chunk: recomputing saves nothing)
                parts.append(checkpoint(_head_chunk, head.weight, head.bias, h, t, temperature, entropy_grad,
                                        left_out, use_reentrant=False))
            else:
                parts.append(_head_chunk(head.weight, head.bias, h, t, temperature, entropy_grad, left_out))
        return torch.cat(parts).reshape(*hidden.shape[:-1], per_position + 1)

    head.forward = forward  # (an instance attribute shadows the class's forward until deleted)
    try:
        yield
    finally:
        del head.forward


def _head_chunk(weight, bias, hidden, targets, temperature: float, entropy_grad: bool,
                left_out: torch.Tensor | None = None) -> torch.Tensor:
    """[n, K + 1]: log π of each of the K targets and the entropy at n positions, from their logits in
    float32; the ids `left_out` (a vision-language policy's image tokens) have no probability."""
    logits = torch.nn.functional.linear(hidden, weight, bias).float() / temperature
    allowed = logits if left_out is None else logits.index_fill(-1, left_out, -torch.inf)
    norm = torch.logsumexp(allowed, dim=-1)
    logp = logits.gather(-1, targets) - norm[:, None]  # (finite even where a prompt's target is an image pad)
    source = logits if entropy_grad else logits.detach()
    probs = torch.softmax(allowed if entropy_grad else allowed.detach(), dim=-1)
    entropy = (norm if entropy_grad else norm.detach()) - (probs * source).sum(-1)
    return torch.cat([logp, entropy[:, None]], dim=-1)
