"""Benchmark: the OpenAI endpoint (generate.py --serve) under 1, 4 and 16 concurrent clients, and what its
HTTP layer costs against generate.py --input-file on the same prompts.

    python -m inference.tools.bench serve                          # the conformance fixture's model, CPU
    python -m inference.tools.bench serve --ckpt-path D --config C --clients 1,4,16 --max-tokens 16
    python -m inference.tools.bench serve --mixed 16:400 --max-tokens 64     # mixed lengths, token ids

Each client sends its requests one after another (streamed chat completions, greedy); requests per second
counts all clients' requests over the wall time, time to first token is from sending a request to its first
token's chunk (the queue wait included). The overhead line runs the same prompts as one generate.py batch file
at the same --max-batch-size. With --mixed LO:HI each request is a streamed completion of random token ids, a
prompt of LO to HI tokens and a reply of 1 to --max-tokens (greedy; the same draws for every run), and a
last line times a short request (16 tokens, a reply of 1) sent while a long reply (HI tokens, --max-tokens)
runs. Figures are printed, never asserted.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

from .common import ROOT

GENERATE = os.path.join(ROOT, "generate.py")
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "reference-tiny")
TOKENIZER_CONFIG = {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"}


def fixture_checkpoint(workdir: str) -> str:
    """The conformance fixture as a checkpoint a generation run reads (it lacks tokenizer_config.json)."""
    d = os.path.join(workdir, "fixture")
    os.makedirs(d, exist_ok=True)
    for name in ("model0-mp1.safetensors", "tokenizer.json", "config.json"):
        if not os.path.exists(os.path.join(d, name)):
            os.symlink(os.path.join(FIXTURE, name), os.path.join(d, name))
    with open(os.path.join(d, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(TOKENIZER_CONFIG, f, ensure_ascii=False)
    return d


def prompts(n: int):
    return [f"Question {k}: name {k % 7 + 2} rivers and say where each one reaches the sea."
            for k in range(n)]


class Server:
    def __init__(self, args, port: int):
        self.proc = subprocess.Popen([sys.executable, GENERATE, *args, "--serve", f"127.0.0.1:{port}"],
                                     cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            if self.proc.poll() is not None:
                raise SystemExit("bench serve: the server ended:\n" + self.proc.stderr.read())
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2)
                return
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.5)
        raise SystemExit("bench serve: the server did not come up")

    def stop(self):
        self.proc.terminate()
        self.proc.wait(120)


def ask(url: str, prompt: str, max_tokens: int):
    """One streamed chat completion -> (seconds to the first token, seconds in all)."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    start, first = time.perf_counter(), None
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if first is None and line.startswith(b"data: {") and any(
                    c["delta"].get("content") for c in json.loads(line[len(b"data: "):])["choices"]):
                first = time.perf_counter() - start
    return first if first is not None else time.perf_counter() - start, time.perf_counter() - start


