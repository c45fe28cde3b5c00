"""Errors that no restart can fix, and how a role ends the run with one.

A role that restarts after a deterministic error (a verifier that returns a string, weights that
turned NaN, a run that cannot accept a single sample) meets the same error again: restarting it
only hides the reason behind `run.max_restarts` restarts. Such an error is a `FatalError`. The
role writes its sentence to `failure.json` and exits with FATAL_EXIT; the supervisor then stops
the run at once with that sentence on the console instead of restarting the role.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

from asyncrl.files import write_atomic
from asyncrl.observe.events import EventLog
from asyncrl.run import heartbeat
from asyncrl.rundir import RunDir

FATAL_EXIT = 3


class FatalError(RuntimeError):
    """The same inputs would fail the same way after a restart."""


class ContractError(FatalError):
    """A function the user supplied (verifier, objective, agent, tool) returned what its contract
    does not allow."""


def read_failure(run_dir: str | Path) -> dict | None:
    try:
        return json.loads(RunDir(run_dir).failure.read_text())
    except (OSError, ValueError):
        return None


def configure_logging(run_dir: str | Path) -> None:
    """A role's messages go to its log (stdout) at `run.log_level` and above; other libraries' at
    warnings and above, whatever the level (their info is request-by-request noise)."""
    from asyncrl.config import read_run_config

    try:
        level = read_run_config(run_dir).run.log_level.upper()
    except Exception:  # (the config is checked where it is read for real; say everything until then)
        level = "INFO"
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout, force=True,
                        format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("asyncrl").setLevel(level)
    if level not in ("DEBUG", "INFO"):  # Hugging Face's loading bars: off, whether imported yet or not
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
        if "transformers" in sys.modules:
            sys.modules["transformers"].utils.logging.disable_progress_bar()


def run_role(role: str, run_dir: str | Path, main: Callable[[], None]) -> None:
    """Run a role's main; a FatalError ends the process with FATAL_EXIT after saying why."""
    configure_logging(run_dir)
    try:
        main()
        heartbeat.cover_exit(run_dir, role)
    except FatalError as e:
        traceback.print_exc()  # (into the role's log: where in the user's code)
        record = {"role": role, "error": str(e), "kind": type(e).__name__, "wall_time": time.time()}
        write_atomic(RunDir(run_dir).failure, json.dumps(record))
        EventLog(run_dir, role).write("run_stopped", reason=type(e).__name__, error=str(e))
        print(f"{role}: {e}", flush=True)
        sys.exit(FATAL_EXIT)
