"""Trainer checkpoints: written in the background, checksummed, renamed into place, keep-last-N.

`checkpoints/step_000040/` holds everything needed to continue after 40 trained steps, and is
itself a plain Hugging Face model directory (config.json, model.safetensors, tokenizer files):

    model.safetensors, config.json, tokenizer*   the policy after `step` updates (whole, from rank 0)
    optimizer/                                   AdamW's moments: a torch.distributed.checkpoint (DCP)
                                                 directory, one file per trainer rank holding its shard
    trainer_state.pt                             scheduler, RNG, step
    manifest.json                                step + sha256 of every other file; written last

Saving copies the state to host memory (the only time training waits), then a thread on every rank
writes its optimizer shard into a hidden temp directory (DCP, over a process group of its own so that
it never interleaves with training's collectives), and rank 0's thread adds the model, fsyncs it all
and renames it into place: a checkpoint exists completely or not at all. A checkpoint whose files do
not match its manifest is skipped for the one before it. DCP reshards on load, so a checkpoint written
by M ranks resumes under any other number: the optimizer is never gathered whole in one process.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file

from asyncrl.plugins import check_directory
from asyncrl.policy import lora
from asyncrl.rundir import CheckpointFiles, RunDir, checkpoint_dirs
from asyncrl.transports import weights

# DCP says so on every save and load of one process (trainer.ranks = 1), which is intended here
warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)


def check_storage(path: Path, overwrite: bool, where: str = "") -> bool:
    """Whether a new run may take <run.storage>/<run.name>: False if it is empty or absent, True if it holds
    an earlier asyncrl run's that --run.overwrite lets it delete; else ConfigError. (The launcher asks
    where the driver sees the path, the trainer's Ray host on its own node: `where` names that node.)"""
    from asyncrl.config import ConfigError

    check_directory(path, f"run.storage / run.name{where}")
    if not path.exists() or not any(path.iterdir()):
        return False
    if not {"checkpoints", "config.json"} & {p.name for p in path.iterdir()}:
        raise ConfigError(f"run.storage: {path}{where} holds files but no asyncrl checkpoints or trainer "
                          "directory; asyncrl neither writes into it nor deletes it: choose another "
                          "--run.name or --run.storage")
    if not overwrite:
        raise ConfigError(f"run.storage: {path}{where} already holds a run's checkpoints; choose another "
                          "--run.name or --run.storage, or pass --run.overwrite true")
    return True


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _to_host(obj):
    """A deep copy with every tensor on the CPU (the state keeps changing while the copy is written)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_host(v) for v in obj)
    return obj


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def optimizer_state(model, optimizer) -> dict:
    """The optimizer's state keyed by parameter name; under FSDP each rank's shard of it (DTensors)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer)


def _dcp():
    """torch.distributed.checkpoint, imported by the trainer when it first saves or loads: 1.2 s of every
    other process's start (the orchestrator reads checkpoints' steps and manifests only)."""
    import torch.distributed.checkpoint as dcp

    return dcp


def _set_optimizer_state(model, optimizer, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, optim_state_dict=state)


def load_optimizer(path: Path, model, optimizer, group=None) -> None:
    """A checkpoint's optimizer into this rank's optimizer, resharded to today's ranks (DCP reads each
    rank's part of every moment whatever the rank count that wrote it). `group`: the ranks' process group
    (None: one process)."""
    if not CheckpointFiles(path).optimizer.exists():
        return _load_whole_optimizer(path, model, optimizer, group)
    state = optimizer_state(model, optimizer)  # the shapes and placements to fill (moments initialised)
    _dcp().load({"optimizer": state}, checkpoint_id=str(CheckpointFiles(path).optimizer), process_group=group,
                no_dist=group is None)
    _set_optimizer_state(model, optimizer, state)


def _load_whole_optimizer(path: Path, model, optimizer, group) -> None:
    """A checkpoint from before DCP: the whole optimizer inside trainer_state.pt, for one process."""
    if group is not None:
        raise ValueError(f"{path} keeps its optimizer whole in trainer_state.pt (written before sharded "
                         "checkpoints): resume it with trainer.ranks = 1; its next checkpoint "
                         "resumes under any rank count")
    state = load_trainer_state(path)["optimizer"]
    if all(isinstance(k, int) for k in state["state"]):  # keyed by position (before trainer ranks)
        optimizer.load_state_dict(state)
    else:
        _set_optimizer_state(model, optimizer, state)


