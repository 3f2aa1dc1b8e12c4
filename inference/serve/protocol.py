"""The OpenAI API's shapes, checked: request bodies of /v1/chat/completions and /v1/completions become
`Request`s (what the engine runs, per prompt), replies and stream chunks are built from what it gives back,
and every bad input is an `APIError` with OpenAI's error body ({"error": {"message", "type", "param",
"code"}}) and the HTTP status a client expects. No torch here: the checks run in the HTTP server's thread.
"""
import json
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

MAX_STOP = 4                 # OpenAI's limit on stop sequences
MAX_TOP_LOGPROBS = 20        # chat: top_logprobs 0..20 (OpenAI)
MAX_LEGACY_LOGPROBS = 5      # completions: logprobs 0..5 (OpenAI)


class APIError(Exception):
    """A request the server refuses: the HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 kind: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or {400: "invalid_request_error", 401: "authentication_error",
                             404: "invalid_request_error", 413: "invalid_request_error",
                             503: "server_error"}.get(status, "server_error")

    def body(self) -> Dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, param, code)


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen; requests batch together only with equal Sampling (one sampler, one RNG
    stream per batch). seed None: the server's RNG stream, which every rank keeps alike."""
    temperature: float = 1.0
    top_p: float = 1.0
    seed: Optional[int] = None


@dataclass
class Request:
    """One prompt to run, as the engine needs it (a chat request is one; a completions request one per
    prompt). `ids` and the image fields are set by the server from the messages or the prompt."""
    ids: List[int]
    max_tokens: int
    sampling: Sampling
    stop: List[str] = field(default_factory=list)
    logprobs: Optional[int] = None         # top alternatives per generated token (0: the token's only)
    echo_logprobs: bool = False            # the prompt's tokens' log-probs too (completions' echo)
    thinking_mode: str = "chat"            # chat requests: how the reply is split and parsed
    tools: bool = False                    # chat requests: tool calls parsed from the reply
    token_types: Optional[List[int]] = None
    images: Optional[list] = None


# ---------------------------------------------------------------------------------------------------------
# Field checks

def _typed(body: Dict[str, Any], name: str, kinds, default=None, what: str = ""):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise bad(f"'{name}' must be {what}, got a boolean", name)
    if not isinstance(value, kinds):
        raise bad(f"'{name}' must be {what}, got {type(value).__name__}", name)
    return value


def _number(body, name, default, lo, hi, what):
    v = _typed(body, name, (int, float), default, "a number")
    if not lo <= v <= hi:
        raise bad(f"'{name}' must be {what}, got {v}", name)
    return float(v)


def _int(body, name, default, lo, hi=None):
    v = _typed(body, name, int, default, "an integer")
    if v is not None and (v < lo or (hi is not None and v > hi)):
        span = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
        raise bad(f"'{name}' must be {span}, got {v}", name)
    return v


def _bool(body, name, default=False):
    return _typed(body, name, bool, default, "a boolean")


def check_common(body: Any, model_name: str) -> None:
    """What every generation request shares: an object, the served model's name, n = 1."""
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if model is not None and model != model_name:
        raise APIError(404, f"The model '{model}' does not exist: this server serves '{model_name}'", "model",
                       "model_not_found")
    if _int(body, "n", 1, 1) != 1:
        raise bad("'n' must be 1: this server returns one choice per prompt", "n")
    if _int(body, "best_of", 1, 1) != 1:
        raise bad("'best_of' must be 1", "best_of")


def sampling_of(body: Dict[str, Any]) -> Sampling:
    return Sampling(_number(body, "temperature", 1.0, 0.0, 2.0, "between 0 and 2"),
                    _number(body, "top_p", 1.0, 1e-9, 1.0, "in (0, 1]"), _int(body, "seed", None, 0))


