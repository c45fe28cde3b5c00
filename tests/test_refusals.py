"""Settings that can never work are refused before any role starts; a user's own file that is wrong is
named (file, line or row) with exit 2; a warm start never overwrites a policy; one row check for every
reader of a task; a role the OOM killer took is said, not restarted."""
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CHAR_POLICY, job_config

from asyncrl.config import ConfigError, load_config
from asyncrl.plugins import import_object
from asyncrl.rewards.tasks import BadTaskRow, load_tasks, servable_prompt
from asyncrl.run.memory import oom_verdict, peak_rss
from asyncrl.run.preflight import check_inputs
from asyncrl.run.sizes import _check_memory
from asyncrl.rundir import RunDir


def cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "asyncrl.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def quiet(*args, **kwargs):
    pass


@pytest.mark.parametrize("setting, value, said", [
    ("rollout.max_tokens", 10**9, "rollout.max_tokens = 1000000000 leaves no room for a prompt"),
    ("inference.max_prompt_tokens", 600, "lower inference.max_prompt_tokens to"),
    ("rollout.group_size", 10**6, "can never wait in a server whose queue holds"),
    ("rollout.prompts_per_step", 10**7, "GiB in the trainer; this machine has"),
])
def test_a_size_that_can_never_fit_is_refused_with_its_numbers(tiny_model, tmp_path, setting, value, said):
    with pytest.raises(ConfigError, match=said):
        check_inputs(job_config(tmp_path, tiny_model, **{setting: value}), quiet)


def test_the_memory_floor_refuses_only_what_cannot_fit(tiny_model, tmp_path):
    model = json.loads((Path(tiny_model) / "config.json").read_text())
    cfg = job_config(tmp_path, tiny_model)
    _check_memory(cfg, model, available=2**30)  # the default batch: a few MB
    with pytest.raises(ConfigError, match="raise trainer.minibatches"):
        _check_memory(cfg, model, available=2**10)


