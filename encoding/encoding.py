"""DeepSeek-V4.1 chat prompt encoder and strict completion parser.

Reproduces the released `encoding/encoding.py` byte for byte (docs/cli.md §5). The model has no Jinja
template: this module is the prompt format. Every invalid input raises `EncodingError` (a `ValueError`)
naming the offending field, where the release would raise AssertionError / TypeError / NotImplementedError.
"""
import copy
import json
import re
from typing import Any, Dict, List, Optional, Tuple, Union


class EncodingError(ValueError):
    pass


class ParseError(EncodingError):
    """The completion text does not follow the V4.1 output format."""


# Special strings (U+FF5C `｜` and U+2581 `▁`, never ASCII).
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
SYSTEM_TOKEN = "<｜System｜>"
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
LATEST_REMINDER_TOKEN = "<｜latest_reminder｜>"
IMAGE_PLACEHOLDER = "<｜deepseek_image｜>"
TASK_TOKENS = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
}

# Reasoning-effort aliases; `high` is also the default. Pre-release engines used the second table.
RELEASE_EFFORT_TABLE = {"low": 50, "high": 75, "max": 100}
PRE_RELEASE_EFFORT_TABLE = {"low": 25, "high": 50, "xhigh": 75, "max": 100}

EFFORT_TEMPLATE = (
    "Reasoning Effort: {budget} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
)
SYSTEM_TEMPLATE = "{content}"
USER_TEMPLATE = "{content}"
LATEST_REMINDER_TEMPLATE = LATEST_REMINDER_TOKEN + "{content}"
ASSISTANT_TEMPLATE = "{reasoning}{content}{tool_calls}"
REASONING_TEMPLATE = "{reasoning_content}" + THINK_END
RESPONSE_FORMAT_TEMPLATE = (
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{schema}"
)
TOOL_RESULT_TEMPLATE = "<tool_result>{content}</tool_result>"
TOOL_CALLS_TEMPLATE = "\n\n<" + DSML + " calls>\n{invokes}\n</" + DSML + " calls>"
INVOKE_TEMPLATE = "<" + DSML + ' invoke name="{name}">\n{parameters}\n</' + DSML + " invoke>"
PARAMETER_TEMPLATE = "<" + DSML + ' parameter name="{key}" string="{is_str}">{value}</' + DSML + " parameter>"

