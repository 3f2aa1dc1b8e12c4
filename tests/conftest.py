import json
import os
import shutil
import sys

import pytest

# Conformance runs under the CPU code paths the reference-tiny fixture was produced with: MKL's
# conditional-bitwise-reproducible (SSE4.2) kernels, whose fp32 exp differs from the AVX-512 one in the last
# ulp near bf16 rounding ties, and oneDNN's AVX2 bf16 GEMM summation order. Both only take effect when set
# before torch runs its first kernel, hence here, before any test module imports torch. See README "Numerics".
os.environ.setdefault("MKL_CBWR", "COMPATIBLE")
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")


# `bash run.sh test` runs two pytest workers on two cores: one torch thread each, or they fight for the cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch  # noqa: E402
    torch.set_num_threads(1)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
FIXTURE = os.path.join(FIXTURES, "reference-tiny")           # DeepSeek's own code on a tiny checkpoint
FIXTURE_CPU2 = os.path.join(FIXTURES, "reference-tiny-cpu2")  # the same run on a second CPU
ENCODING_FIXTURES = os.path.join(FIXTURES, "encoding")
TOKENIZER_CONFIG = {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"}


def fixture_file(path: str) -> str:
    """A file the repository ships: its absence is a broken checkout, never a reason to skip."""
    assert os.path.exists(path), f"{path} is missing: the fixtures ship with the repository (tests/fixtures/)"
    return path


def free_port() -> int:
    """A free localhost TCP port for a gloo rendezvous in a test: below the kernel's ephemeral range (32768
    and up on Linux), in a block of 2,000 ports for each pytest worker. A port the kernel hands out (bind to
    port 0) can be handed out again, to another worker's ranks or to any outgoing connection, between this
    call and rank 0's bind; a port below that range in a block of this worker's own cannot."""
    import random
    import socket
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    # six blocks fit between 20000 and the ephemeral range; a seventh worker shares gw0's block
    low = 20000 + 2000 * (int(worker[2:]) % 6 if worker[2:].isdigit() else 0)
    for port in random.Random().sample(range(low, low + 2000), 2000):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port in {low}..{low + 1999} for {worker}")


def fixture_model(opts=None, **overrides):
    """The reference-tiny checkpoint in a Transformer (W = 1), config keys overridden by `overrides`."""
    fixture_file(os.path.join(FIXTURE, "model0-mp1.safetensors"))
    from encoding.tokenizer import load_tokenizer
    from inference.engine.checkpoint import load_checkpoint
    from inference.config import ModelArgs
    from inference.model import Transformer
    args = ModelArgs.from_file(os.path.join(FIXTURE, "config.json"), **overrides)
    model = Transformer(args, opts=opts, tokenizer=load_tokenizer(FIXTURE))
    load_checkpoint(model, FIXTURE)
    return model


def fixture_config(**overrides) -> dict:
    """The fixture's config.json without its runtime keys, with `overrides`."""
    with open(fixture_file(os.path.join(FIXTURE, "config.json"))) as f:
        config = json.load(f)
    for runtime_key in ("max_batch_size", "temperature"):
        config.pop(runtime_key, None)
    return dict(config, **overrides)


def tiny_model(root, config: dict, worlds=(1,), seed: int = 3, expert_dtype=None) -> dict:
    """A random-weight checkpoint of `config` (inference/tools/synthetic.py, the fixture's tokenizer) under
    `root`, converted by convert.py at each world size in `worlds`: {"config": its config.json, "dirs":
    {world: the shards' directory}}. expert_dtype "fp8": FP8 experts, and the config says "expert_dtype":
    null."""
    import convert
    from inference.config import ModelArgs
    from inference.tools.synthetic import write_synthetic_checkpoint
    tok = root / "tok"
    tok.mkdir()
    shutil.copy(os.path.join(FIXTURE, "tokenizer.json"), tok / "tokenizer.json")
    (tok / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, ensure_ascii=False))
    write_synthetic_checkpoint(ModelArgs.from_dict(config), str(root / "hf"), seed=seed, shards=1,
                               tokenizer_dir=str(tok))
    dirs = {}
    for world in worlds:
        dirs[world] = str(root / f"mp{world}")
        convert.convert(str(root / "hf"), dirs[world], world, expert_dtype=expert_dtype, workers=1,
                        progress=False, log=lambda *_: None)
    (root / "config.json").write_text(json.dumps(dict(config, expert_dtype=None) if expert_dtype == "fp8"
                                                 else config, indent=1))
    return {"config": str(root / "config.json"), "dirs": dirs}


@pytest.fixture(scope="session")
def tiny_mp4(tmp_path_factory):
    """A tiny random-weight model converted at MP 4: the fixture's config with o_groups = 4 (its own 2 admits
    W = 1 and 2 only). {"ckpt": the shards' directory, "config": its config.json}."""
    model = tiny_model(tmp_path_factory.mktemp("tiny_mp4"), fixture_config(o_groups=4), worlds=(4,))
    return {"ckpt": model["dirs"][4], "config": model["config"]}


def fixture_tensors(name: str):
    """A safetensors file of the fixture, e.g. reference_logits or intermediates."""
    from safetensors.torch import load_file
    return load_file(fixture_file(os.path.join(FIXTURE, f"{name}.safetensors")))


# `bash run.sh test` hands whole files to two workers in collection order (--no-loadscope-reorder): the
# slowest files go first, so that no worker is left running one of them while the other has finished.
# Their tests' own seconds on 2 cores (docs/benchmarks.md §4); a stale order costs time, never a result.
SLOWEST_FIRST = ["test_speculative.py", "test_gpu_check.py", "test_kernels_compile.py",
                 "test_invariant_model.py", "test_vision_cli.py", "test_generate.py", "test_serve.py",
                 "test_multinode.py", "test_long_context.py", "test_corpus_kld.py", "test_prefill_chunks.py",
                 "test_offload.py", "test_chat.py", "test_model_fixture.py"]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(os.path.basename(str(item.path)), len(rank)))   # stable