def ask_ids(url: str, ids, max_tokens: int):
    """One streamed completion of token ids -> (seconds to the first token, seconds in all)."""
    body = {"prompt": [ids], "max_tokens": max_tokens, "temperature": 0, "stream": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    start, first = time.perf_counter(), None
    with urllib.request.urlopen(req, timeout=1800) as r:
        for line in r:
            if first is None and line.startswith(b"data: {") and json.loads(line[6:])["choices"]:
                first = time.perf_counter() - start
    return first if first is not None else time.perf_counter() - start, time.perf_counter() - start


def mixed_work(n: int, lo: int, hi: int, max_tokens: int, seed: int = 0):
    """n (token ids, reply length): prompts of lo to hi tokens, replies of 1 to max_tokens."""
    import random
    rng = random.Random(seed)
    return [([rng.randrange(10, 1000) for _ in range(rng.randint(lo, hi))], rng.randint(1, max_tokens))
            for _ in range(n)]


def load(url: str, clients: int, per_client: int, max_tokens: int, mixed=None):
    """`clients` threads, each sending `per_client` requests in turn -> (requests/s, TTFTs, latencies).
    `mixed` (lo, hi): token-id prompts of mixed lengths (mixed_work)."""
    ttft, latency, lock = [], [], threading.Lock()
    work = prompts(clients * per_client) if mixed is None else \
        mixed_work(clients * per_client, *mixed, max_tokens, seed=clients)

    def client(c):
        for k in range(per_client):
            w = work[c * per_client + k]
            t, total = ask(url, w, max_tokens) if mixed is None else ask_ids(url, *w)
            with lock:
                ttft.append(t)
                latency.append(total)
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return len(work) / (time.perf_counter() - start), ttft, latency


def batch_file_seconds(args, workdir: str, n: int, max_tokens: int) -> float:
    """generate.py --input-file over the same n prompts: its own 'total' seconds (after loading)."""
    path = os.path.join(workdir, "prompts.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n\n".join(prompts(n)))
    out = subprocess.run([sys.executable, GENERATE, *args, "--input-file", path, "--temperature", "0",
                          "--max-new-tokens", str(max_tokens)], cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit("bench serve: generate.py --input-file failed:\n" + out.stderr)
    line = next(ln for ln in (out.stdout + out.stderr).splitlines() if "; total " in ln)
    return float(line.rsplit("; total ", 1)[1].split()[0])


def _pct(values, q: float) -> float:
    return sorted(values)[int(q * (len(values) - 1))]


def _short_beside_long(url: str, mixed, o) -> str:
    """A long request (mixed[1] prompt tokens, --max-tokens reply) and, once its first token came, short ones
    (16 tokens, a reply of 1) one after another while it runs -> their time to first token."""
    import random
    rng = random.Random(7)
    long_ids = [rng.randrange(10, 1000) for _ in range(mixed[1])]
    started, done, short = threading.Event(), threading.Event(), []

    def long_one():
        body = {"prompt": [long_ids], "max_tokens": o.max_tokens, "temperature": 0, "stream": True}
        req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=1800) as r:
            for line in r:
                if line.startswith(b"data: {"):
                    started.set()
        done.set()
    threading.Thread(target=long_one, daemon=True).start()
    started.wait(1800)
    long_start = time.perf_counter()
    while not done.is_set() and len(short) < 20:
        short.append(ask_ids(url, [rng.randrange(10, 1000) for _ in range(16)], 1)[0])
    done.wait(1800)
    return (f"time to first token median {1e3 * statistics.median(short):.0f} ms, p99 "
            f"{1e3 * _pct(short, 0.99):.0f} ms over {len(short)} requests (the long reply ran "
            f"{time.perf_counter() - long_start:.1f} s after its first token)")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m inference.tools.bench serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt-path", default=None, help="converted checkpoint (default: the fixture's model)")
    ap.add_argument("--config", default=None, help="its config.json (default: the fixture's)")
    ap.add_argument("--clients", default="1,4,16", help="concurrent clients, comma-separated")
    ap.add_argument("--requests", type=int, default=4, help="requests each client sends in turn (4)")
    ap.add_argument("--max-tokens", type=int, default=16, help="greedy tokens per reply (16)")
    ap.add_argument("--max-batch-size", type=int, default=16, help="the server's batch rows (16)")
    ap.add_argument("--threads", type=int, default=2, help="the server's CPU threads (2)")
    ap.add_argument("--numerics", default="reference")
    ap.add_argument("--port", type=int, default=18080)
    ap.add_argument("--mixed", default=None, metavar="LO:HI",
                    help="token-id prompts of LO to HI tokens, replies of 1 to --max-tokens (not set: the "
                         "chat prompts above, every reply --max-tokens)")
    o = ap.parse_args(argv)
    mixed = None
    if o.mixed is not None:
        try:
            mixed = tuple(int(v) for v in o.mixed.split(":"))
            assert len(mixed) == 2 and 1 <= mixed[0] <= mixed[1]
        except (ValueError, AssertionError):
            raise SystemExit(f"bench serve: --mixed {o.mixed}: expected LO:HI, 1 <= LO <= HI") from None
    workdir = tempfile.mkdtemp(prefix="dsv41-bench-serve-")
    try:
        ckpt = o.ckpt_path or fixture_checkpoint(workdir)
        config = o.config or os.path.join(ckpt, "config.json")
        args = ["--ckpt-path", ckpt, "--config", config, "--device", "cpu", "--threads", str(o.threads),
                "--numerics", o.numerics, "--max-batch-size", str(o.max_batch_size), "--max-seq-len",
                str(256 if mixed is None else mixed[1] + o.max_tokens + 2)]
        server = Server(args, o.port)
        try:
            ask(server.url, "warm up", 2)
            print(f"server: {o.threads} threads, batches of up to {o.max_batch_size}, numerics {o.numerics}, "
                  f"{o.max_tokens} greedy tokens a reply, {o.requests} requests per client")
            for clients in [int(c) for c in o.clients.split(",")]:
                rps, ttft, latency = load(server.url, clients, o.requests, o.max_tokens, mixed)
                tokens = f"{rps * o.max_tokens:7.1f} tokens/s; " if mixed is None else ""
                print(f"{clients:3d} clients: {rps:6.2f} requests/s, {tokens}time to first token median "
                      f"{1e3 * statistics.median(ttft):7.0f} ms, p90 {1e3 * _pct(ttft, 0.9):7.0f} ms, p99 "
                      f"{1e3 * _pct(ttft, 0.99):7.0f} ms; latency median "
                      f"{1e3 * statistics.median(latency):7.0f} ms")
            if mixed is not None:
                print("a short request sent while a long reply runs: "
                      + _short_beside_long(server.url, mixed, o))
                return 0
            n = max(int(c) for c in o.clients.split(","))
            start = time.perf_counter()
            load(server.url, n, 1, o.max_tokens)
            served = time.perf_counter() - start
        finally:
            server.stop()
        direct = batch_file_seconds(args, workdir, n, o.max_tokens)
        print(f"the same {n} prompts: {served:.2f} s through the server ({n} concurrent clients), "
              f"{direct:.2f} s as a generate.py --input-file batch: the HTTP layer {served / direct:.2f}x")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0