TOOLS_TEMPLATE = """## Tools

You have access to a set of tools to help answer the user's question. \
You can invoke tools by writing a "<｜DSML｜ calls>" block like the following:

<｜DSML｜ calls>
<｜DSML｜ invoke name="$TOOL_NAME">
<｜DSML｜ parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜ parameter>
...
</｜DSML｜ invoke>
<｜DSML｜ invoke name="$TOOL_NAME2">
...
</｜DSML｜ invoke>
</｜DSML｜ calls>

String parameters should be specified as is and set `string="true"`. \
For all other types (numbers, booleans, arrays, objects), pass the value in JSON format \
and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside \
<think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

{tool_schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""

# Parser delimiters.
TOOL_CALLS_START = "\n\n<" + DSML + " calls"
TOOL_CALLS_END = "</" + DSML + " calls>"
INVOKE_START = "<" + DSML + " invoke"
INVOKE_END = "</" + DSML + " invoke"
PARAMETER_START = "<" + DSML + " parameter"
PARAMETER_END = "/" + DSML + " parameter"

# Roles the thinking-drop filter keeps before the last user turn (assistants are kept without reasoning).
_KEPT_ROLES = ("user", "system", "tool", "latest_reminder", "direct_search_results")
# Exceptions that odd input values (wrong types, missing keys) raise deep inside the rendering code.
_MALFORMED = (TypeError, AttributeError, KeyError, IndexError, ValueError, RecursionError)

Message = Dict[str, Any]


def to_json(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except _MALFORMED:
        pass
    try:
        return json.dumps(value, ensure_ascii=True)
    except _MALFORMED as e:
        raise EncodingError(f"value of type {type(value).__name__} is not JSON-serializable: {e}") from e


def resolve_reasoning_effort(effort: Union[int, str, None], table: Optional[Dict[str, int]] = None) -> int:
    """The effort budget 1..100 for an int, an alias of `table` (default: the release table) or None."""
    table = RELEASE_EFFORT_TABLE if table is None else table
    if effort is None:
        return table["high"]
    # Exact int: bool is an int subclass and must be rejected, as must floats and numeric strings.
    if type(effort) is int and 1 <= effort <= 100:
        return effort
    if isinstance(effort, str) and effort in table:
        return table[effort]
    aliases = ", ".join(sorted(table, key=table.get))
    raise EncodingError(f"reasoning_effort must be an int in 1..100 or one of {aliases}; got {effort!r}")


def _check_thinking_mode(thinking_mode: Any) -> None:
    if not isinstance(thinking_mode, str) or thinking_mode not in ("chat", "thinking"):
        raise EncodingError(f"thinking_mode must be 'chat' or 'thinking'; got {thinking_mode!r}")


# ---------------------------------------------------------------------------------------------------------
# Rendering


def render_tools(functions: List[Dict[str, Any]]) -> str:
    return TOOLS_TEMPLATE.format(tool_schemas="\n".join(to_json(f) for f in functions))


def _decode_arguments(arguments: Any) -> Dict[str, Any]:
    # Strings are JSON, possibly double-encoded; anything that is not an object becomes one parameter.
    value = arguments
    for _ in range(2):
        if not isinstance(value, str):
            break
        try:
            value = json.loads(value)
        except ValueError:
            break
    return value if isinstance(value, dict) else {"arguments": arguments}


def render_tool_calls(tool_calls: List[Dict[str, Any]]) -> str:
    invokes = []
    for call in tool_calls:
        function = call["function"]
        parameters = []
        for key, value in _decode_arguments(function["arguments"]).items():
            if isinstance(value, str):  # inserted raw, no escaping
                parameters.append(PARAMETER_TEMPLATE.format(key=key, is_str="true", value=value))
            else:
                parameters.append(PARAMETER_TEMPLATE.format(key=key, is_str="false", value=to_json(value)))
        invokes.append(INVOKE_TEMPLATE.format(name=function["name"], parameters="\n".join(parameters)))
    return TOOL_CALLS_TEMPLATE.format(invokes="\n".join(invokes))


def _join_texts(parts: List[Any], where: str) -> str:
    for part in parts:
        if not isinstance(part, str):
            raise EncodingError(f"{where}: text must be a string, got {type(part).__name__}")
    return "\n\n".join(parts)


def _render_block(block: Dict[str, Any], where: str) -> Any:
    kind = block.get("type")
    if kind == "text":
        return block.get("text", "")
    if kind == "tool_result":
        content = block.get("content", "")
        if isinstance(content, list):
            parts = [b.get("text", "") if b.get("type") == "text" else f"[Unsupported {b.get('type')}]"
                     for b in content]
            content = _join_texts(parts, f"{where} tool_result content")
        return TOOL_RESULT_TEMPLATE.format(content=content)
    return f"[Unsupported {kind}]"


def find_last_user_index(messages: List[Message]) -> int:
    # Tool results were merged into user turns; a mid-conversation system message also counts.
    for idx in range(len(messages) - 1, -1, -1):
        role = messages[idx].get("role")
        if role == "user" or (role == "system" and idx > 0):
            return idx
    return -1


def render_message(index: int, messages: List[Message], thinking_mode: str, drop_thinking: bool = True,
                   reasoning_effort: Union[int, str, None] = None,
                   effort_table: Optional[Dict[str, int]] = None) -> str:
    """Text of messages[index] (merged, sorted and filtered list) plus the transition that follows it.

    `drop_thinking` is the effective switch: false when tools are declared anywhere.
    """
    # Both checks run for every rendered message, in chat mode too.
    _check_thinking_mode(thinking_mode)
    budget = resolve_reasoning_effort(reasoning_effort, effort_table)
    thinking = thinking_mode == "thinking"
    where = f"message {index}"

    msg = messages[index]
    role = msg.get("role")
    content = msg.get("content")
    last_user_idx = find_last_user_index(messages)
    prompt = ""

    effort_line = thinking and index == 0
    if index == 0 and (effort_line or role == "system"):
        prompt += SYSTEM_TOKEN
    if effort_line:
        prompt += EFFORT_TEMPLATE.format(budget=budget)

    if role == "system":
        if index > 0:  # mid-conversation system message
            prompt += SYSTEM_TOKEN
        prompt += SYSTEM_TEMPLATE.format(content=content or "")
        tools = msg.get("tools")
        if tools:
            prompt += "\n\n" + render_tools([tool["function"] for tool in tools])
        response_format = msg.get("response_format")
        if response_format:
            prompt += "\n\n" + RESPONSE_FORMAT_TEMPLATE.format(schema=to_json(response_format))
    elif role == "user":
        prompt += USER_TOKEN
        blocks = msg.get("content_blocks")
        if blocks:
            prompt += _join_texts([_render_block(b, where) for b in blocks], f"{where} content")
        else:
            prompt += USER_TEMPLATE.format(content=content or "")
    elif role == "latest_reminder":
        # A None content renders as the text "None" (release behaviour).
        prompt += LATEST_REMINDER_TEMPLATE.format(content=content)
    elif role == "assistant":
        reasoning = ""
        prev_has_task = index > 0 and messages[index - 1].get("task") is not None
        if thinking and not prev_has_task and (not drop_thinking or index > last_user_idx):
            reasoning = REASONING_TEMPLATE.format(reasoning_content=msg.get("reasoning_content") or "")
        tool_calls = msg.get("tool_calls")
        calls = render_tool_calls(tool_calls) if tool_calls else ""
        prompt += ASSISTANT_TEMPLATE.format(reasoning=reasoning, content=content or "", tool_calls=calls)
        if not msg.get("wo_eos"):
            prompt += EOS
    else:
        raise EncodingError(f"{where}: unsupported role {role!r} (expected system, user, assistant, tool "
                            "or latest_reminder)")

    # Transition: nothing if a non-assistant, non-reminder message follows.
    if index + 1 < len(messages) and messages[index + 1].get("role") not in ("assistant", "latest_reminder"):
        return prompt
    task = msg.get("task")
    if task is not None:
        if not isinstance(task, str) or task not in TASK_TOKENS:
            raise EncodingError(f"{where}: task must be one of {', '.join(TASK_TOKENS)}; got {task!r}")
        if task == "action":
            prompt += ASSISTANT_TOKEN + (THINK_START if thinking else THINK_END) + TASK_TOKENS[task]
        else:
            prompt += TASK_TOKENS[task]
    elif role == "user" or (role == "system" and index > 0):
        open_thinking = thinking and (not drop_thinking or index >= last_user_idx)
        prompt += ASSISTANT_TOKEN + (THINK_START if open_thinking else THINK_END)
    return prompt


# ---------------------------------------------------------------------------------------------------------
# Preprocessing


def _image_record(block: Dict[str, Any], where: str) -> Dict[str, Any]:
    if block.get("type") == "image_url":
        url = block["image_url"]
        if isinstance(url, dict):
            url = url["url"]
        elif not isinstance(url, str):
            raise EncodingError(f"{where}: image_url must be a string or an object with 'url'")
        return {"type": "image", "url": url}
    record = {"type": "image"}
    record.update({key: block[key] for key in ("source", "url", "data") if key in block})
    if not any(record.get(key) for key in ("source", "url", "data")):
        raise EncodingError(f"{where}: image block needs a non-empty 'source', 'url' or 'data'")
    return record


def _process_blocks(blocks: List[Any], images: List[Dict[str, Any]], where: str) -> List[Dict[str, Any]]:
    out = []
    for block in blocks:
        if not isinstance(block, dict):
            raise EncodingError(f"{where}: content blocks must be objects, got {type(block).__name__}")
        kind = block.get("type")
        if kind in ("image_url", "image"):
            images.append(_image_record(block, where))
            block = {"type": "text", "text": IMAGE_PLACEHOLDER}
        elif kind == "text":
            text = block.get("text", "")
            if not isinstance(text, str):
                raise EncodingError(f"{where}: text block 'text' must be a string")
            if IMAGE_PLACEHOLDER in text:
                raise EncodingError(f"{where}: text contains the reserved image placeholder "
                                    f"{IMAGE_PLACEHOLDER}")
        elif kind == "tool_result" and isinstance(block.get("content"), list):
            block = dict(block, content=_process_blocks(block["content"], images, where + " tool_result"))
        out.append(block)
    return out


def process_images(messages: List[Message]) -> Tuple[List[Message], List[Dict[str, Any]]]:
    """Replace image blocks by the placeholder (copies); returns the messages and the image records."""
    images: List[Dict[str, Any]] = []
    out = []
    for i, msg in enumerate(messages):
        where = f"message {i}"
        if not isinstance(msg, dict):
            raise EncodingError(f"{where}: messages must be objects, got {type(msg).__name__}")
        msg = copy.deepcopy(msg)
        for field in ("content", "reasoning_content"):
            if isinstance(msg.get(field), str) and IMAGE_PLACEHOLDER in msg[field]:
                raise EncodingError(f"{where}: {field} contains the reserved image placeholder "
                                    f"{IMAGE_PLACEHOLDER}; pass images as content blocks")
        if isinstance(msg.get("content"), list):
            blocks = _process_blocks(msg["content"], images, f"{where} content")
            msg["content_blocks"] = blocks
            msg["content"] = "\n\n".join(b.get("text", "") for b in blocks if b.get("type") == "text")
        out.append(msg)
    return out, images


def merge_tool_messages(messages: List[Message]) -> List[Message]:
    """Fold tool results and consecutive user messages into single user turns (on copies)."""
    merged: List[Message] = []
    for msg in messages:
        role = msg.get("role")
        prev = merged[-1] if merged else None
        prev_open = prev is not None and prev.get("role") == "user" and "content_blocks" in prev
        if role == "tool":
            block = {"type": "tool_result", "tool_use_id": msg.get("tool_call_id", ""),
                     "content": copy.deepcopy(msg.get("content", ""))}
            if prev_open:
                prev["content_blocks"].append(block)
            else:
                merged.append({"role": "user", "content_blocks": [block]})
        elif role == "user":
            blocks = msg.get("content_blocks")
            if blocks is None:
                blocks = [{"type": "text", "text": msg.get("content", "")}]
            blocks = copy.deepcopy(blocks)
            # A user turn that carries a task stays on its own; a merged message loses its fields.
            if prev_open and prev.get("task") is None:
                prev["content_blocks"].extend(blocks)
            else:
                msg = copy.deepcopy(msg)
                msg["content_blocks"] = blocks
                merged.append(msg)
        else:
            merged.append(copy.deepcopy(msg))
    return merged


def sort_tool_results_by_call_order(messages: List[Message]) -> List[Message]:
    """Order each user turn's tool results like the calls of the preceding assistant (in place)."""
    order: Dict[Any, int] = {}
    for msg in messages:
        role = msg.get("role")
        if role == "assistant" and msg.get("tool_calls"):
            order = {}
            for idx, call in enumerate(msg["tool_calls"]):
                call_id = call.get("id") or call.get("function", {}).get("id")
                if call_id:
                    order[call_id] = idx
        elif role == "user" and msg.get("content_blocks"):
            blocks = msg["content_blocks"]
            slots = [k for k, b in enumerate(blocks) if b.get("type") == "tool_result"]
            if len(slots) >= 2:
                # sorted() is stable: unknown ids (0) keep their arrival order.
                results = sorted((blocks[k] for k in slots), key=lambda b: order.get(b.get("tool_use_id"), 0))
                for k, block in zip(slots, results):
                    blocks[k] = block
    return messages


