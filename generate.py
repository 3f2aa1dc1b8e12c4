"""DeepSeek-V4.1-Flash inference from the command line (spec cli.md §2).

    torchrun --nproc-per-node W generate.py --ckpt-path DIR --config config.json --interactive
    torchrun --nproc-per-node W generate.py --ckpt-path DIR --config config.json --input-file prompts.txt
    torchrun --nproc-per-node W generate.py --ckpt-path DIR --config config.json \\
        --score S.json --dump-logits OUT.safetensors [--all-prefill-logits] [--dspark]
    add --speculative dspark [--spec-verify chunked|sequential] [--spec-k K] [--spec-min-confidence TAU]
    to either generation mode for DSpark speculative decoding (one sequence at a time)

Rank 0 reads every input and prints; the other ranks receive each prompt or command by broadcast, so all
ranks make the same forward calls, and an error found on rank 0 alone is broadcast so that every rank exits.
"""
import argparse
import copy
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from encoding import (IMAGE_PLACEHOLDER, EncodingError, ParseError, encode_case, encode_messages, load_cases,
                      parse_message_from_completion_text, parse_tagged_text, resolve_reasoning_effort,
                      to_json)
from encoding.encoding import EOS as EOS_TEXT, THINK_END
from encoding.tokenizer import TokenizerError, image_token_spelling, load_tokenizer, read_special_ids
from inference.checkpoint import CheckpointError, check_shards, load_checkpoint, save_atomically
from inference.batch import prompt_buffer, read_completions
from inference.config import ConfigError, ModelArgs, RuntimeOptions
from inference.engram import EngramError
from inference.parallel import ParallelContext
from inference.speculative import SpecStats, speculative_generate_batch
from inference.vision import VisionError, prepare_vl_inputs

DEFAULT_SEED = 33377335
# Official runtime limits: batch mode keeps the ModelArgs defaults, interactive mode uses these.
INTERACTIVE_MAX_BATCH_SIZE = 1
INTERACTIVE_MAX_SEQ_LEN = 65536


class CLIError(Exception):
    pass


# Errors that mean "bad input or set-up": reported as one line, no traceback.
KNOWN_ERRORS = (CLIError, ConfigError, CheckpointError, EncodingError, TokenizerError, VisionError,
                EngramError)


class RankLogger:
    """Prints on rank 0 only (errors: on every rank, so each process says why it stops)."""

    def __init__(self, rank: int):
        self.rank = rank

    def info(self, *parts: Any) -> None:
        if self.rank == 0:
            print(*parts, flush=True)

    def warning(self, msg: str) -> None:
        if self.rank == 0:
            print(f"warning: {msg}", file=sys.stderr, flush=True)

    def error(self, msg: str) -> None:
        prefix = f"[rank {self.rank}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
        print(f"{prefix}error: {msg}", file=sys.stderr, flush=True)


@dataclass
class Prompt:
    """One prompt, ready for the model. Built on rank 0 and broadcast."""
    raw: str                               # what "Prompt:" prints
    ids: List[int]
    thinking_mode: str
    token_types: Optional[List[int]] = None
    images: Optional[list] = None          # [ImageInput] of this prompt


@dataclass
class Stats:
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0

    def summary(self) -> str:
        def rate(n, s):
            return f"{n} tokens in {s:.2f} s ({n / s:.1f} tokens/s)" if s > 0 else f"{n} tokens"
        return (f"prefill: {rate(self.prefill_tokens, self.prefill_s)}; "
                f"decode: {rate(self.decode_tokens, self.decode_s)}")


@dataclass
class Session:
    model: Any
    tokenizer: Any
    margs: ModelArgs
    par: ParallelContext
    log: RankLogger
    opts: argparse.Namespace
    eos_id: int = 1
    stats: Stats = field(default_factory=Stats)
    out_file: Any = None                  # JSONL records (rank 0)
    spec: Optional[SpecStats] = None      # --speculative dspark: accumulated over all prompts


# ---------------------------------------------------------------------------------------------------------
# Generation (cli.md §2.3): prefill and decode step are separate so each can be timed and read alone.
# ---------------------------------------------------------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefill(model, ids: torch.Tensor, token_types: Optional[torch.Tensor] = None, images=None,
            all_logits: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """ids [B, P] at positions [0, P) -> (sampled next ids [B], logits)."""
    next_ids, logits, _ = model(ids, 0, images=images, token_types=token_types, all_logits=all_logits)
    return next_ids, logits


