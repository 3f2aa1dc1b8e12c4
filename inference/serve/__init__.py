"""The reference behind an OpenAI-compatible endpoint: `generate.py --serve [HOST:]PORT` (also under torchrun,
on every node: rank 0 serves HTTP, every rank runs each batch).

    protocol.py   the OpenAI request and reply shapes, checked; errors in OpenAI's JSON shape
    engine.py     the queue, the batches, the generation loop that hands each token back (every rank)
    app.py        the routes (FastAPI on uvicorn, imported only with --serve), streaming as server-sent events

Routes: GET /health, GET /v1/models, POST /v1/chat/completions, POST /v1/completions, and vLLM's POST
/tokenize, POST /detokenize, GET /tokenizer_info. docs/cli.md §2.10 has the flags and the commands.
"""
import argparse
import contextlib
import importlib.util
import os
import signal
import socket
import threading
from typing import Optional, Tuple

DEFAULT_HOST = "127.0.0.1"
DEFAULT_NAME = "deepseek-ai/DeepSeek-V4.1-Flash"


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("serving (--serve: an OpenAI-compatible HTTP endpoint)")
    add = g.add_argument
    add("--serve", default=None, metavar="[HOST:]PORT", help=f"serve the OpenAI API on HOST:PORT (host "
        f"{DEFAULT_HOST} unless given; 0.0.0.0 listens on every interface; port 0 picks a free one)")
    add("--served-model-name", default=DEFAULT_NAME, help=f"the model name clients send ({DEFAULT_NAME})")
    add("--api-key", default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health (default: none)")
    add("--allowed-local-media-path", default=None, metavar="DIR", help="image_url paths (file:// or plain) "
        "are read only inside DIR; without it only data URLs are accepted")
    add("--max-queue", type=int, default=64, help="requests that may wait for a batch; past it: 503 (64)")
    add("--batch-wait-ms", type=float, default=100, help="once a request waits, the longest the next batch "
        "waits for the requests being read and tokenized meanwhile (100; none being read: no wait)")
    add("--max-request-mb", type=float, default=32, help="largest request body in MiB (32)")
    add("--batch-loop", choices=["scheduler", "official"], default="scheduler", help="scheduler: every "
        "request in a row of its own at its own position, joining and leaving the running batch (default; "
        "its decode steps run eagerly on a GPU); official: DeepSeek's loop, batches of one shared position "
        "run to their end (CUDA graphs on a GPU)")


def parse_address(text: str) -> Tuple[str, int]:
    """'8000', 'HOST:8000' or '[::1]:8000' -> (host, port); ValueError with the reason."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]") if sep else DEFAULT_HOST
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--serve {text}: expected [HOST:]PORT with a port 0..65535")
    return host or DEFAULT_HOST, int(port)


def check_serve_options(o: argparse.Namespace) -> Optional[str]:
    """-> the first problem with the serving flags, or None (every rank, before any collective)."""
    try:
        parse_address(o.serve)
    except ValueError as e:
        return str(e)
    if o.max_queue < 1:
        return f"--max-queue must be >= 1, got {o.max_queue}"
    if o.batch_wait_ms < 0:
        return f"--batch-wait-ms must be >= 0, got {o.batch_wait_ms}"
    if o.max_request_mb <= 0:
        return f"--max-request-mb must be > 0, got {o.max_request_mb}"
    if o.allowed_local_media_path and not os.path.isdir(o.allowed_local_media_path):
        return f"--allowed-local-media-path {o.allowed_local_media_path}: not a directory"
    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        return f"--serve needs {' and '.join(missing)}: pip install -r requirements.txt"
    return None


def bind(address: str) -> socket.socket:
    """Rank 0: the listening socket, bound before the model loads (a port in use fails fast)."""
    host, port = parse_address(address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"--serve {address}: cannot listen on {host}:{port} ({e.strerror or e})") from None
    return sock


def serve(runner, o: argparse.Namespace, eos_id: int, bos_id: int, sock: Optional[socket.socket],
          log) -> None:
    """Every rank until rank 0's server stops (SIGINT / SIGTERM: uvicorn stops accepting, the requests in
    flight finish, then every rank leaves the batch loop). Every rank runs the batches in its main thread
    (torch's CPU kernels run at half speed from another thread, whose OpenMP team competes with the main
    thread's); rank 0 serves HTTP from a second thread, and the other ranks leave signals to rank 0."""
    from .engine import Queue, serve_loop
    from .official import serve_batches
    loop = serve_batches if o.batch_loop == "official" else serve_loop
    session = runner.loaded.session
    par, margs = session.par, session.args
    if par.rank != 0:
        for sig in (signal.SIGINT, signal.SIGTERM):     # rank 0 drains and tells every rank when to stop
            signal.signal(sig, signal.SIG_IGN)
        loop(runner, par, None, eos_id, log)
        return
    import uvicorn
    from .app import Server, build_app

    class _Uvicorn(uvicorn.Server):
        """uvicorn's server in a thread of its own: the signals are the main thread's (below)."""
        @contextlib.contextmanager
        def capture_signals(self):
            yield

    queue = Queue(o.max_queue, margs.max_batch_size, o.batch_wait_ms / 1e3)
    server = Server(session.tokenizer, margs, queue, o.served_model_name, bos_id, eos_id, o.api_key,
                    o.allowed_local_media_path, int(o.max_request_mb * 2 ** 20), not o.language_model_only,
                    o.thinking_mode, o.reasoning_effort, o.temperature)
    http = _Uvicorn(uvicorn.Config(build_app(server), log_level="warning", access_log=False,
                                   timeout_graceful_shutdown=60))

    def web():
        try:
            http.run(sockets=[sock])
        finally:
            queue.close()                               # the batch loop ends once the queue is empty

    def on_signal(signum, frame):                       # a second one stops without waiting for requests
        http.force_exit, http.should_exit = http.should_exit, True

    before = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    thread = threading.Thread(target=web, name="http", daemon=True)
    thread.start()
    host, port = sock.getsockname()[:2]
    log.info(f"serving {o.served_model_name} on http://{host}:{port}/v1 (OpenAI API; {margs.max_batch_size} "
             f"rows, --batch-loop {o.batch_loop}, context {margs.max_seq_len}); Ctrl-C stops")
    try:
        loop(runner, par, queue, eos_id, log)
    except BaseException:                               # the model side failed: stop serving, then say why
        http.should_exit = True
        raise
    finally:
        thread.join(90)
        for s, handler in before.items():
            signal.signal(s, handler)
    log.info("server stopped")
