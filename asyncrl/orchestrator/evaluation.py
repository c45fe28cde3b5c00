"""The held-out evaluation: greedy answers (or greedy agent episodes) on a fixed set of items.

The set is built once: the first `task.eval_size` distinct prompts of the held-out side of the
task's split (asyncrl/rewards/tasks.py), which training and the warm start never draw. An item
counts as solved when its reward is 1; `eval_reward` is the mean reward, partial credit included.
"""
from __future__ import annotations

import asyncio

from asyncrl.orchestrator.rollout import all_or_none
from asyncrl.rewards.pool import VerifierError
from asyncrl.rewards.tasks import BadTaskRow, checked_prompt, eval_entries
from asyncrl.run.role import ContractError

EVAL_CHUNK = 64  # held-out prompts per request


class Evaluator:
    def __init__(self, cfg, tasks, tokenizer, router, verifiers, agents, images=None):
        """`router` (asyncrl/orchestrator/replicas.py) runs each request on a replica, riding out restarts.
        `images`: a vision-language policy's ImagePrompts (asyncrl/vision/prompts.py)."""
        self.cfg, self.tasks, self.tokenizer, self.images = cfg, tasks, tokenizer, images
        self.router, self.verifiers, self.agents = router, verifiers, agents
        self.items: tuple[list[dict], list[list[int]]] | None = None

    def item_set(self) -> tuple[list[dict], list[list[int]]]:
        """The held-out items and their prompt ids, built once: every evaluation uses the same."""
        if self.items is None:
            entries, prompts = [], []
            for entry in eval_entries(self.tasks, self.cfg.task.eval_size):
                try:
                    entry, prompt = checked_prompt(self.tasks, entry, self.tokenizer,
                                                   self.cfg.inference.max_prompt_tokens, images=self.images)
                except BadTaskRow:  # left out, as in training (the training side reports its rows)
                    continue
                entries.append(entry)
                prompts.append(prompt)
            self.items = entries, prompts
        return self.items

    def images_shown(self) -> set[str]:
        """The held-out set's images (kept in the run's image store for every evaluation)."""
        return {h for e in (self.items or ([], []))[0] for h in e.get("image_hashes", ())}

    async def run(self, served_version: int) -> dict:
        """One evaluation's record, under whatever version the server holds (the oldest that sampled)."""
        entries, prompts = self.item_set()
        agentic = [bool(self.agents and self.agents.agent_for(e)) for e in entries]
        parts = [(scorer, [i for i, a in enumerate(agentic) if a == wanted])
                 for scorer, wanted in ((self._completions, False), (self._episodes, True))]
        parts = [(scorer, rows) for scorer, rows in parts if rows]
        results = await asyncio.gather(*(scorer([entries[i] for i in rows], [prompts[i] for i in rows])
                                         for scorer, rows in parts))
        scores, versions = [0.0] * len(entries), []
        for (_, rows), (part_scores, part_versions) in zip(parts, results):
            for i, score in zip(rows, part_scores):
                scores[i] = score
            versions += part_versions
        n = max(len(entries), 1)
        record = {"eval_version": min(versions) if versions else served_version,
                  "eval_accuracy": sum(s >= 1.0 for s in scores) / n, "eval_reward": sum(scores) / n,
                  "eval_items": len(entries)}
        for tag in (m.tag for m in self.cfg.task.mix):  # per-task accuracy of a multi-task run
            mine = [s for s, e in zip(scores, entries) if e["task"] == tag]
            if mine:
                record[f"eval_accuracy/{tag}"] = sum(s >= 1.0 for s in mine) / len(mine)
        return record

    async def _completions(self, entries: list[dict], prompts: list[list[int]]):
        """(score per item, versions that sampled) of one greedy completion per item."""
        # in requests of EVAL_CHUNK prompts, all at once: the server batches them as one, and each
        # request is small enough to meet timeouts.http however large eval_size is
        starts = range(0, len(prompts), EVAL_CHUNK)
        shown = [e.get("image_hashes", []) for e in entries]
        reader = self.images.store.get if self.images else None
        max_tokens = self.cfg.rollout.max_tokens
        parts = await asyncio.gather(*(self.router.call(
            lambda client, i=i: client.complete(prompts[i:i + EVAL_CHUNK], 1, max_tokens, temperature=0.0,
                                                images=shown[i:i + EVAL_CHUNK], image_bytes=reader),
            "an evaluation", len(prompts[i:i + EVAL_CHUNK]), trusted=True) for i in starts))
        choices = [c for part in parts for c in part]
        results = await self.verifiers.score_many([(c["text"], e) for c, e in zip(choices, entries)],
                                                  self.cfg.timeouts.verifier)
        broken = next((r for r in results if isinstance(r, ContractError)), None)
        if broken:
            raise broken
        scores = [0.0 if isinstance(r, VerifierError) else r for r in results]  # unscorable: wrong
        return scores, [min(c["versions"]) for c in choices if c["versions"]]

    async def _episodes(self, entries: list[dict], prompts: list[list[int]]):
        """(reward per item, versions that sampled) of one greedy episode per item; a failed one scores 0."""
        outcomes = await all_or_none(self.router.call(
            lambda client, i=i, e=e: self.agents.episode(e, f"eval-{i}", client, priority=-1, greedy=True),
            "an evaluation", trusted=True) for i, e in enumerate(entries))
        versions = [o.episode.versions for o in outcomes]
        return ([o.reward if o.failure is None else 0.0 for o in outcomes],
                [min(v for v in vs if v >= 0) for vs in versions if any(v >= 0 for v in vs)])