def drop_thinking_messages(messages: List[Message]) -> List[Message]:
    """History before the last user turn loses its reasoning; unknown roles there are dropped."""
    last_user_idx = find_last_user_index(messages)
    kept = []
    for idx, msg in enumerate(messages):
        role = msg.get("role")
        if idx >= last_user_idx or role in _KEPT_ROLES:
            kept.append(msg)
        elif role == "assistant":
            msg = dict(msg)
            msg.pop("reasoning_content", None)
            kept.append(msg)
    return kept


def _prepare(messages: List[Message]) -> List[Message]:
    return sort_tool_results_by_call_order(merge_tool_messages(messages))


def encode_messages(messages: List[Message], thinking_mode: str, context: Optional[List[Message]] = None,
                    drop_thinking: bool = True, add_default_bos_token: bool = True,
                    reasoning_effort: Union[int, str, None] = None, return_multi_modal_data: bool = False,
                    effort_table: Optional[Dict[str, int]] = None
                    ) -> Union[str, Tuple[str, Dict[str, List[Dict[str, Any]]]]]:
    """Render `messages` (after `context`, already in the KV cache) as the V4.1 prompt text.

    Returns the prompt, or `(prompt, {"images": records})` with `return_multi_modal_data`. `effort_table`
    selects the effort aliases (default RELEASE_EFFORT_TABLE; PRE_RELEASE_EFFORT_TABLE for old engines).
    The inputs are never mutated.
    """
    if not isinstance(messages, list):
        raise EncodingError(f"messages must be a list, got {type(messages).__name__}")
    context = context if context else []
    if not isinstance(context, list):
        raise EncodingError(f"context must be a list, got {type(context).__name__}")
    try:
        context_msgs, _ = process_images(context)
        msgs, images = process_images(messages)
        full = _prepare(context_msgs + msgs)
        context_msgs = _prepare(context_msgs)
    except EncodingError:
        raise
    except _MALFORMED as e:
        raise EncodingError(f"malformed message fields ({type(e).__name__}: {e})") from e

    prompt = BOS if add_default_bos_token and not context else ""

    # Declared tools keep every reasoning: the model was trained on full tool-use trajectories.
    try:
        has_tools = any(msg.get("tools") for msg in full)
    except _MALFORMED as e:
        raise EncodingError(f"malformed tools ({type(e).__name__}: {e})") from e
    drop = bool(drop_thinking) and not has_tools
    if thinking_mode == "thinking" and drop:
        full = drop_thinking_messages(full)
        context_msgs = drop_thinking_messages(context_msgs)

    for idx in range(len(context_msgs), len(full)):
        try:
            prompt += render_message(idx, full, thinking_mode, drop_thinking=drop,
                                     reasoning_effort=reasoning_effort, effort_table=effort_table)
        except EncodingError:
            raise
        except _MALFORMED as e:
            raise EncodingError(f"message {idx}: malformed field ({type(e).__name__}: {e})") from e

    if return_multi_modal_data:
        return prompt, {"images": images}
    return prompt


