"""A role as an operating-system process: its command, environment and log, bound to the launcher's
life; stopping a set of them; waiting for a replica started on its own. The supervisor (supervisor.py)
and the Ray hosts (asyncrl/cluster/ray_host.py) both start roles with these.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from asyncrl.config import Config
from asyncrl.files import poll, write_atomic
from asyncrl.inference import replica
from asyncrl.rundir import RunDir

MODULES = {"trainer": "asyncrl.trainer.main", "orchestrator": "asyncrl.orchestrator"}


class RunError(RuntimeError):
    """The run cannot go on; the message says why and where to look."""


def command(role: str, run_dir: Path) -> list[str]:
    server = replica.server_of(role)
    if server is not None:
        kind, index = server
        return [sys.executable, "-m", "asyncrl.inference.server", str(run_dir), str(index),
                *(["--teacher"] if kind == "teacher" else [])]
    return [sys.executable, "-m", MODULES[role], str(run_dir)]


try:  # Linux: a child can ask the kernel for a signal when its parent dies
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):
    _PRCTL = None
_PR_SET_PDEATHSIG = 1


def bind_to_parent(parent: int) -> None:
    """SIGTERM when `parent` dies, however it dies (SIGKILL, OOM, a closed terminal), so that no role
    outlives the launcher to write into a run that a --resume starts again."""
    if _PRCTL is None:
        return
    _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # it died between the fork and the line above
        os._exit(1)


def spawn(cmd: list[str], **kwargs) -> subprocess.Popen:
    """A role's process: its own session (a Ctrl-C reaches the launcher, which stops it), and bound
    to the launcher's life."""
    launcher = os.getpid()
    return subprocess.Popen(cmd, start_new_session=True, preexec_fn=lambda: bind_to_parent(launcher),
                            **kwargs)


def role_env(threads: int, **extra: str) -> dict:
    return dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", **extra)


def start_role(role: str, run_dir: Path, threads: int, **env: str) -> subprocess.Popen:
    log = open(RunDir(run_dir).log(role), "a")  # a restarted role appends: its crash stays readable
    return spawn(command(role, run_dir), stdout=log, stderr=subprocess.STDOUT, env=role_env(threads, **env))


def start_vllm(cfg: Config, run_dir: Path, threads: int, index: int, port: int = 0,
               kind: str = "inference") -> subprocess.Popen:
    """Replica (or teacher) `index` as vLLM's OpenAI server on loopback; its URL goes to
    replicas/<index>.json (teachers/<index>.json) at once (the orchestrator waits for /health within
    timeouts.startup). A teacher serves teacher.path in teacher.dtype, scoring through prompt_logprobs."""
    from asyncrl.run.ports import free_port

    teacher = kind == "teacher"
    port = cfg.inference.port + index if cfg.inference.port and not teacher else port
    if port == 0:
        port = free_port(cfg.inference.host)
    model, dtype = (cfg.teacher.path, cfg.teacher.dtype) if teacher else (cfg.model.path, cfg.inference.dtype)
    extra = cfg.teacher.vllm_args if teacher else cfg.inference.vllm_args
    cmd = [cfg.inference.vllm_python or sys.executable, "-m", "vllm.entrypoints.openai.api_server",
           "--model", model, "--host", cfg.inference.host, "--port", str(port),
           "--dtype", dtype, "--logprobs-mode", "raw_logprobs" if teacher else "processed_logprobs",
           "--seed", str(cfg.run.seed), *extra]
    if cfg.inference.weight_transfer == "nccl" and not teacher:  # (trainer broadcasts: weight_sender.py)
        cmd += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
    if cfg.trainer.routing_replay and not teacher:  # (each choice's experts: vllm_client.py)
        cmd += ["--enable-return-routed-experts"]
    lora = cfg.trainer.lora.rank and not teacher  # (versions are adapters: vllm_client.py)
    if lora:  # vLLM takes ranks 8, 16, 32, ... as its largest
        largest = max(8, 2 ** (lora - 1).bit_length())
        cmd += ["--enable-lora", "--max-loras", "2", "--max-lora-rank", str(largest)]
    env = dict(
        os.environ,
        VLLM_SERVER_DEV_MODE="1",
        VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        OMP_NUM_THREADS=str(threads),
        **({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"} if lora else {}),
        # (vLLM 0.32 returns routed experts from its second model runner only)
        **({"VLLM_USE_V2_MODEL_RUNNER": "1"} if cfg.trainer.routing_replay and not teacher else {}),
    )
    if teacher:  # (the run's token guards it like the built-in servers' admin endpoints)
        env["VLLM_API_KEY"] = (RunDir(run_dir).token).read_text().strip()
    log = open(RunDir(run_dir).log(replica.role(index, kind)), "a")
    proc = spawn(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    info = replica.info_path(run_dir, index, kind)
    info.parent.mkdir(exist_ok=True)
    write_atomic(info, json.dumps({"url": f"http://{cfg.inference.host}:{port}", "engine": "vllm"}))
    return proc


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text().splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def stop(procs: dict[str, subprocess.Popen], grace: float = 5.0) -> None:
    for p in procs.values():
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs.values():
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def wait_for_replica(proc: subprocess.Popen, run_dir: Path, deadline: float, index: int = 0) -> str:
    """The URL of replica `index` started on its own (tests, benchmarks), once it serves."""
    def started() -> dict | None:
        if proc.poll() is not None:
            log = RunDir(run_dir).log(replica.role(index))
            raise RunError(f"the inference process exited with code {proc.returncode}; last lines of {log}:\n"
                           f"{tail(log)}")
        return replica.read_info(run_dir, index)

    try:
        return poll(started, deadline, "")["url"]
    except TimeoutError:
        raise RunError(f"the inference server did not start within {deadline:.0f}s") from None
