"""generate.py --serve: the OpenAI-compatible endpoint, with the real `openai` SDK as the client, against the
conformance fixture's model (W = 1) and a tiny model converted for two ranks (W = 2, gloo, under torchrun).

Checked against the project's own outputs: a streamed greedy chat reply equals generate.py's reply to the same
case; /v1/completions' echoed prompt log-probs equal the log-softmax of `--score --all-prefill-logits`; 16
clients arriving at random times with prompts and replies of mixed lengths get their one-at-a-time replies
(the invariant order; and at W = 2); a client gone mid-stream leaves the
server serving; each bad input gets its status and message; SIGTERM drains and ends every rank."""
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch
from safetensors.torch import load_file

from conftest import FIXTURE, ROOT, TOKENIZER_CONFIG, fixture_config, fixture_file, free_port, tiny_model

openai = pytest.importorskip("openai")

GENERATE = os.path.join(ROOT, "generate.py")
MODEL = "deepseek-ai/DeepSeek-V4.1-Flash"
KEY = "sk-test"
CASE = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three rivers."}]
NEW = 10                           # greedy tokens per reply (the fixture's model does not say EOS that soon)


class Served:
    """A generate.py --serve run: W = 1 as `python generate.py`, W = 2 under torchrun. Up once /health
    answers; stop() sends SIGTERM to rank 0 (as a user's `kill`) and returns the exit status and output."""

    def __init__(self, ckpt: str, config: str, extra=(), nproc: int = 1):
        self.port = free_port()
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        args = ["--ckpt-path", ckpt, "--config", config, "--device", "cpu", "--threads", "1", *extra,
                "--serve", f"127.0.0.1:{self.port}"]
        cmd = [sys.executable, GENERATE, *args] if nproc == 1 else \
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
             GENERATE, *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     cwd=ROOT, env=env, start_new_session=True)
        self.lines = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError("the server ended before serving:\n" + "".join(self.lines))
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2)
                return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.5)
        self.proc.kill()
        raise AssertionError("the server did not come up:\n" + "".join(self.lines))

    def client(self, key: str = KEY) -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=300)

    def rank0_pid(self) -> int:
        if self.proc.args[1] == GENERATE:
            return self.proc.pid
        for pid in os.listdir("/proc"):                 # torchrun's worker with RANK=0
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = f.read().split(b"\0")
                with open(f"/proc/{pid}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError):
                continue
            if parent == self.proc.pid and b"RANK=0" in env:
                return int(pid)
        raise AssertionError("no rank 0 under torchrun")

    def stop(self):
        os.kill(self.rank0_pid(), signal.SIGTERM)
        try:
            code = self.proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise AssertionError("the server did not stop on SIGTERM:\n" + "".join(self.lines))
        time.sleep(0.2)
        return code, "".join(self.lines)


def post(url: str, body, key: str = KEY, raw: bool = False):
    """-> (status, parsed JSON body) of a POST with a JSON (or raw bytes) body."""
    data = body if raw else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json",
                                                          "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory):
    """The conformance fixture's checkpoint with the tokenizer_config.json a generation run reads (EOS)."""
    d = tmp_path_factory.mktemp("served_fixture")
    for name in ("model0-mp1.safetensors", "tokenizer.json", "config.json"):
        os.symlink(fixture_file(os.path.join(FIXTURE, name)), d / name)
    (d / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, ensure_ascii=False))
    return str(d)


FLAGS = ["--numerics", "invariant", "--max-seq-len", "160", "--max-batch-size", "8"]


@pytest.fixture(scope="module")
def server(fixture_dir):
    s = Served(fixture_dir, os.path.join(fixture_dir, "config.json"), FLAGS + ["--api-key", KEY,
                                                                              "--max-request-mb", "0.05"])
    yield s
    code, out = s.stop()
    assert code == 0 and "server stopped" in out, out


