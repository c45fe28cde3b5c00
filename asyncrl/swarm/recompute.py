"""The trusted recompute: a sample's logprobs under the version(s) its worker claims sampled it.

The orchestrator holds a copy of the policy (float32, the trainer's published weights read from the
run directory) and runs it on a thread of its own over the samples waiting, up to 32 at once: a padded
prefill of their prompts and completions per version they name (one, but for a sample whose generation
spanned a weight update), and each completion token's logprob at the sample's temperature, as the engine
computes it (asyncrl/inference/sampling.py). One sample at a time cost BATCHGAIN the compute on the default
policy, and held groups waited behind the queue until they were too stale (docs/untrusted.md). The
verdict compares them with the claimed ones: the mean absolute difference over the completion, and the
largest one (a changed token shows there, not in the mean).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import torch

from asyncrl.rundir import RunDir
from asyncrl.transports import weights

# honest workers' noise, by the dtype they serve in, against this float32 recompute (docs/untrusted.md)
TOLERANCE = {"float32": 0.002, "bfloat16": 0.25, "float16": 0.1}
# the largest drift (mean claimed - recomputed, nats per token) an honest worker may show, by dtype
DRIFT = {"float32": 0.001, "bfloat16": 0.003, "float16": 0.002}
ONE_TOKEN = 20  # one token may differ by this many times the tolerance
BACKLOG = 2000  # samples waiting for a recompute beyond which a new one goes unchecked
BATCH = 32  # samples recomputed in one forward pass


@dataclass
class Verdict:
    mean: float  # mean |claimed - recomputed| over the completion's tokens
    most: float  # the largest
    error: str | None = None  # the version's weights are gone (pruned): not checked
    excess: float = 0.0  # sum of (claimed - recomputed) over the tokens (asyncrl/swarm/trust.py: drift)
    tokens: int = 0

    def fails(self, tolerance: float) -> bool:
        return self.error is None and (self.mean > tolerance or self.most > ONE_TOKEN * tolerance)


@dataclass
class Sample:
    prompt: list[int]
    completion: list[int]
    claimed: list[float]
    versions: list[int]
    temperature: float


class Recomputer:
    def __init__(self, model_path: str, run_dir, keep: int, device: str = "cpu"):
        """`keep`: versions held in memory (the trainer prunes its files soon after they are served)."""
        self.model_path, self.run_dir, self.keep, self.device = model_path, RunDir(run_dir), keep, device
        self.model, self.held = None, None  # the policy, and the version it holds
        self.states: dict[int, asyncio.Future] = {}  # version -> its weights (read once, when first named)
        self.queue: list[tuple[Sample, dict, asyncio.Future]] = []
        self.draining: asyncio.Task | None = None
        self.pending = 0  # checks not yet done
        self.seconds = 0.0  # all recompute compute, for the report

    async def check(self, sample: Sample) -> Verdict:
        if self.pending >= BACKLOG:
            return Verdict(0.0, 0.0, f"the recompute is {self.pending} samples behind")
        self.pending += 1
        try:
            states = {v: await self._state(v) for v in sorted(set(sample.versions))}  # (now: before pruning)
            if any(state is None for state in states.values()):
                gone = [v for v, state in states.items() if state is None]
                return Verdict(0.0, 0.0, f"version {gone[0]}'s weights were no longer on disk")
            verdict = asyncio.get_running_loop().create_future()
            self.queue.append((sample, states, verdict))
            if self.draining is None or self.draining.done():
                self.draining = asyncio.create_task(self._drain())
            return await verdict
        finally:
            self.pending -= 1

    async def _drain(self) -> None:
        """Every sample waiting, in one padded forward pass per version they name (one model, one thread)."""
        while self.queue:
            batch, self.queue = self.queue[:BATCH], self.queue[BATCH:]
            try:
                states = {v: st for _, held, _ in batch for v, st in held.items()}
                verdicts = await asyncio.to_thread(self._check, [s for s, _, _ in batch], states)
            except Exception as e:  # (a verdict for each: the checks' tasks must not hang)
                why = f"the recompute failed: {type(e).__name__}: {e}"
                verdicts = [Verdict(0.0, 0.0, why)] * len(batch)
            for (_, _, future), verdict in zip(batch, verdicts):
                if not future.done():
                    future.set_result(verdict)

    def _state(self, version: int) -> asyncio.Future:
        if version not in self.states:
            read = self._initial if version == 0 else lambda: _read(self.run_dir.weights_file(version))
            self.states[version] = asyncio.ensure_future(asyncio.to_thread(read))
            for old in [v for v in self.states if v < version - self.keep]:
                del self.states[old]
        return self.states[version]

    def _initial(self) -> dict:
        from asyncrl.policy.model import load_policy

        model, _ = load_policy(self.model_path)
        return {k: v.clone() for k, v in model.state_dict().items()}

    def _check(self, samples: list[Sample], states: dict[int, dict]) -> list[Verdict]:
        start = time.perf_counter()
        recomputed = [torch.zeros(len(s.completion)) for s in samples]
        for version in sorted({v for s in samples for v in s.versions}):
            rows = [i for i, s in enumerate(samples) if version in s.versions]
            self._hold(version, states[version])
            for i, logp in zip(rows, self._logprobs([samples[i] for i in rows])):
                here = torch.tensor(samples[i].versions) == version
                recomputed[i][here] = logp[here]
        self.seconds += time.perf_counter() - start
        verdicts = []
        for s, r in zip(samples, recomputed):
            signed = torch.tensor(s.claimed, dtype=torch.float32) - r
            diff = signed.abs()
            verdicts.append(Verdict(float(diff.mean()), float(diff.max()), excess=float(signed.sum()),
                                    tokens=len(s.completion)))
        return verdicts

    def _logprobs(self, samples: list[Sample]) -> list[torch.Tensor]:
        """Each completion token's logprob at its sample's temperature, the rows right-padded in one call."""
        width = max(len(s.prompt) + len(s.completion) for s in samples)
        ids = torch.zeros(len(samples), width, dtype=torch.long)
        mask = torch.zeros(len(samples), width, dtype=torch.long)
        for i, s in enumerate(samples):
            ids[i, :len(s.prompt) + len(s.completion)] = torch.tensor(s.prompt + s.completion)
            mask[i, :len(s.prompt) + len(s.completion)] = 1
        with torch.inference_mode():
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
        out = []
        for i, s in enumerate(samples):
            rows = logits[i, len(s.prompt) - 1: len(s.prompt) + len(s.completion) - 1].float()
            logp = torch.log_softmax(rows / (s.temperature or 1.0), dim=-1)
            target = torch.tensor(s.completion, device=logp.device)[:, None]
            out.append(logp.gather(1, target).squeeze(1).cpu())
        return out

    def _hold(self, version: int, state: dict) -> None:
        if self.model is None:
            from asyncrl.policy.model import load_policy

            self.model, _ = load_policy(self.model_path)
            self.model.to(self.device)
            self.held = 0
        if version != self.held:
            self.model.load_state_dict(state, strict=False)
            self.held = version


def _read(path) -> dict | None:
    """A copy in memory: the tensors safetensors returns may map the file, which the trainer overwrites
    with a later version once this one is pruned (weights.prune's spare)."""
    try:
        return {name: t.clone() for name, t in weights.load(path).items()}
    except (OSError, ValueError):  # pruned, or being overwritten: the sample goes unchecked
        return None
