"""Strict, streaming loader for the converted `model{rank}-mp{world}.safetensors` files."""
import glob
import os
import re
import sys
import threading
from typing import Optional

import torch
from safetensors import safe_open

from ..kernels import drop_derived
from ..model import Transformer
from ..safetensors_io import (CHECKSUM, SafetensorsError, check_recorded, read_header, read_manifest,
                              tensor_entry)
from .errors import InputError
from .memory import (STORED_AS_BF16 as _WIDEN, MemoryPlan, build_meta_model, capacity_of, fix_hint, gib,
                     host_memory, rank_plan, verdict_line)

# The DSpark stages share the backbone's embedding and head; a file may carry them as aliases.
_ALIAS = re.compile(r"^mtp\.\d+\.(embed|head)\.weight$")
_VISION_PREFIXES = ("vision.", "aligner.", "image_start", "image_end", "image_newline")


class CheckpointError(ValueError):
    pass


def shard_path(ckpt_dir: str, rank: int, world_size: int) -> str:
    return os.path.join(ckpt_dir, f"model{rank}-mp{world_size}.safetensors")


def check_shards(ckpt_dir: str, world_size: int) -> None:
    """Fail early (before building anything) when the shard files do not fit the world size."""
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"checkpoint directory not found: {ckpt_dir}")
    missing = [shard_path(ckpt_dir, r, world_size) for r in range(world_size)
               if not os.path.isfile(shard_path(ckpt_dir, r, world_size))]
    if missing:
        found = sorted(os.path.basename(p)
                       for p in glob.glob(os.path.join(ckpt_dir, "model*-mp*.safetensors")))
        worlds = sorted({int(m.group(1)) for f in found if (m := re.search(r"-mp(\d+)\.", f))})
        hint = (f"; the directory holds shards for world size {', '.join(map(str, worlds))}: launch with "
                f"--nproc-per-node {worlds[0]}" if worlds else "; no model*-mp*.safetensors files found")
        raise CheckpointError(f"missing shard {missing[0]} for world size {world_size}{hint}")


def check_checkpoint_dir(ckpt_dir: str, world_size: int, need_eos: bool = True) -> None:
    """The shards for this world size and the tokenizer files: scoring needs only tokenizer.json (the Engram
    token map), generation also the EOS definition in tokenizer_config.json."""
    check_shards(ckpt_dir, world_size)
    for name in ["tokenizer.json"] + (["tokenizer_config.json"] if need_eos else []):
        path = os.path.join(ckpt_dir, name)
        if not os.path.isfile(path):
            raise CheckpointError(f"tokenizer file not found: {path} "
                                  f"(convert.py copies it with --tokenizer-path)")


_WRONG = "wrong --config for this checkpoint?"


