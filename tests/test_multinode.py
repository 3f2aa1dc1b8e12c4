"""Several nodes (README, docs/cli.md §4.2): the README's multi-node example through `run.sh generate` as two
"nodes" of two ranks on this machine (MP 4, gloo over loopback: ALLOW_LOOPBACK=1, GLOO_SOCKET_IFNAME=lo),
against one node of four; a node or a rank that never joins stops with one line within a bounded time; the
process-group timeout reaches the group. Whatever a test starts is killed in the end, also on a timeout."""
import os
import re
import signal
import subprocess
import sys
import time
from typing import List

import pytest

from conftest import ROOT, free_port
import ranks

RUN_SH = os.path.join(ROOT, "run.sh")
GENERATE = os.path.join(ROOT, "generate.py")
TIMEOUT = 240       # seconds for the launches of one test together: a hang fails the test, never the suite
LAUNCH_ENV = ("MP", "NODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "CKPT", "CONFIG", "JOIN_TIMEOUT",
              "ALLOW_LOOPBACK", "DRY_RUN", "RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_USE_AGENT_STORE")


def readme_example():
    """The README's multi-node command: (its environment, its run.sh generate arguments)."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    for m in re.finditer(r"`((?:[A-Z_]+=\S+ )+)bash run\.sh generate ([^`]*)`", text):
        env = dict(kv.split("=", 1) for kv in m.group(1).split())
        if "NODES" in env:
            return env, m.group(2).split()
    raise AssertionError("README.md has no `... NODES=... bash run.sh generate ...` example")


def start(cmd: List[str], env: dict, stdin: str = "") -> subprocess.Popen:
    """cmd with `stdin` written (and closed) at once, and the launch variables only as given."""
    full = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    full.update(env, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, env=full, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdin.write(stdin)     # a few lines: the pipe holds them
    proc.stdin.close()
    proc.stdin = None           # communicate() would flush it
    return proc


def finish(procs: List[subprocess.Popen], timeout: float = TIMEOUT) -> List[subprocess.CompletedProcess]:
    """Each process's CompletedProcess, all within `timeout` seconds together; whatever is left of them and
    their descendants (torchrun agents, ranks) is killed in the end, also on a timeout."""
    deadline, done = time.monotonic() + timeout, []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        kill(procs)
    return done


def kill(procs: List[subprocess.Popen]) -> None:
    """SIGKILL to every process still running and to all its descendants, found before the first signal:
    torchrun starts each rank in a session of its own, out of reach of a process-group kill."""
    for p in procs:
        if p.poll() is None:
            for pid in [*ranks.descendants(p.pid), p.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        try:
            p.communicate(timeout=30)
        except (subprocess.TimeoutExpired, ValueError):     # a pipe held out of reach; pipes already read
            pass


def node_env(readme_env: dict, tiny: dict, port: int, **over) -> dict:
    """The README's environment for this machine: MP 4 (two ranks a node), loopback with its override, the
    tiny checkpoint and config, gloo on lo."""
    env = dict(readme_env, MP="4", MASTER_ADDR="127.0.0.1", ALLOW_LOOPBACK="1", MASTER_PORT=str(port),
               CKPT=tiny["ckpt"], CONFIG=tiny["config"], GLOO_SOCKET_IFNAME="lo")
    env.update(over)
    return env


def replies(stdout: str) -> List[str]:
    """An interactive session's replies: what follows each '>>> ' prompt but the last (the timings)."""
    return stdout.split(">>> ")[1:-1]


