"""generate.py --interactive as a user sees it (docs/cli.md §2.4): replies printed as they are decoded, the
reasoning apart from the answer, Ctrl-C stopping a reply on every rank and returning to the prompt, /clear
confirmed, Ctrl-D or Ctrl-C at the prompt ending the session, the terminal set back; driven through a
pseudo-terminal at W = 1 and under torchrun at W = 2 (gloo). Also the pieces this rests on (incremental
detokenization, the stop hook of the generate loop, the reply printer) and batch mode's refusals: an empty
prompt file, a blank prompt, two modes at once."""
import io
import json
import os
import pty
import select
import signal
import subprocess
import sys
import termios
import time

import pytest

from conftest import FIXTURE
from ranks import descendants
from test_generate import (GENERATE, ScriptedModel, assert_clean_error, base_args, read_jsonl, run_cli,
                           tiny)  # noqa: F401 (tiny: the session's converted checkpoint)

from encoding import encode_messages
from encoding.tokenizer import load_tokenizer
from inference.engine import chat, generation
from inference.engine.batch import Budget, PromptBatch
from inference.engine.chat import Detokenizer, ReplyPrinter
from inference.parallel import ParallelContext

WAIT = 60          # seconds: the bound of every wait for output (a hang fails the test, it never blocks it)
START_WAIT = 180   # seconds: start-up, torchrun and the model build included, on a busy 2-core machine
LONG = "Tell me a long story"


# ---------------------------------------------------------------------------------------------------------
# In-process: the pieces
# ---------------------------------------------------------------------------------------------------------

def test_detokenizer_never_splits_a_character_and_joins_to_the_decoded_text():
    tok = load_tokenizer(FIXTURE)            # byte-level: a character may take several tokens
    text = "héllo 世界 </think> ok <｜end▁of▁sentence｜> 🙂!"
    ids = tok.encode(text, add_special_tokens=False).ids
    detok = Detokenizer(tok)
    pieces = [detok.add(i) for i in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=False)
    assert not any("\ufffd" in p for p in pieces)
    assert "世" in pieces and "<｜end▁of▁sentence｜>" in "".join(pieces)
    assert sum(1 for p in pieces if p) > 10
    # A reply cut inside a character: held back until the end, then given as decode gives it.
    detok = Detokenizer(tok)
    cut = tok.encode("ab世", add_special_tokens=False).ids[:-1]      # 世 is two tokens here
    assert [detok.add(i) for i in cut] == ["a", "b", ""]
    assert detok.flush() == tok.decode(cut, skip_special_tokens=False)[2:] == "\ufffd"


def test_generate_loop_stops_when_the_hook_says_so():
    model, seen = ScriptedModel(), []

    def on_step(ids):
        seen.append(ids.tolist())
        return len(seen) == 3
    completions, reasons = generation.generate(model, PromptBatch([[5, 6, 7]]), Budget(50, 1),
                                               on_step=on_step)
    assert seen == [[103], [104], [105]]                   # prefill's token, then one per decode step
    assert completions == [[103, 104, 105]] and reasons == ["interrupted"]
    assert len(model.calls) == 3                            # no step after the stop
    completions, reasons = generation.generate(ScriptedModel(), PromptBatch([[5, 6, 7]]), Budget(2, 1),
                                               on_step=lambda ids: True)
    assert completions == [[103]] and reasons == ["interrupted"]
    # A stop at the last step is no interruption: the budget was used.
    completions, reasons = generation.generate(ScriptedModel(), PromptBatch([[5, 6, 7]]), Budget(1, 1),
                                               on_step=lambda ids: True)
    assert completions == [[103]] and reasons == ["length"]


def test_stop_flag_at_one_rank_needs_no_collective():
    asked = []
    flag = chat.StopFlag(ParallelContext.single(), lambda: bool(asked))
    assert flag() is False
    asked.append(True)
    assert flag() is True


def test_reply_printer_sets_thinking_apart_from_the_answer():
    out = io.StringIO()
    printer = ReplyPrinter(out, thinking=True)
    for piece in ["Let me", " see </", "th", "ink", ">Yes", ", 4."]:
        printer.write(piece)
        assert "</" not in out.getvalue()                   # a possible </think> waits for the next piece
    printer.end()
    assert out.getvalue() == "[thinking]\nLet me see \n[answer]\nYes, 4.\n"
    out = io.StringIO()
    printer = ReplyPrinter(out, thinking=True)    # cut while thinking: "</" was not the marker
    printer.write("hmm </")
    printer.end()
    assert out.getvalue() == "[thinking]\nhmm </\n"
    out = io.StringIO()
    printer = ReplyPrinter(out, thinking=False)   # chat: the text as it comes
    printer.write("a</think>b")
    printer.end()
    assert out.getvalue() == "a</think>b\n"


