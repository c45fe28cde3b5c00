"""One group: G samples of one prompt, scored by the task's verifier."""
from __future__ import annotations

import asyncio
import math

from asyncrl.rewards.pool import VerifierError, VerifierPool
from asyncrl.run.role import ContractError
from asyncrl.trajectory import Trajectory


def checked(reward) -> tuple[float | None, str | None]:
    """(reward, None) or (None, error message): a verifier that raised, hung or returned NaN fails one
    sample; one that broke its contract (returned a string) stops the run."""
    if isinstance(reward, ContractError):
        raise reward
    if isinstance(reward, VerifierError):
        return None, str(reward)
    if not math.isfinite(reward):
        return None, f"verifier returned {reward!r}, not a finite number"
    return float(reward), None


async def score_group(verifiers: VerifierPool, entry: dict, prompt: list[int], index: int,
                      choices: list[dict], seconds: float, cfg) -> tuple[list[Trajectory], list[dict]]:
    """A group's G choices from the inference server (`seconds` after its request went out), scored by the
    task's verifier: (trajectories, one record per sample that cannot be trained on); advantages are the
    caller's."""
    ro = cfg.rollout
    scores = iter(map(checked, await verifiers.score_many(
        [(c["text"], entry) for c in choices if c["finish_reason"] != "abort"], cfg.timeouts.verifier)))
    scored, dropped = [], []
    for k, choice in enumerate(choices):
        sample_id = f"{index}-{k}"
        if choice["finish_reason"] == "abort":  # cut short by /abort or a failed step: not a sample
            why = "refused" if choice.get("refused") else "aborted"  # (refused: a joined worker's, swarm/)
            dropped.append({"id": sample_id, "reason": why, "prompt_id": index,
                            "error": choice.get("error") or "aborted by the inference server (/abort)"})
            continue
        reward, error = next(scores)
        if error is not None:
            dropped.append({"id": sample_id, "reason": "verifier_error", "error": error, "prompt_id": index,
                            "completion": choice["text"]})
            continue
        completion = choice["token_ids"]
        scored.append(Trajectory(
            id=sample_id, group_id=str(index), task=cfg.task.name, prompt_id=index,
            tokens=prompt + completion,
            loss_mask=[0] * len(prompt) + [1] * len(completion),
            logprobs=[0.0] * len(prompt) + choice["logprobs"]["token_logprobs"],
            versions=[-1] * len(prompt) + choice["versions"],
            routing=choice.get("routing"),
            images=entry.get("image_hashes") or None,
            reward=reward,
            info={"finish_reason": choice["finish_reason"], "completion": choice["text"],
                  "answer": entry["answer"], "generate_seconds": seconds,
                  "temperature": ro.temperature,
                  **{k: choice[k] for k in ("worker", "check") if k in choice}},
        ))
    return scored, dropped


async def all_or_none(coros) -> list:
    """Results of all; on the first error the others are cancelled (a retried group starts clean)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def rollout_agent_group(agents, client, entry: dict, index: int, cfg
                              ) -> tuple[list[Trajectory], list[dict]]:
    """G agent episodes of one task on one server (`client`), like score_group; a failed episode drops
    only itself."""
    outcomes = await all_or_none(agents.episode(entry, f"{index}-{k}", client, priority=index)
                                  for k in range(cfg.rollout.group_size))
    scored, dropped = [], []
    for k, out in enumerate(outcomes):
        sample_id, ep = f"{index}-{k}", out.episode
        if out.failure:
            dropped.append({"id": sample_id, "reason": out.failure, "error": out.error, "prompt_id": index,
                            "completion": ep.final_text})
            continue
        scored.append(
            Trajectory(
                id=sample_id,
                group_id=str(index),
                task=entry.get("task", cfg.task.name),
                prompt_id=index,
                tokens=ep.tokens,
                loss_mask=ep.loss_mask,
                logprobs=ep.logprobs,
                versions=ep.versions,
                routing=ep.routing,
                images=ep.images or None,
                reward=out.reward,
                info={
                    "finish_reason": ep.finish_reason,
                    "temperature": cfg.rollout.temperature,
                    "completion": ep.final_text,
                    "answer": entry.get("answer"),
                    "turns": ep.turns,
                    "turn_rewards": ep.turn_rewards,
                    "truncated": ep.truncated,
                    "tool_calls": len(ep.tool_calls),
                    "tool_errors": sum(c["error"] is not None for c in ep.tool_calls),
                    "tool_seconds": round(sum(c["seconds"] for c in ep.tool_calls), 4),
                    "generate_seconds": out.seconds,
                    **({"hints": ep.hints} if ep.hints else {}),
                },
            )
        )
    return scored, dropped
