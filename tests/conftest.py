import os
import sys

# Conformance runs under the CPU code paths the reference-tiny fixture was produced with: MKL's
# conditional-bitwise-reproducible (SSE4.2) kernels, whose fp32 exp differs from the AVX-512 one in the last
# ulp near bf16 rounding ties, and oneDNN's AVX2 bf16 GEMM summation order. Both only take effect when set
# before torch runs its first kernel, hence here, before any test module imports torch. See README "Numerics".
os.environ.setdefault("MKL_CBWR", "COMPATIBLE")
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")

import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SHARED = os.path.join(os.path.dirname(ROOT), "shared")
FIXTURE = os.path.join(SHARED, "fixtures", "reference-tiny")
ENCODING_FIXTURES = os.path.join(SHARED, "fixtures", "encoding")


def need_shared(path: str) -> str:
    if not os.path.exists(path):
        pytest.skip(f"../shared is absent: {path} not found (CI places shared/ beside the checkout)")
    return path


def free_port() -> int:
    """A free localhost TCP port for a gloo rendezvous in a test."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fixture_model(opts=None, **overrides):
    """The reference-tiny checkpoint in a Transformer (W = 1), config keys overridden by `overrides`;
    skips when ../shared is absent."""
    need_shared(os.path.join(FIXTURE, "model0-mp1.safetensors"))
    from encoding.tokenizer import load_tokenizer
    from inference.engine.checkpoint import load_checkpoint
    from inference.config import ModelArgs
    from inference.model import Transformer
    args = ModelArgs.from_file(os.path.join(FIXTURE, "config.json"), **overrides)
    model = Transformer(args, opts=opts, tokenizer=load_tokenizer(FIXTURE))
    load_checkpoint(model, FIXTURE)
    return model


def fixture_tensors(name: str):
    """A safetensors file of the fixture, e.g. reference_logits or intermediates."""
    from safetensors.torch import load_file
    return load_file(need_shared(os.path.join(FIXTURE, f"{name}.safetensors")))