def run_generate(args, timeout=300):
    proc = subprocess.run([sys.executable, GENERATE, "--threads", "1", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def generate_reply(ckpt, config, tmp_path, extra=(), nproc=1):
    """generate.py's greedy record for CASE (batch mode, a JSON case file)."""
    (tmp_path / "case.json").write_text(json.dumps(CASE))
    out = tmp_path / "out.jsonl"
    args = ["--ckpt-path", ckpt, "--config", config, "--device", "cpu", "--input-file",
            str(tmp_path / "case.json"), "--temperature", "0", "--max-new-tokens", str(NEW), "--output",
            str(out), *extra]
    if nproc == 1:
        run_generate(args)
    else:
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               "--nproc-per-node", str(nproc), GENERATE, "--threads", "1", *args],
                              capture_output=True, text=True, cwd=ROOT, timeout=300,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text().splitlines()[0])


def streamed_reply(client, max_tokens=NEW, started=None):
    """A greedy chat reply streamed: (its text, its tokens from the log-probs, finish_reason, usage).
    `started` (a threading.Event) is set at the first token."""
    text, tokens, finish, used = "", [], None, None
    for chunk in client.chat.completions.create(model=MODEL, messages=CASE, max_tokens=max_tokens,
                                                temperature=0, stream=True, logprobs=True,
                                                stream_options={"include_usage": True}):
        if started is not None and any(c.logprobs for c in chunk.choices):
            started.set()
        if chunk.usage is not None:
            used = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            tokens += [t.token for t in (c.logprobs.content if c.logprobs else [])]
            finish = c.finish_reason or finish
    return text, tokens, finish, used


def test_a_streamed_chat_reply_is_generate_py_s_reply(server, fixture_dir, tmp_path):
    record = generate_reply(fixture_dir, os.path.join(fixture_dir, "config.json"), tmp_path, FLAGS)
    text, tokens, finish, used = streamed_reply(server.client())
    assert text == record["completion"] and "".join(tokens) == record["completion"]
    assert (finish, record["finish_reason"]) == ("length", "length")
    assert used.completion_tokens == record["completion_tokens"] == NEW == len(tokens)
    assert used.prompt_tokens == record["prompt_tokens"]
    whole = server.client().chat.completions.create(model=MODEL, messages=CASE, max_tokens=NEW, temperature=0)
    assert whole.choices[0].message.content == record["content"]


