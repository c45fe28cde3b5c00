"""The built-in generation engine: continuous batching over an HF causal LM with a KV cache.

Sequences join and leave the running batch at token boundaries: each `step()` admits waiting
sequences (prefilling each distinct prompt once and sharing its KV rows among the G samples of
that prompt), samples one token for every running row, retires the rows that finished, and feeds
the new tokens through the model. Nothing waits for the longest sequence of a batch.

Every sampled token carries its logprob under the sampling distribution (logits / temperature,
before top-p truncation) and the version of the weights that sampled it. `reload()` swaps the
weights at a token boundary: under "interrupt" the running rows' caches are recomputed under
the new weights and generation goes on (partial rollouts); under "abort" they start over.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from asyncrl.inference import kv
from asyncrl.inference.prefix_cache import PrefixCache
from asyncrl.inference.sampling import SamplingParams, sample_rows
from asyncrl.observe.fit import LinearFit
from asyncrl.policy import routing
from asyncrl.vision import inputs as vision


@dataclass
class Sample:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None  # why an "abort" came from the engine itself (a failed step)
    # a MoE policy's experts for each token fed (prompt, then every sampled token but the last): chunks of
    # [tokens, MoE layers, top-k] (asyncrl/policy/routing.py)
    routes: list = field(default_factory=list)


@dataclass(eq=False)
class Sequence:
    prompt: list[int]
    params: SamplingParams
    on_done: Callable[["Sequence"], None] | None = None
    sample: Sample = field(default_factory=Sample)
    images: tuple = ()  # a vision-language policy's Pictures (asyncrl/vision/inputs.py), in prompt order

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.sample.token_ids


# A finished row stays in the batch (computed, ignored) until this share of rows has finished:
# dropping rows copies the whole KV cache, which on a long-tailed batch cost more than decoding.
COMPACT_AT = 4  # compact once 1/4 of the rows are finished
ADMIT_WITHIN_STEPS = 1  # the longest a waiting sequence is held back while others decode (4 starved
# the default 8-token demo by ~25%; 1 costs it nothing measurable and lifts agent episodes/s ~25%)


class Engine:
    """Running batch state, advanced one token per `step()`. Not thread-safe: one thread drives it."""

    def __init__(self, model, pad_token_id: int, eos_token_id: int | None, seed: int = 0,
                 max_sequences: int = 512, max_tokens: int = 2**18, prefix_cache_tokens: int = 0):
        self.model = model.eval()
        self.device = next(model.parameters()).device  # (every tensor the engine makes lives beside it)
        self.pad_id, self.eos_id = pad_token_id, eos_token_id
        self.max_sequences, self.max_tokens = max_sequences, max_tokens
        self.version = 0
        self.generator = torch.Generator(self.device).manual_seed(seed)
        self.cache_arg = kv.cache_kwarg(model)
        # a prefill needs the last position's logits alone: the output layer on every prompt token cost a
        # 49,152-token vocabulary's model ~20 GFLOP per 360 prompt tokens
        self.last_logits = {"logits_to_keep": 1} if kv.takes(model, "logits_to_keep") else {}
        self.waiting: deque[Sequence] = deque()
        self.admitting = True  # False while draining for a "finish" weight update
        self.held = 0  # steps the oldest waiting sequence has been held back (see _admit)
        self.tokens_generated = 0
        self.tokens_discarded = 0  # sampled, then thrown away by an "abort" reload
        self.tokens_prefilled = 0  # fed through the model to admit sequences (padding not counted)
        self.tokens_reused = 0  # of admitted prompts, found in the prefix cache instead
        # a mixture-of-experts policy: each fed token's experts are recorded (routing replay, docs/moe.md);
        # a cached prefix would have none, so its later turns prefill again
        self.routers = routing.routers(model)
        self.prefixes = PrefixCache(0 if self.routers else prefix_cache_tokens)
        placeholders = vision.placeholders(model.config)  # (image tokens: never sampled)
        self.placeholders = torch.tensor(placeholders, device=self.device) if placeholders else None
        # seconds per decode step against its rows, per prefill against its tokens: the rate model
        # `asyncrl plan` calibrates from (asyncrl/plan/calibrate.py)
        self.decode_fit, self.prefill_fit = LinearFit(), LinearFit()
        self._clear()

    def _clear(self) -> None:
        self.rows: list[Sequence | None] = []  # the batch's rows; None: finished, not yet compacted away
        self.cache = None  # the DynamicCache of the running rows; rebuilt only when rows change
        self.mask = torch.zeros((0, 0), dtype=torch.long, device=self.device)
        self.positions = torch.zeros(0, dtype=torch.long, device=self.device)  # each row's next token's
        self.logits = torch.zeros(0, device=self.device)
        self.temps = torch.zeros(0, device=self.device)
        self.top_ps = torch.zeros(0, device=self.device)
        self.logit_versions: list[int] = []  # the weights each row's next-token logits came from

    # --- requests ----------------------------------------------------------------------------
    def add(self, seqs: list[Sequence]) -> None:
        self.waiting.extend(seqs)

    @property
    def running(self) -> list[Sequence]:
        return [s for s in self.rows if s is not None]

    def has_work(self) -> bool:
        return bool(self.rows) or (self.admitting and bool(self.waiting))

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams, images: list | None = None
                 ) -> list[Sample]:
        """Run `prompts` (showing `images`, each prompt's Pictures) to completion, with whatever else is
        queued, and return their samples."""
        seqs = [Sequence(p, params, images=images[k] if images else ()) for k, p in enumerate(prompts)]
        self.add(seqs)
        while any(s.sample.finish_reason is None for s in seqs):
            self.step()
        return [s.sample for s in seqs]

    # --- one step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> None:
        if self.admitting:
            self._admit()
        if not self.rows:
            return
        with self.decode_fit.timed(len(self.rows)):
            self._decode()

    def _decode(self) -> None:
        """Sample a token for every running row, retire the finished ones, feed the rest."""
        logits = self.logits if self.placeholders is None else \
            self.logits.index_fill(1, self.placeholders, -torch.inf)
        tokens, logprobs = sample_rows(logits, self.temps, self.top_ps, self.generator)
        live = sampled = 0
        for row, (seq, tok, lp, v) in enumerate(
            zip(self.rows, tokens.tolist(), logprobs.tolist(), self.logit_versions)
        ):
            if seq is None:
                continue
            sampled += 1
            s = seq.sample
            s.token_ids.append(tok)
            s.logprobs.append(lp)
            s.versions.append(v)
            if tok == self.eos_id or tok in seq.params.stop_token_ids:
                self._finish(seq, "stop")
            elif len(s.token_ids) >= seq.params.max_tokens:
                self._finish(seq, "length")
            else:
                live += 1
                continue
            if seq.params.cache_prefix:
                self._remember(row, seq)
            self.rows[row] = None
        self.tokens_generated += sampled
        if live == 0:
            self._clear()
            return
        if (len(self.rows) - live) * COMPACT_AT >= len(self.rows):
            tokens = tokens[self._compact()]
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(self.rows), 1))], dim=1)
        self._forward(tokens[:, None], self.positions[:, None])
        self.positions = self.positions + 1
        self.logit_versions = [self.version] * len(self.rows)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.sample.finish_reason = reason
        if seq.on_done is not None:
            seq.on_done(seq)

    def _remember(self, row: int, seq: Sequence) -> None:
        """Keep the row's keys and values (every token but the last sampled, which was never fed) for
        the request that continues the sequence."""
        if not self.prefixes.budget or seq.images:
            return
        columns = self.mask[row].nonzero().squeeze(1)
        fed = tuple(seq.tokens[:-1])
        if len(columns) == len(fed):
            self.prefixes.put(fed, [(k[row:row + 1, :, columns], v[row:row + 1, :, columns])
                                    for k, v in kv.tensors(self.cache)])

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor) -> None:
        with routing.record(self.routers) as calls:
            out = self.model(input_ids=ids, attention_mask=self.mask, position_ids=positions,
                             use_cache=True, **{self.cache_arg: self.cache})
        self.cache, self.logits = out[self.cache_arg], out.logits[:, -1]
        for seq, routes in zip(self.rows, routing.per_row(calls, len(self.rows), 1)):
            if seq is not None:  # (a finished row not yet compacted away)
                seq.sample.routes.append(routes)

    def _compact(self) -> torch.Tensor:
        """Drop the finished rows from the batch and its cache; returns the kept rows' old indices."""
        keep = torch.tensor([i for i, seq in enumerate(self.rows) if seq is not None], dtype=torch.long,
                            device=self.device)
        self._keep_rows(keep)
        return keep

    def _keep_rows(self, rows: torch.Tensor) -> None:
        self.rows = [self.rows[i] for i in rows.tolist()]
        if not self.rows:
            self._clear()
            return
        layers, self.mask = kv.select(kv.tensors(self.cache), self.mask, rows)
        self.cache = kv.build(layers, self.model.config)
        self.positions, self.logits = self.positions[rows], self.logits[rows]
        self.temps, self.top_ps = self.temps[rows], self.top_ps[rows]
        self.logit_versions = [self.logit_versions[i] for i in rows.tolist()]

    # --- admission and prefill ---------------------------------------------------------------
    def _admit(self) -> None:
        # Each admission is a prefill forward plus a copy of the whole running KV cache. When
        # requests trickle in one by one (agent turns), admitting each at once pays that per
        # request; holding them back (ADMIT_WITHIN_STEPS) until a quarter of the running batch is
        # waiting admits them together. An idle engine admits at once.
        if not self.waiting:
            return
        running = len(self.running)  # (a list built from the rows: counted once, not per waiting sequence)
        if running and len(self.waiting) < running // 4 and self.held < ADMIT_WITHIN_STEPS:
            self.held += 1
            return
        self.held = 0
        batch: list[Sequence] = []
        width = self.mask.shape[1]
        while self.waiting and running + len(batch) < self.max_sequences:
            seq = self.waiting[0]
            width = max(width, len(seq.prompt) + seq.params.max_tokens)
            if (running + len(batch) + 1) * width > self.max_tokens and (running or batch):
                break  # back-pressure: the cache would outgrow its token budget
            batch.append(self.waiting.popleft())
        if batch:
            self._prefill(batch, [s.prompt for s in batch])

    def _prefill(self, seqs: list[Sequence], token_lists: list[list[int]]) -> None:
        """Admit `seqs`, whose caches hold `token_lists` once prefilled: those that continue a cached
        prefix feed only the tokens after it, the others their whole lists."""
        start, fed = time.perf_counter(), self.tokens_prefilled
        # (a cached turn's next positions are its length: not so for rows with images, which prefill anew)
        hits = [self.prefixes.take(t) if s.params.cache_prefix and not s.images else None
                for s, t in zip(seqs, token_lists)]
        fresh = [i for i, hit in enumerate(hits) if hit is None]
        cached = [i for i, hit in enumerate(hits) if hit is not None]
        if fresh:
            with routing.record(self.routers) as calls:
                prefilled = self._run_fresh([token_lists[i] for i in fresh], [seqs[i].images for i in fresh])
            self._note_prompt_routes(calls, [seqs[i] for i in fresh], [token_lists[i] for i in fresh])
            self._join([seqs[i] for i in fresh], *prefilled)
        if cached:
            self._join([seqs[i] for i in cached],
                       *self._run_cached([token_lists[i] for i in cached], [hits[i] for i in cached]))
        self.prefill_fit.add(self.tokens_prefilled - fed, time.perf_counter() - start)

    def _run_fresh(self, token_lists: list[list[int]], images: list[tuple] | None = None):
        """Each distinct token list (with its images) once, left-padded, its KV rows given to every
        sequence that has it: (layers, mask, next-token logits, next positions), a row per list."""
        keys = [(tuple(t), tuple(p.digest for p in pictures))
                for t, pictures in zip(token_lists, images or [()] * len(token_lists))]
        distinct = list(dict.fromkeys(keys))
        index = {key: i for i, key in enumerate(distinct)}
        width = max(len(t) for t, _ in distinct)
        ids = torch.full((len(distinct), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(distinct), width), dtype=torch.long)
        for row, (toks, _) in enumerate(distinct):
            ids[row, width - len(toks):] = torch.tensor(toks)
            mask[row, width - len(toks):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)  # (built here, moved once)
        self.tokens_prefilled += sum(len(t) for t, _ in distinct)
        if any(digests for _, digests in distinct):  # M-RoPE: 3-D positions, image features as embeddings
            pictures_of = dict(zip(keys, images))
            given = vision.inputs(self.model, ids, mask, [pictures_of[key] for key in distinct])
            positions = given["position_ids"].amax(0)  # (decoding goes on from the largest: text's)
        else:
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            given = {"input_ids": ids, "position_ids": positions}
        out = self.model(attention_mask=mask, use_cache=True, **given, **self.last_logits)
        rows = torch.tensor([index[key] for key in keys], dtype=torch.long, device=self.device)
        layers, mask = kv.select(kv.tensors(out[self.cache_arg]), mask, rows)
        return layers, mask, out.logits[:, -1][rows], positions[:, -1][rows] + 1

    def _note_prompt_routes(self, calls: list, seqs: list[Sequence], token_lists: list[list[int]]) -> None:
        """Each sequence's routes start over with its prefill's ([pads, tokens] rows, a row per distinct
        list, as _run_fresh feeds them). A dense model records nothing."""
        if not calls:
            return
        distinct = list(dict.fromkeys(map(tuple, token_lists)))
        width = max(map(len, distinct))
        per_list = routing.per_row(calls, len(distinct), width)
        index = {t: i for i, t in enumerate(distinct)}
        for seq, toks in zip(seqs, token_lists):
            seq.sample.routes = [per_list[index[tuple(toks)]][width - len(toks):]]

    def _run_cached(self, token_lists: list[list[int]], hits: list[tuple[int, list]]):
        """Each list's tokens after its cached prefix, attending to the prefix's keys and values (both
        left-padded: [pads, prefix, pads, new tokens], the pads masked)."""
        past = max(n for n, _ in hits)
        new = [t[n:] for t, (n, _) in zip(token_lists, hits)]
        width = max(map(len, new))
        layers = [(torch.cat([kv.left_pad(h[1][i][0], past) for h in hits]),
                   torch.cat([kv.left_pad(h[1][i][1], past) for h in hits])) for i in range(len(hits[0][1]))]
        ids = torch.full((len(new), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(new), past + width), dtype=torch.long)
        for row, ((n, _), toks) in enumerate(zip(hits, new)):
            ids[row, width - len(toks):] = torch.tensor(toks)
            mask[row, past - n:past] = 1
            mask[row, past + width - len(toks):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        starts = torch.tensor([n for n, _ in hits], device=self.device)
        positions = starts[:, None] + (mask[:, past:].cumsum(-1) - 1).clamp(min=0)
        self.tokens_prefilled += sum(map(len, new))
        self.tokens_reused += sum(n for n, _ in hits)
        cache = {self.cache_arg: kv.build(layers, self.model.config, spare=None)}
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **cache,
                         **self.last_logits)
        return kv.tensors(out[self.cache_arg]), mask, out.logits[:, -1], positions[:, -1] + 1

    def _join(self, seqs: list[Sequence], layers: list, mask: torch.Tensor, logits: torch.Tensor,
              positions: torch.Tensor) -> None:
        """Prefilled rows into the running batch."""
        temps = torch.tensor([s.params.temperature for s in seqs], device=self.device)
        top_ps = torch.tensor([s.params.top_p for s in seqs], device=self.device)
        if None in self.rows:  # the cache is copied here anyway: leave the finished rows out
            self._compact()
        if self.rows:
            layers, mask = kv.concat(kv.tensors(self.cache), self.mask, layers, mask)
            logits, positions = torch.cat([self.logits, logits]), torch.cat([self.positions, positions])
            temps, top_ps = torch.cat([self.temps, temps]), torch.cat([self.top_ps, top_ps])
        self.rows = self.rows + seqs
        self.cache = kv.build(layers, self.model.config)
        self.mask, self.logits, self.positions = mask, logits, positions
        self.temps, self.top_ps = temps, top_ps
        self.logit_versions = self.logit_versions + [self.version] * len(seqs)

    # --- weights and admin -------------------------------------------------------------------
    @torch.inference_mode()
    def reload(self, state: dict[str, torch.Tensor] | None, version: int, policy: str = "interrupt") -> None:
        """New weights at a token boundary (`state`, or None when the caller already wrote them
        into the model). interrupt: running rows go on under them (their caches recomputed, so
        later logprobs are exactly the new version's); keep: they go on with their caches as they
        are (no recompute, which costs a prefill of every running row; a later token's logprob is
        that of the mixed cache + new weights it was sampled from, so it stays exact for the
        trainer's importance ratio); abort: running rows start over from their prompts. (A
        "finish" update is the caller's: stop admitting, drain, then reload.)"""
        if state is not None:
            self.model.load_state_dict(state, strict=False)
        self.version = version
        if policy != "keep":  # (cached turns were computed under the old weights)
            self.prefixes.clear()
        running = self.running
        if not running or policy == "keep":
            return
        if policy == "abort":
            for seq in running:
                self.tokens_discarded += len(seq.sample.token_ids)
                seq.sample = Sample()
        self._clear()
        self._prefill(running, [s.tokens for s in running])

    def cancel(self, seqs: list[Sequence]) -> int:
        """Drop sequences whose request was abandoned (the client went away): out of the waiting
        list at once, their running rows freed like finished ones (compacted away on a later
        step). Returns how many were still running or waiting."""
        gone = {id(s) for s in seqs}
        before = len(self.waiting)
        self.waiting = deque(s for s in self.waiting if id(s) not in gone)
        dropped = before - len(self.waiting)
        for row, seq in enumerate(self.rows):
            if seq is not None and id(seq) in gone:
                self.tokens_discarded += len(seq.sample.token_ids)
                self.rows[row] = None
                dropped += 1
        if self.rows and not self.running:
            self._clear()
        return dropped

    def abort_all(self, error: str | None = None) -> int:
        """Finish every running and waiting sequence now with finish_reason "abort" (and `error`, when
        a failed step is the reason)."""
        seqs = self.running + list(self.waiting)
        self.waiting.clear()
        self._clear()
        for seq in seqs:
            seq.sample.error = error
            self._finish(seq, "abort")
        return len(seqs)
