"""Weights streamed from disk (`--offload disk`): the blocks' and the head's weights stay in the converted
shard file and are read into two reused buffers, one unit (a block, or the head) at a time, while the
next unit's are read in a background thread; the embedding table is memory-mapped (a lookup reads its rows).

What stays in memory: the final norm, the vision tower, every cache, each Engram module's small weights (its
tables are mapped from the file: only looked-up rows are read) and, with --dspark or --speculative only, the
DSpark draft head. So the peak is two units' bytes (each buffer is as large as the largest unit: a block, or
the head widened to fp32), plus the dequantized copies of one block's attention weights (kept while the block
runs) and of one expert at a time (routed experts keep nothing), plus the caches and activations, whatever the
checkpoint's size.

The values are bitwise those of the in-memory model: the same bytes land in the parameters before the block
runs, and every derived copy (dequantized or re-laid-out weights) is rebuilt from them. Each forward call
reads every block once, so score a long text with one prefill (prefill_len = its length) rather than one
forward per token.
"""
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from ..kernels import Derived
from ..safetensors_io import TensorInfo, torch_dtypes
from .errors import InputError


@dataclass
class _Entry:
    module: nn.Module
    attr: str
    name: str               # full parameter name, as in the shard file
    shape: Tuple[int, ...]
    dtype: torch.dtype
    nbytes: int             # in memory (a widened tensor: twice its stored bytes)
    info: TensorInfo        # where its bytes are in the file


@dataclass
class OffloadStats:
    blocks_run: int = 0     # units run: blocks and the head
    bytes_read: int = 0
    read_s: float = 0.0     # time the reading thread spent in read calls
    wait_s: float = 0.0     # time the model stood still waiting for a block's weights
    block_s: float = 0.0    # time from a block's weights being asked for to the end of its forward
    per_block: List[float] = field(default_factory=list)

    def summary(self) -> str:
        if not self.blocks_run:
            return "offload: nothing ran"
        gbps = self.bytes_read / self.read_s / 1e9 if self.read_s else float("inf")
        return (f"offload: {self.blocks_run} units run (blocks and head), {self.bytes_read / 1e9:.2f} GB "
                f"read at {gbps:.2f} GB/s, {self.block_s / self.blocks_run:.3f} s per unit, waiting on disk "
                f"{self.wait_s:.2f} s ({100 * self.wait_s / max(self.block_s, 1e-9):.0f}% of unit time)")


