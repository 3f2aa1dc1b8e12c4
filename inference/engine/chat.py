"""The chat's pieces around the generate loop: rank 0's keyboard (Ctrl-C read as a key on a terminal), the
stop that Ctrl-C asks for made every rank's between two decode steps, and a reply printed while it is decoded
(incremental detokenization, thinking apart from the answer). generate.py's interactive mode puts them
together; Runner.run (runner.py) runs the reply itself, its on_step hook calling back here."""
import contextlib
import os
import signal
import sys
import termios
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, TextIO

import torch

from encoding.encoding import THINK_END

from ..parallel import ParallelContext
from .runner import Runner
from .prompts import Completion, Prompt


class Keyboard:
    """Rank 0's keys in chat. On a terminal, Ctrl-C is read as a key, not taken as a signal: under torchrun
    the ranks run in sessions of their own, so the terminal's SIGINT would reach only the launcher, which then
    stops every rank. So for the whole chat (session()) the terminal sends no signal: at the prompt Ctrl-C
    ends the line (and the chat); during a reply keys are read one at a time without echo, Ctrl-C stops the
    reply and the other keys are dropped. Without a terminal (a pipe) lines come from input(), and a SIGINT
    sent to rank 0 stops a reply."""

    def __init__(self, stdin: TextIO):
        self.fd = stdin.fileno() if stdin.isatty() else None
        self.saved = termios.tcgetattr(self.fd) if self.fd is not None else None   # as the chat found it
        self.stop = False          # Ctrl-C seen during the current reply

    def _set(self, reply: bool) -> None:
        attrs = [*self.saved[:6], list(self.saved[6])]
        attrs[3] &= ~termios.ISIG
        if reply:    # key by key, unechoed (the reply is being printed), a read never waits
            attrs[3] &= ~(termios.ICANON | termios.ECHO)
            attrs[6][termios.VMIN], attrs[6][termios.VTIME] = 0, 0
        else:        # whole lines with the terminal's editing, as input() reads them; Ctrl-C ends a line
            attrs[6][termios.VEOL] = b"\x03"
        termios.tcsetattr(self.fd, termios.TCSANOW, attrs)

    @contextlib.contextmanager
    def session(self):
        """The chat: the terminal set as above, and set back at the end, also when torchrun ends the ranks
        (SIGTERM, after another rank failed): a shell left without echo or Ctrl-C is broken."""
        if self.fd is None:
            yield
            return

        def on_sigterm(signum, frame):   # the terminal set back, then the signal's own end, as without us
            termios.tcsetattr(self.fd, termios.TCSANOW, self.saved)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        old_handler = signal.signal(signal.SIGTERM, on_sigterm)
        self._set(reply=False)
        try:
            yield
        finally:
            termios.tcsetattr(self.fd, termios.TCSANOW, self.saved)
            signal.signal(signal.SIGTERM, old_handler)

    def read_line(self, prompt: str) -> Optional[str]:
        """A line typed at the prompt, or None for Ctrl-C, Ctrl-D (end of input) or a terminal gone."""
        try:
            if self.fd is None:
                return input(prompt)
            sys.stdout.write(prompt)
            sys.stdout.flush()
            data = b""
            while not data.endswith((b"\n", b"\x03")):
                chunk = os.read(self.fd, 4096)
                if not chunk:              # Ctrl-D: a line's text so far, or the end of input
                    break
                data += chunk
        except (EOFError, KeyboardInterrupt, OSError):
            data = b"\x03"
        if not data or data.endswith(b"\x03"):
            print(flush=True)
            return None
        return data.rstrip(b"\n").decode("utf-8", "replace")

    @contextlib.contextmanager
    def reply(self):
        """While a reply is generated: Ctrl-C (a key, or SIGINT sent to this process) sets `stop`."""
        self.stop = False

        def on_sigint(signum, frame):
            self.stop = True
        old_handler = signal.signal(signal.SIGINT, on_sigint)
        try:
            if self.fd is not None:
                self._set(reply=True)
            yield
        finally:
            self.stop_asked()   # keys typed after the last step: dropped, as a Ctrl-C left queued would
            if self.fd is not None:   # end the chat at the next prompt
                self._set(reply=False)
            signal.signal(signal.SIGINT, old_handler)

    def stop_asked(self) -> bool:
        """Between decode steps: has Ctrl-C come during this reply? Reads every key typed so far (a terminal
        gone counts as Ctrl-C)."""
        keys = b""
        try:
            while self.fd is not None and (chunk := os.read(self.fd, 1024)):
                keys += chunk
        except OSError:
            keys = b"\x03"
        self.stop = self.stop or b"\x03" in keys
        return self.stop


