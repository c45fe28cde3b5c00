"""The orchestrator role: the single controller of a run, and the ledger's only writer.

Three loops share one asyncio event loop:
  admit    starts groups (G samples of one prompt) while the staleness gate allows;
  assemble packs batch k from finished groups, drops those too stale, writes it for the trainer;
  follow   waits for each new version from the trainer, has the inference server load it,
           records the step's metrics, commits the batches a durable checkpoint contains, and
           runs the held-out evaluation every few versions.

Every state change goes to the ledger first (asyncrl/store/ledger.py), so a restarted orchestrator
rebuilds everything from it: prompts whose generation was lost are issued again, finished groups
go back to the ready pool, the gate and the cursor are recounted. If the inference server goes
away mid-run, the orchestrator waits for it to come back, has it load the served version again
and retries what was lost.

Run as `python -m asyncrl.orchestrator RUN_DIR` (asyncrl/orchestrator/__main__.py).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

from asyncrl.agents.proxy import start_proxy
from asyncrl.agents.runner import AgentRunner
from asyncrl.config import Config, read_run_config
from asyncrl.control import api as control
from asyncrl.control import pausing
from asyncrl.control.access import read_token
from asyncrl.control.live import actions_at, settings_at, with_settings
from asyncrl.files import apoll
from asyncrl.inference.client import InferenceUnavailable
from asyncrl.observe.events import EventLog
from asyncrl.observe.profile import Phases
from asyncrl.observe.sinks import Sinks
from asyncrl.orchestrator import staleness, waves, workers
from asyncrl.orchestrator.advantages import advantage_fn, normalize_per_task
from asyncrl.orchestrator.breaker import Breaker, RunCannotProgress
from asyncrl.orchestrator.collapse import CollapseWatch
from asyncrl.orchestrator.evaluation import Evaluator
from asyncrl.orchestrator.prompts import next_prompt, prune_images
from asyncrl.orchestrator.records import batch_stats, step_record
from asyncrl.orchestrator.replicas import ATTEMPTS, Router
from asyncrl.orchestrator.restore import restore
from asyncrl.orchestrator.rollout import rollout_agent_group, score_group
from asyncrl.orchestrator.staleness import StalenessGate
from asyncrl.orchestrator.teacher import Teacher
from asyncrl.rewards.pool import VerifierPool
from asyncrl.rewards.tasks import load_tasks
from asyncrl.run.heartbeat import Heartbeat
from asyncrl.store.ledger import Ledger
from asyncrl.trajectory import Trajectory, write_batch
from asyncrl.transports.trainer_link import trainer_link
from asyncrl.vision.prompts import image_prompts


class Orchestrator:
    def __init__(self, cfg: Config, run_dir: Path, router: Router, tokenizer, verifiers: VerifierPool, link):
        self.cfg, self.run_dir, self.router, self.tokenizer = cfg, run_dir, router, tokenizer
        self.base_cfg = cfg  # self.cfg is it with the live changes in force (asyncrl/control/live.py)
        self.link = link  # to the trainer: asyncrl/transports/trainer_link.py
        self.verifiers = verifiers
        self.tasks = load_tasks(cfg.task)
        self.advantages = advantage_fn(cfg.rollout.advantage, cfg.rollout.baseline_decay)
        self.gate = StalenessGate(cfg.rollout.prompts_per_step, cfg.rollout.max_staleness)
        self.changed = asyncio.Condition()  # signalled when a group finishes or a version is served
        self.failure: Exception | None = None  # first rollout or evaluation error; ends the role
        self.assembled = False  # every batch has been handed to the trainer
        self.in_flight, self.evals = set(), []  # rollout groups, evaluations (asyncio tasks)
        self.waves: set[asyncio.Task] = set()  # the requests generating the groups in flight
        self.in_flight_peak = 0  # the most groups generating at once since the last step record
        self.serve_seconds = 0.0  # from each version's marker to admission hearing it is served, all told
        self.phases = Phases()  # ledger and batch-file writes; the rest of its CPU is HTTP and bookkeeping
        self.ledger = Ledger(run_dir)
        self.events = EventLog(run_dir, "orchestrator")
        self.sinks = Sinks(cfg, run_dir, self.events)  # TensorBoard, W&B: the records metrics.jsonl gets
        self.heartbeat = Heartbeat(run_dir, "orchestrator")
        router.version = self.ledger.get("served_version", 0)
        self.breaker = Breaker(cfg.rollout.max_failed_samples, cfg.timeouts.no_accepted_sample)
        self.bad_rows: set[str] = set()  # reported once: a file read in epochs meets its bad rows again
        self.images = image_prompts(cfg.model.path, tokenizer, run_dir)  # a vision-language policy's
        self.agents = AgentRunner(cfg, tokenizer, verifiers, self.events, self.images) \
            if any(cfg.agent_paths().values()) else None
        self.showing: dict[int, list[str]] = {}  # the images of each group generating
        eval_tasks = load_tasks(cfg.task, held_out=True) if cfg.task.eval_size else None
        self.evaluator = (Evaluator(cfg, eval_tasks, tokenizer, self.router, verifiers, self.agents,
                                    self.images) if eval_tasks else None)
        self.teacher = Teacher(cfg, run_dir, tokenizer, self.events) if cfg.teacher.enabled else None
        self.collapse = CollapseWatch()  # entropy or held-out accuracy falling past a bound: said at once
        self.swarm = workers.swarm(self) if cfg.workers.enabled else None  # joined workers: asyncrl/swarm/
        restore(self)

    async def _connect_trainer(self) -> None:
        """The newest durable checkpoint commits its batches; the trainer gets each batch it may need."""
        self._commit(await self.link.checkpoints(verify=True))
        await self.link.start(self.committed_through)
        if self.cursor:
            self.events.write("orchestrator_resumed", served_version=self.router.version, cursor=self.cursor,
                              reissued=len(self.reissue), ready_groups=len(self.ready),
                              next_step=self.next_step, committed_through=self.committed_through)

    def _use_settings(self, settings: dict) -> None:
        """Live settings in force from here on: read where they are used, through self.cfg."""
        self.cfg = with_settings(self.base_cfg, settings)
        self.gate.max_staleness = self.cfg.rollout.max_staleness
        if self.evaluator:
            self.evaluator.cfg = self.cfg
        if self.agents:
            self.agents.cfg = self.cfg
            self.agents.limits.max_tokens_per_turn = self.cfg.rollout.max_tokens

    def _now(self) -> float:
        return time.time() - self.started_at

    def _write_metrics(self, record: dict) -> None:
        self.metrics.write(json.dumps(record) + "\n")
        self.metrics.flush()
        self.sinks.write(record)

    def _fail(self, error: Exception) -> None:
        """The role ends with the first failure (groups finishing meanwhile may fail too: a second error)."""
        self.failure = self.failure or error

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def _wait_for(self, predicate, deadline: float, what: str) -> None:
        """Wait until `predicate()` holds; a failed rollout or the deadline (not a pause) ends the wait."""
        async def wait() -> None:
            async with self.changed:
                await asyncio.wait_for(self.changed.wait_for(lambda: self.failure or predicate()), deadline)

        try:
            await pausing.patiently(self.run_dir, deadline, wait)
        except TimeoutError:
            raise TimeoutError(f"orchestrator: waited {deadline:.0f}s for {what} "
                               f"(served version {self.router.version})") from None
        if self.failure:
            raise self.failure

    # --- admit --------------------------------------------------------------------------
    async def admit(self) -> None:
        while True:
            await self._wait_for(lambda: self.assembled or self._may_admit(0), self.cfg.timeouts.train_step,
                                 "room to start a rollout (the trainer publishes versions)")
            if self.assembled:
                return
            wave = []  # every group there is room for now: their dispatch records go in one transaction
            while self._may_admit(len(wave)) and (started := next_prompt(self)):  # (a bad row ends a wave)
                wave.append(started)
            self.ledger.dispatch([index for index, _, _ in wave])
            choices = waves.start(self.router, [(i, p) for i, entry, p in wave if not self._agentic(entry)],
                                  self.cfg, self.waves, {i: e.get("image_hashes") for i, e, _ in wave},
                                  self.images.store.get if self.images else None)
            for index, entry, prompt in wave:
                self.showing[index] = entry.get("image_hashes", [])
                task = asyncio.create_task(self._run_group(index, entry, prompt, choices.get(index)))
                self.in_flight.add(task)
                task.add_done_callback(self.in_flight.discard)
            self.in_flight_peak = max(self.in_flight_peak, len(self.in_flight))

    def _agentic(self, entry: dict) -> bool:
        return bool(self.agents and self.agents.agent_for(entry))

    def _may_admit(self, pending: int) -> bool:
        """Whether one more group may start, `pending` being admitted already but not yet started."""
        needed = self.cfg.run.steps * self.cfg.rollout.prompts_per_step  # (run.steps is live)
        running, most = len(self.in_flight) + pending, self.cfg.rollout.max_concurrent_groups
        return not self.paused and self.gate.may_start(self.router.version, running, most, needed,
                                                       reissue=bool(self.reissue))

    async def _run_group(self, index: int, entry: dict, prompt: list[int], choices: asyncio.Future | None):
        try:
            await self._generate_group(index, entry, prompt, choices)
        finally:  # free the slot before admission hears of it, or it waits for the next event
            self.in_flight.discard(asyncio.current_task())
            self.showing.pop(index, None)
            await self._notify()

    async def _generate_group(self, index: int, entry: dict, prompt: list[int], choices: asyncio.Future | None
                              ) -> None:
        """`choices`: the group's samples from its wave (None: an agent's episodes, generated here)."""
        cfg = self.cfg
        try:
            if choices is None:
                generate = lambda client: rollout_agent_group(self.agents, client, entry, index, cfg)  # noqa: E731
                group, dropped = await self.router.call(generate, f"prompt {index}", cfg.rollout.group_size,
                                                        trusted=True)  # (provenance: asyncrl/swarm/)
            else:
                group, dropped = await score_group(self.verifiers, entry, prompt, index, *await choices, cfg)
            if self.teacher and group:  # (on record, and so in a batch, only once scored: teacher.py)
                await self.teacher.score(group)
        except Exception as e:  # every waiting loop hears of it (_run_group notifies)
            self._fail(e if not isinstance(e, InferenceUnavailable) else RuntimeError(
                f"orchestrator: prompt {index} failed {ATTEMPTS} times: {e}"))
            return
        for d in dropped:
            self.events.write("sample_dropped", **{k: v for k, v in d.items() if k != "id"}, sample=d["id"])
        if group:
            for traj, adv in zip(group, self.advantages([t.reward for t in group])):
                traj.advantages = [adv if m else 0.0 for m in traj.loss_mask]
        baseline = getattr(self.advantages, "value", None)
        with self.phases("ledger"):
            self.ledger.finish(index, group, [(d["id"], d["reason"]) for d in dropped],
                               meta={"baseline": baseline} if baseline is not None else None)
        if group:
            self._finished(group)
        else:
            self.gate.release()
        try:  # (after the ledger: the failed samples are on record however the run ends)
            self.breaker.record(len(group), [(d["reason"], d.get("error", "")) for d in dropped])
        except RunCannotProgress as e:
            self._fail(e)

    def _finished(self, group: list[Trajectory]) -> None:
        """Into the pool batches are packed from, the oldest first (a group's prompt breaks ties: the same
        order after a restart)."""
        if self.swarm and not self.swarm.admit(group):  # (a joined worker's, held for a check or dropped)
            return
        staleness.offer(self.ready, min(t.oldest_version for t in group), group[0].prompt_id, group)

    # --- assemble -----------------------------------------------------------------------
    async def assemble(self) -> None:
        per_step = self.cfg.rollout.prompts_per_step
        step = self.next_step
        while step < self.cfg.run.steps:  # (run.steps is live; a change to it never ends this batch)
            self.next_step, dropped = step, 0
            changed = self.ledger.schedule_changes(step)  # (pending changes take effect with this batch)
            if changed:
                self._use_settings(settings_at(self.ledger.scheduled_changes(), step))
                self.events.write("settings_changed", step=step, changes=dict(changed))
            batch: list[list[Trajectory]] = []
            while len(batch) < per_step:
                await self._wait_for(lambda: bool(self.ready), self.cfg.timeouts.train_step,
                                     f"finished rollouts for batch {step}")
                oldest, group, fresh = staleness.take(self.ready, self.gate, step)
                # (the trainer's logprobs are at this step's temperature: a group drawn at another is dropped)
                sampled_at = group[0].info.get("temperature", self.cfg.rollout.temperature)
                if fresh and sampled_at == self.cfg.rollout.temperature:
                    batch.append(group)
                    continue
                dropped += 1
                self.gate.release()
                reason = "too_stale" if not fresh else "temperature_changed"
                self.ledger.drop_group(group, reason)
                self.events.write("group_dropped", reason=reason, step=step,
                                  prompt_id=group[0].prompt_id, oldest_version=oldest)
                await self._notify()
            trajs = [t for g in batch for t in g]
            with self.phases("ledger"):
                self.ledger.batch(step, trajs, batch_stats(step, trajs, dropped))
            with self.phases("write_batch"):
                self._write_batch(step, trajs)
                await self.link.deliver(step)
            step += 1
        self.assembled = True
        await self._notify()

    def _write_batch(self, step: int, trajs: list[Trajectory]) -> None:
        """The trainer's file of batch `step` (the ledger holds the group advantages; this is the one place
        they are rescaled per task, so a batch rewritten after a crash is the same batch)."""
        if self.cfg.rollout.task_normalization:
            normalize_per_task(trajs)
        changes = self.ledger.scheduled_changes()
        write_batch(self.run_dir, step, trajs, settings_at(changes, step), actions_at(changes, step))

    # --- follow -------------------------------------------------------------------------
    async def follow(self) -> None:
        if self.router.version == 0 and self.evaluator:
            self.evals.append(asyncio.create_task(self.evaluate()))
        version = self.router.version
        while version < self.cfg.run.steps:  # (run.steps is live: read at every version)
            version += 1
            marker = await self._wait_for_version(version)
            seen = time.monotonic()
            await self.router.load(version, marker)
            teacher = await self.teacher.stats() if self.teacher else {}
            stats = {**await self.router.stats(), "teacher": teacher}
            record = step_record(self, version, marker, stats)
            self._warn(self.collapse.step(record, self.cfg.trainer.lr))
            self.ledger.record_step(version, record)
            workers.record_masked(self, version, marker)
            await self._notify()
            self.serve_seconds += time.monotonic() - seen  # (until admission hears of it: asyncrl plan)
            self._write_metrics(record)
            self._commit(await self.link.checkpoints())
            await self.link.copy_events(self.ledger)
            if self.evaluator and (version % self.cfg.task.eval_every == 0 or version == self.cfg.run.steps):
                self.evals.append(asyncio.create_task(self.evaluate()))
        await asyncio.gather(*self.evals)
        await self._wait_for_final_checkpoint()

    def _commit(self, durable_steps: list[int]) -> None:
        """The batches a durable checkpoint contains are committed: never to be trained again."""
        if durable_steps and durable_steps[-1] > self.committed_through:
            self.committed_through = durable_steps[-1]
            oldest_kept = durable_steps[0] if self.cfg.run.prune_trained else 0  # (no restart goes earlier)
            n = self.ledger.commit_through(self.committed_through, oldest_kept)
            self.events.write("committed", through_step=self.committed_through, samples=n)
            if self.images and self.cfg.run.prune_trained:  # (images go with the batches that showed them)
                prune_images(self)

    async def _wait_for_final_checkpoint(self) -> None:
        async def committed_all() -> bool:
            self._commit(await self.link.checkpoints())
            return self.committed_through >= self.cfg.run.steps

        await apoll(committed_all, self.cfg.timeouts.checkpoint,
                    f"orchestrator: the trainer's final checkpoint (step {self.cfg.run.steps}) did not "
                    f"appear in {self.link.where()} within {self.cfg.timeouts.checkpoint:.0f}s "
                    "(timeouts.checkpoint)")
        await self.link.copy_events(self.ledger)

    async def _wait_for_version(self, version: int) -> dict:
        def failed() -> None:
            if self.failure:
                raise self.failure

        deadline = self.cfg.timeouts.train_step
        what = (f"orchestrator: the trainer did not publish version {version} (step {version - 1}) within "
                f"{deadline:.0f}s (timeouts.train_step)")
        return await pausing.patiently(self.run_dir, deadline,
                                       lambda: self.link.marker(version, deadline, what, failed))

    async def evaluate(self) -> None:
        """Held-out greedy accuracy under the version served; a failure ends the role, as a rollout's does."""
        try:
            record = {**await self.evaluator.run(self.router.version), "time": self._now()}
        except Exception as e:
            self._fail(e)
            await self._notify()
            raise
        self._warn(self.collapse.evaluation(record, self.cfg.trainer.lr))
        self.ledger.record_eval(record)
        self._write_metrics(record)

    def _warn(self, warning: dict | None) -> None:
        if warning:
            self.events.write("collapse_warning", **warning)

    async def run(self) -> None:
        await self._connect_trainer()
        await self.router.start()
        loops = [asyncio.create_task(self.admit()), asyncio.create_task(self.assemble())]
        beat = asyncio.create_task(self.heartbeat.beat_forever())
        proxy = None
        if self.agents:
            proxy, self.agents.proxy_url = await start_proxy(self.agents.sessions, self.cfg.model.path)
            self.events.write("proxy_started", url=self.agents.proxy_url)
        follow = asyncio.create_task(self.follow())
        api, gateway = await control.serve(self), await workers.open_gateway(self)
        try:
            done, _ = await asyncio.wait([follow, *loops], return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()  # re-raise the first failure
            await follow
        finally:  # nothing may run on against the ledger once it is closed
            tasks = [beat, follow, *loops, *self.waves, *self.in_flight, *self.evals]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await control.close(api, self.run_dir)
            await workers.close_gateway(self, gateway)
            self.sinks.close()
            if proxy is not None:
                await self.agents.close()
                await proxy.cleanup()
            await self.teacher.close() if self.teacher else None
            self.ledger.close()


async def main(run_dir: Path) -> None:
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    cfg = read_run_config(run_dir)
    link = trainer_link(cfg, run_dir)
    router = Router(cfg, run_dir, EventLog(run_dir, "orchestrator"), read_token(run_dir), link)
    verifiers = VerifierPool(cfg.task, cfg.task.verifier_workers)
    try:
        await router.reachable()  # (a server that never answers fails the role before anything slow)
        # The verifier workers import the task code (reasoning-gym: ~1.5 s of CPU) while the tokenizer
        # loads, and before the run's clock starts: started beside the first rollouts, that import held
        # the first batch's scores back and took a core from generation.
        tokenizer, _ = await asyncio.gather(asyncio.to_thread(AutoTokenizer.from_pretrained, cfg.model.path),
                                            verifiers.warm())
        await Orchestrator(cfg, run_dir, router, tokenizer, verifiers, link).run()
    finally:
        await router.close()
        verifiers.close()
    logging.getLogger("asyncrl.orchestrator").info("orchestrator: done")