def _units(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """What streams, in the order a forward call runs it: every backbone block (its Engram module aside),
    then the head."""
    return [(f"layers.{i}.", layer) for i, layer in enumerate(model.layers)] + [("head.", model.head)]


def streamed_names(model: nn.Module) -> List[str]:
    """The parameters the stream owns (read per unit, or mapped: the embedding)."""
    names = ["embed.weight"]
    for prefix, unit in _units(model):
        names += [prefix + n for n, _ in unit.named_parameters() if not n.startswith("engram.")]
    return names


def _malloc_trim():
    """glibc's malloc_trim, or None elsewhere. glibc serves the kernels' many mid-sized temporaries from its
    heap and keeps what they free; on a streamed run that grows the peak by a block's worth of temporaries
    per block until trimmed."""
    try:
        import ctypes
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def _read_into(fd: int, buf: torch.Tensor, offset: int) -> None:
    """Fill `buf` (contiguous, CPU) with the file's bytes from `offset`; short reads are continued."""
    view = memoryview(buf.view(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise InputError(f"unexpected end of the shard file at byte {offset + done}")
        done += n


class BlockStreamer:
    """Materialises a unit's weights (block i, or the head) just before it runs (a forward pre-hook) and
    releases them after (a forward hook); the next unit's bytes are read meanwhile in one background thread.
    Units are expected in order (blocks 0..n-1, head) within a forward call; any other order still works
    (the DSpark head calls the head again: the read is then made while the model waits)."""

    def __init__(self, model: nn.Module, path: str, infos: Dict[str, TensorInfo], progress: bool = False):
        if torch.device(model.ctx.device).type != "cpu":
            raise InputError(f"--offload disk runs on the CPU for now (the model is on {model.ctx.device})")
        self.path, units = path, _units(model)
        self.n, self.modules = len(units), [m for _, m in units]
        dtypes = torch_dtypes()
        self.blocks: List[List[_Entry]] = []
        for prefix, unit in units:
            entries = []
            for name, p in unit.named_parameters():
                if name.startswith("engram."):
                    continue
                full = prefix + name
                info = infos.get(full)
                if info is None:
                    raise InputError(f"{path} does not match the model: tensor {full} is missing")
                stored = dtypes[info.dtype]
                widened = stored == torch.bfloat16 and p.dtype == torch.float32
                if stored != p.dtype and not widened or info.nbytes * (2 if widened else 1) != p.nbytes:
                    raise InputError(f"{path}: tensor {full} is {info.dtype} {list(info.shape)}, expected "
                                     f"{p.dtype} {list(p.shape)}")
                owner, attr = name.rpartition(".")[::2]
                module = unit.get_submodule(owner) if owner else unit
                entries.append(_Entry(module, attr, full, tuple(p.shape), p.dtype, p.nbytes, info))
                module._parameters[attr] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                                        requires_grad=False)
            self.blocks.append(entries)
        self._map_embedding(model, infos)
        # Two slots, each one flat byte buffer as large as the largest unit; a unit's tensors are views into
        # it at fixed offsets. One allocation per slot for the whole run: no per-tensor allocations, no heap
        # fragmentation, and a bound of exactly two units.
        self.offsets = [self._layout(entries) for entries in self.blocks]
        self.slot_bytes = max(end for *_, end in self.offsets) if self.offsets else 0
        self.slots: List[Optional[torch.Tensor]] = [None, None]
        self.next_slot = 0
        self.pending: Optional[Tuple[int, int, object]] = None     # (block, slot, future)
        self.attached: Optional[int] = None
        self.started: Optional[float] = None
        self.stats = OffloadStats()
        self.fd = os.open(path, os.O_RDONLY)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="offload")
        self.lock = threading.Lock()
        self.bar = None
        if progress:
            from tqdm import tqdm
            # One running count of blocks for the whole run, shown only once the run takes a while.
            self.bar = tqdm(unit="unit", desc=f"blocks + head streamed ({self.n} per forward)",
                            file=sys.stderr, delay=5.0, mininterval=2.0)
        self.trim = _malloc_trim()
        self.hooks = []
        for i, module in enumerate(self.modules):
            self.hooks.append(module.register_forward_pre_hook(lambda m, a, i=i: self._before(i)))
            self.hooks.append(module.register_forward_hook(lambda m, a, out, i=i: self._after(i)))

    def _map_embedding(self, model: nn.Module, infos: Dict[str, TensorInfo]) -> None:
        """The embedding table as a private memory map of the file: a lookup reads only its rows' pages."""
        info, p = infos.get("embed.weight"), model.embed.weight
        if info is None or info.dtype != "BF16" or info.nbytes != p.nbytes or info.offset % 2:
            raise InputError(f"{self.path}: embed.weight is not the expected bf16 {list(p.shape)} table")
        data = torch.from_file(self.path, shared=False, size=os.path.getsize(self.path), dtype=torch.uint8)
        table = data[info.offset:info.offset + info.nbytes].view(torch.bfloat16).view(p.shape)
        model.embed._parameters["weight"] = nn.Parameter(table, requires_grad=False)

    # -- reading (background thread) ---------------------------------------------------------------------

    @staticmethod
    def _layout(entries: List[_Entry]) -> List[int]:
        """Byte offsets of a unit's tensors in a slot (64-byte aligned), then the unit's total."""
        out, pos = [], 0
        for e in entries:
            out.append(pos)
            pos += -(-e.nbytes // 64) * 64
        return out + [pos]

    def _buffers(self, block: int, slot: int) -> List[torch.Tensor]:
        """Views of the slot's buffer, one per tensor of the unit, in their dtypes and shapes."""
        if self.slots[slot] is None:
            self.slots[slot] = torch.empty(self.slot_bytes, dtype=torch.uint8)
        arena, offsets = self.slots[slot], self.offsets[block]
        return [arena[off:off + e.nbytes].view(e.dtype).view(e.shape)
                for e, off in zip(self.blocks[block], offsets)]

    def _read(self, block: int, slot: int) -> List[torch.Tensor]:
        start = time.perf_counter()
        bufs = self._buffers(block, slot)
        nbytes = 0
        for e, buf in zip(self.blocks[block], bufs):
            if e.dtype == torch.float32 and e.info.dtype == "BF16":   # stored narrower: widen by 32 MiB
                flat = buf.view(-1)
                staging = torch.empty(min(flat.numel(), 16 << 20), dtype=torch.bfloat16)
                for lo in range(0, flat.numel(), staging.numel()):
                    part = staging[:min(staging.numel(), flat.numel() - lo)]
                    _read_into(self.fd, part, e.info.offset + 2 * lo)
                    flat[lo:lo + part.numel()].copy_(part)
            else:
                _read_into(self.fd, buf, e.info.offset)
            nbytes += e.info.nbytes
        with self.lock:
            self.stats.read_s += time.perf_counter() - start
            self.stats.bytes_read += nbytes
        return bufs

    def _submit(self, block: int):
        slot = self.next_slot
        self.next_slot ^= 1
        self.pending = (block, slot, self.pool.submit(self._read, block, slot))

    # -- the hooks ---------------------------------------------------------------------------------------

    def _before(self, i: int) -> None:
        self.started = time.perf_counter()
        if self.attached is not None:            # the last call stopped inside a block (an exception)
            self._release(self.attached)
        if self.pending is None or self.pending[0] != i:
            if self.pending is not None:
                self.pending[2].result()         # let a read for another block finish: its slot is free
            self._submit(i)
        block, slot, future = self.pending
        t = time.perf_counter()
        bufs = future.result()
        self.stats.wait_s += time.perf_counter() - t
        for e, buf in zip(self.blocks[i], bufs):
            e.module._parameters[e.attr] = nn.Parameter(buf, requires_grad=False)
        self._clear_caches(i)
        self.attached = i
        self._submit((i + 1) % self.n)           # the other slot: the one this block is not using

    def _after(self, i: int) -> None:
        self._release(i)
        if self.trim is not None:
            self.trim(0)    # hand the block's freed temporaries back to the OS (glibc would keep them)
        took = time.perf_counter() - self.started
        self.stats.blocks_run += 1
        self.stats.block_s += took
        self.stats.per_block.append(took)
        if self.bar is not None:
            self.bar.update(1)

    def _release(self, i: int) -> None:
        """Back to meta: a use of a released weight fails loudly instead of reading another block's bytes."""
        self._clear_caches(i)
        for e in self.blocks[i]:
            e.module._parameters[e.attr] = nn.Parameter(torch.empty(e.shape, dtype=e.dtype, device="meta"),
                                                        requires_grad=False)
        self.attached = None

    def _clear_caches(self, i: int) -> None:
        """Drop what the numerics derived from the unit's streamed weights (dequantized copies, invariant
        layouts); the Engram module's weights stay resident, and so do their layouts."""
        for name, m in self.modules[i].named_modules():
            if isinstance(getattr(m, "derived", None), Derived) and not name.startswith("engram"):
                m.derived.clear()

    def close(self) -> str:
        """Wait for the last read-ahead, stop the thread, remove the hooks; returns the summary line."""
        if self.pending is not None:
            self.pending[2].result()
            self.pending = None
        self.pool.shutdown()
        for h in self.hooks:
            h.remove()
        if self.bar is not None:
            self.bar.close()
        os.close(self.fd)
        return self.stats.summary()
