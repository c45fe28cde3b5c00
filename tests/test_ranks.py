"""The trainer over several ranks (trainer.ranks, FSDP2 on gloo) computes what one rank computes: the same
loss, metrics and updated weights on the same batch, for objectives with batch statistics (M2PO's second
moment, VCPO's effective sample size) and both loss aggregations."""
import copy
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import job_args
from test_recovery import assert_nothing_lost
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from asyncrl.config import load_config
from asyncrl.objectives import get_objective
from asyncrl.observe.events import read_events
from asyncrl.policy.model import load_policy
from asyncrl.run.chaos import steps_recorded
from asyncrl.run.launcher import resume
from asyncrl.run.ports import free_port
from asyncrl.store import checkpoint
from asyncrl.trainer.ranks import Ranks
from asyncrl.trainer.step import train_step
from asyncrl.trajectory import Trajectory
from asyncrl.transports import weights

CASES = [("ppo_clip", "token_mean", 1), ("m2po", "seq_mean", 2), ("vcpo", "token_mean", 2),
         ("decoupled_ppo", "seq_mean", 1)]


def batch(vocab: int) -> list[Trajectory]:
    """Four groups of three samples of different lengths, behaviour logprobs a little off the policy's,
    tokens of two versions: a step with clipping, staleness and uneven rows."""
    rng = random.Random(0)
    trajs = []
    for g in range(4):
        reward = [rng.random() for _ in range(3)]
        for k in range(3):
            prompt, n = rng.randint(3, 6), rng.randint(4, 14)
            tokens = [rng.randrange(3, vocab) for _ in range(prompt + n)]
            adv = reward[k] - sum(reward) / 3
            trajs.append(Trajectory(
                f"{g}-{k}", str(g), "t", g, tokens, [0] * prompt + [1] * n,
                [0.0] * prompt + [-2.5 + rng.uniform(-0.5, 0.5) for _ in range(n)],
                [-1] * prompt + [rng.choice([2, 3]) for _ in range(n)], reward[k],
                [0.0] * prompt + [adv] * n))
    return trajs


def steps(model_path: str, ranks: Ranks, cases=CASES, mixed_precision="off", checkpointing=False) -> list:
    """For each case: one train_step from the same weights; the metrics and the whole updated weights."""
    results = []
    for objective, loss_agg, minibatches in cases:
        torch.manual_seed(0)
        model, tokenizer = load_policy(model_path)
        published = list(weights.model_state(model))
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        ranks.shard(model, mixed_precision)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        cfg = load_config(overrides=["--objective.name", objective, "--objective.loss_agg", loss_agg,
                                     "--trainer.minibatches", str(minibatches), "--objective.m2_threshold",
                                     "0.01"])
        metrics = train_step(model, optimizer, get_objective(objective), batch(len(tokenizer)), 3, cfg,
                             tokenizer.pad_token_id, ranks=ranks)
        results.append({"metrics": metrics, "state": ranks.full_model_state(model, published)})
    return results


def jobs_of_steps(ranks: Ranks, jobs: list[tuple]) -> list:
    """`steps(path, ranks, *options)` for each job (path, *options)."""
    return [steps(path, ranks, *options) for path, *options in jobs]


def on_two_ranks(tmp_path, fn, *args):
    """`fn(ranks, *args)` on each rank of a group of 2 gloo ranks (fn: a module-level function); rank 0's
    result."""
    port = free_port()
    out = str(tmp_path / "two_ranks.pt")
    mp.spawn(_rank, args=(port, fn, args, out), nprocs=2, join=True)
    return torch.load(out, weights_only=False)


