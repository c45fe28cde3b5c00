"""The role starter: one process per run imports what the roles need once, then forks each role.

A role started as a new interpreter spends most of its CPU importing torch, transformers and the task
library: measured on 2 cores, 3-4 s of CPU for each of the three roles, against ~1.5 s of work in a
short run, and a restarted role paid it again. The starter pays it once per run. It imports, then
for each order read on stdin ({"role", "env"}) forks a child that moves into its own session, takes
the role's log as stdout and stderr and the order's environment, and runs the role's module as
`python -m` would (processes.command). It reports each child's pid when forked and its exit code
when reaped, one JSON line each on stdout; `Starter` and `ForkedRole` below are the supervisor's side.

A fork copies only the thread that forks, so the starter never starts one: torch creates its thread
pools at first use (each role sets its own thread count then), and nothing here touches an
accelerator. Run as `python -m asyncrl.run.starter RUN_DIR`; it exits at the end of its input.
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from asyncrl.files import process_exists
from asyncrl.rundir import RunDir


def warm_up(run_dir: Path) -> None:
    """Import what the roles import; a part that fails is left to the role that needs it."""
    import importlib

    for module in ("reasoning_gym", "asyncrl.inference.server", "asyncrl.trainer.main",
                   "asyncrl.orchestrator.main"):  # (torch and transformers with them)
        try:
            importlib.import_module(module)
        except Exception as e:  # (the role meets it again, and says so in its own log)
            print(f"starter: importing {module} failed: {type(e).__name__}: {e}", file=sys.stderr)
    try:  # the policy's modeling code (transformers imports it on first use): a local model only
        from transformers import AutoConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        from asyncrl.config import read_run_config

        path = read_run_config(run_dir).model.path
        if (Path(path) / "config.json").exists():
            MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(path))]
    except Exception as e:
        print(f"starter: the model's code was not imported ahead: {type(e).__name__}: {e}", file=sys.stderr)


def _report(record: dict) -> None:
    os.write(1, (json.dumps(record) + "\n").encode())


def _become(role: str, env: dict, run_dir: Path, starter: int) -> None:
    """In the child: the role's session, log, environment and arguments; then the role itself."""
    import runpy

    from setproctitle import setproctitle

    from asyncrl.run.processes import bind_to_parent, command

    os.setsid()
    bind_to_parent(starter)
    cmd = command(role, run_dir)
    setproctitle(" ".join(cmd))  # (what `ps` shows: the command it would have started cold with; set
    # before the environment changes, or setproctitle finds no room for it)
    log = os.open(RunDir(run_dir).log(role), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((null, 0), (log, 1), (log, 2)):
        os.dup2(fd, target)
    os.environ.clear()
    os.environ.update(env)
    module, *args = cmd[2:]  # (python -m MODULE ARGS...)
    sys.argv = [module, *args]
    sys.modules.pop(module, None)  # (run as __main__ afresh, as `python -m` does; its imports are warm)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _report({"pid": pid, "code": os.waitstatus_to_exitcode(status)})


def main(run_dir: str) -> None:
    warm_up(Path(run_dir))
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.05)
        _reap()
        if not readable:
            continue
        chunk = os.read(0, 65536)
        if not chunk:
            return  # the supervisor is done with it
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            order = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            starter, pid = os.getpid(), os.fork()
            if pid == 0:
                _become(order["role"], order["env"], Path(run_dir), starter)
                return  # (the role's main returned: the interpreter exits as it would have)
            _report({"role": order["role"], "pid": pid})


class ForkedRole:
    """A role the starter forked, with the part of subprocess.Popen's interface the supervisor uses."""

    def __init__(self, starter: "Starter", role: str, pid: int):
        self.starter, self.role, self.pid = starter, role, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.starter.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = time.monotonic() + (timeout if timeout is not None else float("inf"))
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.role, timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Starter:
    """The supervisor's side: the starter process, the orders written to it, the reports read back."""

    def __init__(self, run_dir: Path, env: dict):
        from asyncrl.run.processes import spawn

        with open(RunDir(run_dir).log("starter"), "a") as log:  # (the child keeps its own copy)
            self.proc = spawn([sys.executable, "-m", "asyncrl.run.starter", str(run_dir)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env)
        os.set_blocking(self.proc.stdout.fileno(), False)
        self.pending = b""
        self.forked: dict[str, list[int]] = {}  # role -> pids forked for it, in order
        self.codes: dict[int, int] = {}  # pid -> exit code

    def alive(self) -> bool:
        return self.proc.poll() is None

    def start(self, role: str, env: dict, deadline: float) -> ForkedRole:
        """Order `role` forked; its handle once the starter says its pid (the first order waits for the
        starter's imports). TimeoutError past `deadline` seconds, RuntimeError if the starter died."""
        known = len(self.forked.get(role, []))
        self.proc.stdin.write((json.dumps({"role": role, "env": env}) + "\n").encode())
        self.proc.stdin.flush()
        end = time.monotonic() + deadline
        while len(self.forked.get(role, [])) == known:
            self._read()
            if not self.alive():
                raise RuntimeError(f"the role starter exited with code {self.proc.returncode}")
            if time.monotonic() > end:
                raise TimeoutError(f"the role starter did not fork the {role} within {deadline:.0f}s")
            time.sleep(0.01)
        return ForkedRole(self, role, self.forked[role][-1])

    def exit_code(self, pid: int) -> int | None:
        self._read()
        if pid in self.codes:
            return self.codes[pid]
        if not self.alive() and not process_exists(pid):  # (its starter's death sent it SIGTERM)
            self.codes[pid] = -signal.SIGTERM
        return self.codes.get(pid)

    def _read(self) -> None:
        try:
            chunk = self.proc.stdout.read()
        except (BlockingIOError, ValueError):
            chunk = None
        self.pending += chunk or b""
        while b"\n" in self.pending:
            line, self.pending = self.pending.split(b"\n", 1)
            report = json.loads(line)
            if "code" in report:
                self.codes[report["pid"]] = report["code"]
            else:
                self.forked.setdefault(report["role"], []).append(report["pid"])

    def close(self, grace: float = 5.0) -> None:
        """End of input: the starter exits (its roles, if any are left, get SIGTERM with it)."""
        try:
            self.proc.stdin.close()
            self.proc.wait(grace)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        finally:
            self.proc.stdout.close()


if __name__ == "__main__":
    main(sys.argv[1])
