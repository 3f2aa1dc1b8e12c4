"""run.sh (docs/cli.md §4.2): usage, and the checks `run.sh generate` makes before launching torchrun.
gpu-check and wheels: tests/test_gpu_check.py."""
import os
import subprocess

import pytest

from conftest import ROOT

RUN_SH = os.path.join(ROOT, "run.sh")


def run_sh(*args, env=None, timeout=60):
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("MP", "NODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "CKPT", "CONFIG",
                             "JOIN_TIMEOUT", "ALLOW_LOOPBACK")}
    full_env.update(env or {})
    return subprocess.run(["bash", RUN_SH, *args], capture_output=True, text=True, timeout=timeout,
                          env=full_env, stdin=subprocess.DEVNULL)


@pytest.fixture
def ckpt(tmp_path):
    """A directory that passes every check for MP = 2 (the files only need to exist and be non-empty)."""
    for name in ("model0-mp2.safetensors", "model1-mp2.safetensors", "tokenizer.json",
                 "tokenizer_config.json"):
        (tmp_path / name).write_text("x")
    return tmp_path


def test_help():
    for flag in ("--help", "-h"):
        proc = run_sh(flag)
        assert proc.returncode == 0 and "usage: bash run.sh" in proc.stdout
        assert "MP [8]" in proc.stdout and "CKPT" in proc.stdout and "JOIN_TIMEOUT [300]" in proc.stdout
        assert "gpu-check [--wheels DIR | --wheels DIR.tar.xz | --wheels DIR.tar.xz.part0]" in proc.stdout
        assert "wheels DIR [--python-version 3.N] [--pack [--part-size 30M]]" in proc.stdout
    proc = run_sh("bogus")
    assert proc.returncode == 2 and "usage: bash run.sh" in proc.stderr