def parts(model, optimizer, scheduler) -> tuple[dict, dict, dict, dict]:
    """CheckpointWriter.save's arguments for a model in one process (tests, benchmarks; the trainer builds
    them across its ranks)."""
    trainer = {"scheduler": scheduler.state_dict(), "rng": torch.get_rng_state()}
    return weights.model_state(model), model.config.to_dict(), trainer, optimizer_state(model, optimizer)


class CheckpointWriter:
    """At most one checkpoint in flight; `save` returns after the host copy, `wait` after the rename.

    Every rank of the trainer has one and calls `save` at the same step: `ranks` gives its place and the
    process group its optimizer shards are written over (None: one process, rank 0)."""

    def __init__(self, run_dir: str | Path, tokenizer, keep: int, deadline: float, ranks=None,
                 adapter_config=None):
        """`adapter_config` (trainer.lora: a peft LoraConfig): the model state saved is adapters, and a
        checkpoint is a PEFT directory instead of a whole model's."""
        self.run = RunDir(run_dir)
        self.adapter_config = adapter_config
        self.root = self.run.checkpoints
        self.tokenizer, self.keep, self.deadline = tokenizer, keep, deadline
        self.ranks = ranks
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.write_seconds: list[float] = []

    @property
    def leader(self) -> bool:
        return self.ranks is None or self.ranks.leader

    def save(self, step: int, model_state: dict, model_config: dict, trainer_state: dict,
             optimizer: dict) -> float:
        """Snapshot now (the published weights and the model's config, the scheduler and RNG states — read
        on rank 0 only — and this rank's optimizer shard), write in the background; returns the seconds
        training was stalled."""
        start = time.monotonic()
        self.wait()  # the previous one must be on disk before its successor is started
        tmp = CheckpointFiles.temporary(self.root, step)
        if self.leader:  # a fresh temp directory (a crash may have left one), before any rank writes in it
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        if self.ranks is not None:
            self.ranks.barrier()
        snapshot = {"optimizer": _to_host(optimizer)}
        if self.leader:
            snapshot.update(model=_to_host(model_state), config=model_config,
                            trainer=_to_host({"step": step, **trainer_state}))
        self.thread = threading.Thread(
            target=self._write, args=(step, tmp, snapshot), daemon=True, name="checkpoint"
        )
        self.thread.start()
        return time.monotonic() - start

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join(self.deadline)
            if self.thread.is_alive():
                raise TimeoutError(f"trainer: writing a checkpoint to {self.root} took over "
                                   f"{self.deadline:.0f}s (timeouts.checkpoint)")
            self.thread = None
        if self.error is not None:
            raise RuntimeError(f"trainer: writing a checkpoint failed: {self.error}") from self.error

    def _write(self, step: int, tmp: Path, snapshot: dict) -> None:
        try:
            start = time.monotonic()
            group = self.ranks.checkpoint_group if self.ranks is not None else None
            # returns on every rank once all shards and DCP's metadata are written
            _dcp().save({"optimizer": snapshot["optimizer"]},
                        checkpoint_id=str(CheckpointFiles(tmp).optimizer), process_group=group,
                        no_dist=group is None)
            if not self.leader:
                return
            final, written = self.run.checkpoint(step), CheckpointFiles(tmp)
            if self.adapter_config is not None:
                save_file(snapshot["model"], str(written.adapters), metadata={"format": "pt"})
                lora.write_config(self.adapter_config, tmp)
            else:
                save_file(snapshot["model"], str(written.model), metadata={"format": "pt"})
                written.config.write_text(json.dumps(snapshot["config"], indent=2))
            self.tokenizer.save_pretrained(tmp)
            torch.save(snapshot["trainer"], written.trainer_state)
            files = {str(f.relative_to(tmp)): _sha256(f) for f in _files(tmp)}
            written.manifest.write_text(json.dumps({"step": step, "files": files}))
            for f in _files(tmp):
                with open(f, "rb+") as handle:
                    os.fsync(handle.fileno())
            _fsync_dir(written.optimizer)
            shutil.rmtree(final, ignore_errors=True)  # a replayed step rewrites its checkpoint
            os.replace(tmp, final)
            _fsync_dir(self.root)
            for old in valid_steps(self.root, verify=False)[:-self.keep]:
                shutil.rmtree(self.run.checkpoint(old), ignore_errors=True)
            self.write_seconds.append(time.monotonic() - start)
        except BaseException as e:  # reported by the next save() or wait() on the training thread
            self.error = e


