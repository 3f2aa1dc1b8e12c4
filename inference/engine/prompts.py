"""Prompts in, completions out: chat cases and prompt files become token ids (with image spans and token
types), score files become teacher-forcing sequences, and finished completions are parsed back into
assistant messages with the strict V4.1 parser."""
import copy
import json
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from encoding import (IMAGE_PLACEHOLDER, EncodingError, ParseError, encode_case, encode_messages, load_cases,
                      parse_message_from_completion_text, parse_tagged_text, to_json)
from encoding.encoding import EOS as EOS_TEXT, THINK_END
from encoding.tokenizer import image_token_spelling

from ..config import ModelArgs
from ..vision import VisionError, load_image, place_expanded_images, prepare_vl_inputs, preprocess_image
from .batch import PromptBatch
from .errors import InputError


@dataclass
class Prompt:
    """One prompt, ready for the model. Built on rank 0 and broadcast."""
    raw: str                               # what "Prompt:" prints
    ids: List[int]
    thinking_mode: str
    token_types: Optional[List[int]] = None
    images: Optional[list] = None          # [ImageInput] of this prompt



def check_prompt_lengths(lengths: List[int], max_seq_len: int) -> None:
    for i, n in enumerate(lengths):
        if n > max_seq_len:
            raise InputError(f"Prompt length exceeds model maximum sequence length "
                             f"(max_seq_len={max_seq_len}): prompt {i + 1} has {n} tokens")


def _blank_messages(messages: List[Any]) -> bool:
    """True when no message carries text, an image, a tool call or tools: nothing to answer."""
    def blank(content) -> bool:
        if isinstance(content, str):
            return not content.strip()
        if isinstance(content, list):
            return all(isinstance(b, dict) and b.get("type") == "text"
                       and not str(b.get("text") or "").strip() for b in content)
        return content is None
    return all(isinstance(m, dict) and blank(m.get("content")) and blank(m.get("reasoning_content"))
               and not m.get("tool_calls") and not m.get("tools") for m in messages)


def check_vision(margs: ModelArgs, n_images: int, where: str, vision: bool) -> None:
    if n_images and margs.vision_n_layers <= 0:
        raise InputError(f"{where}: {n_images} image(s) given, but this model has no vision tower "
                         f"(vision_n_layers = 0)")
    if n_images and not vision:
        raise InputError(f"{where}: {n_images} image(s) given, but --language-model-only skips the "
                         f"vision tower (drop the flag to use images)")


def tokenize_prompt(tokenizer, margs: ModelArgs, text: str, records: list, where: str, vision: bool = True):
    """Prompt text and image records -> (ids, token types or None, [ImageInput] or None).

    vision=False: the vision tower is not built (--language-model-only), so images are an error."""
    check_vision(margs, len(records), where, vision)
    if records:
        # The encoder writes <｜deepseek_image｜>; the tokenizer may spell id image_token_id differently.
        text = text.replace(IMAGE_PLACEHOLDER, image_token_spelling(tokenizer, IMAGE_PLACEHOLDER,
                                                                    margs.image_token_id))
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    try:
        ids, types, images = prepare_vl_inputs(ids, records, margs)
    except VisionError as e:
        raise InputError(f"{where}: {e}") from None
    return ids, (types if images else None), (images or None)


