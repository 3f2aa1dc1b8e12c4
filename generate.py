"""DeepSeek-V4.1-Flash inference from the command line: interactive chat, prompt files, scoring.

    torchrun --nproc-per-node W generate.py --ckpt-path D --config config.json --interactive | --input-file F
    torchrun --nproc-per-node W generate.py --ckpt-path D --config config.json --score S.json --dump-logits X
    torchrun --nproc-per-node W generate.py --ckpt-path D --config config.json --serve 8000   # OpenAI API

The command line only: options, process-group set-up, reading prompts, printing; inference/engine/ runs the
model. Rank 0 reads every input and prints; the other ranks receive each prompt or command by broadcast, so
all ranks make the same forward calls, and an error found on rank 0 alone stops every rank.
"""
import argparse
import os
import sys
import time
from dataclasses import replace
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
from encoding.tokenizer import TokenizerError, read_special_ids
from inference.config import ConfigError, ModelArgs, RuntimeOptions
from inference.engine.batch import Budget
from inference.engine.chat import chat
from inference.engine.checkpoint import CheckpointError, check_writable
from inference.engine.cuda_graph import GraphedDecode, choose_graphs
from inference.engine.errors import InputError
from inference.engine.prompts import (Prompt, check_prompt_lengths, encode_turn, read_batch_prompts,
                                      read_score_file)
from inference.engine.runner import Runner
from inference.engine.scoring import ScoreJob, ScoreOutputs
from inference.engine.session import (Session, add_checkpoint_flags, add_model_flags, model_args as
                                      session_model_args, runtime_options)
from inference.engine.speculative import SpecOptions
from inference.engram import EngramError
from inference.parallel import ParallelContext, RankLog, run_and_shut_down
from inference.serve import add_serve_flags, bind, check_serve_options
from inference.vision import VisionError

DEFAULT_SEED = 33377335
CLIError = InputError   # bad options or input: reported as one line

KNOWN_ERRORS = (InputError, ConfigError, CheckpointError, EncodingError, TokenizerError, VisionError,
                EngramError)    # "bad input or set-up": reported as one line, no traceback


def from_rank0(par: ParallelContext, fn: Callable[[], Any]) -> Any:
    value, error = par.from_rank0(fn, KNOWN_ERRORS + (OSError,))
    if error is not None:
        raise CLIError(error)
    return value


def batch_mode(runner: Runner, log: RankLog, prompts: List[Prompt]) -> None:
    for prompt, c in runner.run_all(prompts, runner.loaded.session.args.max_batch_size):
        if c is not None:   # rank 0
            log.info("Prompt:", prompt.raw)
            log.info(f"Completion: {c.text}\n")
            if c.warning:
                log.warning(c.warning)