def _files(root: Path) -> list[Path]:
    return sorted(f for f in root.rglob("*") if f.is_file())


def valid_steps(root: Path, verify: bool = True) -> list[int]:
    """Steps of the complete checkpoints under `root`, oldest first."""
    return [step for step, path in checkpoint_dirs(root) if not verify or verify_checkpoint(path) is None]


def verify_checkpoint(path: Path) -> str | None:
    """None if every file matches the manifest; otherwise what is wrong."""
    manifest = CheckpointFiles(path).manifest
    if not manifest.exists():
        return "no manifest.json (written last, so the checkpoint is incomplete)"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError) as e:
        return f"unreadable manifest.json: {e}"
    for name, digest in files.items():
        if not (path / name).exists():
            return f"{name} is missing"
        if _sha256(path / name) != digest:
            return f"{name} does not match its checksum"
    return None


def latest(run_dir: str | Path, log=print) -> Path | None:
    """The newest checkpoint that verifies; each broken newer one is reported and skipped."""
    for _, path in reversed(checkpoint_dirs(RunDir(run_dir).checkpoints)):
        problem = verify_checkpoint(path)
        if problem is None:
            return path
        log(f"checkpoint {path} is corrupt ({problem}); falling back to the one before it")
    return None


def load_trainer_state(path: Path) -> dict:
    return torch.load(CheckpointFiles(path).trainer_state, weights_only=False)


def export(run_dir: str | Path, out: str | Path, step: int | None = None) -> Path:
    """Copy a verified checkpoint's model files to `out`: a plain HF model directory."""
    run = RunDir(run_dir)
    if not run.config.exists() and not run.checkpoints.exists():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no {run.config.name}, no "
                                f"{run.checkpoints.name}/)")
    path = run.checkpoint(step) if step is not None else latest(run_dir)
    if path is None or not path.exists():
        which = f"at step {step}" if step is not None else "that verifies"
        raise FileNotFoundError(f"no checkpoint {which} in {run.checkpoints}")
    problem = verify_checkpoint(path)
    if problem:
        raise ValueError(f"checkpoint {path} is corrupt: {problem}")
    out = Path(out)
    check_directory(out, "OUT_DIR")
    out.mkdir(parents=True, exist_ok=True)
    trainer_only = {CheckpointFiles(path).trainer_state, CheckpointFiles(path).manifest}
    adapters = CheckpointFiles(path).adapters.exists()
    if adapters:
        (out / ADAPTER_DIR).mkdir(exist_ok=True)
    for f in path.iterdir():
        if f.is_file() and f not in trainer_only:
            shutil.copy2(f, out / (f"{ADAPTER_DIR}/{f.name}" if adapters else f.name))
    if adapters:
        _write_merged(out / ADAPTER_DIR, out)
    return out


ADAPTER_DIR = "adapter"  # trainer.lora: export writes the merged model, and the PEFT directory inside it


def _write_merged(adapter_dir: Path, out: Path) -> None:
    """The base policy the adapters were trained on, with them merged in, as a plain HF directory."""
    from types import SimpleNamespace

    from asyncrl.policy.model import load_policy

    config = json.loads((adapter_dir / lora.CONFIG_FILE).read_text())
    model, tokenizer = load_policy(config["base_model_name_or_path"])
    merged = lora.Merged(model, SimpleNamespace(alpha=config["lora_alpha"], rank=config["r"]))
    merged.apply(weights.load(adapter_dir / lora.WEIGHTS_FILE), str(adapter_dir))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
