"""The orchestrator role: the single controller of a run.

Three loops share one asyncio event loop:
  admit    starts groups (G samples of one prompt) while the staleness gate allows;
  assemble packs batch k from finished groups, drops those too stale, writes it for the trainer;
  follow   waits for each new version from the trainer, has the inference server load it,
           records the step's metrics, and runs the held-out evaluation every few versions.

Run as `python -m asyncrl.orchestrator.main RUN_DIR`.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

from asyncrl import weights
from asyncrl.config import Config, read_run_config
from asyncrl.inference.client import InferenceClient
from asyncrl.orchestrator.advantages import advantage_fn
from asyncrl.orchestrator.rollout import rollout_group
from asyncrl.orchestrator.staleness import StalenessGate
from asyncrl.rewards.tasks import TaskSource
from asyncrl.trajectory import Trajectory, write_batch


class JsonlLog:
    def __init__(self, path: Path):
        self.file = open(path, "a")

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()


class Orchestrator:
    def __init__(self, cfg: Config, run_dir: Path, client: InferenceClient, tokenizer):
        self.cfg, self.run_dir, self.client, self.tokenizer = cfg, run_dir, client, tokenizer
        self.tasks = TaskSource(cfg.task)
        self.eval_tasks = TaskSource(cfg.task, seed=cfg.task.eval_seed)
        self.advantages = advantage_fn(cfg.rollout.advantage, cfg.rollout.baseline_decay)
        self.gate = StalenessGate(cfg.rollout.prompts_per_step, cfg.rollout.max_staleness)
        self.changed = asyncio.Condition()  # signalled when a group finishes or a version is served
        self.served_version = 0
        self.cursor = 0  # next dataset index
        self.ready: list[list[Trajectory]] = []
        self.failure: Exception | None = None  # first rollout error; ends the run
        self.assembled = False  # every batch has been handed to the trainer
        self.in_flight: set[asyncio.Task] = set()
        self.batch_stats: dict[int, dict] = {}
        self.metrics = JsonlLog(run_dir / "metrics.jsonl")
        self.events = JsonlLog(run_dir / "events.jsonl")
        self.start = time.monotonic()
        self.last_gen = (self.start, 0)

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def _wait_for(self, predicate, deadline: float, what: str) -> None:
        """Wait until `predicate()` holds; a failed rollout or the deadline ends the wait with an error."""
        try:
            async with self.changed:
                await asyncio.wait_for(self.changed.wait_for(lambda: self.failure or predicate()), deadline)
        except asyncio.TimeoutError:
            raise TimeoutError(f"orchestrator: waited {deadline:.0f}s for {what}") from None
        if self.failure:
            raise self.failure

    # --- admit --------------------------------------------------------------------------
    async def admit(self) -> None:
        limit = self.cfg.rollout.max_concurrent_groups
        needed = self.cfg.run.steps * self.cfg.rollout.prompts_per_step
        while True:
            await self._wait_for(
                lambda: self.assembled or (len(self.in_flight) < limit and self.gate.admitted < needed
                                           and self.gate.can_admit(self.served_version)),
                self.cfg.timeouts.train_step, "room to start a rollout (the trainer publishes versions)",
            )
            if self.assembled:
                return
            self.gate.admit()
            task = asyncio.create_task(self._run_group(self.cursor))
            self.cursor += 1
            self.in_flight.add(task)
            task.add_done_callback(self.in_flight.discard)

    async def _run_group(self, index: int) -> None:
        try:
            group, events = await rollout_group(self.client, self.tasks, self.tokenizer, index, self.cfg)
        except Exception as e:  # e.g. the inference server is gone: every waiting loop must hear of it
            self.failure = e
            await self._notify()
            return
        for e in events:
            self.events.write({**e, "time": time.monotonic() - self.start})
        if group:
            for traj, adv in zip(group, self.advantages([t.reward for t in group])):
                traj.advantages = [adv if m else 0.0 for m in traj.loss_mask]
            self.ready.append(group)
        else:
            self.gate.release()
        await self._notify()

    # --- assemble -----------------------------------------------------------------------
    async def assemble(self) -> None:
        per_step = self.cfg.rollout.prompts_per_step
        for step in range(self.cfg.run.steps):
            dropped = 0
            batch: list[list[Trajectory]] = []
            while len(batch) < per_step:
                await self._wait_for(lambda: bool(self.ready), self.cfg.timeouts.train_step,
                                     f"finished rollouts for batch {step}")
                self.ready.sort(key=lambda g: min(t.oldest_version for t in g))  # oldest first
                group = self.ready.pop(0)
                oldest = min(t.oldest_version for t in group)
                if self.gate.fresh_enough(oldest, step):
                    batch.append(group)
                    continue
                dropped += 1
                self.gate.release()
                self.events.write({"event": "group_dropped", "reason": "too_stale", "step": step,
                                   "prompt_id": group[0].prompt_id, "oldest_version": oldest})
                await self._notify()
            trajs = [t for g in batch for t in g]
            write_batch(self.run_dir, step, trajs)
            self.batch_stats[step] = self._batch_stats(step, trajs, dropped)
        self.assembled = True
        await self._notify()

    @staticmethod
    def _batch_stats(step: int, trajs: list[Trajectory], dropped: int) -> dict:
        rewards = [t.reward for t in trajs]
        stale = [t.staleness(step) for t in trajs]
        return {
            "reward": sum(rewards) / len(rewards),
            "accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),
            "samples": len(trajs),
            "staleness_hist": {str(s): stale.count(s) for s in sorted(set(stale))},
            "dropped_stale_groups": dropped,
            "completion_tokens": sum(sum(t.loss_mask) for t in trajs),
        }

    # --- follow -------------------------------------------------------------------------
    async def follow(self) -> None:
        evals = [asyncio.create_task(self.evaluate())]
        for version in range(1, self.cfg.run.steps + 1):
            marker = await self._wait_for_version(version)
            await self.client.update_weights(self._update_body(version, marker), self.cfg.timeouts.weight_load)
            self.served_version = version
            await self._notify()
            await self._record_step(version, marker)
            if version % self.cfg.task.eval_every == 0 or version == self.cfg.run.steps:
                evals.append(asyncio.create_task(self.evaluate()))
        await asyncio.gather(*evals)

    def _update_body(self, version: int, marker: dict) -> dict:
        body = {"path": str(weights.weights_file(self.run_dir, version)), "version": version,
                "hash": marker.get("serving_hash", marker["hash"])}
        patch = weights.patch_file(self.run_dir, version)
        if patch.exists():
            body.update(patch=str(patch), base_version=version - 1)
        return body

    async def _wait_for_version(self, version: int) -> dict:
        start = time.monotonic()
        while (marker := weights.read_marker(self.run_dir, version)) is None:
            if self.failure:
                raise self.failure
            if time.monotonic() - start > self.cfg.timeouts.train_step:
                raise TimeoutError(
                    f"orchestrator: the trainer did not publish version {version} (step {version - 1}) "
                    f"within {self.cfg.timeouts.train_step:.0f}s (timeouts.train_step)"
                )
            await asyncio.sleep(0.005)
        return marker

    async def _record_step(self, version: int, marker: dict) -> None:
        now = time.monotonic()
        stats = await self.client.stats()
        t_prev, tok_prev = self.last_gen
        self.last_gen = (now, stats["tokens_generated"])
        record = {
            "step": version - 1, "version": version, "time": now - self.start,
            **self.batch_stats.pop(version - 1, {}),
            "gen_tokens_per_s": (stats["tokens_generated"] - tok_prev) / max(now - t_prev, 1e-9),
            "inference_busy_seconds": stats["busy_seconds"],
            "tokens_discarded": stats.get("tokens_discarded", 0),
            "inference_idle_seconds": stats["uptime_seconds"] - stats["busy_seconds"],
            "trainer_busy_seconds": marker.pop("busy_seconds"),
            "trainer_idle_seconds": marker.pop("idle_seconds"),
            "orchestrator_cpu_seconds": time.process_time(),
            "in_flight_groups": len(self.in_flight), "ready_groups": len(self.ready),
            **{k: v for k, v in marker.items() if k not in ("step", "version", "hash", "serving_hash")},
        }
        self.metrics.write(record)

    async def evaluate(self) -> None:
        """Greedy accuracy on the fixed held-out set, under whatever version the server holds."""
        n = self.cfg.task.eval_size
        if n == 0:
            return
        entries = [self.eval_tasks.item(i) for i in range(n)]
        prompts = [self.tokenizer(self.eval_tasks.prompt(e))["input_ids"] for e in entries]
        choices = await self.client.complete(prompts, 1, self.cfg.rollout.max_tokens, temperature=0.0)
        correct = 0.0
        for choice, entry in zip(choices, entries):
            try:
                correct += self.eval_tasks.score(choice["text"], entry)
            except Exception:  # an unscorable answer counts as wrong
                pass
        version = min(min(c["versions"]) for c in choices)
        self.metrics.write({"eval_version": version, "eval_accuracy": correct / n,
                            "time": time.monotonic() - self.start})

    async def run(self) -> None:
        loops = [asyncio.create_task(self.admit()), asyncio.create_task(self.assemble())]
        try:
            follow = asyncio.create_task(self.follow())
            done, _ = await asyncio.wait([follow, *loops], return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()  # re-raise the first failure
            await follow
        finally:
            for task in [*loops, *self.in_flight]:
                task.cancel()


async def main(run_dir: Path) -> None:
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    cfg = read_run_config(run_dir)
    url = json.loads((run_dir / "inference.json").read_text())["url"]
    if cfg.inference.engine == "vllm":
        from asyncrl.inference.vllm_client import VLLMClient

        client = VLLMClient(url, cfg.timeouts.http, model=cfg.model.path)
    else:
        client = InferenceClient(url, cfg.timeouts.http)
    async with client:
        await client.wait_healthy(cfg.timeouts.startup)
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        await Orchestrator(cfg, run_dir, client, tokenizer).run()
    print("orchestrator: done", flush=True)


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1])))
