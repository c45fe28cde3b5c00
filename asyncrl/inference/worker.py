"""The thread that owns the engine: HTTP handlers hand it commands, it answers through futures.

Commands (generate, score, cancel, update, hash, pause, resume, abort) queue up and are applied between
engine steps, so nothing the event loop does ever touches the engine mid-step.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import time

import torch

from asyncrl.inference import scoring
from asyncrl.inference.engine import Engine, SamplingParams, Sequence
from asyncrl.observe.profile import Phases
from asyncrl.policy import lora
from asyncrl.transports import weights

log = logging.getLogger("asyncrl.inference")

UPDATE_POLICIES = ("interrupt", "keep", "abort", "finish")


class Worker:
    """The thread that owns the engine: applies commands between steps, steps while there is work.

    Commands arrive on a queue from the HTTP handlers and are answered through futures on the
    event loop. A "finish" weight update stops admission, lets the running rows finish, then
    loads; "interrupt" and "abort" load at the next token boundary.
    """

    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop, update_policy: str, heartbeat=None,
                 adapters: lora.Merged | None = None):
        """`adapters` (trainer.lora): versions are adapters, merged into a copy of the base weights."""
        self.engine, self.loop, self.update_policy = engine, loop, update_policy
        self.adapters = adapters
        self.heartbeat = heartbeat  # beaten by the engine thread: a stuck engine stops it
        self.commands: queue.Queue = queue.Queue()
        self.paused = False
        self.pending_update: tuple | None = None  # (load, future) waiting for the running rows to drain
        self.queued_sequences = 0  # sequences of generate commands not yet handed to the engine
        self.queued_lock = threading.Lock()  # the event loop adds, the engine thread subtracts
        self.requests: dict[asyncio.Future, list[Sequence]] = {}  # requests being served (engine thread)
        # generate, score, load_weights, recompute_kv (engine thread), respond (event loop)
        self.phases = Phases()
        self.started = time.monotonic()
        threading.Thread(target=self._run, daemon=True, name="engine").start()

    # called on the event loop
    def call(self, name: str, *args) -> asyncio.Future:
        future = self.loop.create_future()
        if name == "generate":
            with self.queued_lock:
                self.queued_sequences += len(args[0])
        self.commands.put((name, args, future))
        return future

    def waiting(self) -> int:
        """Sequences not yet running: queued commands plus the engine's waiting list."""
        return len(self.engine.waiting) + self.queued_sequences

    # the engine thread
    def _run(self) -> None:
        while True:
            if self.heartbeat is not None:
                self.heartbeat.beat()
            idle = self.paused or not self.engine.has_work()
            self._apply_commands(block=idle and self.pending_update is None)
            if self.pending_update and not self.engine.running:
                load, future = self.pending_update
                self.pending_update = None
                self.engine.admitting = True
                try:
                    self._resolve(future, load())
                except Exception as e:
                    self._resolve(future, exc=e)
            if not self.paused and self.engine.has_work():
                try:
                    with self.phases("generate"):
                        self.engine.step()
                except Exception as e:  # fail the requests in flight, keep serving
                    error = f"engine step failed: {type(e).__name__}: {e}"
                    log.error(f"inference: {error}")
                    self.engine.abort_all(error)

    def _apply_commands(self, block: bool) -> None:
        while True:
            try:
                name, args, future = self.commands.get(block=block, timeout=1.0)  # wake to beat
            except queue.Empty:
                return
            block = False
            try:
                getattr(self, f"_cmd_{name}")(future, *args)
            except Exception as e:
                self._resolve(future, exc=e)

    def _resolve(self, future: asyncio.Future, value=None, exc: Exception | None = None) -> None:
        def settle():
            if not future.done():
                future.set_exception(exc) if exc is not None else future.set_result(value)
        self.loop.call_soon_threadsafe(settle)

    def _cmd_generate(self, future, prompts: list[list[int]], params: SamplingParams, on_group=None,
                      n: int = 1, images: list[tuple] | None = None) -> None:
        """`on_group(i, samples)`, called on the event loop, hears of each group of `n` sequences (prompt i's,
        `prompts` holding each prompt n times) as soon as its last one finishes; `future` of them all.
        `images`: each prompt's Pictures (a vision-language policy's)."""
        left, group_left = [len(prompts)], [n] * (len(prompts) // n)
        seqs: list[Sequence] = []

        def done(i: int, _seq: Sequence) -> None:
            if on_group is not None:
                group_left[i] -= 1
                if group_left[i] == 0:
                    self.loop.call_soon_threadsafe(on_group, i, [s.sample for s in seqs[i * n:(i + 1) * n]])
            left[0] -= 1
            if left[0] == 0:
                self.requests.pop(future, None)
                self._resolve(future, [s.sample for s in seqs])

        seqs.extend(Sequence(p, params, functools.partial(done, k // n), images=images[k] if images else ())
                    for k, p in enumerate(prompts))
        self.requests[future] = seqs
        self.engine.add(seqs)
        with self.queued_lock:
            self.queued_sequences -= len(prompts)

    def _cmd_score(self, future, seqs: list[list[int]], starts: list[int], top_k: int) -> None:
        """Prefill-only logprobs of given tokens (asyncrl/inference/scoring.py), between decoding steps."""
        with self.phases("score"):
            self._resolve(future, scoring.score(self.engine.model, self.engine.pad_id, seqs, starts, top_k))

    def _cmd_update(self, future, body: dict) -> None:
        policy = body.get("policy") or self.update_policy

        def load() -> dict:  # runs at the token boundary where the new weights take over
            with self.phases("load_weights"):
                how = self._write_weights(body)
            with self.phases("recompute_kv"):  # model compute: the running rows' caches under the new weights
                self.engine.reload(None, body["version"], policy)
            return {"version": body["version"], "loaded_from": how}

        if policy == "finish" and self.engine.running:
            self.engine.admitting = False
            self.pending_update = (load, future)
        else:
            self._resolve(future, load())

    def _write_weights(self, body: dict) -> str:
        """Apply the patch if it fits the weights held now and reproduces the trainer's hash;
        otherwise load the full file. Returns which one was used."""
        model = self.engine.model
        expected = body.get("hash")
        if self.adapters is not None:
            saved = weights.load(body["path"])
            if expected is not None and weights.state_hash(saved) != expected:
                raise ValueError(f"adapters of version {body['version']} from {body['path']} do not "
                                 "match the trainer's hash")
            self.adapters.apply(saved, body["path"])  # (checks every name and shape before writing one)
            return "adapters"
        with torch.no_grad():
            if body.get("patch") and body.get("base_version") == self.engine.version:
                live = weights.model_state(model)
                weights.apply_patch(live, weights.load(body["patch"]))
                if expected is None or weights.state_hash(live) == expected:
                    return "patch"
                log.warning(f"inference: patch for version {body['version']} gave the wrong hash; "
                            "loading the full weights")
            full = weights.load(body["path"])
            expected_names, given = set(weights.model_state(model)), set(full)
            if expected_names != given:  # (strict=False below would load a partial file silently)
                missing, extra = sorted(expected_names - given), sorted(given - expected_names)
                raise ValueError(f"{body['path']} does not hold this model's weights: {len(missing)} tensors "
                                 f"missing {missing[:3]}, {len(extra)} unknown {extra[:3]}")
            model.load_state_dict(full, strict=False)  # (tied tensors are published once)
        if expected is not None and weights.state_hash(weights.model_state(model)) != expected:
            raise ValueError(
                f"weights of version {body['version']} from {body['path']} do not match the trainer's hash"
            )
        return "full"

    def _cmd_hash(self, future) -> None:
        held = self.adapters.held if self.adapters is not None and self.adapters.held else None
        state = held or weights.model_state(self.engine.model)  # (a version's hash is its adapters')
        self._resolve(future, {"version": self.engine.version, "hash": weights.state_hash(state)})

    def _cmd_pause(self, future) -> None:
        self.paused = True
        self._resolve(future, {"paused": True})

    def _cmd_resume(self, future) -> None:
        self.paused = False
        self._resolve(future, {"paused": False})

    def _cmd_cancel(self, future, request: asyncio.Future) -> None:
        seqs = self.requests.pop(request, None)
        self._resolve(future, {"cancelled": self.engine.cancel(seqs) if seqs else 0})

    def _cmd_abort(self, future) -> None:
        self._resolve(future, {"aborted": self.engine.abort_all()})