# ---------------------------------------------------------------------------------------------------------
# Strict parser


def _read_until_stop(index: int, text: str, stops: List[str]) -> Tuple[int, str, Optional[str]]:
    # Earliest stop wins; on a tie, the first listed.
    best, matched = len(text), None
    for stop in stops:
        pos = text.find(stop, index)
        if pos != -1 and pos < best:
            best, matched = pos, stop
    if matched is None:
        return len(text), text[index:], None
    return best + len(matched), text[index:best], matched


def _arguments_json(params: Dict[str, Tuple[str, str]]) -> str:
    # string="false" values are inserted verbatim (not validated), as the release does.
    items = [f"{to_json(key)}: {to_json(value) if is_str == 'true' else value}"
             for key, (value, is_str) in params.items()]
    return "{" + ", ".join(items) + "}"


def _parse_tool_calls(index: int, text: str) -> Tuple[int, List[Dict[str, Any]]]:
    calls = []
    while index < len(text):
        index, between, stop = _read_until_stop(index, text, [INVOKE_START, TOOL_CALLS_END])
        if between != ">\n":
            raise ParseError(f"tool calls: expected '>\\n' before the next tag, got {between[:40]!r}")
        if stop == TOOL_CALLS_END:
            break
        if stop is None:
            raise ParseError("tool calls: missing closing tag")

        index, header, stop = _read_until_stop(index, text, [PARAMETER_START, INVOKE_END])
        name = re.findall(r'^\s*name="(.*?)">\n$', header, flags=re.DOTALL)
        if len(name) != 1:
            raise ParseError(f"tool call name: malformed invoke header {header[:40]!r}")

        params: Dict[str, Tuple[str, str]] = {}
        while stop == PARAMETER_START:
            index, segment, stop = _read_until_stop(index, text, [PARAMETER_END])
            kv = re.findall(r'^ name="(.*?)" string="(true|false)">(.*?)<$', segment, flags=re.DOTALL)
            if len(kv) != 1:
                raise ParseError(f"tool call parameter: malformed parameter {segment[:40]!r}")
            key, is_str, value = kv[0]
            if key in params:
                raise ParseError(f"tool call parameter: duplicate parameter name {key!r}")
            params[key] = (value, is_str)
            index, between, stop = _read_until_stop(index, text, [PARAMETER_START, INVOKE_END])
            if between != ">\n":
                raise ParseError("tool call parameter: expected '>\\n' after the parameter, "
                                 f"got {between[:40]!r}")

        function = {"name": name[0], "arguments": _arguments_json(params)}
        calls.append({"type": "function", "function": function})
    return index, calls


