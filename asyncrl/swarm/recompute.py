"""The trusted recompute: a sample's logprobs under the version(s) its worker claims sampled it.

The orchestrator holds a copy of the policy (float32, the trainer's published weights read from the
run directory) and runs it on a thread of its own, one sample at a time: a prefill of the prompt and
completion per version the sample names (one, but for a sample whose generation spanned a weight
update), and each completion token's logprob at the engine's temperature, as the engine computes it
(asyncrl/inference/sampling.py). The verdict compares them with the claimed ones: the mean absolute
difference over the completion, and the largest one (a changed token shows there, not in the mean).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import torch

from asyncrl.rundir import RunDir
from asyncrl.transports import weights

# honest workers' noise, by the dtype they serve in, against this float32 recompute (docs/untrusted.md)
TOLERANCE = {"float32": 0.002, "bfloat16": 0.06, "float16": 0.02}
ONE_TOKEN = 20  # one token may differ by this many times the tolerance
BACKLOG = 2000  # samples waiting for a recompute beyond which a new one goes unchecked


@dataclass
class Verdict:
    mean: float  # mean |claimed - recomputed| over the completion's tokens
    most: float  # the largest
    seconds: float  # the recompute's compute
    error: str | None = None  # the version's weights are gone (pruned): not checked

    def fails(self, tolerance: float) -> bool:
        return self.error is None and (self.mean > tolerance or self.most > ONE_TOKEN * tolerance)


class Recomputer:
    def __init__(self, model_path: str, run_dir, keep: int, device: str = "cpu"):
        """`keep`: versions held in memory (the trainer prunes its files soon after they are served)."""
        self.model_path, self.run_dir, self.keep, self.device = model_path, RunDir(run_dir), keep, device
        self.model, self.held = None, None  # the policy, and the version it holds
        self.states: dict[int, asyncio.Future] = {}  # version -> its weights (read once, when first named)
        self.lock = asyncio.Lock()
        self.pending = 0  # checks waiting for the model
        self.seconds = 0.0  # all recompute compute, for the report

    async def check(self, prompt: list[int], completion: list[int], claimed: list[float], versions: list[int],
                    temperature: float) -> Verdict:
        if self.pending >= BACKLOG:
            return Verdict(0.0, 0.0, 0.0, f"the recompute is {self.pending} samples behind")
        self.pending += 1
        try:
            states = {v: await self._state(v) for v in sorted(set(versions))}  # (read now: before pruning)
            if any(state is None for state in states.values()):
                gone = [v for v, state in states.items() if state is None]
                return Verdict(0.0, 0.0, 0.0, f"version {gone[0]}'s weights were no longer on disk")
            async with self.lock:  # (one model: a sample at a time)
                return await asyncio.to_thread(self._check, prompt, completion, claimed, versions, states,
                                               temperature)
        finally:
            self.pending -= 1

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

    def _check(self, prompt, completion, claimed, versions, states, temperature) -> Verdict:
        start = time.perf_counter()
        ids = torch.tensor([prompt + completion], device=self.device)
        recomputed = torch.zeros(len(completion))
        for version, state in states.items():
            self._hold(version, state)
            with torch.inference_mode():
                logits = self.model(input_ids=ids).logits[0, len(prompt) - 1: -1].float()
            logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
            picked = logp.gather(1, torch.tensor(completion, device=self.device)[:, None]).squeeze(1).cpu()
            here = torch.tensor(versions) == version
            recomputed[here] = picked[here]
        diff = (recomputed - torch.tensor(claimed, dtype=torch.float32)).abs()
        seconds = time.perf_counter() - start
        self.seconds += seconds
        return Verdict(float(diff.mean()), float(diff.max()), seconds)

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