def read_batch_prompts(path: str, tokenizer, margs: ModelArgs, thinking_mode: str, effort,
                       vision: bool = True) -> List[Prompt]:
    """A `.json` case file or a blank-line-separated text file -> prompts (docs/cli.md §2.5)."""
    if not os.path.isfile(path):
        raise InputError(f"input file not found: {path}")
    if path.endswith(".json"):
        cases = load_cases(path)
        raws = [to_json(case["messages"]) for case in cases]
        if not cases:
            raise InputError(f"{path}: no prompts (an empty case list)")
        for n, case in enumerate(cases):   # numbered from 0, as load_cases names a case
            if _blank_messages(case["messages"]):
                raise InputError(f"{path}: case {n} is blank (no message has any text, image or tool call)")
    else:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read().rstrip("\n")
        except (OSError, UnicodeDecodeError) as e:
            raise InputError(f"cannot read input file {path}: {e}") from None
        if not text.strip():   # the official tool generates for the prompt "" here
            raise InputError(f"{path}: no prompts (the file is empty or blank)")
        raws = text.split("\n\n")   # official: every "\n\n" splits, even inside longer runs of newlines
        cases = []
        for n, chunk in enumerate(raws):
            if not chunk.strip():
                raise InputError(f"{path}: prompt {n + 1} is blank (prompts are separated by one blank line; "
                                 f"more blank lines in a row make an empty prompt)")
            try:
                cases.append({"messages": [{"role": "user", "content": parse_tagged_text(chunk)}]})
            except EncodingError as e:
                raise InputError(f"{path}: prompt {n + 1}: {e}") from None
    prompts = []
    for n, (case, raw) in enumerate(zip(cases, raws)):
        where = f"{path}: prompt {n + 1}"
        if case.get("context"):
            raise InputError(f"{where}: Standalone inference does not support context without a prefilled "
                             f"KV cache")
        if case.get("reasoning_effort") is None:
            case["reasoning_effort"] = effort
        mode = case.get("thinking_mode") or thinking_mode
        try:
            text, records = encode_case(case, thinking_mode)
        except EncodingError as e:
            raise InputError(f"{where}: {e}") from None
        ids, types, images = tokenize_prompt(tokenizer, margs, text, records, where, vision)
        prompts.append(Prompt(raw, ids, mode, types, images))
    check_prompt_lengths([len(p.ids) for p in prompts], margs.max_seq_len)
    return prompts


def encode_turn(messages: List[Dict[str, Any]], line: str, tokenizer, margs: ModelArgs, thinking_mode: str,
                effort, vision: bool = True) -> Tuple[Dict[str, Any], Prompt]:
    """An interactive line after the conversation so far -> (the user message, the whole conversation as a
    prompt). <image>path</image> tags become image blocks; every turn prefills the whole conversation from
    position 0, so the images of earlier turns are loaded again and their spans re-expanded."""
    message = {"role": "user", "content": parse_tagged_text(line)}
    text, data = encode_messages(messages + [message], thinking_mode, reasoning_effort=effort,
                                 return_multi_modal_data=True)
    ids, types, images = tokenize_prompt(tokenizer, margs, text, data["images"], "prompt", vision)
    check_prompt_lengths([len(ids)], margs.max_seq_len)
    return message, Prompt(line, ids, thinking_mode, types, images)


def parse_completion(text: str, reason: str, thinking_mode: str) -> Tuple[Dict[str, Any], Optional[str]]:
    """Assistant message of a completion, and why the strict parser was bypassed (None if it was not).

    The official loop hands the parser a text without EOS, so it fails on every plain reply
    (docs/cli.md §2.4): re-append EOS when generation stopped on it; otherwise keep the raw text.
    """
    problem = None
    if reason == "eos":
        try:
            return parse_message_from_completion_text(text + EOS_TEXT, thinking_mode), None
        except ParseError as e:
            problem = f"the completion does not parse ({e})"
    elif reason == "interrupted":
        problem = "interrupted before the end of the reply"
    else:
        problem = "the token budget ran out before the end of the reply"
    reasoning, content = "", text
    if thinking_mode == "thinking":
        reasoning, sep, content = text.partition(THINK_END)
        if not sep:
            reasoning, content = text, ""
    message = {"role": "assistant", "content": content, "reasoning_content": reasoning, "tool_calls": []}
    return message, problem



def batch_of(prompts: List[Prompt]) -> PromptBatch:
    """The batch of prepared prompts: their ids, and when any has images, per row its token types (TEXT = -1
    for text rows) and images."""
    ids = [p.ids for p in prompts]
    if not any(p.images for p in prompts):
        return PromptBatch(ids)
    return PromptBatch(ids, [p.token_types or [-1] * len(p.ids) for p in prompts],
                       [p.images or [] for p in prompts])