def stop_of(body: Dict[str, Any]) -> List[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("'stop' must be a non-empty string or a list of them", "stop")
    if len(stops) > MAX_STOP:
        raise bad(f"'stop' takes at most {MAX_STOP} sequences, got {len(stops)}", "stop")
    return stops


def stream_of(body: Dict[str, Any]) -> Tuple[bool, bool]:
    """-> (stream, include_usage)."""
    stream = _bool(body, "stream")
    options = _typed(body, "stream_options", dict, {}, "an object")
    if options and not stream:
        raise bad("'stream_options' needs 'stream': true", "stream_options")
    return stream, _typed(options, "include_usage", bool, False, "a boolean")


def check_prompt_length(n_prompt: int, max_tokens: int, max_seq_len: int) -> None:
    if n_prompt + max(max_tokens, 0) > max_seq_len or n_prompt < 1:
        raise bad(f"This model's maximum context length is {max_seq_len} tokens; the prompt has {n_prompt} "
                  f"and {max_tokens} more were asked for (max_tokens): {n_prompt + max_tokens} in all",
                  None, "context_length_exceeded")


# ---------------------------------------------------------------------------------------------------------
# /v1/chat/completions

THINKING = {True: "thinking", False: "chat"}


def chat_fields(body: Dict[str, Any], default_mode: str) -> Dict[str, Any]:
    """The chat request's fields besides the messages: max_tokens, sampling, stop, logprobs, thinking, tools.
    -> a dict of Request fields and the encoder's (thinking_mode, reasoning_effort, tools)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list of messages", "messages")
    for n, m in enumerate(messages):
        if not isinstance(m,
                          dict) or m.get("role") not in ("system", "user", "assistant", "tool", "developer"):
            raise bad(f"messages[{n}]: each message is an object with a role of system, user, assistant, "
                      f"tool", f"messages[{n}].role")
    limit = _int(body, "max_completion_tokens", None, 1)
    limit = _int(body, "max_tokens", None, 1) if limit is None else limit
    logprobs = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top is not None and not logprobs:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    kwargs = _typed(body, "chat_template_kwargs", dict, {}, "an object")
    thinking = kwargs.get("thinking", kwargs.get("enable_thinking"))
    if thinking is not None and not isinstance(thinking, bool):
        raise bad("'chat_template_kwargs.thinking' must be a boolean", "chat_template_kwargs")
    effort = body.get("reasoning_effort", kwargs.get("reasoning_effort"))
    if thinking is not None:
        mode = THINKING[thinking]
    else:                                   # an effort asks for thinking; else the server's --thinking-mode
        mode = "thinking" if effort is not None else default_mode
    tools = _typed(body, "tools", list, [], "a list")
    choice = body.get("tool_choice", "auto" if tools else "none")
    if choice not in ("auto", "none"):
        raise bad("'tool_choice' must be 'auto' or 'none' (a forced or named tool call is not supported)",
                  "tool_choice")
    for n, t in enumerate(tools):
        if not (isinstance(t, dict) and t.get("type", "function") == "function"
                and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)):
            raise bad(f"tools[{n}] must be {{'type': 'function', 'function': {{'name': ..., ...}}}}",
                      f"tools[{n}]")
    for name in ("response_format", "functions", "logit_bias"):
        if body.get(name) is not None:
            raise bad(f"'{name}' is not supported by this server", name)
    return {"max_tokens": limit, "logprobs": (top or 0) if logprobs else None, "thinking_mode": mode,
            "effort": effort, "tools": tools if choice == "auto" else []}


def chat_case(body: Dict[str, Any], tools: List[dict]) -> Dict[str, Any]:
    """The messages as the encoder takes them: 'developer' is a system message, the tools attached to the
    first message, as a JSON case carries them."""
    messages = [dict(m, role="system") if m.get("role") == "developer" else dict(m) for m in body["messages"]]
    if tools:
        messages[0]["tools"] = tools
    return {"messages": messages}


def check_image_urls(messages: List[Dict[str, Any]], allowed_dir: Optional[str]) -> None:
    """A client may send images as data URLs; a local path (file:// or a plain path) only inside
    --allowed-local-media-path; nothing is fetched from the network."""
    root = os.path.realpath(allowed_dir) if allowed_dir else None
    for n, m in enumerate(messages):
        content = m.get("content")
        for block in content if isinstance(content, list) else []:
            if not isinstance(block, dict) or block.get("type") not in ("image_url", "image"):
                continue
            url = block.get("image_url", block.get("image"))
            url = url.get("url") if isinstance(url, dict) else url
            where = f"messages[{n}].content"
            if not isinstance(url, str) or not url:
                raise bad(f"{where}: an image block needs image_url.url (a data URL)", where)
            if url.startswith("data:"):
                continue
            if url.startswith(("http://", "https://")):
                raise bad(f"{where}: this server fetches no image from the network: send a data URL", where)
            path = url[len("file://"):] if url.startswith("file://") else url
            real = os.path.realpath(path)
            if root is None or os.path.commonpath([root, real]) != root:
                raise bad(f"{where}: a local image path is read only inside --allowed-local-media-path "
                          f"({'not set' if root is None else allowed_dir}); send a data URL", where)


# ---------------------------------------------------------------------------------------------------------
# /v1/completions

def completion_prompts(body: Dict[str, Any]) -> List[Any]:
    """'prompt' as a string, a list of strings, a list of token ids or a list of lists of them -> a list of
    prompts, each a string or a list of ids."""
    p = body.get("prompt")
    if isinstance(p, str):
        return [p]
    if isinstance(p, list) and p:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return [p]
        if all(isinstance(s, str) for s in p):
            return list(p)
        if all(isinstance(s, list) and s and all(isinstance(t, int) and not isinstance(t, bool) for t in s)
               for s in p):
            return list(p)
    raise bad("'prompt' must be a string, a list of strings, a list of token ids or a list of such lists",
              "prompt")


def completion_fields(body: Dict[str, Any]) -> Dict[str, Any]:
    echo = _bool(body, "echo")
    limit = _int(body, "max_tokens", 16, 0)
    if limit == 0 and not echo:
        raise bad("'max_tokens' 0 needs 'echo': true (there would be nothing to return)", "max_tokens")
    logprobs = _int(body, "logprobs", None, 0, MAX_LEGACY_LOGPROBS)
    if body.get("suffix") is not None:
        raise bad("'suffix' is not supported by this server", "suffix")
    return {"max_tokens": limit, "echo": echo, "logprobs": logprobs}


# ---------------------------------------------------------------------------------------------------------
# Replies

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt: int, completion: int) -> Dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def sse(data: Any) -> bytes:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n".encode()
