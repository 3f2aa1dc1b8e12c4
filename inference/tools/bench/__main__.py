"""`python -m inference.tools.bench [SUBCOMMAND] [OPTIONS]`: the first word picks the benchmark, the rest are
its options (`... SUBCOMMAND --help`). No first word, or an option first, is `models`."""
import importlib
import os
import sys

# name -> one line; each name is a module here with main(argv)
SUBCOMMANDS = {
    "models": "prefill tok/s, decode ms/step, weight GB/s, peak memory of random models (the default)",
    "experts": "the CPU routed-expert kernel on one MoE layer of the released geometry",
    "convert": "convert.py's throughput against cp, and its peak RSS, on a synthetic checkpoint",
    "offload": "--offload disk: a prefill streamed from a checkpoint larger than the memory it may use",
    "launches": "device ops and host syncs of a decode step and a prefill, per module kind and route",
    "serve": "the OpenAI endpoint: requests/s and time to first token at 1, 4, 16 clients; HTTP overhead",
}
PROG = "python -m inference.tools.bench"


def usage() -> str:
    rows = "\n".join(f"  {name:9} {line}" for name, line in SUBCOMMANDS.items())
    return (f"usage: {PROG} [{'|'.join(SUBCOMMANDS)}] [OPTIONS]\n\nsubcommands:\n{rows}\n\n"
            f"{PROG} SUBCOMMAND --help lists its options; no subcommand (or an option first) is models.")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(usage())
        return 0
    # as before the subcommands: a bare command, or one that starts with an option, benchmarks the models
    name, rest = ("models", argv) if not argv or argv[0].startswith("-") else (argv[0], argv[1:])
    if name not in SUBCOMMANDS:
        print(f"{PROG}: unknown subcommand {name!r} (expected one of {', '.join(SUBCOMMANDS)})",
              file=sys.stderr)
        return 2
    host = any(a == "--experts-on=host" or (a == "--experts-on" and rest[i + 1:i + 2] == ["host"])
               for i, a in enumerate(rest))
    if name == "models" and host:
        # as generate.py: torch's idle OpenMP workers would spin on the cores the host kernel's threads need
        # (read when torch loads; docs/benchmarks.md §6.1). A value the user set wins.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # imported on use: each subcommand pulls in only what it needs
    result = importlib.import_module(f"{__package__}.{name}").main(rest)
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