def interactive_mode(runner: Runner, log: RankLog, o: argparse.Namespace) -> None:
    session = runner.loaded.session

    def encode(messages: List[Dict[str, Any]], line: str):
        return encode_turn(messages, line, session.tokenizer, session.args, o.thinking_mode,
                           o.reasoning_effort, not o.language_model_only)
    chat(runner, session.par, log, encode, KNOWN_ERRORS, torch.device(o.device))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="DeepSeek-V4.1-Flash inference (launch with torchrun for W > 1).")
    add_checkpoint_flags(p)
    add_model_flags(p)
    add = p.add_argument
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
    add("--seed", type=int, default=DEFAULT_SEED, help=f"RNG seed, every rank (default {DEFAULT_SEED})")
    add("--language-model-only", action="store_true", help="no vision tower (saves memory; images: an error)")
    add("--cuda-graph", dest="cuda_graph", action="store_const", const=True, default=None,
        help="decode steps as CUDA graphs, one per batch size, length bucket and parity: the default for "
        "generation on a GPU (this flag makes a run that cannot use them an error instead of eager)")
    add("--eager", "--no-cuda-graph", dest="cuda_graph", action="store_const", const=False,
        help="decode steps run eagerly, without CUDA graphs")
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
    add_serve_flags(p)
    return p


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def check_options(o: argparse.Namespace) -> RuntimeOptions:
    """Checks that need no file and no other rank: identical on every rank. The first that fails is named.
    -> the runtime options (--numerics and the rest), parsed here once."""
    spec_flags = [f for f, v in (("--spec-verify", o.spec_verify), ("--spec-k", o.spec_k),
                                 ("--spec-min-confidence", o.spec_min_confidence)) if v is not None]
    score_mode = bool(o.score or o.dump_logits)
    modes = [m for m, on in (("--interactive", o.interactive), ("--input-file", o.input_file),
                             ("--score", score_mode), ("--serve", o.serve)) if on]
    checks = [
        (len(modes) > 1 and o.serve is not None,
         f"--serve is a mode of its own: drop {', '.join(m for m in modes if m != '--serve')}"),
        (o.serve is not None and o.speculative != "none",
         "--serve runs plain decoding: drop --speculative (the replies are the same, greedy)"),
        (score_mode and not (o.score and o.dump_logits), "--score and --dump-logits go together"),
        (score_mode and (o.interactive or o.input_file),
         "--score is a mode of its own: drop --interactive / --input-file"),
        (not modes, "Either input-file or interactive mode must be specified (or --score, --serve)"),
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
        (o.cuda_graph and not o.device.startswith("cuda"),
         f"--cuda-graph: CUDA graphs need a CUDA device, not {o.device}"),
    ]
    for failed, message in checks:
        if failed:
            raise CLIError(message)
    problem = check_serve_options(o) if o.serve is not None else None
    if problem:
        raise CLIError(problem)
    resolve_reasoning_effort(o.reasoning_effort)     # EncodingError names the accepted values
    return runtime_options(o)                        # the loading flags: every command's checks


def model_args(o: argparse.Namespace, world_size: int) -> ModelArgs:
    """The checkpoint's files and --config with this command's limits: the official interactive ones in a
    chat, the config's in batch mode, the flags' where given."""
    # a server samples each batch with its requests' settings from the logits; the model's own sampling
    # (a CUDA graph's) stays greedy and draws nothing from the RNG
    limits = {"temperature": 0.0 if o.serve is not None else o.temperature}
    if o.interactive:
        limits.update(max_batch_size=1, max_seq_len=65536)
    if o.max_batch_size is not None:
        limits["max_batch_size"] = o.max_batch_size
    if o.max_seq_len is not None:
        limits["max_seq_len"] = o.max_seq_len
    margs = session_model_args(o, world_size, need_eos=not o.score, **limits)
    if o.serve is not None and margs.max_seq_len < 2:
        raise CLIError(f"--serve needs a context of at least 2 tokens, got {margs.max_seq_len}")
    if (o.speculative != "none" or o.dspark) and not margs.has_dspark:
        raise CLIError(f"{'--dspark' if o.dspark else '--speculative dspark'} needs the DSpark draft head, "
                       f"but this config has none (dspark_block_size = {margs.dspark_block_size}, "
                       f"n_mtp_layers = {margs.n_mtp_layers})")
    if o.spec_k is not None and o.spec_k > margs.dspark_block_size:
        raise CLIError(f"--spec-k {o.spec_k} exceeds the draft block size (dspark_block_size = "
                       f"{margs.dspark_block_size})")
    return margs


