"""One way from a command's flags to a loaded model, for every command that runs one (generate.py, `parity
corpus`, `bench`): the loading flags with one help text and one set of refusals, then

    opts = runtime_options(o)                 # flags -> RuntimeOptions, the combinations refused in one line
    args = model_args(o, world, **limits)     # the checkpoint's files, --config with the command's limits
    session = Session.start(o, log, args, opts)          # process group, threads, seed, tokenizer
    ... the command reads its inputs (rank 0) and may narrow args ...
    loaded = session.load()                   # config against the shard, memory plan, load: Loaded

Every check that needs no file and no other rank comes first, identical on every rank, so that all stop with
the same line before any collective. A command adds its own flags and checks around these (generate.py: the
modes; corpus: the outputs).
"""
import argparse
import os
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from encoding.tokenizer import load_tokenizer
from ..config import (CPU_LINEARS, ENGRAM_PLACEMENTS, EXPERT_PLACEMENTS, KERNEL_BACKENDS, KERNEL_BUILDS,
                      ModelArgs, RuntimeOptions)
from ..kernels import check_device
from ..parallel import ParallelContext, RankLog
from .checkpoint import check_checkpoint_dir, check_config_matches, load_model, verify_checkpoint
from .errors import InputError
from .memory import rank_plan
from .prefill import check_chunk, prefill_chunk_for


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """How the model computes and where its weights live: the flags of every command that runs the model."""
    g = p.add_argument_group("numerics and placement (the same in every command that runs the model)")
    add = g.add_argument
    add("--numerics", default="reference", help="words joined by commas (README, Numerics): reference | "
        "golden (fp32, no fake quantization); fixed (= --fix-index-k); exact | fast | invariant (summation "
        "order; invariant = the same bits on every machine, thread count, batch, chunking and W)")
    add("--kernel-backend", choices=KERNEL_BACKENDS, default="auto",
        help="auto = tilelang on a GPU of compute capability >= 9.0 when installed, else torch")
    add("--kernel-build", choices=KERNEL_BUILDS, default="default", help="how the TileLang kernels are "
        "built: plain = no warp specialization or TMA lowering (the device check says which passed)")
    add("--fix-index-k", action="store_true", help="fix the stale index-key cache defect")
    add("--deterministic-topk", action="store_true",
        help="break exact top-k ties by lowest index (reproducible across platforms)")
    add("--engram-on", choices=ENGRAM_PLACEMENTS, default="device", help="Engram tables in GPU memory, host "
        "memory or mapped from the shard file; looked-up rows are copied (same results)")
    add("--experts-on", choices=EXPERT_PLACEMENTS, default="device", help="host: the routed experts stay in "
        "host memory at stored precision, computed there by the host-expert kernel (one GPU holds the rest)")
    add("--cpu-linears", choices=CPU_LINEARS, default="fp32", help="with --experts-on host on the CPU: "
        "stored = the other FP8/FP4 Linears computed from their stored bytes too (no fp32 copies: a quarter "
        "of their memory and decode reads; the host kernel's summation order)")
    add("--device", default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda or cpu (default: cuda if available)")
    add("--threads", type=int, default=None,
        help="CPU threads per process (default: torch's; torchrun sets 1 per process when W > 1)")


def add_checkpoint_flags(p: argparse.ArgumentParser) -> None:
    """Where the converted checkpoint is and how it is loaded: the flags of every command that reads one."""
    g = p.add_argument_group("the checkpoint and its loading (the same in every command that reads one)")
    add = g.add_argument
    add("--ckpt-path", required=True, help="converted checkpoint directory: model{rank}-mp{W}.safetensors, "
        "tokenizer.json, tokenizer_config.json")
    add("--config", required=True, help="inference config.json (flat, reference key names)")
    add("--offload", choices=["none", "disk"], default="none", help="disk (CPU): stream blocks from disk")
    add("--prefill-chunk", type=int, default=None, help="prefill prompts in calls of at most N tokens (memory"
        " grows with N, not the prompt); default: one call when the memory plan allows it, else its largest")
    add("--verify", action="store_true", help="before loading, check every tensor of the shards against the "
        "sha256 convert.py recorded (each rank reads its shard once more; names the first damaged tensor)")
    add("--dist-timeout", type=float, default=60, help="minutes a collective waits for a slow peer (60)")
    add("--join-timeout", type=float, default=300, help="seconds for every rank to reach MASTER_ADDR (300)")


def runtime_options(o: argparse.Namespace) -> RuntimeOptions:
    """The model flags (and --offload where the command has it) -> RuntimeOptions. Checks that need no file
    and no other rank, identical on every rank; the first that fails is one line (InputError, or the
    ConfigError of RuntimeOptions, which validates itself)."""
    offload = getattr(o, "offload", "none")         # a command without --offload keeps the weights in memory
    checks = [
        (offload == "disk" and o.device != "cpu", f"--offload disk runs on the CPU (not {o.device})"),
        (offload == "disk" and o.experts_on == "host", "--offload disk streams the experts from disk: not "
         "with --experts-on host"),
        (o.threads is not None and o.threads < 1, f"--threads must be >= 1, got {o.threads}"),
    ]
    for failed, message in checks:
        if failed:
            raise InputError(message)
    opts = RuntimeOptions.from_profile(o.numerics, deterministic_topk=o.deterministic_topk,
                                       fix_index_k_publish=o.fix_index_k, kernel_backend=o.kernel_backend,
                                       kernel_build=o.kernel_build,
                                       engram_on="disk" if offload == "disk" else o.engram_on,
                                       experts_on=o.experts_on, cpu_linears=o.cpu_linears)
    check_device(opts, o.device)                    # what the options ask of the device
    if o.device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"--device {o.device}: CUDA is not available (use --device cpu)")
    return opts


