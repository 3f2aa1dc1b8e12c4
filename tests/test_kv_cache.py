"""Packed KV caches (inference/kv_cache.py): exactly the bf16 values the model rounded come back, the same
logits as bf16 caches, and the bytes per token of context the planner reports."""
import json
import os

import pytest
import torch

from conftest import FIXTURE, ROOT, fixture_file, fixture_model

from inference.config import ModelArgs, RuntimeOptions
from inference.engine.memory import plan_memory
from inference.engine.scoring import score
from inference.kernels.reference import fp4_qdq_e4m3_, fp4_qdq_e8m0_, fp8_qdq_
from inference.kv_cache import CacheFormatError, PackedCache, decode, encode, entry_bytes

QDQ = {"fp8": fp8_qdq_, "fp4_e4m3": fp4_qdq_e4m3_, "fp4_ue8m0": fp4_qdq_e8m0_}


def rounded_samples(fmt: str, rows: int = 512, dim: int = 128) -> torch.Tensor:
    """bf16 values rounded by the model's own quantizer, over groups of every magnitude: from all zeros and
    the clamped smallest scales (where the E4M3 scale is subnormal) to large values, signed zeros included."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(rows, dim, generator=g)
    exps = torch.randint(-40, 12, (rows, 1), generator=g).float()
    x = x * torch.exp2(exps)
    x[0] = 0.0
    x[1] = -0.0
    x[2, :16] = 1e-30                                  # one tiny group, the rest normal
    x[3] = torch.linspace(-3e-3, 3e-3, dim)            # E4M3 scales in the subnormal range
    x[4, ::3] = 0.0
    x[5] = torch.linspace(-0.05, 0.05, dim)            # amax / 6 in [2^-9, 2^-6): the max code may be 4
    x = x.to(torch.bfloat16)
    return QDQ[fmt](x)


@pytest.mark.parametrize("fmt", ["fp8", "fp4_e4m3", "fp4_ue8m0"])
def test_round_trip_is_bit_exact(fmt):
    y = rounded_samples(fmt)
    codes, scales = encode(fmt, y)
    back = decode(fmt, codes, scales)
    assert torch.equal(back.view(torch.int16), y.view(torch.int16))
    assert codes.shape[-1] + scales.shape[-1] == entry_bytes(fmt, y.shape[-1])


def test_values_off_the_grid_are_refused():
    with pytest.raises(CacheFormatError, match="fp4_e4m3 grid"):
        encode("fp4_e4m3", torch.linspace(0.1, 0.9, 32).to(torch.bfloat16).view(2, 16))


@pytest.mark.parametrize("fmt", ["fp8", "fp4_ue8m0"])
def test_values_off_a_power_of_two_grid_are_refused(fmt):
    """A power-of-two format's one candidate scale is checked value by value (code times scale must give the
    value written): one value a bf16 ulp off the grid is refused, and so is a tiny value beside a large one
    (2^-133 beside 2^100: x / s underflows to a zero code, which gives 0 back, not 2^-133)."""
    on = torch.tensor([[1.0, -0.5, 0.25, 0.0] * 8], dtype=torch.bfloat16)
    back = decode(fmt, *encode(fmt, on))                                # on the grid: accepted
    assert torch.equal(back, on)
    off = on.clone()
    off[0, 0] = torch.nextafter(off[0, 0], torch.full((), 2.0, dtype=off.dtype))   # 1 + 2^-7: needs 8 bits
    tiny = torch.zeros(1, 32, dtype=torch.bfloat16)
    tiny[0, 0], tiny[0, 1] = 2.0 ** 100, 2.0 ** -133
    for bad in (off, tiny):
        with pytest.raises(CacheFormatError, match=f"{fmt} grid"):
            encode(fmt, bad)


def test_a_decode_row_rounded_as_it_is_stored_holds_the_rounded_values():
    """A decode step's window row stored from the rounding's own codes (store_rounding) reads back exactly the
    model's FP8 rounding of it (reference.fp8_qdq_), over every magnitude the samples hold (zero and tiny
    groups, signed zeros, maxima at 448 x 2^k where the scale's choice is decided); other formats refuse."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(64, 128, generator=g) * torch.exp2(torch.randint(-40, 12, (64, 1), generator=g).float())
    x[0], x[1], x[2, :16] = 0.0, -0.0, 1e-30
    x[3, :32] = 448.0 * 2.0 ** torch.arange(-8, 24.0)
    x = x.to(torch.bfloat16)
    x[4] = torch.nextafter(x[3], torch.tensor(float("inf"), dtype=torch.bfloat16))
    cache = PackedCache((2, 64, 128), "fp8")
    cache.store_rounding((slice(0, 1), torch.arange(64)), x[None])
    assert torch.equal(cache[:1][0].view(torch.int16), fp8_qdq_(x.clone()).view(torch.int16))
    assert cache[1:].abs().sum() == 0
    with pytest.raises(ValueError, match="fp4_e4m3"):
        PackedCache((1, 4, 32), "fp4_e4m3").store_rounding((slice(0, 1), torch.arange(1)), x[None, :1, :32])