def test_echoed_prompt_log_probs_are_the_scored_log_softmax(server, fixture_dir, tmp_path):
    ids = json.loads(open(os.path.join(FIXTURE, "score.json")).read())["sequences"][0][:40]
    r = server.client().completions.create(model=MODEL, prompt=[ids], max_tokens=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) and lp.token_logprobs[0] is None
    assert r.usage.completion_tokens == 0
    (tmp_path / "s.json").write_text(json.dumps({"sequences": [ids], "prefill_len": len(ids)}))
    run_generate(["--ckpt-path", fixture_dir, "--config", os.path.join(fixture_dir, "config.json"),
                  "--device", "cpu", "--numerics", "invariant", "--score", str(tmp_path / "s.json"),
                  "--dump-logits", str(tmp_path / "d.safetensors"), "--all-prefill-logits"])
    logits = load_file(str(tmp_path / "d.safetensors"))["prefill_logits"][0]          # [P, V]
    want = torch.log_softmax(logits.double(), -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    got = torch.tensor(lp.token_logprobs[1:], dtype=torch.float64)
    assert (got - want).abs().max() <= 1e-5, (got - want).abs().max()
    # the top-1 alternative is the argmax, as lm-eval's is_greedy reads it
    best = torch.log_softmax(logits.double(), -1)[:-1].max(-1)
    for n, top in enumerate(lp.top_logprobs[1:]):
        assert abs(list(top.values())[0] - float(best.values[n])) <= 1e-5
    # one more token: the prompt's log-probs unchanged, the first generated token after them
    r1 = server.client().completions.create(model=MODEL, prompt=[ids], max_tokens=1, echo=True, logprobs=1,
                                            temperature=0)
    assert r1.choices[0].logprobs.token_logprobs[:len(ids)] == lp.token_logprobs
    assert len(r1.choices[0].logprobs.tokens) == len(ids) + 1


def mixed_requests(n: int, longest: int, seed: int, most: int = 12):
    """n (prompt ids, max_tokens): prompts of 5 to `longest` tokens, replies of 1 to `most` tokens."""
    import random
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = [rng.randrange(10, 1000) for _ in range(rng.randint(5, longest))]
        out.append((ids, rng.randint(1, most)))
    return out


def ask_ids(client, ids, max_tokens, seed=None):
    """A completion of token ids: (text, finish_reason, each token's log-prob); sampled with a seed when
    given (temperature 0.7), else greedy."""
    r = client.completions.create(model=MODEL, prompt=[ids], max_tokens=max_tokens, logprobs=0,
                                  temperature=0 if seed is None else 0.7, seed=seed)
    c = r.choices[0]
    return c.text, c.finish_reason, c.logprobs.token_logprobs


def arriving_at_random(client, requests, seed: int):
    """Every request from a thread of its own, sent after a random wait of up to 1.5 s (they join the running
    batch at any step, beside any neighbours) -> their replies in order."""
    import random
    waits = [random.Random(seed + k).uniform(0, 1.5) for k in range(len(requests))]
    results = [None] * len(requests)

    def one(k):
        time.sleep(waits[k])
        ids, n, s = requests[k]
        results[k] = ask_ids(client, ids, n, s)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_sixteen_clients_arriving_at_random_get_their_replies_alone(server):
    # the invariant order: each reply's tokens and log-probs are the bits of its run alone, whatever joined
    # or left the running batch (8 rows) while it ran; some sampled with a seed of their own
    client = server.client()
    requests = [(ids, n, 100 + k if k % 4 == 3 else None)
                for k, (ids, n) in enumerate(mixed_requests(16, 60, seed=1, most=10))]
    results = arriving_at_random(client, requests, seed=2)
    assert all(r is not None for r in results)
    assert results == [ask_ids(client, ids, n, s) for ids, n, s in requests]


def test_the_official_batch_loop_serves_the_scheduler_s_replies(server, fixture_dir):
    # --batch-loop official: batches of one shared position (teacher-forced rows), as DeepSeek's loop runs
    # them; in the invariant order each reply is the one the scheduler gives
    requests = [(ids, n, None) for ids, n in mixed_requests(4, 40, seed=5, most=6)]
    official = Served(fixture_dir, os.path.join(fixture_dir, "config.json"),
                      FLAGS + ["--batch-loop", "official"])
    try:
        got = arriving_at_random(official.client(), requests, seed=6)
    finally:
        code, out = official.stop()
    assert code == 0 and "--batch-loop official" in out, out
    assert got == [ask_ids(server.client(), ids, n) for ids, n, _ in requests]


def test_a_client_gone_mid_stream_leaves_the_server_serving(server):
    req = urllib.request.Request(server.url + "/v1/chat/completions", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}, data=json.dumps(
        {"model": MODEL, "messages": CASE, "max_tokens": 60, "stream": True}).encode())
    r = urllib.request.urlopen(req, timeout=60)
    assert r.readline().startswith(b"data: ")
    r.close()                                          # gone after the first event
    text, _, finish, _ = streamed_reply(server.client())
    assert finish == "length" and text


def test_tokenize_detokenize_and_the_model_list(server):
    status, tok, _ = post(server.url + "/tokenize", {"prompt": "Hello world"})
    assert status == 200 and tok["count"] == len(tok["tokens"]) and tok["tokens"][0] == 0
    status, text, _ = post(server.url + "/detokenize", {"tokens": tok["tokens"][1:]})
    assert status == 200 and text["prompt"] == "Hello world"
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    with pytest.raises(urllib.error.HTTPError) as e:                # every route but /health takes the key
        urllib.request.urlopen(server.url + "/tokenizer_info")
    assert e.value.code == 401
    info = json.loads(urllib.request.urlopen(urllib.request.Request(
        server.url + "/tokenizer_info", headers={"Authorization": f"Bearer {KEY}"})).read())
    assert info["model_max_length"] == 160 and info["bos_token_id"] == 0 and info["eos_token_id"] == 1
    # lm-eval's remote tokenizer finds EOS this way
    _, tok, _ = post(server.url + "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False})
    assert tok["tokens"] == [1]


BAD = [  # (body or raw bytes, status, part of the message, param)
    (b"{not json", 400, "not valid JSON", None),
    ({"model": MODEL, "messages": "hi"}, 400, "'messages' must be a non-empty list", "messages"),
    ({"model": MODEL, "messages": CASE, "max_tokens": "8"}, 400, "'max_tokens' must be an integer",
     "max_tokens"),
    ({"model": MODEL, "messages": CASE, "temperature": 3}, 400, "'temperature' must be between 0 and 2",
     "temperature"),
    ({"model": "gpt-4", "messages": CASE}, 404, "The model 'gpt-4' does not exist", "model"),
    ({"model": MODEL, "messages": CASE, "n": 2}, 400, "'n' must be 1", "n"),
    ({"model": MODEL, "messages": CASE, "max_tokens": 200}, 400, "maximum context length is 160", None),
    ({"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, 400, "image",
     "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "/etc/passwd"}}]}]}, 400, "--allowed-local-media-path",
     "messages[0].content"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]}]}, 400, "data URL",
     "messages[0].content"),
    ({"model": MODEL, "messages": CASE, "tool_choice": "required", "tools": []}, 400, "'tool_choice'",
     "tool_choice"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "needs 'echo'", "max_tokens"),
    ({"model": MODEL, "prompt": [[1, 2, 10 ** 7]]}, 400, "outside the vocabulary", "prompt"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x" * 60000}]}, 413, "exceeds the limit",
     None),
]


