"""Explicit tensor-parallel context: no module globals, so one block can be built alone in a test."""
import os
import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist


@dataclass
class ParallelContext:
    world_size: int = 1
    rank: int = 0
    group: Optional[object] = None  # torch.distributed process group (None = default group)

    @classmethod
    def single(cls) -> "ParallelContext":
        return cls(1, 0, None)

    @classmethod
    def from_env(cls, device: str = "cpu") -> "ParallelContext":
        """Initialise torch.distributed from torchrun's environment (gloo on CPU, nccl on CUDA)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        if world > 1 and not dist.is_initialized():
            # This module's functions take `group=group.WORLD` as a default, evaluated when it is imported.
            # Imported after init (torch._dynamo imports it), they would hold the default group past
            # destroy_process_group: its backend threads would then be torn down with the interpreter, at
            # times with "terminate called without an active exception" (SIGABRT) once the run is done.
            import torch.distributed.nn.functional  # noqa: F401
            dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
        return cls(world, rank, None)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_cat(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast_object(self, obj, src: int = 0):
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def from_rank0(self, fn, catch=(ValueError, OSError)):
        """Run fn on rank 0 and broadcast its result, or the message of its error, so that every rank stops
        with it (no rank left waiting in a collective). -> (value, None) or (None, message)."""
        payload = (None, None)
        if self.rank == 0:
            try:
                payload = (fn(), None)
            except catch as e:
                if isinstance(e, OSError) and e.filename:
                    payload = (None, f"{e.strerror or e}: {e.filename}")
                else:
                    payload = (None, str(e))
        return self.broadcast_object(payload)

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)


def shutdown(ok: bool) -> None:
    """End torch.distributed if it was started: a barrier first when this rank finished well (nobody leaves
    while a peer still needs it; after an error the peers stop on their own), then destroy_process_group,
    which releases the backend and joins its threads while the interpreter is still whole."""
    if dist.is_available() and dist.is_initialized():
        if ok:
            dist.barrier()
        dist.destroy_process_group()


class RankLog:
    """Prints on rank 0 only (errors: on every rank, so each process says why it stops)."""

    def __init__(self, rank: int):
        self.rank = rank

    @classmethod
    def from_env(cls) -> "RankLog":
        return cls(int(os.environ.get("RANK", "0")))

    def info(self, *parts: Any) -> None:
        if self.rank == 0:
            print(*parts, flush=True)

    def warning(self, msg: str) -> None:
        if self.rank == 0:
            _line(f"warning: {msg}")

    def error(self, msg: str) -> None:
        prefix = f"[rank {self.rank}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
        _line(f"{prefix}error: {msg}")


def _line(text: str) -> None:
    """One write per line: the ranks share stderr, and print() writes the text and the newline apart, so two
    ranks' messages could interleave on one line."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()