@dataclass
class StopFlag:
    """A stop that rank 0 alone can ask for (Ctrl-C), made every rank's between decode steps, so that all
    ranks leave the loop after the same step. `asked` is rank 0's source (a key, a signal; called on rank 0
    only). W = 1: no collective. W > 1: one all_reduce of one int per step (gloo on 2 CPU ranks: about
    0.3 ms, against tens of ms for a decode step; NCCL: some microseconds)."""
    par: ParallelContext
    asked: Optional[Callable[[], bool]]        # None off rank 0
    device: Any = "cpu"

    def __call__(self) -> bool:
        wanted = bool(self.asked()) if self.par.rank == 0 else False
        if self.par.world_size == 1:
            return wanted
        flag = torch.tensor([int(wanted)], dtype=torch.int32, device=self.device)
        return bool(self.par.all_reduce(flag).item())   # rank 0's value: the others add 0


class Detokenizer:
    """Generated ids -> text pieces as they come, for printing a reply while it is decoded. The pieces joined
    are the decoded ids (tokenizer.decode, special tokens kept). A piece never ends inside a multi-byte UTF-8
    character: text that decodes to a trailing U+FFFD waits for the next id (flush() lets it out at the end).
    Each step decodes a short window, not the whole reply: the ids since the last piece after the piece before
    as context (a decoder may treat a window's first token apart, as SentencePiece's drops a leading space),
    and takes what the new ids added."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: List[int] = []
        self.prefix = 0      # window start: context already printed
        self.read = 0        # ids before this one are printed

    def _decode(self, ids: List[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def add(self, token_id: int) -> str:
        """One more id -> the text it completes ("" while a character is incomplete)."""
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]

    def flush(self) -> str:
        """The text still held back (an incomplete character at the end: U+FFFD, as decode gives it)."""
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return after[len(before):]


DIM, UNDIM = "\x1b[2m", "\x1b[22m"     # ANSI: faint text on, off


class ReplyPrinter:
    """Rank 0: a reply printed piece by piece as it is decoded, each piece flushed. In thinking mode the
    reasoning comes under a "[thinking]" line (dim on a terminal) and the answer under an "[answer]" line,
    which stands in for </think>; text that may be the start of </think> waits for the next piece."""

    def __init__(self, out: TextIO, thinking: bool):
        self.out, self.thinking = out, thinking
        self.style = out.isatty()
        self.held = ""               # a possible start of </think>, not printed yet
        self.line_start = True
        if thinking:
            self._emit("[thinking]\n" + (DIM if self.style else ""))

    def _emit(self, text: str) -> None:
        if text:
            self.out.write(text)
            self.out.flush()
            self.line_start = text.endswith("\n")

    def _marker(self, text: str) -> None:
        self._emit(("" if self.line_start else "\n") + text + "\n")

    def write(self, piece: str) -> None:
        if not self.thinking:
            self._emit(piece)
            return
        text, self.held = self.held + piece, ""
        reasoning, sep, answer = text.partition(THINK_END)
        if sep:
            self._emit(reasoning + (UNDIM if self.style else ""))
            self.thinking = False
            self._marker("[answer]")
            self._emit(answer)
            return
        keep = next((n for n in range(min(len(text), len(THINK_END) - 1), 0, -1)
                     if THINK_END.startswith(text[-n:])), 0)
        self._emit(text[:len(text) - keep])
        self.held = text[len(text) - keep:]

    def end(self) -> None:
        """The reply is over: what was held back, the style reset, the line ended."""
        if self.thinking:
            self._emit(self.held + (UNDIM if self.style else ""))
            self.held = ""
        if not self.line_start:
            self._emit("\n")


def reply(runner: Runner, prompt: Prompt, stop: StopFlag, out: Optional[TextIO]) -> Optional[Completion]:
    """One chat reply on every rank, printed on rank 0 to `out` as it is decoded (plainly or speculatively:
    each committed token in order); `stop` ends it early. -> as Runner.run (one prompt)."""
    printer = ReplyPrinter(out, prompt.thinking_mode == "thinking") if runner.rank == 0 else None
    text = Detokenizer(runner.tokenizer)
    eos_seen = False     # a speculative step may commit drafts after EOS: they are not the reply

    def on_step(ids: torch.Tensor) -> bool:
        nonlocal eos_seen
        eos_seen = eos_seen or int(ids[0]) == runner.eos_id
        if printer is not None and not eos_seen:
            printer.write(text.add(int(ids[0])))
        return stop()

    done = runner.run([prompt], ["reply"], always_warn=True, on_step=on_step)[0]
    if printer is not None:
        printer.write(text.flush())
        printer.end()
    return done


def read_command(keys: Keyboard, messages: List[Dict[str, Any]], encode, errors, log) -> Dict[str, Any]:
    """Rank 0: read one line and turn it into a command for every rank."""
    line = keys.read_line(">>> ")
    if line is None or line.strip() == "/exit":     # Ctrl-C / Ctrl-D at the prompt end the session
        return {"cmd": "exit"}
    if not line.strip():
        return {"cmd": "skip"}
    if line.strip() == "/clear":
        messages.clear()
        return {"cmd": "clear"}
    try:
        message, prompt = encode(messages, line)
    except errors as e:
        log.error(f"{e} (the message was not added; /clear starts a new conversation)")
        return {"cmd": "skip"}
    messages.append(message)
    return {"cmd": "generate", "prompt": prompt}


def chat(runner: Runner, par: ParallelContext, log, encode: Callable, errors: tuple, device) -> None:
    """The interactive chat on every rank. Rank 0 reads each line and broadcasts the command, so all ranks
    make the same calls; `encode(messages, line)` -> (the user message, the Prompt of the conversation so
    far), raising one of `errors` for a line it cannot take. A reply is printed by rank 0 as it is decoded;
    Ctrl-C stops it on every rank after the current step (StopFlag) and what was generated stays in the
    conversation, as it stays on the screen."""
    messages = []    # the conversation lives on rank 0
    keys = Keyboard(sys.stdin) if par.rank == 0 else None
    if par.rank != 0:
        signal.signal(signal.SIGINT, signal.SIG_IGN)   # rank 0 decides when everyone stops
    with keys.session() if keys else contextlib.nullcontext():
        while True:
            command = par.broadcast_object(read_command(keys, messages, encode, errors, log)
                                           if par.rank == 0 else None)
            if command["cmd"] == "exit":
                break
            if command["cmd"] == "clear":
                runner.model.reset()
                log.info("(conversation cleared)")
            if command["cmd"] != "generate":
                continue
            stop = StopFlag(par, keys.stop_asked if keys else None, device)
            with keys.reply() if keys else contextlib.nullcontext():
                done = reply(runner, command["prompt"], stop, sys.stdout if keys else None)
            if done is not None:   # rank 0
                if done.record["finish_reason"] == "interrupted":
                    log.info("(interrupted)")
                elif done.warning:
                    log.warning(done.warning)
                messages.append(done.message)
