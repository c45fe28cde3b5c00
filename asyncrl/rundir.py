"""Every file of a run, named in one place: the on-disk format of a run directory.

`runs/<name>/` is the whole truth of a run (DESIGN.md). Every role finds what it reads and writes
through a `RunDir`; no other module joins a file name to a run's path. Under Ray, a replica's scratch
directory and the trainer's directory in run.storage have the same layout, holding the part their
role uses. Users and tools may rely on these names; `python -m asyncrl.rundir` prints this page
(docs/run_directory.md is it, checked by a test).

| path | written by | holds |
|---|---|---|
| `config.json` | launcher | the resolved config, every key |
| `token` | launcher | the run's secret (mode 0600): admin endpoints, the control API |
| `threads.json` | launcher | the thread plan each role runs with |
| `pids.json` | supervisor | each role's current process id |
| `ledger.db` (`-wal`, `-shm`) | orchestrator | the sample ledger (SQLite): prompts, samples, batches |
| `metrics.jsonl` | orchestrator | a record per step and per evaluation (a projection of the ledger) |
| `events.jsonl` | every role | a line per thing that happened (drops, restarts, changes) |
| `batches/step_{step:06d}.jsonl` | orchestrator | batch `step`: a settings line, then a trajectory a line |
| `images/{hash}` | orchestrator | an image a prompt shows, its bytes as given, named by their hash |
| `weights/v{version:06d}.safetensors` | trainer | version `version`'s full weights |
| `weights/v{version:06d}.patch.safetensors` | trainer | its sparse patch from the version before |
| `weights/v{version:06d}.json` | trainer | its marker (step metrics, hashes): written last |
| `weights/.spare.safetensors` | trainer | a pruned version's file, reused for the next version |
| `checkpoints/step_{step:06d}/` | trainer | the checkpoint after `step` steps (see below) |
| `logs/{role}.log` | each role | its output (a restarted role appends) |
| `heartbeats/{role}` | each role | touched from its main loop: the supervisor reads its age |
| `replicas/{index}.json` | each replica | its URL and process id once it serves |
| `teachers/{index}.json` | each teacher | its URL and process id once it serves (teacher.path) |
| `trainer.json` | supervisor | where the trainer's Ray host is (run.launcher = "ray") |
| `weight_sender.json` | trainer | the NCCL broadcast's address (inference.weight_transfer = "nccl") |
| `control.json` | orchestrator | the control API's address while the orchestrator runs |
| `paused.json` | orchestrator | whether the run is paused, and since when |
| `gateway.json` | orchestrator | the joined workers' gateway address while the orchestrator runs |
| `quarantine.json` | orchestrator | quarantined workers, their samples a recompute verified |
| `failure.json` | a failing role | the sentence a FatalError stopped the run with |
| `summary.json` | launcher | the end-of-run summary and the ledger's audit |
| `report.md`, `report.png` | launcher | the end-of-run report: a table and the curves |
| `tensorboard/`, `wandb/` | orchestrator | the metric sinks' files (run.sinks) |

With run.storage set, `checkpoints/` lives in `<run.storage>/<run.name>/` instead. Beside the run
directory, in run.root:

| path | written by | holds |
|---|---|---|
| `.{name}.lock` | launcher | held while a launcher runs the run |
| `.thread_plans.json` (`.thread_plans.lock`) | launcher | measured thread plans, by model and shape |

A checkpoint, `checkpoints/step_{step:06d}/`, is a plain Hugging Face model directory besides
(written as `.tmp_step_{step:06d}/`, renamed when complete):

| path | holds |
|---|---|
| `model.safetensors`, `config.json`, `tokenizer*` | the policy after `step` updates |
| `optimizer/` | AdamW's moments (torch.distributed.checkpoint, a file per rank) |
| `trainer_state.pt` | scheduler, RNG, step, live settings |
| `manifest.json` | the step and the sha256 of every other file: written last |
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

SPARE = ".spare.safetensors"


class RunDir:
    """The paths of one run directory (nothing is created or read here but config.json's run.storage)."""

    def __init__(self, path: str | Path | RunDir):
        self.path = path.path if isinstance(path, RunDir) else Path(path)

    def __fspath__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    def _at(self, name: str) -> Path:
        return self.path / name

    # --- written once, by the launcher ---------------------------------------------------------
    @property
    def config(self) -> Path:
        return self._at("config.json")

    @property
    def token(self) -> Path:
        return self._at("token")

    @property
    def thread_plan(self) -> Path:
        return self._at("threads.json")

    @property
    def pids(self) -> Path:
        return self._at("pids.json")

    @property
    def summary(self) -> Path:
        return self._at("summary.json")

    @property
    def report_md(self) -> Path:
        return self._at("report.md")

    @property
    def report_png(self) -> Path:
        return self._at("report.png")

    @property
    def lock(self) -> Path:
        return self.path.parent / f".{self.path.name}.lock"

    # --- the durable record --------------------------------------------------------------------
    @property
    def ledger(self) -> Path:
        return self._at("ledger.db")

    @property
    def metrics(self) -> Path:
        return self._at("metrics.jsonl")

    @property
    def events(self) -> Path:
        return self._at("events.jsonl")

    # --- the samples channel -------------------------------------------------------------------
    @property
    def batches(self) -> Path:
        return self._at("batches")

    def batch(self, step: int) -> Path:
        return self.batches / f"step_{step:06d}.jsonl"

    def batch_files(self) -> list[tuple[int, Path]]:
        """(step, path) of every batch file, in step order."""
        found = [(int(p.stem.removeprefix("step_")), p) for p in self.batches.glob("step_*.jsonl")]
        return sorted(found)

    @property
    def images(self) -> Path:
        return self._at("images")

    def image(self, digest: str) -> Path:
        return self.images / digest

    # --- the weights channel -------------------------------------------------------------------
    @property
    def weights(self) -> Path:
        return self._at("weights")

    def weights_file(self, version: int) -> Path:
        return self.weights / f"v{version:06d}.safetensors"

    def patch(self, version: int) -> Path:
        return self.weights / f"v{version:06d}.patch.safetensors"

    def marker(self, version: int) -> Path:
        return self.weights / f"v{version:06d}.json"

    @property
    def spare(self) -> Path:
        return self.weights / SPARE

    def published_versions(self) -> list[int]:
        """Versions whose marker is written, in order."""
        return sorted(int(p.stem[1:]) for p in self.weights.glob("v*.json"))

    # --- checkpoints ---------------------------------------------------------------------------
    @property
    def storage(self) -> Path:
        """Where the trainer keeps what outlives it: <run.storage>/<run.name> when the run sets
        run.storage, else the run directory itself."""
        try:
            run = json.loads(self.config.read_text())["run"]
        except (OSError, ValueError, KeyError, TypeError):  # (a bare directory: an export, a unit test)
            return self.path
        return Path(run["storage"]) / run["name"] if run.get("storage") else self.path

    @property
    def checkpoints(self) -> Path:
        return self.storage / "checkpoints"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"step_{step:06d}"

    def checkpoint_dirs(self) -> list[tuple[int, Path]]:
        return checkpoint_dirs(self.checkpoints)

    # --- the roles' presence -------------------------------------------------------------------
    @property
    def logs(self) -> Path:
        return self._at("logs")

    def log(self, role: str) -> Path:
        return self.logs / f"{role}.log"

    @property
    def heartbeats(self) -> Path:
        return self._at("heartbeats")

    def heartbeat(self, role: str) -> Path:
        return self.heartbeats / role

    @property
    def replicas(self) -> Path:
        return self._at("replicas")

    def replica(self, index: int) -> Path:
        return self.replicas / f"{index}.json"

    @property
    def teachers(self) -> Path:
        return self._at("teachers")

    def teacher(self, index: int) -> Path:
        return self.teachers / f"{index}.json"

    @property
    def trainer_info(self) -> Path:
        return self._at("trainer.json")

    @property
    def weight_sender(self) -> Path:
        return self._at("weight_sender.json")

    @property
    def control(self) -> Path:
        return self._at("control.json")

    @property
    def paused(self) -> Path:
        return self._at("paused.json")

    @property
    def gateway(self) -> Path:
        return self._at("gateway.json")

    @property
    def quarantine(self) -> Path:
        return self._at("quarantine.json")

    @property
    def failure(self) -> Path:
        return self._at("failure.json")

    @property
    def tensorboard(self) -> Path:
        return self._at("tensorboard")

    @property
    def wandb(self) -> Path:
        return self._at("wandb")


def spare_beside(file: Path) -> Path:
    """The spare weights file of the directory `file` is in (transports/weights.py writes over it)."""
    return file.parent / SPARE


def checkpoint_dirs(checkpoints: Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint directory under `checkpoints`, complete or not, in step order."""
    found = [(int(p.name.removeprefix("step_")), p) for p in checkpoints.glob("step_*")]
    return sorted(found)


class CheckpointFiles:
    """The files of one checkpoint directory, or of its temporary twin while it is written."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    @staticmethod
    def temporary(checkpoints: Path, step: int) -> Path:
        return checkpoints / f".tmp_step_{step:06d}"

    @property
    def model(self) -> Path:
        return self.path / "model.safetensors"

    @property
    def config(self) -> Path:
        return self.path / "config.json"

    @property
    def adapters(self) -> Path:
        """trainer.lora: the checkpoint is a PEFT directory (adapter_config.json beside it), not a model's."""
        return self.path / "adapter_model.safetensors"

    @property
    def weights(self) -> Path:
        """What the checkpoint holds of the policy: its adapters, or its whole weights."""
        return self.adapters if self.adapters.exists() else self.model

    @property
    def optimizer(self) -> Path:
        return self.path / "optimizer"

    @property
    def trainer_state(self) -> Path:
        return self.path / "trainer_state.pt"

    @property
    def manifest(self) -> Path:
        return self.path / "manifest.json"


class RunRoot:
    """run.root: the run directories, and what launches share beside them."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    @property
    def thread_plans(self) -> Path:
        return self.path / ".thread_plans.json"

    @property
    def thread_plans_lock(self) -> Path:
        return self.path / ".thread_plans.lock"

    def thread_probe_config(self, pid: int) -> Path:
        """The config a thread-planning subprocess of launcher `pid` reads (deleted after)."""
        return self.path / f".plan-{pid}.json"


def page() -> str:
    """docs/run_directory.md: this module's table."""
    return "# What a run directory holds\n\n" + (__doc__ or "").split("\n\n", 1)[1]


if __name__ == "__main__":
    sys.stdout.write(page())