def test_generate_dry_run_builds_the_torchrun_command(ckpt):
    env = {"MP": "2", "CKPT": str(ckpt), "CONFIG": os.path.join(ROOT, "config.json"), "DRY_RUN": "1",
           "MASTER_PORT": "29555"}
    proc = run_sh("generate", "--interactive", env=env)
    assert proc.returncode == 0, proc.stderr
    cmd = proc.stdout.split()
    assert cmd[cmd.index("--nnodes") + 1] == "1" and cmd[cmd.index("--nproc-per-node") + 1] == "2"
    assert cmd[cmd.index("--master-port") + 1] == "29555"
    assert cmd[cmd.index("--master-addr") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--ckpt-path") + 1] == str(ckpt) and cmd[-1] == "--interactive"
    assert cmd[1:3] == ["-m", "torch.distributed.run"] and "--rdzv-conf" not in cmd
    # Two nodes: one process per node, behind the node join (inference.engine.launch) with JOIN_TIMEOUT as the
    # rendezvous timeout; --ckpt-path on the command line wins over CKPT and is not repeated.
    proc = run_sh("generate", "--ckpt-path", str(ckpt), "--input-file", "p.txt",
                  env={**env, "NODES": "2", "NODE_RANK": "1", "CKPT": "/nonexistent",
                       "MASTER_ADDR": "10.0.0.1", "JOIN_TIMEOUT": "42"})
    assert proc.returncode == 0, proc.stderr
    cmd = proc.stdout.split()
    assert cmd[1:3] == ["-m", "inference.engine.launch"] and cmd[cmd.index("--rdzv-conf") + 1] == "timeout=42"
    assert cmd[cmd.index("--nproc-per-node") + 1] == "1" and cmd[cmd.index("--node-rank") + 1] == "1"
    assert cmd[cmd.index("--master-addr") + 1] == "10.0.0.1" and cmd.count("--ckpt-path") == 1
    # Several "nodes" on this machine: loopback only with the override.
    proc = run_sh("generate", "--interactive", env={**env, "NODES": "2", "MASTER_ADDR": "127.0.0.1",
                                                    "ALLOW_LOOPBACK": "1"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[proc.stdout.split().index("--master-addr") + 1] == "127.0.0.1"


def test_serve_is_the_generate_launch_with_an_address(ckpt):
    """`bash run.sh serve`: the same launch and checks as generate, generate.py serving on HOST:PORT (the
    environment's, or --serve on the command line as given)."""
    env = {"MP": "2", "CKPT": str(ckpt), "CONFIG": os.path.join(ROOT, "config.json"), "DRY_RUN": "1"}
    proc = run_sh("serve", "--api-key", "k", env={**env, "PORT": "9001", "HOST": "0.0.0.0"})
    assert proc.returncode == 0, proc.stderr
    cmd = proc.stdout.split()
    assert cmd[cmd.index("--serve") + 1] == "0.0.0.0:9001" and cmd[-2:] == ["--api-key", "k"]
    cmd = run_sh("serve", "--serve", "8123", env=env).stdout.split()
    assert cmd.count("--serve") == 1 and cmd[cmd.index("--serve") + 1] == "8123"
    assert cmd[cmd.index("--serve") + 1:] == ["8123"]
    proc = run_sh("serve", env={**env, "MP": "3"})
    assert proc.returncode != 0 and "MP=3 does not fit" in proc.stderr


@pytest.mark.parametrize("env,message", [
    ({"MP": "3"}, "MP=3 does not fit ./config.json: world size 3 does not divide vocab_size = 129280"),
    ({"MP": "16"}, "MP=16 does not fit ./config.json: world size 16 does not divide o_groups = 8"),
    ({"MP": "0"}, "MP must be a positive integer, got '0'"),
    ({"MP": "two"}, "MP must be a positive integer"),
    ({"MP": "2", "NODES": "4"}, "MP=2 is not divisible by NODES=4"),
    ({"MP": "2", "NODES": "2", "NODE_RANK": "2"}, "NODE_RANK must be an integer in 0..1"),
    ({"MP": "2", "NODES": "2"}, "NODES=2 needs MASTER_ADDR: node 0's address"),
    ({"MP": "2", "NODES": "2", "MASTER_ADDR": "127.0.0.1"},
     "MASTER_ADDR=127.0.0.1 is a loopback address (127.0.0.1), which the other nodes cannot reach"),
    ({"MP": "2", "NODES": "2", "MASTER_ADDR": "localhost"}, "MASTER_ADDR=localhost is a loopback address"),
    ({"MP": "2", "NODES": "2", "MASTER_ADDR": "::1"}, "MASTER_ADDR=::1 is a loopback address"),
    ({"MP": "2", "NODES": "2", "MASTER_ADDR": "10.0.0.1", "JOIN_TIMEOUT": "0"},
     "JOIN_TIMEOUT must be a positive number of seconds, got '0'"),
    ({"MP": "4"}, "missing shard {ckpt}/model2-mp4.safetensors"),
    ({"MP": "2", "CONFIG": "/nonexistent/config.json"}, "config file not found: /nonexistent/config.json"),
])
def test_generate_prelaunch_errors(ckpt, env, message):
    (ckpt / "model0-mp4.safetensors").write_text("x")
    (ckpt / "model1-mp4.safetensors").write_text("x")
    proc = run_sh("generate", "--interactive", env={"CKPT": str(ckpt), **env})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"run.sh: error: {message.format(ckpt=ckpt)}" in proc.stderr


def test_generate_incomplete_checkpoint(ckpt):
    env = {"MP": "2", "CKPT": str(ckpt), "CONFIG": os.path.join(ROOT, "config.json")}
    (ckpt / "model1-mp2.safetensors").write_text("")
    proc = run_sh("generate", "--interactive", env=env)
    assert proc.returncode == 1 and f"empty shard {ckpt}/model1-mp2.safetensors" in proc.stderr
    (ckpt / "model1-mp2.safetensors").unlink()
    proc = run_sh("generate", "--interactive", env=env)
    assert proc.returncode == 1 and f"missing shard {ckpt}/model1-mp2.safetensors" in proc.stderr
    (ckpt / "model1-mp2.safetensors").write_text("x")
    (ckpt / "tokenizer_config.json").unlink()
    proc = run_sh("generate", "--interactive", env=env)
    assert proc.returncode == 1 and f"missing {ckpt}/tokenizer_config.json" in proc.stderr
    proc = run_sh("generate", "--interactive", env={"MP": "2"})
    assert proc.returncode == 1 and "set CKPT=" in proc.stderr