def check_config_matches(ckpt_dir: str, args, world_size: int, language_model_only: bool = False) -> None:
    """Before any memory plan or allocation: the tensors `args` implies (names, shapes, dtypes) against rank
    0's shard header. Every rank reads the same file, so all stop alike, before any collective. A mismatch
    is one line naming the config key where one decides (dim, vocab_size, n_layers, n_mtp_layers,
    n_routed_experts, moe_inter_dim, vision_n_layers, expert_dtype), else the tensor, from a meta build of
    rank 0's model."""
    path = shard_path(ckpt_dir, 0, world_size)
    file = os.path.basename(path)
    try:
        infos, _ = read_header(path)
    except SafetensorsError as e:
        raise CheckpointError(str(e)) from None
    w = world_size
    per_rank = f" over {w} ranks" if w > 1 else ""

    def stop(message: str):
        raise CheckpointError(f"{message}: {_WRONG}")

    emb = infos.get("embed.weight")
    if emb is not None and len(emb.shape) == 2:
        if emb.shape[1] != args.dim:
            stop(f"config dim {args.dim} but embed.weight has {emb.shape[1]} columns")
        if emb.shape[0] * w != args.vocab_size:
            stop(f"config vocab_size {args.vocab_size} but embed.weight has {emb.shape[0]} rows{per_rank}")
    counted = [("n_layers", "layers", "layers"), ("n_mtp_layers", "mtp", "DSpark stages")]
    if not language_model_only:     # else the file's vision tower is ignored
        counted.append(("vision_n_layers", "vision\\.blocks", "vision blocks"))
    for key, prefix, what in counted:
        held = {int(m.group(1)) for n in infos if (m := re.match(rf"{prefix}\.(\d+)\.", n))}
        if max(held, default=-1) + 1 != getattr(args, key):
            stop(f"config {key} {getattr(args, key)} but {file} holds {max(held, default=-1) + 1} {what}")
    expert = re.compile(r"layers\.\d+\.ffn\.experts\.(\d+)\.")
    experts = sorted((int(m.group(1)), n) for n in infos if (m := expert.match(n)))
    if experts:     # rank 0 holds experts [0, E / W) of every layer
        held = experts[-1][0] + 1
        if held * w != args.n_routed_experts:
            stop(f"config n_routed_experts {args.n_routed_experts} but {file} holds {held} experts per "
                 f"layer{per_rank}")
        w1 = next((n for _, n in experts if n.endswith(".w1.weight")), None)
        if w1 is not None and infos[w1].shape[0] != args.moe_inter_dim:
            stop(f"config moe_inter_dim {args.moe_inter_dim} but {w1} has {infos[w1].shape[0]} rows")
    # Every other tensor: a model on the meta device has the exact names, shapes and dtypes, and no memory.
    try:
        model = build_meta_model(args, world_size, 0, language_model_only=language_model_only)
    except ValueError as e:     # a module's own check of the config
        raise CheckpointError(f"config: {e}") from None
    params = dict(model.named_parameters())
    keys = {n for n in infos if not (language_model_only and n.startswith(_VISION_PREFIXES))}
    missing = [n for n in params if n not in keys]
    if missing:
        stop(f"config implies {missing[0]}, which {file} lacks ({len(missing)} such tensor(s))")
    unexpected = sorted(n for n in keys if n not in params and not _ALIAS.match(n))
    if unexpected:
        stop(f"{file} holds {unexpected[0]}, which this config's model has no place for "
             f"({len(unexpected)} such tensor(s))")
    for name, p in params.items():
        _, dtype, shape = tensor_entry(name, p)
        info = infos[name]
        if dtype == "F32" and info.dtype == "BF16" and _WIDEN.match(name):
            dtype = "BF16"      # stored as bf16, widened when loaded
        if (dtype, list(shape)) == (info.dtype, list(info.shape)):
            continue
        fix = {"F8_E4M3": '"expert_dtype": null', "F4": '"expert_dtype": "fp4"'}.get(info.dtype)
        if ".experts." in name and dtype != info.dtype and fix:
            stop(f"config expert_dtype {args.expert_dtype or 'null'} implies {name} {dtype} but {file} has "
                 f"{info.dtype} (this checkpoint needs {fix})")
        stop(f"config implies {name} {dtype} {list(shape)} but {file} has {info.dtype} {list(info.shape)}")


def verify_checkpoint(ckpt_dir: str, par, log=print) -> None:
    """generate.py --verify: each rank hashes its own shard against the checksums convert.py recorded (one
    progress bar, rank 0's), then the ranks agree, so that every rank stops with the same one line naming the
    first damaged file and tensor (or why nothing could be checked). Run before the model is built."""
    world, rank = par.world_size, par.rank
    path = shard_path(ckpt_dir, rank, world)
    workers = max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    problem, bar, lock = None, None, threading.Lock()

    def advance(n: int) -> None:    # called from the hashing threads
        with lock:
            bar.update(n)

    try:
        ranks = read_manifest(ckpt_dir, world)
        if rank == 0:
            from tqdm import tqdm
            data = sum(i.nbytes for i in read_header(path)[0].values())
            bar = tqdm(total=data, unit="B", unit_scale=True, unit_divisor=1024,
                       desc=f"verify {os.path.basename(path)}", file=sys.stderr, mininterval=1.0)
        check_recorded(ckpt_dir, world, rank, ranks, workers, advance if bar is not None else None)
    except SafetensorsError as e:
        problem = str(e)
    except OSError as e:
        problem = f"{path}: cannot read: {e.strerror or e}"
    finally:
        if bar is not None:
            bar.close()
    problems = [par.broadcast_object(problem, src=r) for r in range(world)]
    first = next((p for p in problems if p is not None), None)
    if first is not None:
        raise CheckpointError(first)
    log(f"verified {ckpt_dir}: {world} shard(s), every tensor matches the {CHECKSUM} recorded at conversion")


