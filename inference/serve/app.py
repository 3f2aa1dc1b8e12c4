"""The HTTP side (rank 0): an ASGI app (FastAPI on uvicorn) with the OpenAI routes and vLLM's tokenizer
routes. Each request is checked (protocol.py), its prompt encoded and tokenized off the event loop, queued as
jobs (engine.Queue), and answered from the events the model side hands back: all at once, or as server-sent
events while the batch runs. A client that goes away cancels its jobs; the others go on.
"""
import asyncio
import json
import logging
import traceback
from typing import Any, Dict, List, Optional, Tuple

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from encoding import EncodingError, encode_messages
from encoding.encoding import THINK_END, TOOL_CALLS_START
from ..engine.errors import InputError
from ..engine.prompts import _blank_messages, parse_completion, tokenize_prompt
from ..vision import VisionError
from . import protocol as P
from .engine import Event, Job, Queue

PROMPT_ERRORS = (EncodingError, InputError, VisionError, ValueError)
log = logging.getLogger("dsv41.serve")


class Server:
    """What the routes share: the tokenizer and model settings, the queue, the served name and the options
    of --serve (api key, local media directory, request size limit, the default thinking mode)."""

    def __init__(self, tokenizer, margs, queue: Queue, name: str, bos_id: int, eos_id: int,
                 api_key: Optional[str] = None,
                 media_dir: Optional[str] = None, max_body: int = 32 << 20, vision: bool = True,
                 thinking_mode: str = "chat", effort=None, temperature: float = 1.0):
        self.tokenizer, self.margs, self.queue, self.name = tokenizer, margs, queue, name
        self.bos_id, self.eos_id = bos_id, eos_id
        self.api_key, self.media_dir, self.max_body = api_key, media_dir, max_body
        self.vision, self.thinking_mode, self.effort = vision, thinking_mode, effort
        self.temperature = temperature

    def decode(self, ids: List[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def sampling(self, body: Dict[str, Any]) -> P.Sampling:
        given = body.get("temperature")                 # absent or null: the server's --temperature
        return P.sampling_of(dict(body, temperature=self.temperature if given is None else given))

    # -- prompts (run off the event loop: tokenizing and decoding images take time) ----------------------

    def chat_request(self, body: Dict[str, Any]) -> P.Request:
        f = P.chat_fields(body, self.thinking_mode)
        P.check_image_urls(body["messages"], self.media_dir)
        case = P.chat_case(body, f["tools"])
        if _blank_messages(case["messages"]):
            raise P.bad("the messages are blank (no text, image or tool call)", "messages")
        effort = f["effort"] if f["effort"] is not None else self.effort
        try:
            text, data = encode_messages(case["messages"], f["thinking_mode"], reasoning_effort=effort,
                                         return_multi_modal_data=True)
            ids, types, images = tokenize_prompt(self.tokenizer, self.margs, text, data["images"], "request",
                                                 self.vision)
        except PROMPT_ERRORS as e:
            raise P.bad(str(e), "messages") from None
        limit = f["max_tokens"] or self.margs.max_seq_len - len(ids)
        P.check_prompt_length(len(ids), limit, self.margs.max_seq_len)
        return P.Request(ids, limit, self.sampling(body), P.stop_of(body), f["logprobs"],
                         thinking_mode=f["thinking_mode"], tools=bool(f["tools"]), token_types=types,
                         images=images)

    def completion_requests(self, body: Dict[str, Any]) -> List[P.Request]:
        f = P.completion_fields(body)
        sampling, stop = self.sampling(body), P.stop_of(body)
        requests = []
        for p in P.completion_prompts(body):
            if isinstance(p, str):
                ids = [self.bos_id] + self.tokenizer.encode(p, add_special_tokens=False).ids
            else:
                ids = list(p)
                bad = [t for t in ids if not 0 <= t < self.margs.vocab_size]
                if bad:
                    raise P.bad(f"token id {bad[0]} is outside the vocabulary "
                                f"(0..{self.margs.vocab_size - 1})", "prompt")
            P.check_prompt_length(len(ids), f["max_tokens"], self.margs.max_seq_len)
            requests.append(P.Request(ids, f["max_tokens"], sampling, stop, f["logprobs"],
                                      echo_logprobs=f["echo"] and f["logprobs"] is not None))
        return requests


class Splitter:
    """A chat reply's text as it streams -> deltas of reasoning_content and content. In thinking mode the text
    before </think> is reasoning; with tools, the text from the tool-call block on is held (it becomes
    tool_calls at the end). Text that may be the start of a marker waits for the next piece."""

    def __init__(self, thinking: bool, tools: bool):
        self.thinking, self.tools = thinking, tools
        self.buf, self.in_calls = "", False

    @staticmethod
    def _safe(text: str, marker: str) -> int:
        """Length of the text's start that cannot be part of `marker`."""
        at = text.find(marker)
        if at >= 0:
            return at
        keep = next((n for n in range(min(len(text), len(marker) - 1), 0,
                                      -1) if marker.startswith(text[-n:])), 0)
        return len(text) - keep

    def feed(self, piece: str) -> Tuple[str, str]:
        self.buf += piece
        reasoning = content = ""
        if self.thinking:
            n = self._safe(self.buf, THINK_END)
            reasoning, self.buf = self.buf[:n], self.buf[n:]
            if self.buf.startswith(THINK_END):
                self.thinking, self.buf = False, self.buf[len(THINK_END):]
        if not self.thinking and not self.in_calls:
            n = self._safe(self.buf, TOOL_CALLS_START) if self.tools else len(self.buf)
            content, self.buf = self.buf[:n], self.buf[n:]
            self.in_calls = self.tools and self.buf.startswith(TOOL_CALLS_START)
        return reasoning, content


def _error(e: P.APIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status == 503 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


async def _body(server: Server, request: HTTPRequest) -> Any:
    size = int(request.headers.get("content-length") or 0)
    if size > server.max_body:
        raise P.APIError(413, f"the request body ({size} bytes) exceeds the limit of {server.max_body} bytes "
                              f"(--max-request-mb)")
    raw = b""
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > server.max_body:
            raise P.APIError(413, f"the request body exceeds the limit of {server.max_body} bytes")
    try:
        return json.loads(raw)
    except ValueError as e:
        raise P.bad(f"the request body is not valid JSON: {e}") from None


def _events(loop) -> Tuple[asyncio.Queue, Any]:
    """An event queue of the request's loop, and the sink the model thread hands events to."""
    q: asyncio.Queue = asyncio.Queue()

    def sink(ev: Event) -> None:
        try:
            loop.call_soon_threadsafe(q.put_nowait, ev)
        except RuntimeError:                 # the loop is closed: the server stopped, nobody waits
            pass
    return q, sink


async def _next(q: asyncio.Queue, request: HTTPRequest, jobs: List[Job]) -> Event:
    """The next event, watching for the client going away meanwhile (then the jobs are cancelled)."""
    while True:
        try:
            return await asyncio.wait_for(q.get(), 0.5)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                for j in jobs:
                    j.cancelled.set()
                raise asyncio.CancelledError()


async def _enqueue(server: Server, request: HTTPRequest, prepare):
    """Read and check the body, make its requests with `prepare(body)` off the event loop, queue a job for
    each. -> (body, stream, include_usage, requests, jobs, their event queues)."""
    with server.queue.arriving():
        body = await _body(server, request)
        P.check_common(body, server.name)
        stream, include_usage = P.stream_of(body)
        reqs = await asyncio.to_thread(prepare, body)
        loop = asyncio.get_running_loop()
        channels = [_events(loop) for _ in reqs]
        jobs = [Job(r, sink) for r, (_, sink) in zip(reqs, channels)]
        server.queue.submit(jobs)
    return body, stream, include_usage, reqs, jobs, [q for q, _ in channels]


async def _collect(q: asyncio.Queue, request: HTTPRequest, jobs: List[Job]):
    """A whole reply: (its tokens' log-prob entries, the "done" event); a failed model is a 500."""
    entries = []
    while True:
        ev = await _next(q, request, jobs)
        if ev.kind == "done":
            break
        if ev.logprob is not None:
            entries.append(ev.logprob)
    if ev.finish_reason == "error":
        raise P.APIError(ev.status, _failed(ev))
    return entries, ev


def _failed(ev) -> str:
    """An error event's message: the request's own problem (400) as it is, else the model's failure."""
    return ev.text if ev.status == 400 else f"the model failed: {ev.text}"


def _chat_logprob(server: Server, e: Dict[str, Any]) -> Dict[str, Any]:
    def one(text, lp):
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
    return dict(one(e["text"], e["logprob"]), top_logprobs=[one(t, v) for _, t, v in e.get("top", [])])


def _tool_calls(calls: List[Dict[str, Any]], stream: bool = False) -> List[Dict[str, Any]]:
    return [dict({"index": n} if stream else {}, id=P.new_id("call"), type="function", function=c["function"])
            for n, c in enumerate(calls)]


def _finish(reason: str, calls) -> str:
    return "tool_calls" if calls else ("stop" if reason in ("stop", "abort") else "length")


def chat_message(text: str, finish: str, req: P.Request) -> Tuple[Dict[str, Any], List[Dict[str, Any]], str]:
    """A finished chat reply's text -> (the assistant message by the strict V4.1 parser, its tool calls when
    the request gave tools, the finish_reason). A reply that ended on EOS or a stop string is parsed as
    complete; one that does not parse keeps its raw text as content (no tool calls)."""
    message, problem = parse_completion(text, "eos" if finish == "stop" else "length", req.thinking_mode)
    calls = message["tool_calls"] if req.tools and not problem else []
    return message, calls, _finish(finish, calls)


def build_app(server: Server) -> FastAPI:
    app = FastAPI(title="DeepSeek-V4.1-Flash reference", docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def guard(request: HTTPRequest, call_next):
        if server.api_key and request.url.path != "/health" and \
                request.headers.get("authorization") != f"Bearer {server.api_key}":
            return _error(P.APIError(401, "missing or wrong API key (Authorization: Bearer ...)",
                                     code="invalid_api_key"))
        try:
            return await call_next(request)
        except P.APIError as e:
            return _error(e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc):
        return _error(P.APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                 code="not_found" if exc.status_code == 404 else None))

    @app.exception_handler(P.APIError)
    async def api_error(request, exc: P.APIError):
        return _error(exc)

    @app.exception_handler(Exception)
    async def internal(request, exc):
        log.error("".join(traceback.format_exception(exc)))
        return _error(P.APIError(500, f"internal error: {type(exc).__name__}: {exc}"))

    @app.get("/health")
    async def health():
        return {"status": "ok", "waiting": server.queue.waiting()}

    @app.get("/v1/models")
    async def models():
        card = {"id": server.name, "object": "model", "created": P.now(), "owned_by": "deepseek-ai",
                "max_model_len": server.margs.max_seq_len}
        return {"object": "list", "data": [card]}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": server.margs.max_seq_len,
                "vocab_size": server.margs.vocab_size, "bos_token": server.decode([server.bos_id]),
                "bos_token_id": server.bos_id, "eos_token": server.decode([server.eos_id]),
                "eos_token_id": server.eos_id, "add_bos_token": True}

    @app.post("/tokenize")
    async def tokenize(request: HTTPRequest):
        body = await _body(server, request)
        if not isinstance(body, dict):
            raise P.bad("the request body must be a JSON object")
        if "messages" in body:
            req = await asyncio.to_thread(server.chat_request, dict(body, max_tokens=1))
            ids = req.ids
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise P.bad("'prompt' must be a string (or give 'messages')", "prompt")
            special = body.get("add_special_tokens", True)
            ids = ([server.bos_id] if special else []) + server.tokenizer.encode(prompt,
                                                                                 add_special_tokens=False).ids
        return {"count": len(ids), "max_model_len": server.margs.max_seq_len, "tokens": ids,
                "token_strs": [server.decode([t]) for t in ids] if body.get("return_token_strs") else None}

    @app.post("/detokenize")
    async def detokenize(request: HTTPRequest):
        body = await _body(server, request)
        ids = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(ids, list) or not all(isinstance(t, int) and 0 <= t < server.margs.vocab_size
                                                 for t in ids):
            raise P.bad("'tokens' must be a list of token ids in the vocabulary", "tokens")
        return {"prompt": server.decode(ids)}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        _, stream, include_usage, [req], [job], [q] = await _enqueue(
            server, request, lambda body: [server.chat_request(body)])
        rid, created = P.new_id("chatcmpl"), P.now()
        if stream:
            return StreamingResponse(_chat_stream(server, request, req, job, q, rid, created, include_usage),
                                     media_type="text/event-stream")
        entries, done = await _collect(q, request, [job])
        logprobs = [_chat_logprob(server, e) for e in entries]
        message, calls, finish = chat_message(done.text, done.finish_reason, req)
        content = message["content"] if not calls or message["content"] else None
        reply = {"role": "assistant", "content": content,
                 "reasoning_content": message["reasoning_content"] or None}
        if calls:
            reply["tool_calls"] = _tool_calls(calls)
        choice = {"index": 0, "message": reply, "logprobs": {"content": logprobs} if req.logprobs is not None
                  else None, "finish_reason": finish}
        return {"id": rid, "object": "chat.completion", "created": created, "model": server.name,
                "choices": [choice], "usage": P.usage(len(req.ids), done.completion_tokens)}

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        body, stream, include_usage, reqs, jobs, queues = await _enqueue(server, request,
                                                                         server.completion_requests)
        echo = bool(body.get("echo"))
        rid, created = P.new_id("cmpl"), P.now()
        if stream:
            return StreamingResponse(_completion_stream(server, request, reqs, jobs, queues, rid, created,
                                                        echo, include_usage), media_type="text/event-stream")
        choices, used = [], 0
        for n, (req, q) in enumerate(zip(reqs, queues)):
            entries, done = await _collect(q, request, jobs)
            used += done.completion_tokens
            prompt_text = server.decode(req.ids) if echo else ""
            lp = None
            if req.logprobs is not None:
                prompt_lp = (done.prompt_logprobs or [None] * len(req.ids)) if echo else []
                lp = _legacy_logprobs(prompt_lp, entries, req.ids if echo else [], server)
            choices.append({"index": n, "text": prompt_text + done.text, "logprobs": lp,
                            "finish_reason": _finish(done.finish_reason, None)})
        return {"id": rid, "object": "text_completion", "created": created, "model": server.name,
                "choices": choices, "usage": P.usage(sum(len(r.ids) for r in reqs), used)}

    return app


def _legacy_logprobs(prompt: List[Optional[Dict[str, Any]]], generated: List[Dict[str, Any]],
                     prompt_ids: List[int], server: Server, offset: int = 0) -> Dict[str, Any]:
    """The completions API's log-probs: tokens, token_logprobs, top_logprobs ({token: log-prob}), text_offset;
    the prompt's first (echo) has none."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    entries = [e if e is not None else {"text": server.decode([t]), "logprob": None}
               for e, t in zip(prompt, prompt_ids)] + generated
    for e in entries:
        out["tokens"].append(e["text"])
        out["token_logprobs"].append(e["logprob"])
        out["top_logprobs"].append({t: v for _, t, v in e["top"]} if e.get("top") else
                                   (None if e["logprob"] is None else {}))
        out["text_offset"].append(offset)
        offset += len(e["text"])
    return out


async def _chat_stream(server, request, req, job, q, rid, created, include_usage):
    def chunk(delta, finish=None, logprobs=None):
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return P.sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": server.name,
                      "choices": [choice]})
    split = Splitter(req.thinking_mode == "thinking", req.tools)
    try:
        yield chunk({"role": "assistant", "content": ""})
        while True:
            ev = await _next(q, request, [job])
            if ev.kind == "done":
                break
            reasoning, content = split.feed(ev.text)
            lp = {"content": [_chat_logprob(server, ev.logprob)]} if ev.logprob is not None else None
            delta = dict({"reasoning_content": reasoning} if reasoning else {}, **({"content": content}
                                                                                  if content else {}))
            if delta or lp:
                yield chunk(delta, logprobs=lp)
        if ev.finish_reason == "error":
            yield P.sse(P.APIError(ev.status, _failed(ev)).body())
            return
        _, calls, finish = chat_message(ev.text, ev.finish_reason, req)
        if calls:
            yield chunk({"tool_calls": _tool_calls(calls, stream=True)})
        elif split.buf:                                   # held text that did not become tool calls
            yield chunk({"reasoning_content" if split.thinking else "content": split.buf})
        yield chunk({}, finish)
        if include_usage:
            yield P.sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                         "model": server.name, "choices": [],
                         "usage": P.usage(len(req.ids), ev.completion_tokens)})
        yield P.sse("[DONE]")
    finally:
        job.cancelled.set()                               # a no-op once done; a client gone: its row stops


async def _completion_stream(server, request, reqs, jobs, queues, rid, created, echo, include_usage):
    def chunk(n, text, finish=None, logprobs=None):
        return P.sse({"id": rid, "object": "text_completion", "created": created, "model": server.name,
                      "choices": [{"index": n, "text": text, "logprobs": logprobs, "finish_reason": finish}]})
    used = 0
    try:
        for n, (req, q) in enumerate(zip(reqs, queues)):
            offset = 0
            if echo:
                offset = len(server.decode(req.ids))
                yield chunk(n, server.decode(req.ids))
            while True:
                ev = await _next(q, request, jobs)
                if ev.kind == "done":
                    break
                lp = _legacy_logprobs([], [ev.logprob], [], server,
                                      offset) if ev.logprob is not None else None
                offset += len(ev.logprob["text"]) if ev.logprob is not None else 0
                if ev.text or lp:
                    yield chunk(n, ev.text, logprobs=lp)
            if ev.finish_reason == "error":
                yield P.sse(P.APIError(ev.status, _failed(ev)).body())
                return
            used += ev.completion_tokens
            yield chunk(n, "", _finish(ev.finish_reason, None))
        if include_usage:
            yield P.sse({"id": rid, "object": "text_completion", "created": created, "model": server.name,
                         "choices": [], "usage": P.usage(sum(len(r.ids) for r in reqs), used)})
        yield P.sse("[DONE]")
    finally:
        for j in jobs:
            j.cancelled.set()
