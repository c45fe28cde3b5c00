"""A wave: the groups admission starts together, generated in one streamed request per part.

A request per group cost the orchestrator (aiohttp's client, the event loop) and the server (its
handler, a response) more CPU than all the rest of a group's bookkeeping. A wave asks for every
group in one request; the server streams each group back as soon as its G samples are done, so no
group waits for another of its wave (what continuous batching is for). The wave is cut into parts,
one per routed replica at least (the router sends each to the least loaded) and at most a training
batch of groups (and an engine batch) each. A replica that goes away mid-stream: the router asks
another for the groups not yet delivered.

A wave larger than a batch (the start of a run at η > 0: η + 1 batches at once) is staggered: a part
beyond the first on each replica goes out when the part before it on that replica has delivered its
first group. The oldest batch then has the engine to itself for its first steps instead of sharing
every decode step with the four behind it: at η = 4 its groups came 0.04 s after the request instead
of 0.15-0.4 s, and the trainer starts that much sooner; the engine is full again a few steps later.
"""
from __future__ import annotations

import asyncio
import math
import time

from asyncrl.inference.client import InferenceError


def start(router, wave: list[tuple[int, list[int]]], cfg, running: set) -> dict[int, asyncio.Future]:
    """Start generating these (index, prompt ids) groups; each group's future gets (choices, seconds) or
    the error that ended its request. The requests' tasks are in `running` while they run."""
    futures = {index: asyncio.get_running_loop().create_future() for index, _ in wave}
    replicas = max(len(router.routed()), 1)
    most = min(cfg.inference.max_batch_sequences // cfg.rollout.group_size, cfg.rollout.prompts_per_step)
    begun: list[asyncio.Event] = []  # per part: it has delivered a group (or ended)
    for j, part in enumerate(parts(wave, replicas, most)):
        begun.append(asyncio.Event())
        after = begun[j - replicas] if j >= replicas else None
        task = asyncio.create_task(
            generate(router, dict(part), {i: futures[i] for i, _ in part}, cfg, after, begun[j]))
        running.add(task)
        task.add_done_callback(running.discard)
    return futures


def parts(wave: list, replicas: int, most: int) -> list[list]:
    """`wave` cut into contiguous parts: at least one per replica, at most `most` groups each."""
    k = min(len(wave), max(replicas, math.ceil(len(wave) / max(most, 1)), 1))
    return [wave[len(wave) * i // k: len(wave) * (i + 1) // k] for i in range(k)]


async def generate(router, prompts: dict[int, list[int]], delivered: dict[int, asyncio.Future], cfg,
                   after: asyncio.Event | None = None, begun: asyncio.Event | None = None) -> None:
    """G samples of each prompt (by index) in one streamed request, sent once `after` is set; delivered[index]
    gets the group's (choices, seconds since the request) when it arrives, or the error that ended the
    wave; `begun` is set at the first group delivered (or the end)."""
    try:
        if after is not None:
            await after.wait()
        await _generate(router, prompts, delivered, cfg, begun or asyncio.Event())
    finally:
        if begun is not None:
            begun.set()


async def _generate(router, prompts: dict[int, list[int]], delivered: dict[int, asyncio.Future], cfg,
                    begun: asyncio.Event) -> None:
    ro, started = cfg.rollout, time.monotonic()

    async def work(client) -> None:
        asked = [index for index in prompts if not delivered[index].done()]

        def arrived(k: int, choices: list[dict]) -> None:
            if not 0 <= k < len(asked) or len(choices) != ro.group_size:
                raise InferenceError(f"inference server {client.url} answered prompt {k} of {len(asked)} "
                                     f"with {len(choices)} choices (asked for {ro.group_size})")
            if not delivered[asked[k]].done():
                delivered[asked[k]].set_result((choices, time.monotonic() - started))
            begun.set()

        await client.complete_groups([prompts[i] for i in asked], ro.group_size, ro.max_tokens,
                                     ro.temperature, ro.top_p, arrived)
        if missing := [index for index in asked if not delivered[index].done()]:
            raise InferenceError(f"inference server {client.url} ended its stream without prompts {missing}")

    try:
        await router.call(work, f"prompts {min(prompts)}..{max(prompts)}", ro.group_size * len(prompts))
    except Exception as e:  # (each group's task hears of it, and fails the run as a group does)
        for future in delivered.values():
            if not future.done():
                future.set_exception(e)
