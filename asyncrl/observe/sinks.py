"""Metric sinks: where the run's records go besides metrics.jsonl (`run.sinks`).

    tensorboard  event files in RUN_DIR/tensorboard (`tensorboard --logdir runs/NAME/tensorboard`)
    wandb        a Weights & Biases run in project `run.wandb_project`, named after the run; online
                 when this machine is logged in (WANDB_API_KEY or `wandb login`), else offline in
                 RUN_DIR/wandb (`wandb sync` uploads it later); `run.wandb_mode` forces either

Both get exactly the records metrics.jsonl gets (per step, per evaluation), from the orchestrator: the
numbers at `step` (evaluations at the version they measured). Each is an optional dependency; a run
that asks for one that is not installed is refused before it starts. A sink that fails while the run
goes on is dropped with one line on the console and an event: training never stops for a sink.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import netrc
import os
from pathlib import Path

from asyncrl.config import Config, ConfigError
from asyncrl.rundir import RunDir

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


def check_installed(cfg: Config) -> None:
    """ConfigError naming what to install, for each sink asked for that cannot be imported."""
    missing = [name for name in cfg.run.sinks if importlib.util.find_spec(PACKAGES[name]) is None]
    if missing:
        raise ConfigError(f"run.sinks asks for {', '.join(missing)}, not installed here: "
                          f"pip install {' '.join(PACKAGES[m] for m in missing)} (or 'asyncrl[sinks]')")


AXES = ("step", "version", "eval_version")  # what a record is at, not what it measured


def _numbers(record: dict) -> dict[str, float]:
    return {k: float(v) for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in AXES}


def _axis(record: dict) -> str:
    """What a record is at: an evaluation at the version it measured, a step's record at its step."""
    return "eval_version" if "eval_version" in record else "step"


class TensorBoard:
    def __init__(self, cfg: Config, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(RunDir(run_dir).tensorboard), flush_secs=5)

    def write(self, record: dict) -> None:
        for key, value in _numbers(record).items():
            self.writer.add_scalar(key, value, record[_axis(record)], walltime=None)

    def close(self) -> None:
        self.writer.close()


def wandb_mode(setting: str) -> str:
    """online where this machine has W&B credentials, offline otherwise (for "auto")."""
    if setting != "auto":
        return setting
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        return "online" if netrc.netrc().authenticators("api.wandb.ai") else "offline"
    except (FileNotFoundError, netrc.NetrcParseError):
        return "offline"


class WandB:
    def __init__(self, cfg: Config, run_dir: Path):
        import wandb

        # one W&B run per asyncrl run: a restarted orchestrator or a resumed run goes on in it
        run_id = f"{cfg.run.name}-{hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:8]}"
        self.run = wandb.init(project=cfg.run.wandb_project, name=cfg.run.name, id=run_id, resume="allow",
                              dir=str(run_dir), mode=wandb_mode(cfg.run.wandb_mode),
                              config=cfg.model_dump(mode="json"), settings=wandb.Settings(silent=True))
        # an evaluation lands after later steps were logged: it has an axis of its own (W&B's own step
        # only grows, and would drop it)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        self.run.define_metric("eval_version")
        self.run.define_metric("eval_*", step_metric="eval_version")

    def write(self, record: dict) -> None:
        axis = _axis(record)
        self.run.log({**_numbers(record), axis: record[axis]})

    def close(self) -> None:
        self.run.finish()


KINDS = {"tensorboard": TensorBoard, "wandb": WandB}


class Sinks:
    def __init__(self, cfg: Config, run_dir: Path, events):
        self.events, self.open = events, {}
        for name in cfg.run.sinks:
            try:
                self.open[name] = KINDS[name](cfg, run_dir)
            except Exception as e:  # (a sink that cannot start must not stop the run either)
                self._drop(name, e, "start")

    def write(self, record: dict) -> None:
        for name, sink in list(self.open.items()):
            try:
                sink.write(record)
            except Exception as e:
                self._drop(name, e, "write")

    def close(self) -> None:
        for name, sink in list(self.open.items()):
            try:
                sink.close()
            except Exception as e:
                self._drop(name, e, "close")
        self.open.clear()

    def _drop(self, name: str, error: Exception, doing: str) -> None:
        self.open.pop(name, None)
        message = f"{type(error).__name__}: {error}"
        logging.getLogger("asyncrl.observe.sinks").warning(
            f"orchestrator: the {name} sink failed to {doing} ({message}); the run goes on without it")
        self.events.write("sink_failed", sink=name, doing=doing, error=message)
