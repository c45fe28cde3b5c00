"""Bad input gets a clear error naming what is wrong, and nothing hangs."""
import json
import socket
import subprocess
import sys
import threading
import time

from asyncrl.launcher import prepare_run_dir, train
from conftest import job_config


def cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "asyncrl.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_config_typo(tmp_path):
    out = cli("train", "--rollout.max_stalenes", "1", "--run.root", str(tmp_path))
    assert out.returncode == 2
    assert "unknown key 'rollout.max_stalenes'" in out.stderr and "max_staleness" in out.stderr


def test_missing_model_path(tmp_path):
    out = cli("train", "--model.path", str(tmp_path / "no-such-model"), "--run.root", str(tmp_path))
    assert out.returncode == 2
    assert "no-such-model" in out.stderr and "is not a local directory" in out.stderr


def test_unknown_dataset(tmp_path):
    out = cli("train", "--task.name", "no_such_task", "--run.root", str(tmp_path))
    assert out.returncode == 2
    assert "task.name = 'no_such_task'" in out.stderr and "chain_sum" in out.stderr


def test_verifier_that_raises_drops_that_sample_and_the_run_goes_on(tiny_model, tmp_path, tests_on_path):
    cfg = job_config(tmp_path, tiny_model, **{"task.verifier": "faulty:flaky_verifier", "run.steps": 4})
    run_dir = train(cfg, log=lambda *a, **k: None)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    errors = [e for e in events if e.get("reason") == "verifier_error"]
    assert errors and all("ValueError: cannot parse" in e["error"] and e["prompt_id"] % 3 == 0 for e in errors)
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"step"' in line]
    assert len(steps) == 4


def test_silent_inference_server_fails_the_orchestrator_within_its_deadline(tmp_path):
    """A server that accepts connections and never answers: a named error, not a hang."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held = []
    threading.Thread(target=lambda: [held.append(listener.accept()) for _ in range(16)], daemon=True).start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    cfg = job_config(tmp_path, "unused", **{"timeouts.http": 1.0, "timeouts.startup": 3.0})
    run_dir = prepare_run_dir(cfg)
    (run_dir / "inference.json").write_text(json.dumps({"url": url}))
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "asyncrl.orchestrator.main", str(run_dir)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert time.monotonic() - start < 30
    assert f"inference server {url} not healthy after 3s" in out.stderr
    listener.close()