def decode_step(model, ids: torch.Tensor, pos: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """ids [B, 1] at position pos -> (sampled next ids [B], logits [B, V])."""
    next_ids, logits, _ = model(ids, pos)
    return next_ids, logits


def _timed(stats: Stats, phase: str, n_tokens: int, device: torch.device, fn: Callable, *args, **kw):
    start = time.perf_counter()
    out = fn(*args, **kw)
    _sync(device)
    setattr(stats, f"{phase}_s", getattr(stats, f"{phase}_s") + time.perf_counter() - start)
    setattr(stats, f"{phase}_tokens", getattr(stats, f"{phase}_tokens") + n_tokens)
    return out


def check_prompt_lengths(lengths: Sequence[int], max_seq_len: int) -> None:
    for i, n in enumerate(lengths):
        if n > max_seq_len:
            raise CLIError(f"Prompt length exceeds model maximum sequence length "
                           f"(max_seq_len={max_seq_len}): prompt {i + 1} has {n} tokens")


@torch.inference_mode()
def generate(model, prompt_tokens: List[List[int]], max_new_tokens: int, eos_id: int,
             prompt_token_types: Optional[List[List[int]]] = None, images: Optional[list] = None,
             stats: Optional[Stats] = None) -> Tuple[List[List[int]], List[str]]:
    """Batched generation, prompts right-padded as in the official loop.

    Returns per prompt the completion ids (EOS excluded, at most max_new_tokens) and the finish reason
    ("eos" or "length").
    """
    stats = stats if stats is not None else Stats()
    args = model.args
    device = next(model.parameters()).device
    lens = [len(t) for t in prompt_tokens]
    check_prompt_lengths(lens, args.max_seq_len)
    total_len = min(args.max_seq_len, max_new_tokens + max(lens))
    bsz, shortest = len(prompt_tokens), min(lens)

    try:
        tokens, types = prompt_buffer(prompt_tokens, total_len, device, prompt_token_types)
    except ValueError as e:
        raise CLIError(str(e)) from None
    in_prompt = tokens != -1
    finished = torch.zeros(bsz, dtype=torch.bool, device=device)

    prev = 0
    for cur in range(shortest, total_len):
        if cur == shortest:
            next_ids, _ = _timed(stats, "prefill", bsz * cur, device, prefill, model, tokens[:, :cur],
                                 token_types=None if types is None else types[:, :cur], images=images)
        else:
            next_ids, _ = _timed(stats, "decode", bsz, device, decode_step, model, tokens[:, prev:cur], prev)
        # Rows still inside their prompt keep the prompt token (teacher forcing).
        next_ids = torch.where(in_prompt[:, cur], tokens[:, cur], next_ids)
        tokens[:, cur] = next_ids
        finished |= ~in_prompt[:, cur] & (next_ids == eos_id)
        prev = cur
        if finished.all():
            break

    return read_completions(tokens, lens, max_new_tokens, eos_id)


# ---------------------------------------------------------------------------------------------------------
# Prompts and completions (rank 0)
# ---------------------------------------------------------------------------------------------------------

def tokenize_prompt(tokenizer, margs: ModelArgs, text: str, records: list, where: str, vision: bool = True):
    """Prompt text and image records -> (ids, token types or None, [ImageInput] or None).

    vision=False: the vision tower is not built (--language-model-only), so images are an error."""
    if records and margs.vision_n_layers <= 0:
        raise CLIError(f"{where}: {len(records)} image(s) given, but this model has no vision tower "
                       f"(vision_n_layers = 0)")
    if records and not vision:
        raise CLIError(f"{where}: {len(records)} image(s) given, but --language-model-only skips the vision "
                       f"tower (drop the flag to use images)")
    if records:
        # The encoder writes <｜deepseek_image｜>; the tokenizer may spell id image_token_id differently.
        text = text.replace(IMAGE_PLACEHOLDER, image_token_spelling(tokenizer, IMAGE_PLACEHOLDER,
                                                                    margs.image_token_id))
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    try:
        ids, types, images = prepare_vl_inputs(ids, records, margs)
    except VisionError as e:
        raise CLIError(f"{where}: {e}") from None
    return ids, (types if images else None), (images or None)


def read_batch_prompts(path: str, tokenizer, margs: ModelArgs, thinking_mode: str, effort,
                       vision: bool = True) -> List[Prompt]:
    """A `.json` case file or a blank-line-separated text file -> prompts (cli.md §2.5)."""
    if not os.path.isfile(path):
        raise CLIError(f"input file not found: {path}")
    if path.endswith(".json"):
        cases = load_cases(path)
        raws = [to_json(case["messages"]) for case in cases]
    else:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read().rstrip("\n")
        except (OSError, UnicodeDecodeError) as e:
            raise CLIError(f"cannot read input file {path}: {e}") from None
        raws = text.split("\n\n")   # official: every "\n\n" splits, even inside longer runs of newlines
        cases = []
        for n, chunk in enumerate(raws):
            try:
                cases.append({"messages": [{"role": "user", "content": parse_tagged_text(chunk)}]})
            except EncodingError as e:
                raise CLIError(f"{path}: prompt {n + 1}: {e}") from None
    prompts = []
    for n, (case, raw) in enumerate(zip(cases, raws)):
        where = f"{path}: prompt {n + 1}"
        if case.get("context"):
            raise CLIError(f"{where}: Standalone inference does not support context without a prefilled "
                           f"KV cache")
        if case.get("reasoning_effort") is None:
            case["reasoning_effort"] = effort
        mode = case.get("thinking_mode") or thinking_mode
        try:
            text, records = encode_case(case, thinking_mode)
        except EncodingError as e:
            raise CLIError(f"{where}: {e}") from None
        ids, types, images = tokenize_prompt(tokenizer, margs, text, records, where, vision)
        prompts.append(Prompt(raw, ids, mode, types, images))
    check_prompt_lengths([len(p.ids) for p in prompts], margs.max_seq_len)
    return prompts


def parse_completion(text: str, reason: str, thinking_mode: str) -> Tuple[Dict[str, Any], Optional[str]]:
    """Assistant message of a completion, and why the strict parser was bypassed (None if it was not).

    The official loop hands the parser a text without EOS, so it fails on every plain reply (cli.md §2.4):
    re-append EOS when generation stopped on it; otherwise keep the raw text.
    """
    problem = None
    if reason == "eos":
        try:
            return parse_message_from_completion_text(text + EOS_TEXT, thinking_mode), None
        except ParseError as e:
            problem = f"the completion does not parse ({e})"
    else:
        problem = "the token budget ran out before the end of the reply"
    reasoning, content = "", text
    if thinking_mode == "thinking":
        reasoning, sep, content = text.partition(THINK_END)
        if not sep:
            reasoning, content = text, ""
    message = {"role": "assistant", "content": content, "reasoning_content": reasoning, "tool_calls": []}
    return message, problem


def finish_completion(sess: Session, prompt: Prompt, completion: List[int], reason: str,
                      where: str, warn_parse: bool) -> Tuple[Dict[str, Any], str, Optional[str]]:
    """Rank 0: decode and parse a completion, write its JSONL record.

    Returns (assistant message, completion text, warning to print after the text or None)."""
    text = sess.tokenizer.decode(completion, skip_special_tokens=False)
    message, problem = parse_completion(text, reason, prompt.thinking_mode)
    warning = None
    if prompt.thinking_mode == "thinking" and reason == "length" and not message["content"]:
        warning = (f"{where}: thinking used the whole --max-new-tokens budget ({sess.opts.max_new_tokens}) "
                   f"and the answer is empty. This looks broken but isn't: raise --max-new-tokens or lower "
                   f"--reasoning-effort")
    elif problem and warn_parse:
        warning = f"{where}: {problem}; keeping the raw text as the reply"
    if sess.out_file is not None:
        record = {"prompt": prompt.raw, "completion": text, "content": message["content"],
                  "reasoning_content": message["reasoning_content"], "tool_calls": message["tool_calls"],
                  "prompt_tokens": len(prompt.ids), "completion_tokens": len(completion) + (reason == "eos"),
                  "finish_reason": reason, "parse_error": problem}
        sess.out_file.write(json.dumps(record, ensure_ascii=False) + "\n")
        sess.out_file.flush()
    return message, text, warning


def vision_inputs(prompts: List[Prompt]) -> Tuple[Optional[list], Optional[list]]:
    """Per row: token types (TEXT = -1 for text rows) and images; None, None if no prompt has images."""
    if not any(p.images for p in prompts):
        return None, None
    return [p.token_types or [-1] * len(p.ids) for p in prompts], [p.images or [] for p in prompts]


def run_prompts(sess: Session, prompts: List[Prompt]) -> Tuple[List[List[int]], List[str]]:
    if sess.opts.speculative == "dspark":
        return run_speculative(sess, prompts)
    types, images = vision_inputs(prompts)
    return generate(sess.model, [p.ids for p in prompts], sess.opts.max_new_tokens, sess.eos_id,
                    prompt_token_types=types, images=images, stats=sess.stats)


def run_speculative(sess: Session, prompts: List[Prompt]) -> Tuple[List[List[int]], List[str]]:
    """DSpark drafting + verification (modules §11.5) for one batch of prompts."""
    o = sess.opts
    types, images = vision_inputs(prompts)
    try:
        completions, reasons, st = speculative_generate_batch(
            sess.model, [p.ids for p in prompts], o.max_new_tokens, sess.eos_id, o.temperature, o.spec_k,
            o.spec_verify or "chunked", o.spec_min_confidence, token_types=types, images=images)
    except ValueError as e:
        raise CLIError(str(e)) from None
    sess.spec = sess.spec or SpecStats()
    sess.spec.add(st)
    sess.stats.prefill_tokens += st.prefill_tokens
    sess.stats.prefill_s += st.prefill_s
    sess.stats.decode_tokens += max(0, st.new_tokens - len(prompts))   # first tokens come from the prefill
    sess.stats.decode_s += st.decode_s
    return completions, reasons


# ---------------------------------------------------------------------------------------------------------
# Modes
# ---------------------------------------------------------------------------------------------------------

def from_rank0(par: ParallelContext, fn: Callable[[], Any]) -> Any:
    """Run fn on rank 0 and broadcast its result, or its error so that every rank stops with it."""
    payload = None
    if par.rank == 0:
        try:
            payload = ("ok", fn())
        except KNOWN_ERRORS as e:
            payload = ("error", str(e))
        except OSError as e:
            payload = ("error", f"{e.strerror or e}: {e.filename}" if e.filename else str(e))
    kind, value = par.broadcast_object(payload)
    if kind == "error":
        raise CLIError(value)
    return value


def batch_mode(sess: Session, prompts: List[Prompt]) -> None:
    # Images: one prompt at a time (every span must fit in the prefill chunk); text: chunks of max_batch_size.
    size = 1 if any(p.images for p in prompts) else sess.margs.max_batch_size
    for start in range(0, len(prompts), size):
        chunk = prompts[start:start + size]
        completions, reasons = run_prompts(sess, chunk)
        if sess.par.rank != 0:
            continue
        for n, (prompt, completion, reason) in enumerate(zip(chunk, completions, reasons)):
            # Hitting the budget is normal in batch mode: warn only about replies that end but do not parse.
            _, text, warning = finish_completion(sess, prompt, completion, reason, f"prompt {start + n + 1}",
                                                 warn_parse=reason == "eos")
            sess.log.info("Prompt:", prompt.raw)
            sess.log.info(f"Completion: {text}")
            sess.log.info()
            if warning:
                sess.log.warning(warning)


def read_command(sess: Session, messages: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Rank 0: read one line and turn it into a command for every rank."""
    try:
        line = input(">>> ")
    except (EOFError, KeyboardInterrupt):   # Ctrl-D / Ctrl-C at the prompt end the session like /exit
        sess.log.info()
        return {"cmd": "exit"}
    if line.strip() == "/exit":
        return {"cmd": "exit"}
    if line.strip() == "/clear":
        messages.clear()
        return {"cmd": "clear"}
    o = sess.opts
    try:
        # <image>path</image> tags become image blocks. Every turn prefills the whole conversation from
        # position 0, so the images of earlier turns are loaded again and their spans re-expanded.
        message = {"role": "user", "content": parse_tagged_text(line)}
        text, data = encode_messages(messages + [message], o.thinking_mode,
                                     reasoning_effort=o.reasoning_effort, return_multi_modal_data=True)
        ids, types, images = tokenize_prompt(sess.tokenizer, sess.margs, text, data["images"], "prompt",
                                             not o.language_model_only)
        check_prompt_lengths([len(ids)], sess.margs.max_seq_len)
    except KNOWN_ERRORS as e:
        sess.log.error(f"{e} (the message was not added; /clear starts a new conversation)")
        return {"cmd": "skip"}
    messages.append(message)
    return {"cmd": "generate", "prompt": Prompt(line, ids, o.thinking_mode, types, images)}


def interactive_mode(sess: Session) -> None:
    par, messages = sess.par, []   # the conversation lives on rank 0
    interrupted = []
    if par.rank == 0:
        # Ctrl-C while generating: finish this reply (the other ranks are inside collectives), then exit.
        def on_sigint(signum, frame):
            interrupted.append(True)
            sess.log.info("\n(interrupted: exiting after this reply)")
    else:
        signal.signal(signal.SIGINT, signal.SIG_IGN)   # rank 0 decides when everyone stops
    while True:
        command = par.broadcast_object(read_command(sess, messages) if par.rank == 0 else None)
        if command["cmd"] == "exit":
            break
        if command["cmd"] == "clear":
            sess.model.reset()
            continue
        if command["cmd"] == "skip":
            continue
        prompt = command["prompt"]
        old_handler = signal.signal(signal.SIGINT, on_sigint) if par.rank == 0 else None
        try:
            completions, reasons = run_prompts(sess, [prompt])
        finally:
            if par.rank == 0:
                signal.signal(signal.SIGINT, old_handler)
        if par.rank == 0:
            message, text, warning = finish_completion(sess, prompt, completions[0], reasons[0], "reply",
                                                       warn_parse=True)
            sess.log.info(text)
            if warning:
                sess.log.warning(warning)
            messages.append(message)
        if par.broadcast_object(bool(interrupted) if par.rank == 0 else None):
            break


SCORE_FORMAT = ('{"sequences": [[ids...] | {"messages": [...], "tools"?, "thinking_mode"?, '
                '"reasoning_effort"?, "completion"?}, ...], "prefill_len": P}')


def _score_case(item: Dict[str, Any], where: str, tokenizer, margs: ModelArgs, thinking_mode: str, effort,
                vision: bool) -> Tuple[List[int], Optional[List[int]], Optional[list]]:
    """A scoring case given as messages -> (ids, token types or None, [ImageInput] or None).

    The messages are encoded as a batch case (its own thinking_mode / reasoning_effort win), images expanded
    with prepare_vl_inputs; the optional completion text is tokenized on its own and appended (type TEXT)."""
    unknown = set(item) - {"messages", "tools", "thinking_mode", "reasoning_effort", "completion"}
    if unknown:
        raise CLIError(f"{where}: unknown key(s) {', '.join(sorted(unknown))} (expected {SCORE_FORMAT})")
    if not isinstance(item.get("messages"), list) or not item["messages"]:
        raise CLIError(f"{where}: 'messages' must be a non-empty list of messages")
    completion = item.get("completion", "")
    if not isinstance(completion, str):
        raise CLIError(f"{where}: 'completion' must be a string, got {type(completion).__name__}")
    messages = copy.deepcopy(item["messages"])
    if item.get("tools"):
        if not isinstance(messages[0], dict):
            raise CLIError(f"{where}: 'tools' needs a first message to attach to")
        messages[0]["tools"] = copy.deepcopy(item["tools"])
    case = {"messages": messages, "thinking_mode": item.get("thinking_mode"),
            "reasoning_effort": effort if item.get("reasoning_effort") is None else item["reasoning_effort"]}
    try:
        text, records = encode_case(case, thinking_mode)
    except EncodingError as e:
        raise CLIError(f"{where}: {e}") from None
    ids, types, images = tokenize_prompt(tokenizer, margs, text, records, where, vision)
    tail = tokenizer.encode(completion, add_special_tokens=False).ids if completion else []
    return ids + tail, (types + [-1] * len(tail) if types is not None else None), images


def read_score_file(path: str, vocab_size: int, tokenizer=None, margs: Optional[ModelArgs] = None,
                    thinking_mode: str = "chat", effort=None, vision: bool = True):
    """S.json -> (sequences, prefill_len, token types per row or None, images per row or None).

    A sequence is a list of token ids, or a case object with messages (image blocks allowed), encoded like a
    batch case, plus an optional completion text appended after the prompt. Every image span must end
    within the prefill chunk [0, prefill_len): images are only merged in the first forward."""
    if not os.path.isfile(path):
        raise CLIError(f"score file not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except ValueError as e:
        raise CLIError(f"{path}: not valid JSON: {e}") from None
    items = data.get("sequences") if isinstance(data, dict) else None
    if not isinstance(items, list) or not items or not all(isinstance(s, dict) or isinstance(s, list) and s
                                                           for s in items):
        raise CLIError(f"{path}: expected {SCORE_FORMAT} with non-empty sequences")
    seqs, types, images = [], [], []
    for i, item in enumerate(items):
        if isinstance(item, dict):
            if tokenizer is None or margs is None:
                raise CLIError(f"{path}: sequence {i}: cases with messages need the tokenizer")
            ids, row_types, row_images = _score_case(item, f"{path}: sequence {i}", tokenizer, margs,
                                                     thinking_mode, effort, vision)
        else:
            ids, row_types, row_images = item, None, None
        if not ids:
            raise CLIError(f"{path}: sequence {i} is empty")
        if not all(type(t) is int and 0 <= t < vocab_size for t in ids):
            raise CLIError(f"{path}: sequence {i} holds a value that is not a token id in [0, {vocab_size})")
        seqs.append(ids)
        types.append(row_types)
        images.append(row_images)
    shortest = min(len(s) for s in seqs)
    p = data.get("prefill_len", shortest)
    if type(p) is not int or not 1 <= p <= shortest:
        raise CLIError(f"{path}: prefill_len must be an int in 1..{shortest} (the shortest sequence), "
                       f"got {p!r}")
    if not any(images):
        return seqs, p, None, None
    for i, row in enumerate(images):
        for k, im in enumerate(row or []):
            end = im.start + im.n_tokens
            if end > p:
                raise CLIError(f"{path}: sequence {i}: image {k} spans positions [{im.start}, {end}), "
                               f"outside the first chunk [0, {p}): images are only merged in the prefill, "
                               f"so prefill_len must be at least {end}")
    return (seqs, p, [t if t is not None else [-1] * len(s) for t, s in zip(types, seqs)],
            [row or [] for row in images])


@torch.inference_mode()
def score(model, seqs: List[List[int]], prefill_len: int, all_prefill_logits: bool = False,
          stats: Optional[Stats] = None, dspark: bool = False, token_types: Optional[List[List[int]]] = None,
          images: Optional[list] = None) -> Dict[str, torch.Tensor]:
    """Teacher-forced logits along the official generate loop: forward 0 runs [0, P), forward k the single
    position P+k-1. logits[k, b] is NaN once row b has no token at that position.

    images / token_types (as generate()): per row, its [ImageInput] and token types (TEXT = -1 for rows
    without images); they go to the prefill only, so every image span must end within [0, P).

    dspark: after every forward, DSpark's forward_spec with the next teacher token (the forward's own sampled
    token where the row has none) and that forward's main_hidden, at its start_pos (fixture README §5):
    forward 0 seeds the rings; forward k gives dspark_*[k-1] (NaN / -1 where logits[k, b] is NaN)."""
    stats = stats if stats is not None else Stats()
    device = next(model.parameters()).device
    bsz, lens = len(seqs), [len(s) for s in seqs]
    total = max(lens)
    check_prompt_lengths(lens, model.args.max_seq_len)
    vision = {}
    try:
        ids, types = prompt_buffer(seqs, total, "cpu", token_types if images and any(images) else None)
    except ValueError as e:
        raise CLIError(str(e)) from None
    if types is not None:
        if (types[:, prefill_len:] >= 0).any():
            raise CLIError("image spans must fit in the prefill chunk [0, prefill_len)")
        vision = {"images": images, "token_types": types[:, :prefill_len].to(device)}
    # Rows that already ended are fed their last token (any valid id would do).
    fed = ids.clone()
    for b, n in enumerate(lens):
        fed[b, n:] = ids[b, n - 1]
    fed = fed.to(device)
    valid = torch.tensor([[p < n for n in lens] for p in range(prefill_len - 1, total)])   # [steps, B]

    lens_t = torch.tensor(lens, device=device)
    drafts = []

    def draft(next_ids: torch.Tensor, hidden: torch.Tensor, pos: int, start_pos: int) -> None:
        if not dspark:
            return
        nxt = fed[:, min(pos + 1, total - 1)]
        nxt = torch.where(pos + 1 < lens_t, nxt, next_ids)
        res = model.mtp.forward_spec(nxt, hidden, start_pos)
        if res is not None:
            drafts.append([t.cpu() for t in res])

    next_ids, logits, hidden = _timed(stats, "prefill", bsz * prefill_len, device, model,
                                      fed[:, :prefill_len], 0, all_logits=all_prefill_logits, **vision)
    out = {}
    if all_prefill_logits:
        out["prefill_logits"] = logits.float().cpu().contiguous()
        logits = logits[:, -1]
    draft(next_ids, hidden, prefill_len - 1, 0)
    steps = [logits.float().cpu()]
    for pos in range(prefill_len, total):
        next_ids, logits, hidden = _timed(stats, "decode", bsz, device, model, fed[:, pos:pos + 1], pos)
        steps.append(logits.float().cpu())
        draft(next_ids, hidden, pos, pos)
    step_logits = torch.stack(steps)                                    # [L - P + 1, B, V]
    step_logits[~valid] = float("nan")
    out["logits"] = step_logits.contiguous()
    out["input_ids"] = ids
    if dspark and drafts:
        gone = ~valid[1:]                                               # [L - P, B]
        draft_ids, draft_logits, confidence = (torch.stack(t) for t in zip(*drafts))
        draft_ids[gone] = -1
        draft_logits[gone] = float("nan")
        confidence[gone] = float("nan")
        out["dspark_draft_ids"] = draft_ids.contiguous()                # [L - P, B, blk + 1]
        out["dspark_logits"] = draft_logits.float().contiguous()        # [L - P, B, blk, V]
        out["dspark_confidence"] = confidence.float().contiguous()      # [L - P, B, blk]
    return out


# ---------------------------------------------------------------------------------------------------------
# Start-up
# ---------------------------------------------------------------------------------------------------------

def _effort(value: str):
    return int(value) if value.lstrip("-").isdigit() else value


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="DeepSeek-V4.1-Flash inference (launch with torchrun for W > 1).")
    p.add_argument("--ckpt-path", required=True,
                   help="converted checkpoint directory: model{rank}-mp{W}.safetensors, tokenizer.json, "
                        "tokenizer_config.json")
    p.add_argument("--config", required=True, help="inference config.json (flat, reference key names)")
    p.add_argument("--input-file", default="",
                   help="batch input: a .json case file, or a text file of prompts separated by blank lines")
    p.add_argument("--interactive", action="store_true",
                   help="chat REPL (/clear starts over, /exit or end of input quits); wins over --input-file")
    p.add_argument("--max-new-tokens", type=int, default=200,
                   help="completion budget per prompt (default 200)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature, 0 = greedy (default 1.0)")
    p.add_argument("--thinking-mode", choices=["chat", "thinking"], default="chat",
                   help="chat encoding mode (default chat); a JSON case's own thinking_mode wins")
    p.add_argument("--reasoning-effort", type=_effort, default=None,
                   help="thinking effort: an int 1..100 or low / high / max (default: high = 75); "
                        "a JSON case's own reasoning_effort wins")
    p.add_argument("--max-batch-size", type=int, default=None,
                   help="prompts per forward pass (default: the config's, else 4; interactive 1)")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="longest prompt + completion (default: the config's, else 4096; interactive 65536)")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED,
                   help=f"RNG seed, the same on every rank (default {DEFAULT_SEED})")
    p.add_argument("--numerics", choices=["reference", "fixed", "golden"], default="reference",
                   help="reference = the official numerics, defects included; fixed = --fix-index-k; "
                        "golden = fp32 weights and activations, no fake quantization (a baseline)")
    p.add_argument("--language-model-only", action="store_true",
                   help="do not build the vision tower (saves memory; prompts with images are an error)")
    p.add_argument("--capture-blocks", default=None, metavar="FILE",
                   help="scoring mode: also save every block's output streams, Engram hashes and index "
                        "selections per forward (safetensors, rank 0) for inference.parity compare-blocks")
    p.add_argument("--fix-index-k", action="store_true",
                   help="fix the stale index-key cache defect (fix_index_k_publish)")
    p.add_argument("--deterministic-topk", action="store_true",
                   help="break exact top-k ties by lowest index (reproducible across platforms)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda or cpu (default: cuda if available)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads per process (default: torch's; torchrun sets 1 per process when W > 1)")
    p.add_argument("--output", default=None,
                   help="also write one JSON record per prompt (interactive: per reply) to this .jsonl "
                        "file (rank 0): prompt, completion, content, reasoning_content, tool_calls, "
                        "prompt_tokens, completion_tokens (EOS included), finish_reason (eos | length), "
                        "parse_error")
    p.add_argument("--score", default=None,
                   help='scoring mode: S.json = {"sequences": [[ids...] | {"messages": [...], "tools"?, '
                        '"thinking_mode"?, "reasoning_effort"?, "completion"?: "text"}, ...], '
                        '"prefill_len": P}; image blocks in messages must end within P; run teacher-forced '
                        "along the generate loop; needs --dump-logits")
    p.add_argument("--dump-logits", default=None,
                   help="scoring mode output (safetensors, rank 0): logits [L-P+1, B, V] fp32 (NaN past a "
                        "sequence's end), input_ids [B, L] (-1 = padding)")
    p.add_argument("--all-prefill-logits", action="store_true",
                   help="scoring mode: also write prefill_logits [B, P, V] (every prefill position)")
    p.add_argument("--dspark", action="store_true",
                   help="scoring mode: after every forward, run the DSpark draft head on the next teacher "
                        "token and write dspark_draft_ids [L-P, B, blk+1], dspark_logits [L-P, B, blk, V], "
                        "dspark_confidence [L-P, B, blk] (drafts are sampled at --temperature: 0 = argmax)")
    p.add_argument("--speculative", choices=["none", "dspark"], default="none",
                   help="dspark: speculative decoding with the DSpark draft head; the rows of a batch "
                        "advance together by the shortest accepted block (default none)")
    p.add_argument("--spec-verify", choices=["chunked", "sequential"], default=None,
                   help="how the main model verifies the drafts: chunked = one extend call, then roll back "
                        "the rejected positions (default); sequential = one decode step per token, stopping "
                        "at the first rejection (bit-exact to plain decoding)")
    p.add_argument("--spec-k", type=int, default=None,
                   help="drafts verified per step, 1..dspark_block_size (default: the block size, 5)")
    p.add_argument("--spec-min-confidence", type=float, default=None,
                   help="verify only the leading drafts whose sigmoid(confidence) >= this value "
                        "(default: off)")
    return p.parse_args(argv)


def check_options(o: argparse.Namespace) -> None:
    """Checks that need no file and no other rank: identical on every rank."""
    if o.score or o.dump_logits:
        if not (o.score and o.dump_logits):
            raise CLIError("--score and --dump-logits go together")
        if o.interactive or o.input_file:
            raise CLIError("--score is a mode of its own: drop --interactive / --input-file")
    elif not o.interactive and not o.input_file:
        raise CLIError("Either input-file or interactive mode must be specified")
    if o.all_prefill_logits and not o.score:
        raise CLIError("--all-prefill-logits needs --score")
    if o.dspark and not o.score:
        raise CLIError("--dspark needs --score (for speculative generation use --speculative dspark)")
    if o.speculative != "none" and o.score:
        raise CLIError("--speculative is for generation; scoring mode runs the draft head with --dspark")
    spec_flags = [f for f, v in (("--spec-verify", o.spec_verify), ("--spec-k", o.spec_k),
                                 ("--spec-min-confidence", o.spec_min_confidence)) if v is not None]
    if spec_flags and o.speculative == "none":
        raise CLIError(f"{', '.join(spec_flags)} need(s) --speculative dspark")
    if o.spec_k is not None and o.spec_k < 1:
        raise CLIError(f"--spec-k must be >= 1, got {o.spec_k}")
    if o.spec_min_confidence is not None and not 0 <= o.spec_min_confidence <= 1:
        raise CLIError(f"--spec-min-confidence must be in [0, 1], got {o.spec_min_confidence}")
    if o.max_new_tokens < 1:
        raise CLIError(f"--max-new-tokens must be >= 1, got {o.max_new_tokens}")
    if o.temperature < 0:
        raise CLIError(f"--temperature must be >= 0, got {o.temperature}")
    for name in ("max_batch_size", "max_seq_len"):
        v = getattr(o, name)
        if v is not None and v < 1:
            raise CLIError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    resolve_reasoning_effort(o.reasoning_effort)     # EncodingError names the accepted values
    if o.device.startswith("cuda") and not torch.cuda.is_available():
        raise CLIError(f"--device {o.device}: CUDA is not available (use --device cpu)")


def check_files(o: argparse.Namespace, world_size: int) -> None:
    check_shards(o.ckpt_path, world_size)
    # The scoring mode needs only tokenizer.json (Engram map); generation also needs the EOS definition.
    needed = ["tokenizer.json"] if o.score else ["tokenizer.json", "tokenizer_config.json"]
    for name in needed:
        path = os.path.join(o.ckpt_path, name)
        if not os.path.isfile(path):
            raise CLIError(f"tokenizer file not found: {path} (convert.py copies it with --tokenizer-path)")


def model_args(o: argparse.Namespace, world_size: int) -> ModelArgs:
    overrides = {"temperature": o.temperature}
    if o.interactive:
        overrides.update(max_batch_size=INTERACTIVE_MAX_BATCH_SIZE, max_seq_len=INTERACTIVE_MAX_SEQ_LEN)
    if o.max_batch_size is not None:
        overrides["max_batch_size"] = o.max_batch_size
    if o.max_seq_len is not None:
        overrides["max_seq_len"] = o.max_seq_len
    margs = ModelArgs.from_file(o.config, **overrides)
    margs.check_world_size(world_size)
    if (o.speculative != "none" or o.dspark) and not (margs.dspark_block_size > 0 and margs.n_mtp_layers > 0):
        raise CLIError(f"{'--dspark' if o.dspark else '--speculative dspark'} needs the DSpark draft head, "
                       f"but this config has none (dspark_block_size = {margs.dspark_block_size}, "
                       f"n_mtp_layers = {margs.n_mtp_layers})")
    if o.spec_k is not None and o.spec_k > margs.dspark_block_size:
        raise CLIError(f"--spec-k {o.spec_k} exceeds the draft block size (dspark_block_size = "
                       f"{margs.dspark_block_size})")
    if margs.o_groups % world_size:
        raise CLIError(f"world size {world_size} must divide o_groups = {margs.o_groups} (W in 1, 2, 4, 8)")
    return margs


def build_model(o: argparse.Namespace, margs: ModelArgs, par: ParallelContext, tokenizer, log: RankLogger):
    from inference.model import Transformer
    opts = RuntimeOptions.from_profile(o.numerics, deterministic_topk=o.deterministic_topk)
    opts.fix_index_k_publish = opts.fix_index_k_publish or o.fix_index_k
    log.info("build model")
    model = Transformer(margs, par, opts, o.device, tokenizer, language_model_only=o.language_model_only)
    log.info("load model")
    load_checkpoint(model, o.ckpt_path, par.rank, par.world_size)
    model.eval()
    log.info("model ready")
    return model


def init_runtime(o: argparse.Namespace, world_size: int) -> ParallelContext:
    if o.device.startswith("cuda"):
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        if world_size > 1:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if o.threads:
        torch.set_num_threads(o.threads)
    par = ParallelContext.from_env(o.device)
    torch.manual_seed(o.seed)   # every rank: sampling relies on identical RNG streams (numerics.md §13)
    return par


def read_inputs(sess: Session):
    """Everything rank 0 alone reads, read before the model is built so that a bad input fails fast."""
    o, par, margs = sess.opts, sess.par, sess.margs
    work = None
    if o.score:
        seqs, prefill_len, types, images = from_rank0(par, lambda: read_score_file(
            o.score, margs.vocab_size, sess.tokenizer, margs, o.thinking_mode, o.reasoning_effort,
            not o.language_model_only))
        if o.max_batch_size is None:
            margs.max_batch_size = len(seqs)
        if len(seqs) > margs.max_batch_size:
            raise CLIError(f"{len(seqs)} sequences exceed --max-batch-size {margs.max_batch_size}")
        check_prompt_lengths([len(s) for s in seqs], margs.max_seq_len)
        from_rank0(par, lambda: _check_writable(o.dump_logits))
        if o.capture_blocks:
            from_rank0(par, lambda: _check_writable(o.capture_blocks))
        work = (seqs, prefill_len, types, images)
    elif not o.interactive:
        work = from_rank0(par, lambda: read_batch_prompts(o.input_file, sess.tokenizer, margs,
                                                          o.thinking_mode, o.reasoning_effort,
                                                          not o.language_model_only))
        if not work:
            raise CLIError(f"{o.input_file}: no prompts")
    if o.output:
        handle = []   # the file object stays on rank 0; only the outcome is broadcast
        from_rank0(par, lambda: handle.append(open(o.output, "w", encoding="utf-8")))
        sess.out_file = handle[0] if handle else None
    return work


def score_mode(sess: Session, seqs: List[List[int]], prefill_len: int, token_types: Optional[list] = None,
               images: Optional[list] = None) -> None:
    o = sess.opts
    if o.capture_blocks:
        from inference.parity import score_with_capture
        out = score_with_capture(sess.model, seqs, prefill_len, o.capture_blocks, score_fn=score,
                                 all_prefill_logits=o.all_prefill_logits, stats=sess.stats, dspark=o.dspark,
                                 token_types=token_types, images=images)
        sess.log.info(f"wrote {o.capture_blocks}")
    else:
        out = score(sess.model, seqs, prefill_len, o.all_prefill_logits, sess.stats, dspark=o.dspark,
                    token_types=token_types, images=images)
    if sess.par.rank == 0:
        save_atomically(out, o.dump_logits, {"prefill_len": str(prefill_len),
                                             "world_size": str(sess.par.world_size), "numerics": o.numerics})
        shapes = ", ".join(f"{k} {list(v.shape)}" for k, v in out.items())
        sess.log.info(f"wrote {o.dump_logits}: {shapes}")


def run(o: argparse.Namespace, log: RankLogger) -> None:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    # Checks that every rank makes alike, before any collective: each rank stops with the same message.
    check_options(o)
    check_files(o, world_size)
    margs = model_args(o, world_size)

    par = init_runtime(o, world_size)
    tokenizer = load_tokenizer(o.ckpt_path)
    sess = Session(None, tokenizer, margs, par, log, o)
    if not o.score:
        sess.eos_id = read_special_ids(o.ckpt_path, tokenizer)["eos"]
    work = read_inputs(sess)

    log.info(margs)
    sess.model = build_model(o, margs, par, tokenizer, log)
    start = time.perf_counter()
    if o.score:
        score_mode(sess, *work)
    elif o.interactive:
        interactive_mode(sess)
    else:
        batch_mode(sess, work)
    if sess.out_file is not None:
        sess.out_file.close()
    log.info(f"{sess.stats.summary()}; total {time.perf_counter() - start:.2f} s")
    if sess.spec is not None:
        log.info(sess.spec.summary(o.spec_verify or "chunked", o.spec_k or margs.dspark_block_size))


def _check_writable(path: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise CLIError(f"output folder does not exist: {folder}")
    if not os.access(folder, os.W_OK):
        raise CLIError(f"output folder is not writable: {folder}")


def main(argv: Optional[List[str]] = None) -> int:
    o = parse_args(argv)
    log = RankLogger(int(os.environ.get("RANK", "0")))
    code = 0
    try:
        run(o, log)
    except KNOWN_ERRORS as e:
        log.error(str(e))
        code = 1
    except KeyboardInterrupt:
        log.error("interrupted")
        code = 130
    finally:
        if dist.is_available() and dist.is_initialized():
            if code == 0:
                dist.barrier()          # nobody leaves while a peer still needs it
            dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
