"""The trainer as a group of ranks (trainer.ranks = M): one process per rank, one torch.distributed group.

The trainer role's process is rank 0, the leader: it starts ranks 1..M-1 as its own children (each dies
with it), and dies itself, with the child's exit code, the moment one of them dies — so a dead rank takes
the whole group down and the supervisor restarts it from the last checkpoint, as it restarts a one-rank
trainer. Under Ray the leader's host starts each other rank in a host of its own, on any node
(cluster/ray_host.py), and stops the group the same way. Every collective has the group's timeout (gloo
on CPU, NCCL on GPUs; neither waits forever).

Only the leader touches the run directory (batches in, versions and checkpoints out, heartbeat, events);
the others get each batch by broadcast. The model is sharded with FSDP2 (`fully_shard` per decoder block
and at the root, on a one-dimensional device mesh). A step splits every minibatch's rows between the
ranks; each rank's per-token logprobs are gathered (with their gradient) so that the objective sees the
whole minibatch on every rank — batch statistics (M2PO's second moment, VCPO's effective sample size),
metrics and the loss normalisation are exactly one rank's — and each rank back-propagates the loss of its
own rows: the gradients, summed across ranks, are the one-rank gradients.

With one rank every collective is the identity and nothing is sharded: the same code path.
"""
from __future__ import annotations

import datetime
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from asyncrl.run.ports import free_port

RANK_ENV = "ASYNCRL_TRAINER_RANK"
HOSTED_ENV = "ASYNCRL_TRAINER_RANKS_HOSTED"  # set: the launcher started every rank (Ray: a host per rank)


class Ranks:
    def __init__(self, rank: int = 0, size: int = 1, checkpoint_group=None):
        self.rank, self.size = rank, size
        self.checkpoint_group = checkpoint_group  # checkpoints are written over their own group (a thread)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def rows(self, n: int) -> slice:
        """This rank's contiguous share of n rows."""
        bounds = [round(i * n / self.size) for i in range(self.size + 1)]
        return slice(bounds[self.rank], bounds[self.rank + 1])

    def gather_rows(self, local: torch.Tensor, n: int) -> torch.Tensor:
        """Every rank's rows, in rank order ([n, ...]); the gradient flows back to the rank that owns each."""
        if self.size == 1:
            return local
        width = -(-n // self.size)  # all_gather needs one shape: pad each share to the largest
        padded = torch.nn.functional.pad(local, (0, 0) * (local.dim() - 1) + (0, width - local.shape[0]))
        from torch.distributed.nn.functional import all_gather

        parts = all_gather(padded)
        return torch.cat([p[: self._count(r, n)] for r, p in enumerate(parts)])

    def _count(self, rank: int, n: int) -> int:
        return round((rank + 1) * n / self.size) - round(rank * n / self.size)

    def own_loss(self, part: torch.Tensor) -> torch.Tensor:
        """This rank's part of the loss, scaled so that FSDP's average of the ranks' gradients is the
        gradient of the sum of the parts: the one-rank loss."""
        return part * self.size

    def total(self, value: torch.Tensor) -> torch.Tensor:
        """The sum over ranks (no gradient)."""
        if self.size == 1:
            return value.detach()
        value = value.detach().clone()
        dist.all_reduce(value)
        return value

    def all(self, flag: bool) -> bool:
        return bool(self.total(torch.tensor(0.0 if flag else 1.0)) == 0)

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()

    def broadcast(self, obj):
        """The leader's `obj` on every rank."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def shard(self, model, mixed_precision: str) -> None:
        """FSDP2 over the group: each decoder block, then the root. FSDP averages the ranks' gradients (a
        sum would need a reduce op gloo lacks): `own_loss` scales each rank's part to match."""
        if self.size == 1:
            return
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        device = next(model.parameters()).device.type
        mesh = init_device_mesh(device, (self.size,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if mixed_precision == "bf16" else MixedPrecisionPolicy()
        for block in decoder_blocks(model):
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)

    # --- the whole weights, for publishing and checkpoints (one full copy, on the leader) -------------
    def full_model_state(self, model, keys: list[str] | None) -> dict[str, torch.Tensor]:
        """The weights to publish, on the leader ({} on the others); `keys`: those of the unsharded
        model's published state (tied weights once)."""
        from asyncrl.transports import weights

        if self.size == 1:
            if keys is None:
                return weights.model_state(model)
            # only the published tensors come to the host (trainer.lora: the adapters, not a GPU's weights)
            state = model.state_dict()
            return {k: state[k].detach().cpu().contiguous() for k in keys}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {k: state[k].contiguous() for k in keys} if self.leader else {}

    def close(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def decoder_blocks(model) -> list[torch.nn.Module]:
    """The repeated blocks of a Hugging Face decoder (Llama, Qwen2/3, ...: model.model.layers)."""
    inner = getattr(model, "model", None) or getattr(model, "transformer", None)
    blocks = getattr(inner, "layers", None) or getattr(inner, "h", None)
    if blocks is None:
        raise ValueError(f"trainer.ranks > 1: cannot find the decoder blocks of {type(model).__name__} "
                         "(looked for model.layers and transformer.h)")
    return list(blocks)


def join_group(cfg, run_dir: Path, log=print) -> Ranks:
    """This process's place in the trainer's group; the leader starts the other ranks first, unless the
    launcher started them (HOSTED_ENV, with MASTER_ADDR and MASTER_PORT naming the leader)."""
    size = cfg.trainer.ranks
    if size == 1:
        return Ranks()
    rank = int(os.environ.get(RANK_ENV, "0"))
    if rank == 0 and not os.environ.get(HOSTED_ENV):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        _start_followers(run_dir, size, log)
    timeout = datetime.timedelta(seconds=cfg.timeouts.batch + cfg.timeouts.step_compute)
    device = cfg.trainer.device
    backend = "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"
    if device.startswith("cuda"):
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, rank=rank, world_size=size, timeout=timeout)
    checkpoints = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=cfg.timeouts.checkpoint))
    return Ranks(rank, size, checkpoints)



def _start_followers(run_dir: Path, size: int, log) -> None:
    """Ranks 1..size-1 as children of this process (bound to its life); a watcher ends this process with
    the exit code of the first that dies, so the group never waits on a dead rank."""
    from asyncrl.run.processes import spawn

    followers = {}
    for rank in range(1, size):
        env = dict(os.environ, **{RANK_ENV: str(rank)})
        followers[rank] = spawn([sys.executable, "-m", "asyncrl.trainer.main", str(run_dir)], env=env,
                                stdout=sys.stdout, stderr=subprocess.STDOUT)

    def watch() -> None:
        while followers:
            for rank, proc in list(followers.items()):
                code = proc.poll()
                if code == 0:  # done: the run's last step is behind it
                    del followers[rank]
                elif code is not None:
                    log(f"trainer: rank {rank} exited with code {code}; the group stops with it")
                    os._exit(code if code > 0 else 1)
            time.sleep(0.2)

    threading.Thread(target=watch, daemon=True, name="ranks").start()
