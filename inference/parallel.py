"""Explicit tensor-parallel context: no module globals, so one block can be built alone in a test."""
import math
import os
import socket
import sys
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from .config import ConfigError

# A collective waits this long for a peer: the slowest rank may still be loading its shard (64 GB at W = 8)
# from network storage, where NCCL's default of 10 minutes would abort the run. generate.py --dist-timeout.
DIST_TIMEOUT_MIN = 60.0
# Every rank (and, with several nodes, every node) must arrive at the rendezvous within this many seconds.
JOIN_TIMEOUT_S = 300.0
# Rank 0's broadcasts may wait on a person (the chat's prompt): they go through a gloo group of their own with
# this deadline, so that an idle chat does not end at the collectives' --dist-timeout.
IDLE_TIMEOUT = timedelta(days=7)


class DistributedError(ConfigError):
    """A process group that cannot form (a rank or node missing, no rendezvous): one line on every rank that
    sees it (a ConfigError, so generate.py prints it without a traceback)."""


@dataclass
class ParallelContext:
    world_size: int = 1
    rank: int = 0
    group: Optional[object] = None  # torch.distributed process group (None = default group)
    # broadcast_object's gloo group (see IDLE_TIMEOUT), held weakly: torch.distributed owns it, and a group
    # kept alive past destroy_process_group keeps its threads until the interpreter ends (see shutdown)
    control: Optional[weakref.ref] = None

    @classmethod
    def single(cls) -> "ParallelContext":
        return cls(1, 0, None)

    @classmethod
    def from_env(cls, device: str = "cpu", timeout_min: float = DIST_TIMEOUT_MIN,
                 join_timeout_s: float = JOIN_TIMEOUT_S) -> "ParallelContext":
        """Initialise torch.distributed from torchrun's environment (gloo on CPU, nccl on CUDA): every rank
        first arrives at MASTER_ADDR:MASTER_PORT within `join_timeout_s` (else one line naming the ranks
        missing), then the group starts with `timeout_min` for every collective and store wait."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        if world > 1 and not dist.is_initialized():
            for what, v in (("--dist-timeout (minutes)", timeout_min), ("--join-timeout (seconds)",
                                                                       join_timeout_s)):
                if not (v > 0 and math.isfinite(v)):
                    raise DistributedError(f"{what} must be a positive number, got {v}")
            # This module's functions take `group=group.WORLD` as a default, evaluated when it is imported.
            # Imported after init (torch._dynamo imports it), they would hold the default group past
            # destroy_process_group: its backend threads would then be torn down with the interpreter, at
            # times with "terminate called without an active exception" (SIGABRT) once the run is done.
            import torch.distributed.nn.functional  # noqa: F401
            store = join_ranks(rank, world, join_timeout_s)
            timeout = timedelta(minutes=timeout_min)
            store.set_timeout(timeout)      # NCCL trades its ids through the store at the first collective
            dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", timeout=timeout,
                                    store=dist.PrefixStore("default_pg", store), rank=rank, world_size=world)
            return cls(world, rank, None, weakref.ref(dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)))
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
        control = self.control() if self.control is not None else None
        dist.broadcast_object_list(box, src=src, group=control if control is not None else self.group)
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


def join_ranks(rank: int, world: int, timeout_s: float) -> dist.Store:
    """The store at MASTER_ADDR:MASTER_PORT (torchrun's agent hosts it; without torchrun, rank 0), once every
    rank has arrived there; a DistributedError names the ranks still missing after `timeout_s`."""
    addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
    where, deadline = f"{addr}:{port}", time.monotonic() + timeout_s
    host = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    if not host and not reachable(addr, port, deadline):
        raise DistributedError(f"rank {rank} found no rendezvous at {where} within {timeout_s:g} s (is "
                               f"rank 0 running? check MASTER_ADDR, MASTER_PORT and the firewall)")
    try:
        store = dist.TCPStore(addr, port, world, host, timedelta(seconds=timeout_s), wait_for_workers=False,
                              multi_tenant=host)
    except dist.DistError as e:     # rank 0: the port is taken
        raise DistributedError(f"rank {rank}: no rendezvous at {where}: {first_line(e)}") from None
    # A torchrun restart reuses the agent's store: its own keys.
    arrived = dist.PrefixStore(f"inference/join/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    try:
        missing = arrive(arrived, rank, world, deadline, host)
    except dist.DistError as e:
        raise DistributedError(f"rank {rank} lost the rendezvous at {where}: {first_line(e)}") from None
    if missing:
        raise DistributedError(f"{span('rank', missing)} of {world} did not join within {timeout_s:g} s "
                               f"(rank {rank} waited on {where}; --join-timeout)")
    return store


def reachable(addr: str, port: int, deadline: float) -> bool:
    """Whether a TCP connection to addr:port opens before the deadline (tried again every 0.2 s). Probed
    here because TCPStore's own retries log a C++ stack trace at every failed try."""
    while True:
        wait = min(2.0, max(0.1, deadline - time.monotonic()))
        try:
            with socket.create_connection((addr, port), timeout=wait):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)


def arrive(store: dist.Store, me: int, count: int, deadline: float, host: bool) -> List[int]:
    """Participant `me` of 0..count-1 arrives, and waits until all have or the deadline passes -> those still
    missing. The host (whose store closes when it stops) first marks the attempt failed and gives the others
    up to 5 s to see it, so that they stop with the same message rather than a lost connection."""
    store.set(str(me), "1")
    missing = list(range(count))
    while True:
        missing = [k for k in missing if not store.check([str(k)])]
        if not missing or time.monotonic() >= deadline or not host and store.check(["failed"]):
            break
        time.sleep(0.05)
    if missing and host:
        store.set("failed", "1")
        here = [k for k in range(count) if k not in missing and k != me]
        end = time.monotonic() + 5
        while here and time.monotonic() < end:
            here = [k for k in here if not store.check([f"seen/{k}"])]
            time.sleep(0.05)
    elif missing:
        store.set(f"seen/{me}", "1")
    return missing


def span(what: str, ids: List[int]) -> str:
    """('rank', [2, 3, 5]) -> 'ranks 2-3, 5'; ('node', [1]) -> 'node 1'."""
    parts, i = [], 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return f"{what}{'s' if len(ids) > 1 else ''} {', '.join(parts)}"


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def shutdown(ok: bool) -> None:
    """End torch.distributed if it was started: a barrier first when this rank finished well (nobody leaves
    while a peer still needs it; after an error the peers stop on their own), then destroy_process_group,
    which releases the backend and joins its threads while the interpreter is still whole."""
    if dist.is_available() and dist.is_initialized():
        if ok:
            dist.barrier()
        dist.destroy_process_group()


def run_and_shut_down(run, log, known: tuple, error_code: int = 1, interrupted: str = "interrupted") -> int:
    """A command line's body on this rank: run(); a `known` error (bad input or set-up) is one line and exit
    status `error_code`, Ctrl-C one line and 130; torch.distributed is ended either way (shutdown)."""
    code = 0
    try:
        run()
    except known as e:
        log.error(str(e))
        code = error_code
    except KeyboardInterrupt:
        log.error(interrupted)
        code = 130
    finally:
        shutdown(ok=code == 0)
    return code


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