def parse_message_from_completion_text(text: str, thinking_mode: str) -> Dict[str, Any]:
    """Parse the generated text after the prompt (ending with EOS) into an assistant message.

    Strict: malformed output raises ParseError instead of being repaired.
    """
    if not isinstance(text, str):
        raise ParseError(f"completion text must be a string, got {type(text).__name__}")
    reasoning, index = "", 0
    if thinking_mode == "thinking":
        index, reasoning, stop = _read_until_stop(index, text, [THINK_END, TOOL_CALLS_START])
        if stop != THINK_END:
            raise ParseError("reasoning_content: missing </think> before the answer")

    index, content, stop = _read_until_stop(index, text, [EOS, TOOL_CALLS_START])
    tool_calls: List[Dict[str, Any]] = []
    if stop == TOOL_CALLS_START:
        index, tool_calls = _parse_tool_calls(index, text)
        index, tail, stop = _read_until_stop(index, text, [EOS])
        if tail:
            raise ParseError(f"tool_calls: unexpected text after the tool-call block: {tail[:40]!r}")
    elif stop != EOS:
        raise ParseError("content: missing end-of-sentence token")
    if index != len(text) or stop not in (EOS, None):
        raise ParseError("content: unexpected text after the end-of-sentence token")

    for token in (BOS, EOS, THINK_START, THINK_END, DSML):
        if token in content:
            raise ParseError(f"content: unexpected special token {token}")
        if token in reasoning:
            raise ParseError(f"reasoning_content: unexpected special token {token}")

    return {"role": "assistant", "content": content, "reasoning_content": reasoning, "tool_calls": tool_calls}


