"""Strict, streaming loader for the converted `model{rank}-mp{world}.safetensors` files."""
import glob
import os
import re

import torch
from safetensors import safe_open

from ..model import Transformer
from .errors import InputError

# Held in fp32 by the model although stored as bf16 (exact widening).
_WIDEN = re.compile(r"^(head\.weight|mtp\.\d+\.markov_head\.head\.weight"
                    r"|mtp\.\d+\.confidence_head\.proj\.weight"
                    r"|layers\.\d+\.attn\.compressor\.(wkv|wgate)\.weight"
                    r"|vision\.blocks\.\d+\.norm[12]\.weight|vision\.norm\.weight)$")
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


def check_writable(path: str) -> None:
    """Fail before any work when an output file could not be written."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise InputError(f"output folder does not exist: {folder}")
    if not os.access(folder, os.W_OK):
        raise InputError(f"output folder is not writable: {folder}")


def load_checkpoint(model: torch.nn.Module, ckpt_dir: str, rank: int = 0, world_size: int = 1) -> None:
    """Copy every tensor of this rank's file into the model's pre-allocated parameters, one at a time."""
    check_shards(ckpt_dir, world_size)
    path = shard_path(ckpt_dir, rank, world_size)
    params = dict(model.named_parameters())
    try:
        f = safe_open(path, framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
        raise CheckpointError(f"cannot read {path}: {e}") from None
    keys = set(f.keys())
    if getattr(model, "language_model_only", False):      # the vision tower was not built on purpose
        keys = {k for k in keys if not k.startswith(_VISION_PREFIXES)}
    missing = sorted(set(params) - keys)
    unexpected = sorted(k for k in keys - set(params) if not _ALIAS.match(k))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing (e.g. {', '.join(missing[:3])})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected (e.g. {', '.join(unexpected[:3])})")
        raise CheckpointError(f"{path} does not match the model: {'; '.join(parts)}")
    for name in sorted(keys - {k for k in keys if _ALIAS.match(k)}):
        p = params[name]
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
    for m in model.modules():
        if hasattr(m, "clear_cache"):
            m.clear_cache()


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


def load_model(ckpt_dir: str, args, par, opts, device: str = "cpu", tokenizer=None,
               language_model_only: bool = False, log=print):
    """Build the Transformer for this rank and fill it from `model{rank}-mp{W}.safetensors`."""
    log("build model")
    model = Transformer(args, par, opts, device, tokenizer, language_model_only=language_model_only)
    log("load model")
    load_checkpoint(model, ckpt_dir, par.rank, par.world_size)
    model.eval()
    log("model ready")
    return model