def check_writable(path: str) -> None:
    """Fail before any work when an output file could not be written."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise InputError(f"output folder does not exist: {folder}")
    if not os.access(folder, os.W_OK):
        raise InputError(f"output folder is not writable: {folder}")


def load_checkpoint(model: torch.nn.Module, ckpt_dir: str, rank: int = 0, world_size: int = 1,
                    progress: bool = False, streamed=frozenset()) -> None:
    """Copy every tensor of this rank's file into the model's pre-allocated parameters, one at a time.
    `progress`: a bar over the shard's bytes (rate, ETA) on stderr. `streamed`: names left in the file for
    the block streamer (offload.py), which has checked them."""
    check_shards(ckpt_dir, world_size)
    path = shard_path(ckpt_dir, rank, world_size)
    params = dict(model.named_parameters())
    try:
        infos, _ = read_header(path)
        f = safe_open(path, framework="pt", device="cpu")
        raw = open(path, "rb", buffering=0)
    except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
        raise CheckpointError(f"cannot read {path}: {e}") from None
    keys = set(f.keys())
    if getattr(model, "language_model_only", False):      # the vision tower was not built on purpose
        keys = {k for k in keys if not k.startswith(_VISION_PREFIXES)}
    if getattr(model, "mtp", True) is None:                # the draft head was not built on purpose
        keys = {k for k in keys if not k.startswith("mtp.")}
    missing = sorted(set(params) - keys)
    unexpected = sorted(k for k in keys - set(params) if not _ALIAS.match(k))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing (e.g. {', '.join(missing[:3])})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected (e.g. {', '.join(unexpected[:3])})")
        raise CheckpointError(f"{path} does not match the model: {'; '.join(parts)}")
    names = sorted(keys - {k for k in keys if _ALIAS.match(k)} - set(streamed))
    mapped = [n for n in names if params[n].is_meta]         # Engram tables left on disk: mapped, not read
    if mapped:
        attach_mapped(model, path, {n: infos[n] for n in mapped})
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=sum(infos[n].nbytes for n in names if n not in mapped), unit="B", unit_scale=True,
                   unit_divisor=1024, desc=f"load {os.path.basename(path)}", file=sys.stderr, mininterval=1.0)
    for name in names:
        if name in mapped:
            continue
        p = params[name]
        if read_into(raw, infos[name], p):           # a CPU parameter of the stored dtype: no second copy
            if bar is not None:
                bar.update(infos[name].nbytes)
            continue
        t = f.get_tensor(name)
        if tuple(t.shape) != tuple(p.shape):
            raise CheckpointError(f"{path}: tensor {name} has shape {list(t.shape)}, expected {list(p.shape)}"
                                  f" (world size {world_size})")
        if t.dtype != p.dtype and not (t.dtype == torch.bfloat16 and p.dtype == torch.float32
                                       and _WIDEN.match(name)):
            raise CheckpointError(f"{path}: tensor {name} has dtype {t.dtype}, expected {p.dtype}")
        with torch.no_grad():
            if t.dtype == p.dtype and t.dtype in (torch.float4_e2m1fn_x2, torch.float8_e8m0fnu):
                p.view(torch.uint8).copy_(t.view(torch.uint8))     # bitwise
            else:
                p.copy_(t)
        del t
        if bar is not None:
            bar.update(infos[name].nbytes)
    raw.close()
    if bar is not None:
        bar.close()
    drop_derived(model)                     # layouts made from the old weights


# safetensors dtype names -> torch dtypes a CPU parameter can take byte for byte
_STORED = {"BF16": torch.bfloat16, "F32": torch.float32, "F8_E4M3": torch.float8_e4m3fn,
           "F8_E8M0": torch.float8_e8m0fnu, "F4": torch.float4_e2m1fn_x2, "I8": torch.int8,
           "U8": torch.uint8, "I64": torch.int64, "I32": torch.int32}


def read_into(raw, info, p: torch.Tensor) -> bool:
    """Read a tensor's bytes from the open file straight into CPU parameter p when p has its shape, dtype and
    a contiguous layout (True); otherwise leave it to the safetensors path (False). Reading through the
    memory-mapped file instead would keep the file's pages mapped next to the copy: twice the shard in the
    process's resident memory while it loads (the routed experts of a CPU run are most of it)."""
    shape = tuple(info.shape)
    if info.dtype == "F4":                   # the header counts E2M1 elements; torch's dtype holds two a byte
        shape = shape[:-1] + (shape[-1] // 2,) if shape else shape
    if (p.device.type != "cpu" or not p.is_contiguous() or _STORED.get(info.dtype) != p.dtype
            or shape != tuple(p.shape) or p.nbytes != info.nbytes):
        return False
    view = memoryview(p.detach().view(-1).view(torch.uint8).numpy())
    raw.seek(info.offset)
    got = 0
    while got < info.nbytes:
        n = raw.readinto(view[got:])
        if not n:
            raise CheckpointError(f"{raw.name}: truncated in tensor data at byte {info.offset + got}")
        got += n
    return True


_MAPPABLE = {"F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu}


def attach_mapped(model: torch.nn.Module, path: str, infos: dict) -> None:
    """Memory-map the shard file once and hand each module its tensors as views of it: pages are read from
    disk only when rows are looked up (a private mapping: nothing is ever written back)."""
    data = torch.from_file(path, shared=False, size=os.path.getsize(path), dtype=torch.uint8)
    for name, info in infos.items():
        if info.dtype not in _MAPPABLE:
            raise CheckpointError(f"{path}: tensor {name} is {info.dtype}; only FP8 tables can stay on disk")
        t = data[info.offset:info.offset + info.nbytes].view(_MAPPABLE[info.dtype]).view(info.shape)
        owner, attr = name.rsplit(".", 1)
        try:
            model.get_submodule(owner).attach(attr, t)
        except ValueError as e:
            raise CheckpointError(f"{path}: tensor {name}: {e} (world size?)") from None


def save_atomically(tensors: dict, path: str, metadata: dict) -> None:
    """Write a safetensors file under a temporary name and rename it: never a half-written output."""
    from safetensors.torch import save_file
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        save_file(tensors, tmp, metadata=metadata)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def check_memory(plan: MemoryPlan, device: str, log=print, gpu_mem: Optional[int] = None) -> None:
    """Before anything is allocated: log the memory plan's verdict, and stop with one line naming the fix
    when the weights, caches and a decode step's workspace cannot fit the GPU (or the `gpu_mem` budget), or,
    with the experts on the host, when what the rank keeps there exceeds this machine's memory."""
    capacity = capacity_of(device, gpu_mem)
    log(verdict_line(plan, device, capacity))
    r = plan.worst
    host = plan.host_need(plan.args.max_batch_size)         # the weights there and a decode step's workspace
    if capacity is not None and not plan.fits_decode(capacity):
        also = f" (and {gib(host)} in host memory)" if plan.experts_on == "host" else ""
        raise CheckpointError(f"the model does not fit: rank {r.rank} needs "
                              f"{gib(r.resident_bytes + r.phase_bytes('decode'))} on {device}, which has "
                              f"{gib(capacity)}{also}: {fix_hint(plan)}")
    ram = host_memory()
    if plan.experts_on == "host" and ram is not None and host > ram:
        raise CheckpointError(f"the routed experts do not fit in host memory: rank {r.rank} needs "
                              f"{gib(host)} there (weights and a decode step's expert workspace), this "
                              f"machine has {gib(ram)}: raise --mp over more machines or use --experts-on "
                              f"device")


def load_model(ckpt_dir: str, args, par, opts, device: str = "cpu", tokenizer=None,
               language_model_only: bool = False, log=print, gpu_mem: Optional[int] = None,
               offload: str = "none", dspark: bool = False, plan: Optional[MemoryPlan] = None):
    """Build the Transformer for this rank and fill it from `model{rank}-mp{W}.safetensors`, after checking
    that it fits (on CUDA, or within a `gpu_mem` byte budget) by `plan` (memory.rank_plan of these settings;
    None: made here). offload="disk": the blocks' weights stay in the file and stream in per block
    (offload.py), unchecked; the streamer is `model.weight_stream` (else None), and the DSpark draft head (as
    large as a block or more, and resident) is only built when `dspark` asks for it."""
    if offload not in ("none", "disk"):
        raise InputError(f"unknown offload {offload!r} (none or disk)")
    if offload == "none":
        if plan is None:
            plan = rank_plan(args, par, opts, device, language_model_only, gpu_mem)
        check_memory(plan, device, log, gpu_mem)
    log("build model")
    model = Transformer(args, par, opts, device, tokenizer, language_model_only=language_model_only,
                        build_dspark=offload == "none" or dspark, streamed=offload == "disk")
    stream = None
    if offload == "disk":
        from .offload import BlockStreamer, streamed_names
        check_shards(ckpt_dir, par.world_size)
        path = shard_path(ckpt_dir, par.rank, par.world_size)
        try:
            infos, _ = read_header(path)
        except Exception as e:
            raise CheckpointError(f"cannot read {path}: {e}") from None
        names = streamed_names(model)
        stream = BlockStreamer(model, path, infos, progress=par.rank == 0)
    log("load model")
    load_checkpoint(model, ckpt_dir, par.rank, par.world_size, progress=par.rank == 0,
                    streamed=set(names) if stream else frozenset())
    model.attach_stream(stream)
    model.eval()
    log("model ready")
    return model