def test_an_explicit_port_that_is_taken_is_refused(tiny_model, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = cli("train", "--model.path", tiny_model, "--run.root", str(tmp_path),
                  "--inference.port", str(port))
    assert out.returncode == 2, out.stderr
    assert f"port {port} (replica 0) on 127.0.0.1 cannot be bound" in out.stderr


def test_a_users_own_files_are_named_with_what_is_wrong(tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n\x9e{"prompt": "x"}\n')
    with pytest.raises(ConfigError, match=r"tasks.jsonl' is not UTF-8 text: line 2, column 1 has byte 0x9e"):
        load_tasks(load_config(overrides={"task": {"name": "jsonl", "path": str(tasks)}}).task)
    verifier = tmp_path / "verifier.py"
    verifier.write_text("def verify(c, e):\n    return 1 +\n")
    with pytest.raises(ConfigError, match=r"verifier.py, line 2: invalid syntax"):
        import_object(f"{verifier}:verify", "task.verifier")
    broken = tmp_path / "broken.py"
    broken.write_text("import math\nvalue = math.sqrt(-1)\n")
    with pytest.raises(ConfigError, match=r"fails when imported: ValueError: .*broken.py, line 2"):
        import_object(f"{broken}:value", "task.verifier")
    config = tmp_path / "c.toml"
    config.write_bytes(b'[run]\nname = "\xe9"\n')
    with pytest.raises(ConfigError, match="c.toml' is not UTF-8 text: line 2, column 9"):
        load_config(config)
    (tmp_path / "afile").write_text("not a run")
    out = cli("train", "--run.root", str(tmp_path), "--run.name", "afile")
    assert out.returncode == 2 and "unexpected" not in out.stderr
    assert "afile' cannot be a directory: it is a file" in out.stderr


def test_every_reader_of_a_task_drops_a_huge_row_without_encoding_it(tiny_model):
    from transformers import AutoTokenizer

    class Rows:
        def where(self, entry, index=None):
            return f"row {index}"

        def item(self, index):
            return {"question": "x" * 5_000_000 if index else "1+1=", "answer": "2"}

        def prompt(self, entry):
            return entry["question"]

        def prompt_ids(self, entry, tokenizer):
            raise AssertionError("a huge prompt was encoded")

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    with pytest.raises(BadTaskRow, match="row 1: the prompt has 5000000 characters"):
        servable_prompt(Rows(), 1, tokenizer, 256)


def test_a_warm_start_skips_the_rows_rl_would_drop(tmp_path):
    from asyncrl.policy.warmstart import warmstart

    rows = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(40)]
    rows.insert(20, {"prompt": "9" * 2_000_000, "answer": "1"})
    data = tmp_path / "tasks.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    said = []
    cfg = load_config(overrides={"task": {"name": "jsonl", "path": str(data), "eval_size": 4},
                                 "warmstart": {"steps": 3, "batch_size": 64, "hidden_size": 32, "layers": 1,
                                               **CHAR_POLICY}})
    summary = warmstart(cfg, tmp_path / "policy", log=lambda *a, **k: said.append(" ".join(map(str, a))))
    assert summary["steps"] == 3
    assert any("row 21: the prompt has 2000000 characters" in line for line in said), said


def test_the_default_policy_is_never_overwritten_by_another_recipe(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    default = tmp_path / "models" / "tiny-default"
    default.mkdir(parents=True)
    (default / "warmstart.json").write_text(json.dumps({"recipe": {"another": "recipe"}}))
    (default / "model.safetensors").write_bytes(b"the demo's policy")
    cfg = load_config(overrides={"warmstart": {"steps": 2, "hidden_size": 32, "layers": 1, **CHAR_POLICY},
                                 "task": {"eval_size": 4}})
    resolved = check_inputs(cfg, quiet)
    assert resolved.model.path.startswith("models/tiny-") and resolved.model.path != "models/tiny-default"
    assert (tmp_path / resolved.model.path / "warmstart.json").exists()
    assert (default / "model.safetensors").read_bytes() == b"the demo's policy"
    assert check_inputs(cfg, quiet).model.path == resolved.model.path  # built once, then reused
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "warmstart.json").write_text(json.dumps({"recipe": {"another": "recipe"}}))
    demos = str(Path(__file__).parent.parent / "examples/agents/calculator.py") + ":demos"
    with pytest.raises(ConfigError, match="was warm-started by another recipe .* is not overwritten"):
        check_inputs(load_config(overrides={"model": {"path": str(mine)}, "warmstart": {"demos": demos}}),
                     quiet)


def test_an_oom_kill_is_told_from_another_sigkill():
    hold = "x = bytearray(300 * 2**20); import time; time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", hold])
    try:
        for _ in range(100):
            peak = peak_rss(child.pid) or 0
            if peak > 300 * 2**20:
                break
            subprocess.run(["sleep", "0.1"])
    finally:
        child.send_signal(signal.SIGKILL)
        code = child.wait()
    assert peak > 300 * 2**20 and code == -signal.SIGKILL
    assert oom_verdict(code, peak, limit=100 * peak, kernel_killed=False) is None  # a chaos kill: restart
    said = oom_verdict(code, peak, limit=peak, kernel_killed=False)
    assert said.startswith("was killed by the out-of-memory killer (peak resident memory 0.3 GiB")
    assert oom_verdict(code, peak, limit=100 * peak, kernel_killed=True) is not None
    assert oom_verdict(1, peak, limit=peak, kernel_killed=True) is None  # an error exit is not an OOM kill


def test_ctl_on_an_ended_run_and_export_of_a_non_run_say_so(tmp_path):
    run = RunDir(tmp_path / "job")
    run.path.mkdir()
    run.config.write_text("{}")
    run.summary.write_text("{}")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    run.control.write_text(json.dumps({"url": "http://127.0.0.1:9", "pid": gone.pid}))  # left by a killed run
    out = cli("ctl", str(run.path), "status")
    assert out.returncode == 2 and "the run has ended" in out.stderr, out.stderr
    out = cli("export", str(tmp_path), str(tmp_path / "out"))
    assert out.returncode == 2 and f"{tmp_path} is not a run directory" in out.stderr, out.stderr
    assert not os.path.exists(tmp_path / "out")