# ---------------------------------------------------------------------------------------------------------
# Batch mode's refusals (found before the model is built)
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["empty", "blank-only", "blank-prompt", "json-empty", "json-blank-case"])
def test_batch_refuses_empty_input(tiny, case):
    root = tiny["root"]
    name, text, message = {
        "empty": ("empty.txt", "", "empty.txt: no prompts (the file is empty or blank)"),
        "blank-only": ("blank.txt", " \n\n  \n\n\n", "blank.txt: no prompts (the file is empty or blank)"),
        "blank-prompt": ("gap.txt", "Hello\n\n\n\nWorld", "gap.txt: prompt 2 is blank"),
        "json-empty": ("none.json", "[]", "none.json: no prompts (an empty case list)"),
        "json-blank-case": ("cases.json", json.dumps([
            {"messages": [{"role": "user", "content": "Hi"}]},
            {"messages": [{"role": "system", "content": " "}, {"role": "user", "content": ""}]}]),
            "cases.json: case 1 is blank"),
    }[case]
    (root / name).write_text(text, encoding="utf-8")
    proc = run_cli(base_args(tiny) + ["--input-file", str(root / name)])
    assert_clean_error(proc, message)
    assert "build model" not in proc.stdout


def test_interactive_with_an_input_file_is_an_error(tiny):
    proc = run_cli(base_args(tiny) + ["--interactive", "--input-file", os.path.join(FIXTURE, "score.json")])
    assert_clean_error(proc, "--interactive and --input-file are two modes: give one")


# ---------------------------------------------------------------------------------------------------------
# Chat sessions: a pseudo-terminal (W = 1, W = 2 under torchrun) and a pipe with SIGINT
# ---------------------------------------------------------------------------------------------------------