def test_packed_cache_indexes_like_the_buffer_it_replaces(monkeypatch):
    import inference.kv_cache
    monkeypatch.setattr(inference.kv_cache, "DECODE_CHUNK", 3 * 64)      # reads decode 3 rows at a time
    y = rounded_samples("fp8", rows=12, dim=64).view(2, 6, 64)
    cache = PackedCache((3, 8, 64), "fp8")
    plain = torch.zeros(3, 8, 64, dtype=torch.bfloat16)
    for c in (cache, plain):
        c[:2, 1:7] = y
        c[:2, 3] = y[:, 0]
        c[:2, torch.tensor([7, 0])] = y[:, 4:6]
    assert cache.shape == plain.shape
    assert torch.equal(cache[:3].view(torch.int16), plain.view(torch.int16))
    assert torch.equal(cache[:2, 2:5].view(torch.int16), plain[:2, 2:5].view(torch.int16))


def test_same_logits_as_bf16_caches_teacher_forced():
    case = json.load(open(fixture_file(os.path.join(FIXTURE, "score.json"))))
    out = {}
    for packed in (True, False):
        model = fixture_model(RuntimeOptions(packed_kv=packed))
        kinds = {type(m.kv_cache).__name__ for m in model.modules() if hasattr(m, "kv_cache")}
        assert kinds == ({"PackedCache"} if packed else {"Tensor"})
        # a prefill of 70 (past the 64-token window) writes the caches, 5 decode steps (both ratio-2
        # parities) read them; the fixture's 301 and 20 repeat the same writes and reads
        p = 70
        out[packed] = score(model, [s[:p + 6] for s in case["sequences"]], p, dspark=True)
    for key in ("logits", "dspark_logits"):
        assert torch.equal(out[True][key].view(torch.int32), out[False][key].view(torch.int32)), key


def test_golden_keeps_full_precision_caches():
    model = fixture_model(RuntimeOptions(golden=True))
    caches = [m.kv_cache for m in model.modules() if hasattr(m, "kv_cache")]
    assert caches and all(torch.is_tensor(c) and c.dtype == torch.float32 for c in caches)


def test_bytes_per_token_of_context_released():
    """Compressed KV + index keys per token of context (layers 2, 8, 14 at ratio 2, 20 at ratio 1): 3,200 B
    in bf16, 890 B packed; window rings 5.38 MiB -> 2.77 MiB per sequence (43 rings of 128 x 512)."""
    args = ModelArgs.from_file(os.path.join(ROOT, "config.json"), max_seq_len=4096, max_batch_size=2)
    per = {}
    for packed in (False, True):
        c = plan_memory(args, 8, RuntimeOptions(packed_kv=packed), ranks=[0]).ranks[0].caches
        tokens = args.max_batch_size * args.max_seq_len
        rings = (c["window_kv"] + c["dspark_rings"]) / args.max_batch_size
        per[packed] = ((c["compressed_kv"] + c["index_keys"]) / tokens, rings)
    assert per[False] == (2.5 * 1024 + 2.5 * 256, 43 * 128 * 512 * 2)
    assert per[True] == (2.5 * 288 + 2.5 * 68, 43 * 128 * (512 + 16))