def _rank(rank: int, port: int, fn, args: tuple, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        result = fn(Ranks(rank, 2, dist.new_group(backend="gloo")), *args)
        if rank == 0:
            torch.save(result, out)
    finally:
        dist.destroy_process_group()


def test_two_ranks_train_what_one_rank_trains(tiny_model, tmp_path):
    # and the options: bf16 compute (fp32 gradient reduction) with activation checkpointing
    jobs = [(tiny_model,), (tiny_model, CASES[:1], "bf16", True)]
    two, [bf16] = on_two_ranks(tmp_path, jobs_of_steps, jobs)
    torch.set_num_threads(1)
    one = steps(tiny_model, Ranks())
    initial = weights.model_state(load_policy(tiny_model)[0])
    # bf16: near the float32 step, not equal to it
    assert bf16["metrics"]["loss"] == pytest.approx(one[0]["metrics"]["loss"], rel=0.05)
    assert all(bool(torch.isfinite(t).all()) for t in bf16["state"].values())
    for case, a, b in zip(CASES, one, two):
        assert a["metrics"].keys() == b["metrics"].keys(), case
        for key, value in a["metrics"].items():
            assert b["metrics"][key] == pytest.approx(value, rel=1e-4, abs=1e-6, nan_ok=True), (case, key)
        assert a["state"].keys() == b["state"].keys()
        moved = max(float((a["state"][k] - initial[k]).abs().max()) for k in a["state"])
        assert moved > 1e-4, case  # the step changed the weights: the comparison below means something
        # Adam divides each gradient by its own magnitude, so an entry whose gradient is at float noise
        # (attention keys have directions the loss cannot see) moves by a noisy fraction of lr: up to 5e-6
        # of lr = 1e-3 measured (0.5%); a wrong gradient moves entries by a whole lr
        for key in a["state"]:
            torch.testing.assert_close(b["state"][key], a["state"][key], rtol=1e-4, atol=3e-5, msg=str(case))


def step_and_checkpoint(ranks: Ranks, model_path: str, run_dir: Path, step: int) -> dict:
    """Resume from the run's newest checkpoint if any (its optimizer resharded to these ranks), train one
    step, write a checkpoint; the whole optimizer state after the load and after the step."""
    model, tokenizer = load_policy(str(checkpoint.latest(run_dir) or model_path))
    published = list(weights.model_state(model))
    ranks.shard(model, "off")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    full = StateDictOptions(full_state_dict=True, cpu_offload=ranks.size > 1)
    loaded = None
    if checkpoint.latest(run_dir) is not None:
        checkpoint.load_optimizer(checkpoint.latest(run_dir), model, optimizer, ranks.checkpoint_group)
        loaded = copy.deepcopy(get_optimizer_state_dict(model, optimizer, options=full))  # (steps change it)
    cfg = load_config()
    train_step(model, optimizer, get_objective("ppo_clip"), batch(len(tokenizer)), step, cfg,
               tokenizer.pad_token_id, ranks=ranks)
    state = ranks.full_model_state(model, published)
    writer = checkpoint.CheckpointWriter(run_dir, tokenizer, keep=3, deadline=60, ranks=ranks)
    writer.save(step + 1, state, model.config.to_dict(), {"rng": torch.get_rng_state()},
                checkpoint.optimizer_state(model, optimizer))
    writer.wait()
    return {"loaded": loaded, "trained": get_optimizer_state_dict(model, optimizer, options=full)}


def assert_same_optimizer(a: dict, b: dict) -> None:
    assert a["state"].keys() == b["state"].keys() and len(a["state"]) > 0
    for name, moments in a["state"].items():
        for key, value in moments.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(b["state"][name][key])), (name, key)
    assert [g["lr"] for g in a["param_groups"]] == [g["lr"] for g in b["param_groups"]]


@pytest.mark.long
def test_checkpoints_reshard_between_one_and_two_ranks(tiny_model, tmp_path):
    """A checkpoint written by 2 ranks (each its shard of the optimizer, DCP) resumes on 1 with every moment
    exact, and one written by 1 rank resumes on 2."""
    torch.set_num_threads(1)
    run = tmp_path / "run"
    two = on_two_ranks(tmp_path, step_and_checkpoint, tiny_model, run, 0)
    shards = sorted(p.name for p in (run / "checkpoints" / "step_000001" / "optimizer").glob("*.distcp"))
    assert len(shards) == 2, shards  # each rank wrote its own shard; nothing gathered the optimizer whole
    assert checkpoint.verify_checkpoint(run / "checkpoints" / "step_000001") is None
    one = step_and_checkpoint(Ranks(), tiny_model, run, 1)  # resumes the 2-rank checkpoint on 1 rank
    assert_same_optimizer(one["loaded"], two["trained"])
    again = on_two_ranks(tmp_path, step_and_checkpoint, tiny_model, run, 2)  # the 1-rank one on 2
    assert_same_optimizer(again["loaded"], one["trained"])
    assert checkpoint.valid_steps(run / "checkpoints") == [1, 2, 3]


def _followers(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in children.read_text().split()] if children.exists() else []


@pytest.mark.long
@pytest.mark.e2e
def test_two_ranks_end_to_end_a_dead_rank_and_a_resume_on_one(tiny_model, tmp_path, record):
    """trainer.ranks = 2 under the local launcher: rank 1 is SIGKILLed mid-run, the leader stops the group
    with it, the supervisor restarts the trainer from its checkpoint; the finished run then resumes for
    four more steps on one rank from the two-rank checkpoint. Nothing lost either time."""
    run_dir = tmp_path / "runs" / "job"
    args = job_args(tmp_path, tiny_model, **{"run.steps": 24, "trainer.checkpoint_every": 4,
                                             "trainer.ranks": 2, "task.eval_size": 0})
    proc = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    killed = None
    try:
        deadline = time.monotonic() + 300
        while killed is None and proc.poll() is None and time.monotonic() < deadline:
            pids = json.loads((run_dir / "pids.json").read_text()) if (run_dir / "pids.json").exists() else {}
            if steps_recorded(run_dir) >= 6 and _followers(pids["trainer"]):
                killed = steps_recorded(run_dir)
                os.kill(_followers(pids["trainer"])[0], signal.SIGKILL)
            time.sleep(0.05)
        out, _ = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert killed is not None
    record("steps_left_at_rank_kill", 24 - killed, threshold=0)
    assert "trainer: 2 rank(s)" in (run_dir / "logs" / "trainer.log").read_text()
    events = read_events(run_dir)  # (the leader's collective fails, or its watcher sees the rank die)
    assert [e["target"] for e in events if e["event"] == "role_restarted"] == ["trainer"]
    assert [e["ranks"] for e in events if e["event"] == "trainer_ready"] == [2, 2]
    assert all(e["identical"] for e in events if e["event"] == "version_replayed")
    assert_nothing_lost(run_dir)

    resume(run_dir, ["--run.steps", "28", "--trainer.ranks", "1"], log=lambda *a, **k: None)
    assert "trainer: resuming from" in (run_dir / "logs" / "trainer.log").read_text()
    assert "trainer: 1 rank(s)" in (run_dir / "logs" / "trainer.log").read_text().rsplit("resuming", 1)[1]
    assert_nothing_lost(run_dir)