class Session:
    """A command on a pseudo-terminal or on pipes, read with bounded waits; close() kills it and every process
    it started."""

    def __init__(self, cmd, tty: bool):
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.proc = None
        if tty:
            self.pid, self.fd = pty.fork()   # the child: session leader, the terminal its controlling one
            if self.pid == 0:
                try:
                    os.execve(cmd[0], cmd, env)
                finally:
                    os._exit(127)
            self.write_fd = self.fd
        else:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, env=env)
            self.pid, self.fd = self.proc.pid, self.proc.stdout.fileno()
            self.write_fd = self.proc.stdin.fileno()
        self.out, self.seen = b"", 0      # everything read; how much of it expect() has passed
        self.chunks = []                  # (time, bytes) per read
        self.code = None

    def _read(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.fd], [], [], max(timeout, 0))
        if not ready:
            return True
        try:
            data = os.read(self.fd, 65536)
        except OSError:                   # the terminal's other side is closed
            data = b""
        if data:
            self.out += data
            self.chunks.append((time.monotonic(), data))
        return bool(data)

    def expect(self, text: bytes, timeout: float = WAIT) -> float:
        """Wait until `text` appears after what the last expect passed; -> the time it arrived."""
        end = time.monotonic() + timeout
        while text not in self.out[self.seen:]:
            if time.monotonic() > end or not self._read(end - time.monotonic()):
                raise AssertionError(f"{text!r} not seen within {timeout} s; output:\n"
                                     f"{self.out.decode('utf-8', 'replace')}")
        self.seen = self.out.index(text, self.seen) + len(text)
        return self.chunks[-1][0]

    def pieces(self, n: int, timeout: float = WAIT) -> None:
        """Wait until at least n more reads have brought output."""
        start, end = len(self.chunks), time.monotonic() + timeout
        while len(self.chunks) < start + n:
            if time.monotonic() > end or not self._read(end - time.monotonic()):
                raise AssertionError(f"{n} pieces of output not seen within {timeout} s; output:\n"
                                     f"{self.out.decode('utf-8', 'replace')}")

    def send(self, data: bytes) -> None:
        os.write(self.write_fd, data)

    def wait(self, timeout: float = WAIT) -> int:
        """The exit status, reading the output meanwhile (a full terminal buffer would block the writer)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc is not None:
                self.code = self.proc.poll()
            else:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                self.code = os.waitstatus_to_exitcode(status) if pid else None
            if self.code is not None:
                while self._read(0.2):
                    pass
                return self.code
            self._read(0.2)
        raise AssertionError(f"no exit within {timeout} s; output:\n{self.out.decode('utf-8', 'replace')}")

    def close(self) -> None:
        for pid in [self.pid] + descendants(self.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc is None:
            if self.code is None:
                os.waitpid(self.pid, 0)
            os.close(self.fd)
        else:
            self.proc.wait()
            self.proc.stdin.close()
            self.proc.stdout.close()

    def text(self) -> str:
        return self.out.decode("utf-8", "replace").replace("\r\n", "\n")


def chat_command(tiny, mp, out, *extra):
    args = base_args(tiny, mp) + ["--interactive", "--max-new-tokens", "400", "--max-seq-len", "512",
                                  "--output", str(out), *extra]
    if mp == 1:
        return [sys.executable, GENERATE, "--threads", "1", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(mp),
            GENERATE, *args]


def interrupt_reply(s: Session, line: bytes, stop: bytes) -> float:
    """Send a line, see its reply arrive in pieces, stop it; -> seconds from the stop to the next prompt."""
    s.send(line + (b"\r" if s.proc is None else b"\n"))
    s.pieces(3)                           # the reply in more than one piece before it ends
    sent = time.monotonic()
    if stop == b"SIGINT":
        os.kill(s.pid, signal.SIGINT)
    else:
        s.send(stop)
    s.expect(b"(interrupted)")
    return s.expect(b">>> ") - sent


def check_interrupted(records, n):
    assert [r["finish_reason"] for r in records] == ["interrupted"] * n, records
    assert all(r["completion_tokens"] < 400 for r in records)


@pytest.mark.parametrize("mp", [1, 2])
def test_chat_on_a_terminal_streams_stops_clears_and_exits(tiny, mp):
    out = tiny["root"] / f"chat_tty{mp}.jsonl"
    mode = ["--thinking-mode", "thinking"] if mp == 2 else []
    s = Session(chat_command(tiny, mp, out, *mode), tty=True)
    try:
        s.expect(b">>> ", START_WAIT)
        latency = interrupt_reply(s, LONG.encode(), b"\x03")       # Ctrl-C read by rank 0, not a signal
        if mp == 1:   # what was generated stays in the conversation: the next turn's prompt holds it
            latency = max(latency, interrupt_reply(s, b"And then?", b"\x03"))
        s.send(b"  \r")                                              # a blank line: the prompt again
        s.expect(b">>> ")
        s.send(b"/clear\r")
        s.expect(b"(conversation cleared)")                          # after every rank's reset
        s.expect(b">>> ")
        s.send(b"\x04" if mp == 1 else b"\x03")     # Ctrl-D (end of input) or Ctrl-C at the prompt: exit
        assert s.wait() == 0, s.text()
    finally:
        s.close()
    text = s.text()
    print(f"W = {mp}: from Ctrl-C to the prompt {latency:.3f} s")     # shown with -s
    assert "ModelArgs(" not in text                                  # only with --verbose
    assert any("decode:" in line and "; generating " in line     # the replies' time, not the prompt's
               for line in text.splitlines())
    records = read_jsonl(out)
    check_interrupted(records, 2 if mp == 1 else 1)
    if mp == 2:
        assert "[thinking]\n\x1b[2m" in text                         # dim reasoning on a terminal
    else:
        tok = load_tokenizer(tiny["mp"][1])
        first = records[0]
        conversation = [{"role": "user", "content": LONG},
                        {"role": "assistant", "content": first["content"],
                         "reasoning_content": first["reasoning_content"], "tool_calls": []},
                        {"role": "user", "content": "And then?"}]
        expected = tok.encode(encode_messages(conversation, "chat"), add_special_tokens=False).ids
        assert records[1]["prompt_tokens"] == len(expected)


def test_chat_sets_the_terminal_back_when_torchrun_ends_it(tiny):
    """torchrun ends the ranks with SIGTERM when one fails: rank 0 must not leave the terminal without echo
    and Ctrl-C (the chat turns both off during a reply)."""
    s = Session(chat_command(tiny, 1, tiny["root"] / "chat_term.jsonl"), tty=True)
    try:
        modes = termios.ECHO | termios.ICANON | termios.ISIG
        s.expect(b">>> ", START_WAIT)
        s.send(LONG.encode() + b"\r")
        s.pieces(3)
        assert not termios.tcgetattr(s.fd)[3] & modes     # the master reads the terminal's settings
        os.kill(s.pid, signal.SIGTERM)
        assert s.wait() == -signal.SIGTERM         # ended by the signal, as before
        attrs = termios.tcgetattr(s.fd)
        assert attrs[3] & modes == modes and attrs[6][termios.VEOL] != b"\x03"
    finally:
        s.close()


def test_chat_on_a_pipe_stops_a_reply_on_sigint(tiny):
    out = tiny["root"] / "chat_pipe.jsonl"
    s = Session(chat_command(tiny, 1, out, "--thinking-mode", "thinking"), tty=False)
    try:
        s.expect(b">>> ", START_WAIT)
        interrupt_reply(s, LONG.encode(), b"SIGINT")
        s.proc.stdin.close()                                         # end of input
        assert s.wait() == 0, s.text()
    finally:
        s.close()
    assert "[thinking]\n" in s.text() and "\x1b[" not in s.text()    # no terminal, no ANSI codes
    check_interrupted(read_jsonl(out), 1)


def test_a_chat_waits_at_its_prompt_longer_than_the_collectives_timeout(tiny):
    """The ranks wait for rank 0's next command while a person reads and types: that wait goes through a
    group of its own (ParallelContext.control), not the collectives' --dist-timeout, which here is 6 s and
    would end every rank of an idle chat (it did before: rank 1's broadcast timed out)."""
    out = tiny["root"] / "chat_idle.jsonl"
    s = Session(chat_command(tiny, 2, out, "--dist-timeout", "0.1", "--max-new-tokens", "8"), tty=False)
    try:
        s.expect(b">>> ", START_WAIT)
        time.sleep(9)                                                # idle past the 6 s
        s.send(b"Hello\n")
        s.expect(b">>> ")                                            # the reply came, on both ranks
        s.proc.stdin.close()
        assert s.wait() == 0, s.text()
    finally:
        s.close()
    assert [r["finish_reason"] for r in read_jsonl(out)] in (["length"], ["eos"])
