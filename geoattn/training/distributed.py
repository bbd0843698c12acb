"""DDP set-up and teardown for ``torchrun`` (gloo on CPU, nccl on CUDA).

Every rank draws the same global batch from the same generator and keeps its own slice, so a run on
R ranks follows the same trajectory as one process with the same global batch.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job; the defaults describe a single process."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, x: Tensor) -> Tensor:
        """This rank's rows of a global batch ``(B, ...)`` -> ``(B / world_size, ...)``."""
        if x.shape[0] % self.world_size:
            raise ValueError(f"batch of {x.shape[0]} does not split evenly over {self.world_size} ranks")
        n = x.shape[0] // self.world_size
        return x[self.rank * n : (self.rank + 1) * n]


def from_environment() -> DistEnv:
    """The job described by torchrun's environment variables (a single process when they are absent)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return DistEnv()
    return DistEnv(int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0")), world_size)


def init(env: DistEnv, device: str) -> torch.device:
    """Join the process group (when distributed) and return this rank's device."""
    on_cuda = device.startswith("cuda")
    if not env.enabled:
        return torch.device(device)
    if on_cuda:
        torch.cuda.set_device(env.local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if on_cuda else "gloo")
    return torch.device(f"cuda:{env.local_rank}") if on_cuda else torch.device("cpu")


def all_reduce_mean(x: Tensor, env: DistEnv) -> Tensor:
    """The mean of ``x`` over ranks (``x`` itself when not distributed)."""
    if not env.enabled:
        return x
    x = x.clone()
    dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x / env.world_size


def any_rank(flag: bool, env: DistEnv, device: torch.device) -> bool:
    """True when ``flag`` is set on any rank (all ranks then stop at the same iteration)."""
    if not env.enabled:
        return flag
    t = torch.tensor([float(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def barrier(env: DistEnv) -> None:
    if env.enabled and dist.is_initialized():
        dist.barrier()


def teardown_and_exit(code: int) -> None:
    """Leave the process group deterministically and exit with ``code`` (never returns).

    On the CPU with gloo (docs/tasks.md#distributed-runs): destroying the group with a live DDP wrapper, or
    returning through the interpreter's normal shutdown, aborts a rank now and then. The caller drops its DDP
    wrapper first; then barrier, destroy, flush, and ``os._exit`` skip the racy interpreter teardown.
    """
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
