"""Shared fixtures: one tiny warm-started policy for the whole session, and a job runner."""
from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import pytest

from asyncrl.config import load_config

TESTS = Path(__file__).parent
# the agent tests' policy: one token per character and the compact tool format of the tiny examples
CHAR_POLICY = {"tokenizer": "char", "architecture": "llama", "kv_heads": 4}


def built_once(tmp_path_factory, name: str, build) -> str:
    """A model directory `build(out)` writes once for the whole run: under pytest-xdist the workers share
    the base temp directory's parent, and the first to ask builds it while the others wait on its lock."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    out = root / "models" / name
    out.parent.mkdir(exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if not (out / "config.json").exists():
            build(out)
    return str(out)


BUILT = {"tiny_model", "calc_model", "vision_model"}  # the session's built policies (built_once)


def pytest_collection_modifyitems(items):
    """The order two workers finish soonest in: one test that needs the default policy first, so that the
    first worker builds it (~2.5 min) at once while the other runs the tests that need no built policy
    (279 of 377, ~4 min of a worker); then those; then the long tests (marked `long`), so that none is
    left to end the suite alone, a group's first (the Ray tests share one worker and its cluster: two
    clusters side by side slowed both runs); then the rest. (With the built tests last, both workers
    reached the build together and one waited ~170 s on its lock.)"""
    def needs_built(item) -> bool:
        return bool(BUILT & set(item.fixturenames))

    def long(item) -> bool:
        return item.get_closest_marker("long") is not None

    first = next((i for i in items if "tiny_model" in i.fixturenames and not long(i)), None)
    def grouped(item) -> bool:
        return item.get_closest_marker("xdist_group") is not None

    items.sort(key=lambda item: (item is not first, needs_built(item), not long(item), not grouped(item)))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """The default tiny policy, built once (~2.5 min on 2 cores); ASYNCRL_TEST_MODEL reuses a built one."""
    given = os.environ.get("ASYNCRL_TEST_MODEL")
    if given:
        return given
    from asyncrl.policy.warmstart import warmstart

    return built_once(tmp_path_factory, "tiny",
                      lambda out: warmstart(load_config(), out, log=lambda *a, **k: None))


@pytest.fixture(scope="session")
def calc_model(tmp_path_factory) -> str:
    """A smaller tiny policy warm-started on the calculator demonstrations (~35 s): it writes tool
    calls in the compact format some of the time. ASYNCRL_TEST_CALC_MODEL reuses a built one."""
    given = os.environ.get("ASYNCRL_TEST_CALC_MODEL")
    if given:
        return given
    from asyncrl.policy.warmstart import warmstart

    cfg = load_config(
        overrides={
            "warmstart": {
                "demos": str(TESTS.parent / "examples/agents/calculator.py") + ":demos",
                "steps": 300,
                "batch_size": 32,
                "hidden_size": 64,
                "layers": 2,
                "lr": 3e-3,
                **CHAR_POLICY,
            }
        }
    )
    return built_once(tmp_path_factory, "calc", lambda out: warmstart(cfg, out, log=lambda *a, **k: None))


@contextlib.contextmanager
def inference_server(tmp_path: Path, model: str):
    """A real inference server process for `model`: yields (url, run_dir)."""
    from asyncrl.run.launcher import prepare_run_dir
    from asyncrl.run.processes import start_role, stop, wait_for_replica

    run_dir = prepare_run_dir(job_config(tmp_path, model))
    proc = start_role("inference-0", run_dir, threads=1)
    try:
        yield wait_for_replica(proc, run_dir, 60), run_dir
    finally:
        stop({"inference-0": proc})


def job_config(tmp_path: Path, model: str, **overrides):
    """A short run's config: small batches, a run dir under tmp_path, overrides as {"a.b": v}."""
    return load_config(overrides=job_args(tmp_path, model, **overrides))


def job_args(tmp_path: Path, model: str, **overrides) -> list[str]:
    """The same as command-line overrides: ["--run.root", "...", ...]."""
    base = {
        "run.root": str(tmp_path / "runs"), "run.name": "job", "run.steps": 6, "model.path": model,
        "rollout.prompts_per_step": 4, "rollout.group_size": 4, "task.eval_size": 50,
        "timeouts.startup": 60, "timeouts.train_step": 120, "timeouts.batch": 120,
        # fixed, so that runs do not each time the roles to plan a split (test_e2e covers the planner)
        "trainer.threads": 1, "inference.threads": 1,
    }
    base.update(overrides)
    return [
        x
        for k, v in base.items()
        for x in (f"--{k}", v if isinstance(v, str) else repr(v).lower() if isinstance(v, bool) else str(v))
    ]


def stop_when(run_dir: Path, ready, seconds: float, what: str) -> int:
    """Stop the run (the control API's POST /stop) once `ready()` holds; the step count it ends at. A test
    that needs a run only until something has happened (a role back, a replica joined) ends it there,
    instead of sizing run.steps for the slowest machine it may meet."""
    from asyncrl.control import ctl
    from asyncrl.files import poll

    poll(ready, seconds, what, every=0.2)
    return ctl.request(run_dir, "POST", "/stop")["value"]


def events_of(run_dir: Path, kind: str, **match) -> list[dict]:
    """The run's events of `kind` whose fields include `match`."""
    from asyncrl.observe.events import read_events

    return [e for e in read_events(run_dir) if e["event"] == kind and match.items() <= e.items()]


@pytest.fixture
def record(request):
    """record(name, value, threshold): a quantity this test measured and the bound it asserts, appended
    to the JSONL file ASYNCRL_TEST_RECORD names (benchmarks/flakiness.py reports each one's spread)."""
    path = os.environ.get("ASYNCRL_TEST_RECORD")

    def write(name: str, value: float, threshold: float | None = None) -> None:
        if path:
            with open(path, "a") as f:
                f.write(json.dumps({"test": request.node.nodeid, "name": name, "value": value,
                                    "threshold": threshold}) + "\n")
    return write


@pytest.fixture
def tests_on_path(monkeypatch):
    """Role processes can import helper modules from tests/ (e.g. a verifier that raises)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), *sys.path]))
    monkeypatch.syspath_prepend(str(TESTS))


@pytest.fixture(scope="session")
def ray_cluster():
    """One Ray cluster for each pytest process that runs a Ray test (under pytest-xdist each worker may
    start its own: measured, the Ray tests pass with two clusters side by side): a head and a simulated
    second node carrying the resource `node_b` (the test pins inference replicas there); each node has one
    `trainer_slot` (a trainer of two ranks asking for one per rank spans both nodes). Logical CPUs are
    over-declared: the roles' thread counts are what they ask for, not what this machine has. Yields its
    address."""
    pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    node = {"num_cpus": 8, "object_store_memory": 128 * 2**20}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False,
                                                            "resources": {"trainer_slot": 1}})
    cluster.add_node(**node, resources={"node_b": 4, "trainer_slot": 1})
    cluster.wait_for_nodes()
    try:
        yield cluster.address
    finally:
        cluster.shutdown()