# ---------------------------------------------------------------------------------------------------------
# Batch input (generate.py --input-file)

_IMAGE_TAG = re.compile(r"<image>(.*?)</image>", flags=re.DOTALL)


def parse_tagged_text(text: str) -> Union[str, List[Dict[str, Any]]]:
    """`<image>path</image>` tags → OpenAI content blocks; text without tags is returned unchanged."""
    rest = _IMAGE_TAG.sub("", text)
    if "<image>" in rest or "</image>" in rest:
        raise EncodingError("Malformed <image>path</image> tag")
    matches = list(_IMAGE_TAG.finditer(text))
    if not matches:
        return text
    blocks: List[Dict[str, Any]] = []
    pos = 0
    for m in matches:
        if m.start() > pos:
            blocks.append({"type": "text", "text": text[pos:m.start()]})
        if not m.group(1):
            raise EncodingError("Empty image path in <image></image> tag")
        blocks.append({"type": "image_url", "image_url": {"url": m.group(1)}})
        pos = m.end()
    if pos < len(text):
        blocks.append({"type": "text", "text": text[pos:]})
    return blocks


def load_cases(path: str) -> List[Dict[str, Any]]:
    """Read a JSON batch file: a case object, a bare message list, or a list of case objects."""
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except ValueError as e:
            raise EncodingError(f"{path}: not valid JSON: {e}") from e
    if isinstance(data, dict):
        raw = [data]
    elif isinstance(data, list) and data and isinstance(data[0], dict) and "role" in data[0]:
        raw = [{"messages": data}]
    elif isinstance(data, list):
        raw = data
    else:
        raise EncodingError(f"{path}: expected a case object or a list, got {type(data).__name__}")

    cases = []
    for n, case in enumerate(raw):
        if not isinstance(case, dict) or not isinstance(case.get("messages"), list):
            raise EncodingError(f"{path}: case {n}: 'messages' must be a list of messages")
        messages = copy.deepcopy(case["messages"])
        if case.get("tools"):
            if not messages or not isinstance(messages[0], dict):
                raise EncodingError(f"{path}: case {n}: 'tools' needs a first message to attach to")
            messages[0]["tools"] = copy.deepcopy(case["tools"])
        cases.append({
            "messages": messages,
            "context": case.get("context"),
            "thinking_mode": case.get("thinking_mode"),
            "reasoning_effort": case.get("reasoning_effort"),
        })
    return cases


def encode_case(case: Dict[str, Any], thinking_mode: str) -> Tuple[str, List[Dict[str, Any]]]:
    """Prompt and image records of one loaded case; the case's own thinking_mode wins."""
    prompt, data = encode_messages(case["messages"], case.get("thinking_mode") or thinking_mode,
                                   context=case.get("context"), reasoning_effort=case.get("reasoning_effort"),
                                   return_multi_modal_data=True)
    return prompt, data["images"]
