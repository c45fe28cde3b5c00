"""[workers]: inference workers that join a run from machines it does not own (docs/untrusted.md)."""
from __future__ import annotations

from pydantic import Field

from asyncrl.config.sections import Section


class WorkersConfig(Section):
    # the orchestrator opens the workers' gateway (asyncrl/swarm/gateway.py) on host:port; workers join
    # with `asyncrl worker --join URL --token T`, a token per worker from `asyncrl ctl RUN workers add`
    enabled: bool = False
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535, description="0: a free port, written to RUN_DIR/gateway.json")
    # a worker silent this long (no poll, no result) loses its work, which is issued again elsewhere
    lease_seconds: float = Field(20.0, gt=0)
    # a worker that has not loaded the served version this long after being told leaves routing
    # until it holds it (a slow link slows no one else)
    load_grace_seconds: float = Field(2.0, gt=0)
    # the share of each worker's samples whose logprobs a trusted model recomputes under the claimed
    # version; four times this for a new worker, half for a proven one (asyncrl/swarm/trust.py)
    verify_fraction: float = Field(0.1, ge=0, le=1)
    # where the orchestrator's trusted copy of the policy recomputes (a GPU of its node: "cuda:0")
    verify_device: str = "cpu"
    # a recomputed sample fails when its tokens' mean |claimed - recomputed| logprob exceeds this, or one
    # token's exceeds 20x this; 0: by the serving dtype (float32 0.002, bfloat16 0.25: docs/untrusted.md;
    # a vLLM worker's kernels need ~0.05 in float32)
    tolerance: float = Field(0.0, ge=0)
    # a worker whose recomputed tokens' claimed logprobs exceed the trusted model's by more than this many
    # nats per token on average (over 200 tokens at least) is quarantined; 0: by the serving dtype
    # (asyncrl/swarm/recompute.py DRIFT; docs/untrusted.md)
    max_drift: float = Field(0.0, ge=0)
    # trust in [0, 1]: a new worker starts at 0.5, a passed check moves it towards 1, a failed recompute
    # takes 0.25, a failed cheap check 0.5; below this the worker is quarantined
    quarantine_below: float = Field(0.2, ge=0, lt=0.5)