SCORE_FORMAT = ('{"sequences": [[ids...] | {"messages": [...], "tools"?, "thinking_mode"?, '
                '"reasoning_effort"?, "completion"?}, ...], "prefill_len"?: P, '
                '"images"?: [[paths...] | null, ...]}')
SCORE_KEYS = {"sequences", "prefill_len", "images"}


def _score_case(item: Dict[str, Any], where: str, tokenizer, margs: ModelArgs, thinking_mode: str, effort,
                vision: bool) -> Tuple[List[int], Optional[List[int]], Optional[list]]:
    """A scoring case given as messages -> (ids, token types or None, [ImageInput] or None).

    The messages are encoded as a batch case (its own thinking_mode / reasoning_effort win), images expanded
    with prepare_vl_inputs; the optional completion text is tokenized on its own and appended (type TEXT)."""
    unknown = set(item) - {"messages", "tools", "thinking_mode", "reasoning_effort", "completion"}
    if unknown:
        raise InputError(f"{where}: unknown key(s) {', '.join(sorted(unknown))} (expected {SCORE_FORMAT})")
    if not isinstance(item.get("messages"), list) or not item["messages"]:
        raise InputError(f"{where}: 'messages' must be a non-empty list of messages")
    completion = item.get("completion", "")
    if not isinstance(completion, str):
        raise InputError(f"{where}: 'completion' must be a string, got {type(completion).__name__}")
    messages = copy.deepcopy(item["messages"])
    if item.get("tools"):
        if not isinstance(messages[0], dict):
            raise InputError(f"{where}: 'tools' needs a first message to attach to")
        messages[0]["tools"] = copy.deepcopy(item["tools"])
    case = {"messages": messages, "thinking_mode": item.get("thinking_mode"),
            "reasoning_effort": effort if item.get("reasoning_effort") is None else item["reasoning_effort"]}
    try:
        text, records = encode_case(case, thinking_mode)
    except EncodingError as e:
        raise InputError(f"{where}: {e}") from None
    ids, types, images = tokenize_prompt(tokenizer, margs, text, records, where, vision)
    tail = tokenizer.encode(completion, add_special_tokens=False).ids if completion else []
    return ids + tail, (types + [-1] * len(tail) if types is not None else None), images


def _raw_images(ids: List[int], paths: List[str], margs: Optional[ModelArgs], where: str, vision: bool):
    """Raw ids (image spans already expanded) and the images of those spans, in order -> (types, images)."""
    if margs is None:
        raise InputError(f"{where}: images need the model config")
    check_vision(margs, len(paths), where, vision)
    try:
        images = [preprocess_image(load_image(p, k), margs) for k, p in enumerate(paths)]
        types = place_expanded_images(ids, images, margs, paths)
    except VisionError as e:
        raise InputError(f"{where}: {e}") from None
    return types, images


