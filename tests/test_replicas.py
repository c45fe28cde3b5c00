"""Data-parallel inference replicas (inference.replicas) under the local launcher and under Ray: groups
are routed across them, a replica killed mid-run leaves routing and comes back holding the served
version, a replica started by hand joins, and nothing is lost (the ledger audit)."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import events_of, job_args, stop_when
from test_recovery import assert_nothing_lost

from asyncrl.observe.events import read_events
from asyncrl.run.chaos import Chaos, steps_recorded
from asyncrl.run.processes import start_role, stop, wait_for_replica
from asyncrl.rundir import RunDir
from asyncrl.store.checkpoint import valid_steps
from asyncrl.store.ledger import audit

pytestmark = pytest.mark.e2e

RUN = {"run.steps": 16, "rollout.prompts_per_step": 4, "rollout.group_size": 4, "trainer.checkpoint_every": 4,
       "task.eval_size": 50, "task.eval_every": 16, "inference.replicas": 2}


STEPS = 120  # at most, for the tests with a kill or a join: they stop the run once it is seen (stop_when)
AFTER = 3  # steps trained after the last thing a test waits for, before it stops the run


def train_cli(tmp_path, model, **overrides) -> subprocess.Popen:
    args = job_args(tmp_path, model, **{**RUN, **overrides})
    return subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "train", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def routed_sequences(events: list[dict]) -> dict[int, int]:
    [routing] = [e for e in events if e["event"] == "routing"]
    return {int(k): v for k, v in routing["sequences"].items()}


@pytest.mark.long
def test_replica_killed_and_replica_joining_mid_run(tiny_model, tmp_path, record):
    """Replica 1 is SIGKILLed after step 2; a third replica, started by hand after step 3, joins. Once
    both serve the run and AFTER more steps are trained, the run is stopped (a cold replica starts in
    ~6 s, a step takes ~0.25 s: 120 steps are the bound, not the length)."""
    run_dir = tmp_path / "runs" / "job"
    proc = train_cli(tmp_path, tiny_model, **{"run.steps": STEPS, "task.eval_every": STEPS,
                                                   "trainer.checkpoint_every": 20})
    chaos = Chaos(run_dir, [("inference-1", 2)], seed=3)
    chaos.start()
    joined = None
    try:
        deadline = time.monotonic() + 300
        while steps_recorded(run_dir) < 3 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        joined = start_role("inference-2", run_dir, threads=1)
        wait_for_replica(joined, run_dir, 60, index=2)
        end = stop_when(run_dir, lambda: served_by_then(run_dir, [("inference_recovered", 1),
                                                                  ("replica_joined", 2)]), 300,
                        "replica 1 back and replica 2 joined")
        out, _ = proc.communicate(timeout=600)
    finally:
        if joined is not None:
            stop({"inference-2": joined})
    assert proc.returncode == 0, out[-3000:]
    assert [k["role"] for k in chaos.kills] == ["inference-1"]
    events = read_events(run_dir)
    for kind, index in (("inference_recovered", 1), ("replica_joined", 2)):  # back (or in) at version v
        [served] = [e["version"] for e in events if e["event"] == kind and e["replica"] == index]
        record(f"steps_left_at_{kind}", end - served, threshold=0)
    sequences = routed_sequences(events)
    record("sequences_to_joined_replica", sequences[2], threshold=0)
    assert sequences[0] > 0 and sequences[1] > 0 and sequences[2] > 0, sequences
    assert_nothing_lost(run_dir, end)


def served_by_then(run_dir: Path, waited: list[tuple[str, int]]) -> bool:
    """Every (event, replica) in `waited` has happened, and AFTER steps have been trained since the last."""
    versions = [events_of(run_dir, kind, replica=index) for kind, index in waited]
    return all(versions) and steps_recorded(run_dir) >= max(v[0]["version"] for v in versions) + AFTER


@pytest.mark.xdist_group("ray")
@pytest.mark.long
@pytest.mark.timeout(900)
def test_ray_replicas_on_a_second_node_without_the_run_directory(tiny_model, tmp_path, ray_cluster, record):
    """Run.launcher ray: the trainer in an actor on the driver's node, two replicas pinned to the simulated
    node `node_b`, each with only its own scratch directory (its config names that directory as the run's),
    so every version reaches them through Ray's object store. One is SIGKILLed mid-run. A teacher
    (on-policy distillation, objective rl_opd) runs in an actor on `node_b` too and scores every sample."""
    run_dir = tmp_path / "runs" / "job"
    proc = train_cli(tmp_path, tiny_model, **{"run.launcher": "ray", "run.ray_address": ray_cluster,
                                              "inference.ray_resources": "{node_b = 1}",
                                              "teacher.path": tiny_model,
                                              "teacher.ray_resources": "{node_b = 1}",
                                              "objective.name": "rl_opd", "objective.opd_coef": 0.1,
                                              "trainer.publish_patches": True, "run.steps": STEPS,
                                              "task.eval_every": STEPS, "trainer.checkpoint_every": 20})
    chaos = Chaos(run_dir, [("inference-0", 2)], seed=5)
    chaos.start()
    end = stop_when(run_dir, lambda: served_by_then(run_dir, [("inference_recovered", 0)]), 600,
                    "replica 0 back")
    out, _ = proc.communicate(timeout=800)
    assert proc.returncode == 0, out[-3000:]
    assert "ray: placed the trainer's 1 rank(s), 2 inference replica(s) and 1 teacher(s)" in out
    infos = [json.loads(RunDir(run_dir).replica(i).read_text()) for i in range(2)]
    assert all(info["actor"].startswith("job.inference-") for info in infos)
    assert json.loads(RunDir(run_dir).teacher(0).read_text())["actor"].startswith("job.teacher-0")
    assert audit(run_dir, 1, distilled=True)["trained_without_teacher"] == 0
    events = read_events(run_dir)
    [served] = [e["version"] for e in events if e["event"] == "inference_recovered" and e["replica"] == 0]
    record("steps_left_at_inference_recovered", end - served, threshold=0)
    assert all(n > 0 for n in routed_sequences(events).values())
    for i in range(2):  # their logs came back; they served from a directory that is not the run's
        log = (run_dir / "logs" / f"inference-{i}.log").read_text()
        assert f"inference {i}: serving" in log
    assert not list((run_dir / "weights").glob("*.staged*"))
    assert_nothing_lost(run_dir, end)


def trainer_host_after(run_dir: Path, step: int, previous: str | None, proc) -> dict:
    """trainer.json once `step` steps are recorded and it names a host other than `previous`."""
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        path = run_dir / "trainer.json"
        if steps_recorded(run_dir) >= step and path.exists():
            info = json.loads(path.read_text())
            if info["actor"] != previous:
                return info
        time.sleep(0.05)
    raise AssertionError(f"no new trainer host by step {step}: {proc.poll()=}")


@pytest.mark.xdist_group("ray")
@pytest.mark.long
@pytest.mark.timeout(900)
def test_ray_trainer_ranks_on_two_nodes_keep_their_state_in_run_storage(tiny_model, tmp_path, ray_cluster,
                                                                       record):
    """run.storage set: the trainer's two ranks run on two nodes (a host each), in <storage>/job, with
    nothing of the run directory; batches reach it and versions leave it through Ray. The leader's host
    actor is killed mid-run, later the other rank's: each time the whole group restarts from the
    checkpoint in run.storage (its optimizer resharded by DCP), the batches it needs are sent again, and
    the replayed versions are bit-identical."""
    import ray

    run_dir, storage = tmp_path / "runs" / "job", tmp_path / "bucket"
    steps = 20
    proc = train_cli(tmp_path, tiny_model, **{
        "run.launcher": "ray", "run.ray_address": ray_cluster, "run.storage": str(storage),
        "inference.replicas": 1, "inference.ray_resources": "{node_b = 1}",
        "trainer.ray_resources": "{trainer_slot = 1}", "trainer.publish_patches": True, "run.steps": steps,
        "trainer.ranks": 2, "task.eval_every": steps, "trainer.checkpoint_every": 4})
    killed, infos = [], []
    try:
        ray.init(address=ray_cluster, namespace="asyncrl", log_to_driver=False)
        for at_step, actor in ((6, "{actor}"), (14, "{actor}.rank1")):
            infos.append(trainer_host_after(run_dir, at_step, infos[-1]["actor"] if infos else None, proc))
            ray.kill(ray.get_actor(actor.format(actor=infos[-1]["actor"])))
            killed.append(steps_recorded(run_dir))
    finally:
        ray.shutdown()
        out, _ = proc.communicate(timeout=800)
    assert proc.returncode == 0, out[-3000:]
    record("steps_left_at_trainer_rank_kill", steps - killed[-1], threshold=0)
    assert [len(set(info["rank_nodes"])) for info in infos] == [2, 2]  # each rank on its own node
    assert infos[0]["dir"] == str(storage / "job")
    assert str(tmp_path / "runs") not in (storage / "job" / "config.json").read_text()
    assert valid_steps(storage / "job" / "checkpoints")[-1] == steps
    last = storage / "job" / "checkpoints" / f"step_{steps:06d}"
    assert len(list((last / "optimizer").glob("*.distcp"))) == 2  # a shard per rank
    assert not (run_dir / "checkpoints").exists() and not list((run_dir / "weights").glob("*.safetensors"))
    events = read_events(run_dir)  # the trainer's own events came back through the link
    assert [e["target"] for e in events if e["event"] == "role_restarted"] == ["trainer", "trainer"]
    assert len([e for e in events if e["event"] == "trainer_resumed"]) == 2
    replayed = [e["identical"] for e in events if e["event"] == "version_replayed"]
    assert replayed and all(replayed)
    log = (run_dir / "logs" / "trainer.log").read_text()
    assert "trainer: resuming from" in log and "trainer: 2 rank(s)" in log
    assert_nothing_lost(run_dir)


@pytest.mark.xdist_group("ray")
def test_ray_placement_that_cannot_be_met_is_one_line(tiny_model, tmp_path, ray_cluster):
    proc = train_cli(tmp_path, tiny_model, **{"run.launcher": "ray", "run.ray_address": ray_cluster,
                                              "inference.ray_resources": "{node_c = 1}",
                                              "run.ray_placement_timeout": 3.0})
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, out[-2000:]
    assert "Ray could not place the run's roles within 3s" in out and "node_c" in out


def test_ray_address_nobody_answers_is_one_line_before_the_run(tiny_model, tmp_path):
    """ray.init waits minutes on such an address: the probe says so at once, before any run directory."""
    pytest.importorskip("ray")
    proc = train_cli(tmp_path, tiny_model, **{"run.launcher": "ray", "run.ray_address": "127.0.0.1:1"})
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, out[-2000:]
    assert "run.ray_address = '127.0.0.1:1': no Ray cluster answers there" in out
    assert not (tmp_path / "runs" / "job").exists()
