"""One group: G samples of one prompt, scored by the task's verifier, with group advantages."""
from __future__ import annotations

import asyncio
import time

from asyncrl.inference.client import InferenceClient
from asyncrl.rewards.tasks import TaskSource
from asyncrl.trajectory import Trajectory


async def score(tasks: TaskSource, text: str, entry: dict, timeout: float) -> tuple[float | None, str | None]:
    """(reward, None) or (None, error message): a verifier that raises or hangs fails one sample."""
    try:
        reward = await asyncio.wait_for(asyncio.to_thread(tasks.score, text, entry), timeout)
    except asyncio.TimeoutError:
        return None, f"verifier took over {timeout:.0f}s (timeouts.verifier)"
    except Exception as e:  # a user's verifier may raise anything
        return None, f"verifier raised {type(e).__name__}: {e}"
    if reward != reward:  # NaN
        return None, "verifier returned NaN"
    return reward, None


async def rollout_group(client: InferenceClient, tasks: TaskSource, tokenizer, index: int, cfg) -> tuple[list[Trajectory], list[dict]]:
    """(scored trajectories, events for samples that could not be scored); advantages are the caller's."""
    ro = cfg.rollout
    entry = tasks.item(index)
    prompt = tokenizer(tasks.prompt(entry))["input_ids"]
    started = time.monotonic()
    choices = await client.complete([prompt], ro.group_size, ro.max_tokens, ro.temperature, ro.top_p)
    generated = time.monotonic()
    scored, events = [], []
    for k, choice in enumerate(choices):
        if choice["finish_reason"] == "abort":  # cut short by /abort: not a sample of the policy
            events.append({"event": "sample_dropped", "reason": "aborted", "prompt_id": index, "sample": k})
            continue
        reward, error = await score(tasks, choice["text"], entry, cfg.timeouts.verifier)
        if error is not None:
            events.append({"event": "sample_dropped", "reason": "verifier_error", "error": error,
                           "prompt_id": index, "sample": k, "completion": choice["text"]})
            continue
        completion = choice["token_ids"]
        scored.append(Trajectory(
            id=f"{index}-{k}", group_id=str(index), task=cfg.task.name, prompt_id=index,
            tokens=prompt + completion,
            loss_mask=[0] * len(prompt) + [1] * len(completion),
            logprobs=[0.0] * len(prompt) + choice["logprobs"]["token_logprobs"],
            versions=[-1] * len(prompt) + choice["versions"],
            reward=reward,
            info={"finish_reason": choice["finish_reason"], "completion": choice["text"],
                  "answer": entry["answer"], "generate_seconds": generated - started},
        ))
    return scored, events