def read_score_file(path: str, vocab_size: int, tokenizer=None, margs: Optional[ModelArgs] = None,
                    thinking_mode: str = "chat", effort=None, vision: bool = True):
    """S.json -> (sequences, prefill_len, token types per row or None, images per row or None).

    A sequence is a list of token ids, or a case object with messages (image blocks allowed), encoded like a
    batch case, plus an optional completion text appended after the prompt. A list of ids may hold expanded
    image spans, whose images the optional top-level "images" lists per sequence (docs/cli.md 2.6). Every
    image span must end within the prefill chunk [0, prefill_len): images are only merged in the first
    forward."""
    if not os.path.isfile(path):
        raise InputError(f"score file not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except ValueError as e:
        raise InputError(f"{path}: not valid JSON: {e}") from None
    items = data.get("sequences") if isinstance(data, dict) else None
    if not isinstance(items, list) or not items or not all(isinstance(s, dict) or isinstance(s, list) and s
                                                           for s in items):
        raise InputError(f"{path}: expected {SCORE_FORMAT} with non-empty sequences")
    if set(data) - SCORE_KEYS:
        raise InputError(f"{path}: unknown key(s) {', '.join(sorted(set(data) - SCORE_KEYS))} "
                         f"(expected {SCORE_FORMAT})")
    given = data.get("images")
    if given is not None and (not isinstance(given, list) or len(given) != len(items) or not all(
            g is None or isinstance(g, list) and all(isinstance(x, str) for x in g) for g in given)):
        raise InputError(f"{path}: 'images' must be a list of {len(items)} entries (one per sequence), each "
                         f"a list of image paths or null")
    seqs, types, images = [], [], []
    for i, item in enumerate(items):
        where = f"{path}: sequence {i}"
        paths = (given or [None] * len(items))[i]
        if isinstance(item, dict):
            if tokenizer is None or margs is None:
                raise InputError(f"{where}: cases with messages need the tokenizer")
            if paths:
                raise InputError(f"{where}: a messages case brings its images in its messages; its 'images' "
                                 f"entry must be null or []")
            ids, row_types, row_images = _score_case(item, where, tokenizer, margs, thinking_mode, effort,
                                                     vision)
        else:
            ids, row_types, row_images = item, None, None
        if not ids:
            raise InputError(f"{path}: sequence {i} is empty")
        if not all(type(t) is int and 0 <= t < vocab_size for t in ids):
            raise InputError(f"{path}: sequence {i} holds a value that is not a token id in "
                             f"[0, {vocab_size})")
        if paths or (not isinstance(item, dict) and margs is not None and margs.vision_n_layers > 0
                     and margs.image_token_id in ids):     # a text-only model reads that id as text
            row_types, row_images = _raw_images(ids, paths or [], margs, where, vision)
        seqs.append(ids)
        types.append(row_types)
        images.append(row_images)
    shortest = min(len(s) for s in seqs)
    p = data.get("prefill_len", shortest)
    if type(p) is not int or not 1 <= p <= shortest:
        raise InputError(f"{path}: prefill_len must be an int in 1..{shortest} (the shortest sequence), "
                         f"got {p!r}")
    if not any(images):
        return seqs, p, None, None
    for i, row in enumerate(images):
        for k, im in enumerate(row or []):
            end = im.start + im.n_tokens
            if end > p:
                raise InputError(f"{path}: sequence {i}: image {k} spans positions [{im.start}, {end}), "
                               f"outside the first chunk [0, {p}): images are only merged in the prefill, "
                               f"so prefill_len must be at least {end}")
    return (seqs, p, [t if t is not None else [-1] * len(s) for t, s in zip(types, seqs)],
            [row or [] for row in images])


@dataclass
class Completion:
    text: str
    message: Dict[str, Any]               # the parsed assistant message
    warning: Optional[str]                # to print after the text
    record: Dict[str, Any]                # the --output JSONL record


def finish_completion(tokenizer, prompt: Prompt, completion: List[int], reason: str, where: str,
                      warn_parse: bool, max_new_tokens: int) -> Completion:
    """Decode and parse a completion (EOS excluded; reason "eos", "length" or "interrupted"). An interrupted
    reply gets no warning: the caller says it was interrupted."""
    text = tokenizer.decode(completion, skip_special_tokens=False)
    message, problem = parse_completion(text, reason, prompt.thinking_mode)
    warning = None
    if prompt.thinking_mode == "thinking" and reason == "length" and not message["content"]:
        warning = (f"{where}: thinking used the whole --max-new-tokens budget ({max_new_tokens}) and the "
                   f"answer is empty. This looks broken but isn't: raise --max-new-tokens or lower "
                   f"--reasoning-effort")
    elif problem and warn_parse and reason != "interrupted":
        warning = f"{where}: {problem}; keeping the raw text as the reply"
    record = {"prompt": prompt.raw, "completion": text, "content": message["content"],
              "reasoning_content": message["reasoning_content"], "tool_calls": message["tool_calls"],
              "prompt_tokens": len(prompt.ids), "completion_tokens": len(completion) + (reason == "eos"),
              "finish_reason": reason, "parse_error": problem}
    return Completion(text, message, warning, record)