def read_inputs(o: argparse.Namespace, session: Session):
    """Everything rank 0 alone reads, read before the model is built so that a bad input fails fast.
    -> (the model settings: scoring's batch is its sequences, the work, the record file (rank 0) or None)."""
    par, margs, tokenizer = session.par, session.args, session.tokenizer
    work = None
    if o.score:
        job = ScoreJob(*from_rank0(par, lambda: read_score_file(
            o.score, margs.vocab_size, tokenizer, margs, o.thinking_mode, o.reasoning_effort,
            not o.language_model_only)))
        margs = replace(margs, max_batch_size=o.max_batch_size or len(job.seqs))   # before any use of it
        if len(job.seqs) > margs.max_batch_size:
            raise CLIError(f"{len(job.seqs)} sequences exceed --max-batch-size {margs.max_batch_size}")
        check_prompt_lengths([len(s) for s in job.seqs], margs.max_seq_len)
        from_rank0(par, lambda: [check_writable(f) for f in (o.dump_logits, o.capture_blocks) if f])
        work = job
    elif o.input_file:
        work = from_rank0(par, lambda: read_batch_prompts(o.input_file, tokenizer, margs, o.thinking_mode,
                                                          o.reasoning_effort, not o.language_model_only))
        if not work:
            raise CLIError(f"{o.input_file}: no prompts")
    handle = []   # the file object stays on rank 0; only the outcome is broadcast
    if o.output:
        from_rank0(par, lambda: handle.append(open(o.output, "w", encoding="utf-8")))
    return margs, work, handle[0] if handle else None


def run(o: argparse.Namespace, log: RankLog) -> None:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    # Checks that every rank makes alike, before any collective: each rank stops with the same message.
    opts = check_options(o)
    margs = model_args(o, world_size)
    graphed, opts = choose_graphs(o.cuda_graph, o.device, opts, margs, log.info, bool(o.score),
                                  o.speculative != "none")
    # every rank seeds alike: sampling relies on identical RNG streams (docs/numerics.md §11)
    session = Session.start(o, log, margs, opts, o.language_model_only, seed=o.seed)
    spec = None
    if o.speculative == "dspark":
        spec = SpecOptions(o.temperature, o.spec_k, o.spec_verify or "chunked", o.spec_min_confidence)
    special = None if o.score else read_special_ids(o.ckpt_path, session.tokenizer)
    eos_id = 1 if o.score else special["eos"]
    margs, work, records = read_inputs(o, session)
    # the port is taken before the model loads: one in use stops every rank now
    listening = []      # the socket stays on rank 0; only the outcome is broadcast
    if o.serve is not None:
        from_rank0(session.par, lambda: listening.append(bind(o.serve)))

    if o.verbose:
        log.info(margs)
    loaded = session.load(margs, dspark=o.dspark or spec is not None, cuda_graphs=graphed)
    runner = Runner(loaded, Budget(o.max_new_tokens, eos_id, loaded.prefill_chunk), spec, records,
                    GraphedDecode(loaded.model) if graphed else None)
    start = time.perf_counter()
    if o.score:
        out = ScoreOutputs(o.dump_logits, o.capture_blocks, o.all_prefill_logits, o.dspark)
        tensors = runner.score(work, out, {"numerics": o.numerics})
        if o.capture_blocks:
            log.info(f"wrote {o.capture_blocks}")
        log.info(f"wrote {o.dump_logits}: " + ", ".join(f"{k} {list(v.shape)}" for k, v in tensors.items()))
    elif o.serve is not None:
        from inference.serve import serve
        serve(runner, o, eos_id, special["bos"], listening[0] if listening else None, log)
    elif o.interactive:
        interactive_mode(runner, log, o)
    else:
        batch_mode(runner, log, work)
    # timings (a chat's: the replies', not the time at the prompt), weight streaming, speculation
    done = ((runner.busy_s, "generating") if o.interactive else (time.perf_counter() - start, "total")
            if o.serve is None else (time.perf_counter() - start, "served"))
    for line in runner.finish(*done):
        log.info(line)


def main(argv: Optional[List[str]] = None) -> int:
    o = parse_args(argv)
    log = RankLog.from_env()
    return run_and_shut_down(lambda: run(o, log), log, KNOWN_ERRORS)


if __name__ == "__main__":
    sys.exit(main())