@pytest.mark.parametrize("body, status, message, param", BAD)
def test_each_bad_input_gets_its_status_and_message(server, body, status, message, param):
    route = "/v1/completions" if isinstance(body, dict) and "prompt" in body else "/v1/chat/completions"
    got, reply, _ = post(server.url + route, body, raw=isinstance(body, bytes))
    assert got == status, reply
    assert set(reply) == {"error"} and set(reply["error"]) == {"message", "type", "param", "code"}
    assert message in reply["error"]["message"] and reply["error"]["param"] == param, reply


def test_a_missing_api_key_is_refused(server):
    with pytest.raises(openai.AuthenticationError):
        server.client(key="wrong").chat.completions.create(model=MODEL, messages=CASE, max_tokens=1)
    status, reply, _ = post(server.url + "/v1/completions", {"model": MODEL, "prompt": "x"}, key="")
    assert status == 401 and reply["error"]["code"] == "invalid_api_key"


# ---------------------------------------------------------------------------------------------------------
# Without a server: the queue, the stop strings, the tool calls of a streamed reply

def test_a_full_queue_answers_503_with_retry_after():
    from inference.serve.app import _error
    from inference.serve.engine import Job, Queue
    from inference.serve.protocol import APIError, Request, Sampling
    q = Queue(capacity=2, max_batch=8)
    job = lambda s=Sampling(): Job(Request([1, 2], 4, s), lambda ev: None)     # noqa: E731
    q.submit([job(), job(Sampling(0.0))])
    with pytest.raises(APIError) as e:
        q.submit([job()])
    response = _error(e.value)
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    # the scheduler takes as many as it has free rows, whatever their sampling (each row samples its own)
    assert [len(q.take(1, 0.0)), len(q.take(8, 0.0)), len(q.take(8, 0.0))] == [1, 1, 0]
    q.close()
    assert q.take(8, 0.1) is None


class Tokens:
    """A tokenizer of one character per id."""
    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


def test_stop_strings_end_a_row_and_never_reach_the_client():
    from inference.serve.engine import Job, Row
    from inference.serve.protocol import Request, Sampling
    events = []
    row = Row(Job(Request([1], 50, Sampling(), stop=["END", "\n\n"]), events.append), Tokens(), eos_id=0)
    for ch in "abcENxEN":
        row.add(ord(ch), None)
    assert "".join(e.text for e in events) == "abcENx" and not row.finish     # "EN" held: it may start END
    row.add(ord("D"), None)
    assert row.finish == "stop" and row.text == "abcENx"
    assert "".join(e.text for e in events) == "abcENx"


def test_a_streamed_tool_call_reply_ends_in_tool_calls():
    from encoding.encoding import render_tool_calls
    from inference.serve.app import Server, _chat_stream
    from inference.serve.engine import Event, Job
    from inference.serve.protocol import Request, Sampling
    call = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    text = "mull</think>Let me check." + render_tool_calls([call])
    req = Request([1, 2], 100, Sampling(), thinking_mode="thinking", tools=True)

    class Connected:
        async def is_disconnected(self):
            return False

    async def run():
        q = asyncio.Queue()
        for n in range(0, len(text), 3):
            q.put_nowait(Event("token", 5, text[n:n + 3]))
        q.put_nowait(Event("done", text=text, finish_reason="stop", completion_tokens=9))
        server = Server(Tokens(), None, None, MODEL, 0, 1)
        return [c async for c in _chat_stream(server, Connected(), req, Job(req, None), q, "id", 0, False)]
    chunks = [json.loads(c[len(b"data: "):]) for c in asyncio.run(run()) if c != b"data: [DONE]\n\n"]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "mull"
    assert "".join(d.get("content", "") for d in deltas) == "Let me check."
    calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert len(calls) == 1 and calls[0][0]["function"] == call["function"] and calls[0][0]["index"] == 0
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


