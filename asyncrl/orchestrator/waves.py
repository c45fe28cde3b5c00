"""A wave: the groups admission starts together, generated in one streamed request per part.

A request per group cost the orchestrator (aiohttp's client, the event loop) and the server (its
handler, a response) more CPU than all the rest of a group's bookkeeping. A wave asks for every
group in one request; the server streams each group back as soon as its G samples are done, so no
group waits for another of its wave (what continuous batching is for). The wave is cut into parts,
one per routed replica at least (the router sends each to the least loaded) and at most a training
batch of groups (and an engine batch) each. A replica that goes away mid-stream: the router asks
another for the groups not yet delivered.

A wave larger than a batch (the start of a run at η > 0: η + 1 batches at once) goes out a batch at a
time per replica: a part beyond the first on each replica is sent when the part before it there has
delivered all its groups. The oldest batch then has the engine to itself instead of sharing every
step with the four behind it, and the trainer starts sooner (η = 4, 30 uniform steps, three runs each:
the first batch written at 0.07-0.09 s instead of 0.18-0.41 s, version 10 at 1.48-1.57 s instead of
1.59-1.80 s; sending each part when the one before had delivered only its first group gave 0.20-0.24 s,
the joins slowing the first batch's last groups). Long-tailed answers lose nothing by it: 24 steps at
η = 4 in 6.8-7.7 s against 8.1-8.5 s.
"""
from __future__ import annotations

import asyncio
import math
import time

from asyncrl.inference.client import InferenceError


def start(router, wave: list[tuple[int, list[int]]], cfg, running: set, images: dict | None = None,
          image_bytes=None) -> dict[int, asyncio.Future]:
    """Start generating these (index, prompt ids) groups; each group's future gets (choices, seconds) or
    the error that ended its request. The requests' tasks are in `running` while they run. `images`: the
    prompts' image hashes by index (a vision-language policy's), `image_bytes(hash)` reads one."""
    futures = {index: asyncio.get_running_loop().create_future() for index, _ in wave}
    sent: list[asyncio.Task] = []
    for part, before in schedule(wave, len(router.routed()), cfg):
        after = sent[before] if before is not None else None
        mine = {i: futures[i] for i, _ in part}
        sent.append(asyncio.create_task(generate(router, dict(part), mine, cfg, after, images, image_bytes)))
        running.add(sent[-1])
        sent[-1].add_done_callback(running.discard)
    return futures


def schedule(wave: list, replicas: int, cfg) -> list[tuple[list, int | None]]:
    """The wave's parts in sending order, each with the index of the part it is sent after (None: at
    once): the one before it on the same replica."""
    replicas = max(replicas, 1)
    most = min(cfg.inference.max_batch_sequences // cfg.rollout.group_size, cfg.rollout.prompts_per_step)
    return [(part, j - replicas if j >= replicas else None)
            for j, part in enumerate(parts(wave, replicas, most))]


def parts(wave: list, replicas: int, most: int) -> list[list]:
    """`wave` cut into contiguous parts: at least one per replica, at most `most` groups each."""
    k = min(len(wave), max(replicas, math.ceil(len(wave) / max(most, 1)), 1))
    return [wave[len(wave) * i // k: len(wave) * (i + 1) // k] for i in range(k)]


async def generate(router, prompts: dict[int, list[int]], delivered: dict[int, asyncio.Future], cfg,
                   after: asyncio.Task | None = None, images: dict | None = None, image_bytes=None) -> None:
    """G samples of each prompt (by index) in one streamed request, sent once `after` (the part before
    it) has ended; delivered[index] gets the group's (choices, seconds since the request) when it
    arrives, or the error that ended the wave."""
    if after is not None:
        await asyncio.wait([after])  # (its failure is its own groups')
    ro, started = cfg.rollout, time.monotonic()

    async def work(client) -> None:
        asked = [index for index in prompts if not delivered[index].done()]

        def arrived(k: int, choices: list[dict]) -> None:
            if not 0 <= k < len(asked) or len(choices) != ro.group_size:
                raise InferenceError(f"inference server {client.url} answered prompt {k} of {len(asked)} "
                                     f"with {len(choices)} choices (asked for {ro.group_size})")
            if not delivered[asked[k]].done():
                delivered[asked[k]].set_result((choices, time.monotonic() - started))

        await client.complete_groups([prompts[i] for i in asked], ro.group_size, ro.max_tokens,
                                     ro.temperature, ro.top_p, arrived,
                                     [images.get(i) or [] for i in asked] if images else None, image_bytes)
        if missing := [index for index in asked if not delivered[index].done()]:
            raise InferenceError(f"inference server {client.url} ended its stream without prompts {missing}")

    try:
        shows = bool(images and any(images.get(i) for i in prompts))  # (joined workers take text: swarm/)
        await router.call(work, f"prompts {min(prompts)}..{max(prompts)}", ro.group_size * len(prompts),
                          trusted=shows)
    except Exception as e:  # (each group's task hears of it, and fails the run as a group does)
        for future in delivered.values():
            if not future.done():
                future.set_exception(e)