def model_args(o: argparse.Namespace, world_size: int, need_eos: bool = True, **limits) -> ModelArgs:
    """The checkpoint directory's files for this world size (the tokenizer's EOS definition too when
    `need_eos`: generation stops at it), then --config with the command's `limits` (max_batch_size,
    max_seq_len, temperature, ...), checked against the world size and --prefill-chunk."""
    check_checkpoint_dir(o.ckpt_path, world_size, need_eos)
    args = ModelArgs.from_file(o.config, **limits)
    args.check_world_size(world_size)
    check_chunk(o.prefill_chunk, args.max_seq_len)     # before the memory plan's meta build
    return args


@dataclass(frozen=True)
class Loaded:
    """A loaded model and what its calls need besides: the session it came from, the prefill chunk."""
    session: "Session"
    model: Any                              # the Transformer
    prefill_chunk: Optional[int]            # positions per prefill call (None: one call)


@dataclass(frozen=True)
class Session:
    """A command's run of the model before it is loaded: the checked options and model settings, the process
    group, the tokenizer, and the loading flags."""
    ckpt_path: str
    args: ModelArgs
    opts: RuntimeOptions
    par: ParallelContext
    tokenizer: Any
    device: str
    log: RankLog
    language_model_only: bool = False       # no vision tower built (and none read from the shard)
    offload: str = "none"
    prefill_chunk: Optional[int] = None     # asked for (None: the memory plan's choice)
    verify: bool = False

    @staticmethod
    def start(o: argparse.Namespace, log: RankLog, args: ModelArgs, opts: RuntimeOptions,
              language_model_only: bool = False, seed: Optional[int] = None) -> "Session":
        """Join the other ranks (torchrun's environment; gloo on the CPU, nccl on CUDA), set the CPU threads
        and the RNG seed, and read the tokenizer. `seed`: every rank seeds alike (sampling relies on identical
        RNG streams); None leaves the RNG as it is."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if o.device.startswith("cuda"):
            os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
            if world > 1:
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if o.threads:
            torch.set_num_threads(o.threads)
        par = ParallelContext.from_env(o.device, o.dist_timeout, o.join_timeout)
        if seed is not None:
            torch.manual_seed(seed)
        return Session(o.ckpt_path, args, opts, par, load_tokenizer(o.ckpt_path), o.device, log,
                       language_model_only, o.offload, o.prefill_chunk, o.verify)

    def load(self, args: Optional[ModelArgs] = None, dspark: bool = False,
             cuda_graphs: bool = False) -> Loaded:
        """Check the config against rank 0's shard header (every rank reads the same file, so all stop alike;
        after the command's inputs, whose errors are the more telling), verify the shards (--verify), plan the
        memory (one meta build, for the fit check and the default
        prefill chunk; blocks streamed from disk: none), build and load this rank's model. `args`: settings
        narrowed since start (a batch read from the input: what the config check read is unchanged);
        `dspark`: build the draft head even when streaming; `cuda_graphs`: the plan counts their pool."""
        args = args or self.args
        info, language_model_only = self.log.info, self.language_model_only
        check_config_matches(self.ckpt_path, args, self.par.world_size, language_model_only)
        if self.verify:
            verify_checkpoint(self.ckpt_path, self.par, info)
        plan = None if self.offload == "disk" else rank_plan(args, self.par, self.opts, self.device,
                                                             language_model_only, cuda_graphs=cuda_graphs)
        chunk = prefill_chunk_for(self.prefill_chunk, args, plan, self.device, info)
        model = load_model(self.ckpt_path, args, self.par, self.opts, self.device, self.tokenizer,
                           language_model_only, info, offload=self.offload, dspark=dspark, plan=plan)
        return Loaded(replace(self, args=args), model, chunk)
