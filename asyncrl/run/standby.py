"""A warm spare: a process that has already imported what every role needs and waits to become
whichever role dies next.

A cold restart spends most of its time importing torch and transformers (~6 s on 2 cores); the
spare has done that before anything fails, so a restarted role is back in about a second. It
reads one JSON line on stdin, {"role": ..., "env": {...}}, moves its output to that role's log
and runs the role's module as `__main__`. End of input means it is not needed: it exits.

Run as `python -m asyncrl.run.standby RUN_DIR` (the launcher starts one after the roles are up).
"""
from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

from asyncrl.rundir import RunDir


def warm_up(run_dir: Path) -> None:
    import reasoning_gym  # noqa: F401
    import torch  # noqa: F401
    from transformers import AutoConfig, AutoTokenizer  # noqa: F401
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    import asyncrl.inference.server  # noqa: F401
    import asyncrl.orchestrator.main  # noqa: F401
    import asyncrl.trainer.main  # noqa: F401
    from asyncrl.config import read_run_config

    config = AutoConfig.from_pretrained(read_run_config(run_dir).model.path)
    MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]  # imports the model's modeling code


def main(run_dir: str) -> None:
    from asyncrl.run.processes import command

    warm_up(Path(run_dir))
    print("standby: warm", flush=True)  # (the supervisor reads this line: not a log message)
    line = sys.stdin.readline()
    if not line:
        return
    order = json.loads(line)
    os.environ.update(order["env"])
    log = os.open(
        RunDir(run_dir).log(order['role']), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644
    )
    os.dup2(log, 1)
    os.dup2(log, 2)
    module, *args = command(order["role"], Path(run_dir))[2:]  # (python -m MODULE ARGS...)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1])