def test_readme_example_is_a_valid_launch(tmp_path):
    """As written (2 nodes x 4 GPUs), run.sh accepts it and launches torchrun behind the node join."""
    env, args = readme_example()
    assert (env["NODES"], env["NODE_RANK"]) == ("2", "0") and int(env["MP"]) % 2 == 0
    mp = int(env["MP"])
    for name in [f"model{i}-mp{mp}.safetensors" for i in range(mp)] + ["tokenizer.json",
                                                                      "tokenizer_config.json"]:
        (tmp_path / name).write_text("x")
    proc = finish([start(["bash", RUN_SH, "generate", *args], dict(env, CKPT=str(tmp_path), DRY_RUN="1"))])[0]
    assert proc.returncode == 0, proc.stderr
    cmd = proc.stdout.split()
    assert cmd[1:3] == ["-m", "inference.engine.launch"]
    assert cmd[cmd.index("--nnodes") + 1] == "2" and cmd[cmd.index("--nproc-per-node") + 1] == str(mp // 2)
    assert cmd[cmd.index("--master-addr") + 1] == env["MASTER_ADDR"]
    assert cmd[cmd.index("--rdzv-conf") + 1] == "timeout=300"
    assert cmd[-len(args):] == args


def test_readme_example_on_two_nodes_of_two_ranks(tiny_mp4):
    """Node 1 first, then node 0 with the session on its stdin: the replies of one node of four ranks."""
    readme_env, args = readme_example()
    args = [*args, "--device", "cpu", "--max-new-tokens", "4"]
    assert "--interactive" in args
    port, session = free_port(), "Hello!\nWhat is 2+2?\n/exit\n"
    node1 = start(["bash", RUN_SH, "generate", *args], node_env(readme_env, tiny_mp4, port, NODE_RANK="1"))
    node0 = start(["bash", RUN_SH, "generate", *args], node_env(readme_env, tiny_mp4, port, NODE_RANK="0"),
                  stdin=session)
    node1, node0 = finish([node1, node0])
    assert node0.returncode == 0 and node1.returncode == 0, node0.stderr + node1.stderr
    assert "node 0 of 2: waiting up to 300 s on 127.0.0.1" in node0.stdout
    assert ">>> " not in node1.stdout           # rank 0, on node 0, reads and prints
    one_node = ranks.run_generate(["--ckpt-path", tiny_mp4["ckpt"], "--config", tiny_mp4["config"], *args], 4,
                                  stdin=session, timeout=TIMEOUT)
    assert one_node.returncode == 0, one_node.stderr
    assert len(replies(node0.stdout)) == 2 and replies(node0.stdout) == replies(one_node.stdout)


def one_line_errors(expected):
    """Each (finished process, the start of its message): exit status 1, that one line and nothing else."""
    for proc, message in expected:
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(message), proc.stderr


def test_a_node_that_never_joins_is_named_in_one_line(tiny_mp4):
    """Node 0 alone, and node 1 alone: each stops within its JOIN_TIMEOUT with one line naming what is missing
    and the address, no traceback."""
    readme_env, args = readme_example()
    ports = free_port(), free_port()
    alone = [start(["bash", RUN_SH, "generate", *args],
                   node_env(readme_env, tiny_mp4, port, NODE_RANK=rank, JOIN_TIMEOUT="3"))
             for rank, port in zip(("0", "1"), ports)]
    node0, node1 = finish(alone, timeout=120)
    one_line_errors(((node0, f"run.sh: error: node 1 (ranks 2-3) did not join within 3 s: node 0 waited "
                                  f"on 127.0.0.1:{ports[0]} (start run.sh generate with NODE_RANK=1"),
                          (node1, f"run.sh: error: node 1 found no node 0 at 127.0.0.1:{ports[1]} within "
                                  f"3 s")))


def test_a_rank_that_never_joins_is_named_in_one_line(tiny_mp4):
    """generate.py under a hand-made launch: rank 0 of 4 alone names ranks 1-3; rank 3 alone finds no
    rendezvous. Both within --join-timeout, one line each."""
    args = [GENERATE, "--ckpt-path", tiny_mp4["ckpt"], "--config", tiny_mp4["config"], "--device", "cpu",
            "--interactive", "--join-timeout", "2"]
    ports = free_port(), free_port()
    alone = [start([sys.executable, *args], {"RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": "4",
                                             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
             for rank, port in zip((0, 3), ports)]
    rank0, rank3 = finish(alone, timeout=120)
    one_line_errors(((rank0, f"[rank 0] error: ranks 1-3 of 4 did not join within 2 s (rank 0 waited on "
                                  f"127.0.0.1:{ports[0]}; --join-timeout)"),
                          (rank3, f"[rank 3] error: rank 3 found no rendezvous at 127.0.0.1:{ports[1]} "
                                  f"within 2 s")))


def test_the_process_group_timeout_reaches_the_group():
    """--dist-timeout is the wait of a collective for a late peer: 0.05 minutes -> rank 0's all_reduce gives
    up after 3,000 ms while rank 1 (a rank still loading) sleeps."""
    code = ("import sys, time, torch; from inference.parallel import ParallelContext; "
            "par = ParallelContext.from_env('cpu', 0.05, 60); "
            "time.sleep(600) if par.rank == 1 else None; par.all_reduce(torch.ones(1))")
    port = free_port()
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    procs = [start([sys.executable, "-c", code], dict(env, RANK=str(r))) for r in (0, 1)]
    try:
        rank0 = finish(procs[:1], timeout=120)[0]
    finally:
        kill(procs)
    assert rank0.returncode != 0 and "Timed out waiting 3000ms" in rank0.stderr, rank0.stderr


def test_generate_passes_its_timeouts(monkeypatch):
    import generate
    from inference.engine import session
    from inference.parallel import RankLog

    class Joined(Exception):        # stops the start right after the process group, before the tokenizer
        pass

    seen = []

    def from_env(cls, *a):
        seen.append(a)
        raise Joined
    monkeypatch.setattr(session.ParallelContext, "from_env", classmethod(from_env))
    base = ["--ckpt-path", "c", "--config", "c.json", "--device", "cpu", "--interactive"]
    o = generate.parse_args(base)
    assert (o.dist_timeout, o.join_timeout) == (60, 300)
    with pytest.raises(Joined):
        session.Session.start(generate.parse_args([*base, "--dist-timeout", "90", "--join-timeout", "20"]),
                              RankLog(0), None, None)
    assert seen == [("cpu", 90, 20)]
