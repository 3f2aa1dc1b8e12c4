"""DeepSeek-V4.1-Flash inference from the command line: interactive chat, prompt files, scoring.

    torchrun --nproc-per-node W generate.py --ckpt-path D --config config.json --interactive | --input-file F
    torchrun --nproc-per-node W generate.py --ckpt-path D --config config.json --score S.json --dump-logits X

The command line only: options, process-group set-up, reading prompts, printing; inference/engine/ runs the
model. Rank 0 reads every input and prints; the other ranks receive each prompt or command by broadcast, so
all ranks make the same forward calls, and an error found on rank 0 alone stops every rank.
"""
import argparse
import os
import sys
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Optional


def _host_experts_asked(argv: List[str]) -> bool:
    return any(a == "--experts-on=host" or (a == "--experts-on" and argv[i + 1:i + 2] == ["host"])
               for i, a in enumerate(argv))


# Read once, when torch loads its OpenMP runtime: with the routed experts on the host, the host-expert
# kernel's threads start right after torch's parallel regions, whose idle workers by default spin for
# milliseconds on the cores the kernel needs (measured in a CPU run: the kernel at 7-14 GB/s, 12-15 with
# passive workers; docs/benchmarks.md §6.1). A value the user set wins.
if __name__ == "__main__" and _host_experts_asked(sys.argv[1:]):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from encoding import EncodingError, resolve_reasoning_effort
from encoding.tokenizer import TokenizerError, load_tokenizer, read_special_ids
from inference.config import ConfigError, ModelArgs, RuntimeOptions
from inference.engine.checkpoint import (CheckpointError, check_checkpoint_dir, check_config_matches,
                                         check_writable, load_model, verify_checkpoint)
from inference.engine.cuda_graph import GraphedDecode, choose_graphs
from inference.engine.errors import InputError
from inference.engine.memory import rank_plan
from inference.engine.chat import chat
from inference.engine.generation import Runner, SpecOptions
from inference.engine.prefill import check_chunk, prefill_chunk_for
from inference.engine.prompts import (Prompt, check_prompt_lengths, encode_turn, read_batch_prompts,
                                      read_score_file)
from inference.engine.scoring import score_to_file
from inference.engram import EngramError
from inference.parallel import ParallelContext, RankLog, run_and_shut_down
from inference.vision import VisionError

DEFAULT_SEED = 33377335
CLIError = InputError   # bad options or input: reported as one line

KNOWN_ERRORS = (InputError, ConfigError, CheckpointError, EncodingError, TokenizerError, VisionError,
                EngramError)    # "bad input or set-up": reported as one line, no traceback


@dataclass
class Session:
    runner: Runner                        # the model and what every batch shares
    margs: ModelArgs
    par: ParallelContext
    log: RankLog
    opts: argparse.Namespace


def from_rank0(par: ParallelContext, fn: Callable[[], Any]) -> Any:
    value, error = par.from_rank0(fn, KNOWN_ERRORS + (OSError,))
    if error is not None:
        raise CLIError(error)
    return value


def batch_mode(sess: Session, prompts: List[Prompt]) -> None:
    for prompt, c in sess.runner.run_all(prompts, sess.margs.max_batch_size):
        if c is not None:   # rank 0
            sess.log.info("Prompt:", prompt.raw)
            sess.log.info(f"Completion: {c.text}\n")
            if c.warning:
                sess.log.warning(c.warning)


