"""One session builder for every command that runs the model (inference/engine/session.py): generate.py,
`parity corpus` and `bench` take the same loading flags (same spellings, defaults, choices and help) and
refuse the same combinations with the same line."""
import argparse

import pytest

import generate
from inference.config import ConfigError
from inference.engine import session
from inference.engine.errors import InputError
from inference.tools import parity
from inference.tools.bench import models as bench_models


def flags_of(add) -> dict:
    """option string -> (dest, default, choices, help, type, required, const) of what `add` defines."""
    p = argparse.ArgumentParser()
    add(p)
    return described(p, None)


def described(p: argparse.ArgumentParser, wanted) -> dict:
    out = {}
    for a in p._actions:
        for flag in a.option_strings:
            if wanted is None or flag in wanted:
                out[flag] = (a.dest, a.default, a.choices, a.help, a.type, a.required, a.const)
    out.pop("-h", None), out.pop("--help", None)
    return out


def corpus_parser() -> argparse.ArgumentParser:
    sub = next(a for a in parity.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["corpus"]


MODEL = flags_of(session.add_model_flags)
CHECKPOINT = flags_of(session.add_checkpoint_flags)
COMMANDS = {"generate.py": (generate.build_parser, True), "parity corpus": (corpus_parser, True),
            "bench": (bench_models.build_parser, False)}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_takes_the_same_loading_flags(command):
    build, reads_a_checkpoint = COMMANDS[command]
    want = dict(MODEL, **(CHECKPOINT if reads_a_checkpoint else {}))
    assert {"--experts-on", "--cpu-linears", "--kernel-build", "--numerics", "--device"} <= set(MODEL)
    got = described(build(), set(want))
    missing = sorted(set(want) - set(got))
    assert not missing, f"{command} lacks {missing}"
    differ = sorted(f for f in want if got[f] != want[f])
    assert not differ, f"{command} defines {differ} its own way: {[got[f] for f in differ]}"


REFUSED = [
    (["--offload", "disk", "--device", "cuda"], "--offload disk runs on the CPU (not cuda)"),
    (["--offload", "disk", "--experts-on", "host"], "--offload disk streams the experts from disk"),
    (["--experts-on", "host", "--numerics", "golden"], "not with --numerics golden"),
    (["--cpu-linears", "stored"], "--cpu-linears stored computes the other Linears"),
    (["--experts-on", "host", "--cpu-linears", "stored", "--device", "cuda:0"],
     "--cpu-linears stored computes the Linears held on the CPU: not with --device cuda:0"),
    (["--kernel-backend", "tilelang", "--numerics", "invariant"],
     "--numerics invariant runs the torch kernels"),
    (["--numerics", "exact,fast"], "exact and fast exclude each other"),
    (["--threads", "0"], "--threads must be >= 1, got 0"),
]


def refusal(check, argv):
    with pytest.raises((InputError, ConfigError)) as e:
        check(argv)
    return str(e.value)


@pytest.mark.parametrize("extra, line", REFUSED)
def test_every_command_refuses_the_same_combinations_alike(extra, line):
    ckpt = ["--ckpt-path", "c", "--config", "c.json"]
    generate_line = refusal(lambda a: generate.check_options(generate.parse_args(ckpt + ["--interactive"]
                                                                                 + a)),
                            ["--device", "cpu"] + extra)
    from inference.tools import corpus
    corpus_line = refusal(lambda a: corpus.check_options(parity.build_parser().parse_args(
        ["corpus"] + ckpt + ["--text", "t", "--ctx", "8"] + a)), ["--device", "cpu"] + extra)
    lines = {generate_line, corpus_line}
    if "--offload" not in extra:
        lines.add(refusal(lambda a: session.runtime_options(bench_models.build_parser().parse_args(a)),
                          ["--device", "cpu"] + extra))
    assert len(lines) == 1 and line in generate_line, lines