# ---------------------------------------------------------------------------------------------------------
# Two ranks

@pytest.fixture(scope="module")
def tiny_mp2(tmp_path_factory):
    config = fixture_config(max_seq_len=256)
    return tiny_model(tmp_path_factory.mktemp("served_mp2"), config, worlds=(2,))


def test_two_ranks_serve_generate_py_s_reply_and_stop_together(tiny_mp2, tmp_path):
    ckpt, config = tiny_mp2["dirs"][2], tiny_mp2["config"]
    flags = ["--numerics", "invariant", "--max-batch-size", "4"]
    record = generate_reply(ckpt, config, tmp_path, flags, nproc=2)
    served = Served(ckpt, config, flags, nproc=2)
    in_flight, started = {}, threading.Event()
    try:
        text, tokens, finish, used = streamed_reply(served.client())
        # requests joining and leaving the running batch on both ranks: each one's run alone
        requests = [(ids, n, None) for ids, n in mixed_requests(3, 40, seed=3, most=6)]
        joined = arriving_at_random(served.client(), requests, seed=4)
        solo = [ask_ids(served.client(), ids, n) for ids, n, _ in requests]
        r = served.client().completions.create(model=MODEL, prompt=[[0, 5, 9, 200]], max_tokens=0, echo=True,
                                               logprobs=0)
        # SIGTERM while a reply streams: the reply is finished, then every rank stops
        late = threading.Thread(target=lambda: in_flight.update(
            reply=streamed_reply(served.client(), max_tokens=40, started=started)))
        late.start()
        assert started.wait(120)
    finally:
        code, out = served.stop()
    late.join(120)
    assert text == record["completion"] and used.completion_tokens == record["completion_tokens"] == NEW
    assert joined == solo
    assert len(r.choices[0].logprobs.token_logprobs) == 4
    assert code == 0 and "server stopped" in out, out
    assert in_flight["reply"][2] == "length" and in_flight["reply"][3].completion_tokens == 40


@pytest.mark.parametrize("extra, message", [
    (["--interactive"], "--serve is a mode of its own: drop --interactive"),
    (["--speculative", "dspark"], "--serve runs plain decoding: drop --speculative"),
    (["--max-queue", "0"], "--max-queue must be >= 1, got 0"),
    (["--batch-wait-ms", "-1"], "--batch-wait-ms must be >= 0, got -1"),
    (["--allowed-local-media-path", "/no/such/dir"],
     "--allowed-local-media-path /no/such/dir: not a directory"),
])
def test_serving_flags_are_refused_in_one_line_before_loading(extra, message):
    import generate
    from inference.engine.errors import InputError
    o = generate.parse_args(["--ckpt-path", "c", "--config", "c.json", "--device", "cpu", "--serve", "8000",
                             *extra])
    with pytest.raises(InputError, match=message):
        generate.check_options(o)
    with pytest.raises(InputError, match=r"--serve 8000x: expected \[HOST:\]PORT"):
        generate.check_options(generate.parse_args(["--ckpt-path", "c", "--config", "c.json", "--serve",
                                                    "8000x"]))


def test_a_port_in_use_is_one_line_before_the_model_loads(fixture_dir):
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run_generate_fails(["--ckpt-path", fixture_dir, "--config",
                                   os.path.join(fixture_dir, "config.json"), "--device", "cpu", "--serve",
                                   f"127.0.0.1:{port}"])
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: --serve 127.0.0.1:{port}: cannot listen on 127.0.0.1:{port} (Address already "
                      f"in use)"], proc.stderr
    assert "load model" not in proc.stdout + proc.stderr


def run_generate_fails(args):
    proc = subprocess.run([sys.executable, GENERATE, "--threads", "1", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    return proc