def interactive_mode(sess: Session) -> None:
    o = sess.opts

    def encode(messages: List[Dict[str, Any]], line: str):
        return encode_turn(messages, line, sess.runner.tokenizer, sess.margs, o.thinking_mode,
                           o.reasoning_effort, not o.language_model_only)
    chat(sess.runner, sess.par, sess.log, encode, KNOWN_ERRORS, torch.device(o.device))


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="DeepSeek-V4.1-Flash inference (launch with torchrun for W > 1).")
    add = p.add_argument
    add("--ckpt-path", required=True, help="converted checkpoint directory: model{rank}-mp{W}.safetensors, "
        "tokenizer.json, tokenizer_config.json")
    add("--config", required=True, help="inference config.json (flat, reference key names)")
    add("--input-file", default="", help="batch input: a .json case file, or a text file of prompts "
        "separated by blank lines")
    add("--interactive", action="store_true", help="chat REPL: replies print as they are decoded; Ctrl-C "
        "stops a reply; /clear starts over; /exit, Ctrl-C or Ctrl-D at the prompt quits")
    add("--max-new-tokens", type=int, default=200, help="completion budget per prompt (default 200)")
    add("--temperature", type=float, default=1.0, help="sampling temperature, 0 = greedy (default 1.0)")
    add("--thinking-mode", choices=["chat", "thinking"], default="chat", help="a JSON case's own mode wins")
    add("--reasoning-effort", type=lambda v: int(v) if v.lstrip("-").isdigit() else v, default=None,
        help="thinking effort: 1..100 or low / high / max (default high = 75); a JSON case's own wins")
    add("--max-batch-size", type=int, default=None, help="rows per forward (config, 4; chat 1)")
    add("--max-seq-len", type=int, default=None, help="prompt + answer (config, 4096; chat 65536)")
    add("--prefill-chunk", type=int, default=None, help="prefill prompts in calls of at most N tokens (memory"
        " grows with N, not the prompt); default: one call when the memory plan allows it, else its largest")
    add("--seed", type=int, default=DEFAULT_SEED, help=f"RNG seed, every rank (default {DEFAULT_SEED})")
    add("--numerics", default="reference", help="words joined by commas (README, Numerics): reference | "
        "golden (fp32, no fake quantization); fixed (= --fix-index-k); exact | fast | invariant (summation "
        "order; invariant = the same bits on every machine, thread count, batch, chunking and W)")
    add("--kernel-backend", choices=["auto", "torch", "tilelang"], default="auto",
        help="auto = tilelang on a GPU of compute capability >= 9.0 when installed, else torch")
    add("--kernel-build", choices=["default", "plain"], default="default", help="how the TileLang kernels "
        "are built: plain = no warp specialization or TMA lowering (the device check says which passed)")
    add("--fix-index-k", action="store_true", help="fix the stale index-key cache defect")
    add("--deterministic-topk", action="store_true",
        help="break exact top-k ties by lowest index (reproducible across platforms)")
    add("--engram-on", choices=["device", "host", "disk"], default="device", help="Engram tables in GPU "
        "memory, host memory or mapped from the shard file; looked-up rows are copied (same results)")
    add("--experts-on", choices=["device", "host"], default="device", help="host: the routed experts stay in "
        "host memory at stored precision, computed there by the host-expert kernel (one GPU holds the rest)")
    add("--cpu-linears", choices=["fp32", "stored"], default="fp32", help="with --experts-on host on the "
        "CPU: stored = the other FP8/FP4 Linears computed from their stored bytes too (no fp32 copies: a "
        "quarter of their memory and decode reads; the host kernel's summation order)")
    add("--offload", choices=["none", "disk"], default="none", help="disk (CPU): stream blocks from disk")
    add("--language-model-only", action="store_true", help="no vision tower (saves memory; images: an error)")
    add("--cuda-graph", dest="cuda_graph", action="store_const", const=True, default=None,
        help="decode steps as CUDA graphs, one per batch size, length bucket and parity: the default for "
        "generation on a GPU (this flag makes a run that cannot use them an error instead of eager)")
    add("--eager", "--no-cuda-graph", dest="cuda_graph", action="store_const", const=False,
        help="decode steps run eagerly, without CUDA graphs")
    add("--device", default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda or cpu (default: cuda if available)")
    add("--threads", type=int, default=None,
        help="CPU threads per process (default: torch's; torchrun sets 1 per process when W > 1)")
    add("--dist-timeout", type=float, default=60, help="minutes a collective waits for a slow peer (60)")
    add("--join-timeout", type=float, default=300, help="seconds for every rank to reach MASTER_ADDR (300)")
    add("--output", default=None, help="also write one JSON record per prompt (interactive: per reply) to "
        "this .jsonl file (rank 0): prompt, completion, content, reasoning_content, tool_calls, "
        "prompt_tokens, completion_tokens (EOS included), finish_reason (eos | length | interrupted: "
        "Ctrl-C in chat), parse_error")
    add("--score", default=None, help='scoring mode (docs/cli.md 2.6): S.json = {"sequences": [[ids...] | '
        '{"messages": [...], "completion"?: "text", ...}, ...], "prefill_len"?: P, "images"?: [[paths] | null'
        ', ...]}; image spans end within P; teacher-forced along the generate loop; needs --dump-logits')
    add("--dump-logits", default=None, help="scoring mode output (safetensors, rank 0): logits [L-P+1, B, V] "
        "fp32 (NaN past a sequence's end), input_ids [B, L] (-1 = padding)")
    add("--all-prefill-logits", action="store_true",
        help="scoring mode: also write prefill_logits [B, P, V] (every prefill position)")
    add("--dspark", action="store_true", help="scoring mode: after every forward, run the DSpark draft head "
        "on the next teacher token and write dspark_draft_ids [L-P, B, blk+1], dspark_logits [L-P, B, blk, "
        "V], dspark_confidence [L-P, B, blk] (drafts sampled at --temperature: 0 = argmax)")
    add("--capture-blocks", default=None, metavar="FILE", help="scoring mode: also save every block's output "
        "streams, Engram hashes and index selections per forward, for inference.tools.parity compare-blocks")
    add("--speculative", choices=["none", "dspark"], default="none", help="dspark: speculative decoding "
        "with the DSpark draft head; a batch advances by its shortest accepted block (default none)")
    add("--spec-verify", choices=["chunked", "sequential"], default=None, help="chunked = one extend call, "
        "then roll back the rejected positions (default); sequential = one decode step per token")
    add("--spec-k", type=int, default=None,
        help="drafts verified per step, 1..dspark_block_size (default: the block size, 5)")
    add("--spec-min-confidence", type=float, default=None,
        help="verify only the leading drafts whose sigmoid(confidence) >= this value (default: off)")
    add("--verbose", action="store_true", help="also print the model settings (ModelArgs) at start")
    add("--verify", action="store_true", help="before loading, check every tensor of the shards against the "
        "sha256 convert.py recorded (each rank reads its shard once more; names the first damaged tensor)")
    return p.parse_args(argv)


def check_options(o: argparse.Namespace) -> RuntimeOptions:
    """Checks that need no file and no other rank: identical on every rank. The first that fails is named.
    -> the runtime options (--numerics and the rest), parsed here once."""
    spec_flags = [f for f, v in (("--spec-verify", o.spec_verify), ("--spec-k", o.spec_k),
                                 ("--spec-min-confidence", o.spec_min_confidence)) if v is not None]
    score_mode = bool(o.score or o.dump_logits)
    checks = [
        (score_mode and not (o.score and o.dump_logits), "--score and --dump-logits go together"),
        (score_mode and (o.interactive or o.input_file),
         "--score is a mode of its own: drop --interactive / --input-file"),
        (not score_mode and not o.interactive and not o.input_file,
         "Either input-file or interactive mode must be specified"),
        (o.interactive and o.input_file, "--interactive and --input-file are two modes: give one"),
        (o.all_prefill_logits and not o.score, "--all-prefill-logits needs --score"),
        (o.dspark and not o.score,
         "--dspark needs --score (for speculative generation use --speculative dspark)"),
        (o.speculative != "none" and o.score,
         "--speculative is for generation; scoring mode runs the draft head with --dspark"),
        (spec_flags and o.speculative == "none", f"{', '.join(spec_flags)} need(s) --speculative dspark"),
        (o.spec_k is not None and o.spec_k < 1, f"--spec-k must be >= 1, got {o.spec_k}"),
        (o.spec_min_confidence is not None and not 0 <= o.spec_min_confidence <= 1,
         f"--spec-min-confidence must be in [0, 1], got {o.spec_min_confidence}"),
        (o.max_new_tokens < 1, f"--max-new-tokens must be >= 1, got {o.max_new_tokens}"),
        (o.temperature < 0, f"--temperature must be >= 0, got {o.temperature}"),
        (o.max_batch_size is not None and o.max_batch_size < 1,
         f"--max-batch-size must be >= 1, got {o.max_batch_size}"),
        (o.max_seq_len is not None and o.max_seq_len < 1, f"--max-seq-len must be >= 1, got {o.max_seq_len}"),
        (o.offload == "disk" and o.device != "cpu", f"--offload disk runs on the CPU (not {o.device})"),
        (o.offload == "disk" and o.experts_on == "host", "--offload disk streams the experts from disk: "
         "not with --experts-on host"),
        (o.cpu_linears == "stored" and o.device != "cpu", f"--cpu-linears stored computes the Linears "
         f"held on the CPU: not with --device {o.device}"),
        (o.cuda_graph and not o.device.startswith("cuda"),
         f"--cuda-graph: CUDA graphs need a CUDA device, not {o.device}"),
        (o.device.startswith("cuda") and not torch.cuda.is_available(),
         f"--device {o.device}: CUDA is not available (use --device cpu)"),
    ]
    for failed, message in checks:
        if failed:
            raise CLIError(message)
    resolve_reasoning_effort(o.reasoning_effort)     # EncodingError names the accepted values
    # ConfigError names a bad --numerics word (the other fields are argparse choices)
    return RuntimeOptions.from_profile(o.numerics, deterministic_topk=o.deterministic_topk,
                                       fix_index_k_publish=o.fix_index_k, kernel_backend=o.kernel_backend,
                                       kernel_build=o.kernel_build,
                                       engram_on="disk" if o.offload == "disk" else o.engram_on,
                                       experts_on=o.experts_on, cpu_linears=o.cpu_linears)


def model_args(o: argparse.Namespace, world_size: int) -> ModelArgs:
    overrides = {"temperature": o.temperature}
    if o.interactive:   # the official interactive limits (batch mode keeps the config's)
        overrides.update(max_batch_size=1, max_seq_len=65536)
    if o.max_batch_size is not None:
        overrides["max_batch_size"] = o.max_batch_size
    if o.max_seq_len is not None:
        overrides["max_seq_len"] = o.max_seq_len
    margs = ModelArgs.from_file(o.config, **overrides)
    margs.check_world_size(world_size)
    if (o.speculative != "none" or o.dspark) and not margs.has_dspark:
        raise CLIError(f"{'--dspark' if o.dspark else '--speculative dspark'} needs the DSpark draft head, "
                       f"but this config has none (dspark_block_size = {margs.dspark_block_size}, "
                       f"n_mtp_layers = {margs.n_mtp_layers})")
    if o.spec_k is not None and o.spec_k > margs.dspark_block_size:
        raise CLIError(f"--spec-k {o.spec_k} exceeds the draft block size (dspark_block_size = "
                       f"{margs.dspark_block_size})")
    check_chunk(o.prefill_chunk, margs.max_seq_len)     # before the memory plan's meta build
    return margs


def init_runtime(o: argparse.Namespace, world_size: int) -> ParallelContext:
    if o.device.startswith("cuda"):
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        if world_size > 1:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if o.threads:
        torch.set_num_threads(o.threads)
    par = ParallelContext.from_env(o.device, o.dist_timeout, o.join_timeout)
    torch.manual_seed(o.seed)   # every rank: sampling relies on identical RNG streams (docs/numerics.md §11)
    return par


def read_inputs(o: argparse.Namespace, par: ParallelContext, margs: ModelArgs, tokenizer):
    """Everything rank 0 alone reads, read before the model is built so that a bad input fails fast.
    -> (the model settings: scoring's batch is its sequences, the work, the record file (rank 0) or None)."""
    work = None
    if o.score:
        seqs, prefill_len, types, images = from_rank0(par, lambda: read_score_file(
            o.score, margs.vocab_size, tokenizer, margs, o.thinking_mode, o.reasoning_effort,
            not o.language_model_only))
        margs = replace(margs, max_batch_size=o.max_batch_size or len(seqs))   # before any use of the batch
        if len(seqs) > margs.max_batch_size:
            raise CLIError(f"{len(seqs)} sequences exceed --max-batch-size {margs.max_batch_size}")
        check_prompt_lengths([len(s) for s in seqs], margs.max_seq_len)
        from_rank0(par, lambda: [check_writable(f) for f in (o.dump_logits, o.capture_blocks) if f])
        work = (seqs, prefill_len, types, images)
    elif not o.interactive:
        work = from_rank0(par, lambda: read_batch_prompts(o.input_file, tokenizer, margs, o.thinking_mode,
                                                          o.reasoning_effort, not o.language_model_only))
        if not work:
            raise CLIError(f"{o.input_file}: no prompts")
    handle = []   # the file object stays on rank 0; only the outcome is broadcast
    if o.output:
        from_rank0(par, lambda: handle.append(open(o.output, "w", encoding="utf-8")))
    return margs, work, handle[0] if handle else None


def score_mode(sess: Session, seqs: List[List[int]], prefill_len: int, token_types: Optional[list] = None,
               images: Optional[list] = None) -> None:
    o, r = sess.opts, sess.runner
    out = score_to_file(r.model, seqs, prefill_len, o.dump_logits, {"numerics": o.numerics}, o.capture_blocks,
                        all_prefill_logits=o.all_prefill_logits, stats=r.stats, dspark=o.dspark,
                        token_types=token_types, images=images, prefill_chunk=r.prefill_chunk)
    if o.capture_blocks:
        sess.log.info(f"wrote {o.capture_blocks}")
    sess.log.info(f"wrote {o.dump_logits}: " + ", ".join(f"{k} {list(v.shape)}" for k, v in out.items()))


def run(o: argparse.Namespace, log: RankLog) -> None:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    # Checks that every rank makes alike, before any collective: each rank stops with the same message.
    opts = check_options(o)
    check_checkpoint_dir(o.ckpt_path, world_size, need_eos=not o.score)
    margs = model_args(o, world_size)
    graphed, opts = choose_graphs(o.cuda_graph, o.device, opts, margs, log.info, bool(o.score),
                                  o.speculative != "none")

    par = init_runtime(o, world_size)
    tokenizer = load_tokenizer(o.ckpt_path)
    spec = None
    if o.speculative == "dspark":
        spec = SpecOptions(o.temperature, o.spec_k, o.spec_verify or "chunked", o.spec_min_confidence)
    eos_id = 1 if o.score else read_special_ids(o.ckpt_path, tokenizer)["eos"]
    margs, work, records = read_inputs(o, par, margs, tokenizer)

    if o.verbose:
        log.info(margs)
    check_config_matches(o.ckpt_path, margs, world_size, o.language_model_only)   # before any memory plan
    if o.verify:
        verify_checkpoint(o.ckpt_path, par, log.info)
    # One meta build for the loader's memory check and the default prefill chunk; streamed blocks: no check.
    plan = None if o.offload == "disk" else rank_plan(margs, par, opts, o.device, o.language_model_only,
                                                      cuda_graphs=graphed)
    prefill_chunk = prefill_chunk_for(o.prefill_chunk, margs, plan, o.device, log.info)
    model = load_model(o.ckpt_path, margs, par, opts, o.device, tokenizer, o.language_model_only, log.info,
                       offload=o.offload, dspark=o.dspark or spec is not None, plan=plan)
    runner = Runner(model, tokenizer, o.max_new_tokens, eos_id, spec, records=records, rank=par.rank,
                    prefill_chunk=prefill_chunk, graphs=GraphedDecode(model) if graphed else None)
    sess = Session(runner, margs, par, log, o)
    start = time.perf_counter()
    if o.score:
        score_mode(sess, *work)
    elif o.interactive:
        interactive_mode(sess)
    else:
        batch_mode(sess, work)
    # timings (a chat's: the replies', not the time at the prompt), weight streaming, speculation
    done = (sess.runner.busy_s, "generating") if o.interactive else (time.perf_counter() - start, "total")
    for line in sess.runner.finish(*done):
        log.info(line)


def main(argv: Optional[List[str]] = None) -> int:
    o = parse_args(argv)
    log = RankLog.from_env()
    return run_and_shut_down(lambda: run(o, log), log, KNOWN_ERRORS)


if __name__ == "__main__":
    sys.exit(main())