"""Synthetic Hugging Face checkpoint of DeepSeek-V4.1-Flash for any config (random weights, real formats).

    python -m inference.tools.synthetic --config CFG --out DIR [--seed S] [--shards N] [--tokenizer PATH]

Writes what the released HF repository holds (docs/checkpoint.md §1): `*.safetensors` shards with the
released tensor names, dtypes and quantization formats, `model.safetensors.index.json`, the HF root
`config.json` (docs/checkpoint.md §1.4), the tokenizer files, and — for convenience — the flat inference
config as `inference/config.json`. `convert.py` turns it into `model{i}-mp{W}.safetensors`.

Formats: FP8 Linears = E4M3 weight + UE8M0 32×32 block scales; routed experts = MXFP4 (two E2M1 codes per
I8 byte, low nibble = even element along K) + UE8M0 per 32 inputs of a row; Engram tables = E4M3 + UE8M0
per row per 32 columns. Every scale is the smallest power of two 2^p with qmax·2^p ≥ amax of its block
(qmax = 448 for E4M3, 6 for E2M1), found exactly (no rounding cast); values are then rounded to nearest
even. `dtype = "bf16"` stores Linears as plain BF16; `expert_dtype = null` gives experts the Linear format.

Weight statistics: those of tests/fixtures/reference-tiny, whose weights follow measurements of the
released checkpoint (norm-weight means, projection gains); small sub-block norms keep the residual stream
dominant, which keeps the model as well-conditioned as the real one (tensor-parallel rounding then moves
logits by ~0.1, not by whole units). gain g below means N(0, (g / sqrt(in_features))^2).

| tensors | values |
|---|---|
| `wq_a`, `wo_a` 1.6; `wq_b`, indexer `wq_b` 0.95; `wo_b` 1.9 | gain |
| `wkv`, compressor `wkv`, Engram `wkv` 1.8 | gain |
| expert and shared-expert `w1`/`w3` 1.5, `w2` 1.05; router 2.9; other Linears, head, Markov head 1.0 | gain |
| `embed` | N(0, 0.12²) |
| Markov `embed` | N(0, 1/rank) |
| `image_*` vectors, Engram tables | N(0, 1) |
| RMSNorm weights: `attn_norm` 0.025, `ffn_norm` 0.2, `kv_norm` 0.4, compressor 0.6 | m·(1 + N(0, 0.1²)) |
| RMSNorm weights: indexer `k_norm` 0.5, `q_norm` 0.97, others 1.0 | m·(1 + N(0, 0.1²)) |
| Engram `q_weight` / `k_weight` | 1 + N(0, 0.1²) |
| `hc_*_fn` | N(0, 1/(hc·dim)) |
| `hc_*_base`, `hc_*_scale`, `attn_sink` | N(0, 0.45²) |
| router `bias`, `bias_vl` | N(0, 0.1²) |
| ViT / aligner biases | N(0, 0.01²) |

With the reference-tiny config, the project's model on this checkpoint gives block outputs of RMS 1.1-2.7
and logits of RMS 1.0 (the fixture's own weights: 1.0-1.9 and 1.0), all finite, DSpark included.

Every tensor (and every row chunk of a large one) draws from its own generator seeded from (seed, name,
chunk), so the output depends only on --seed, never on the shard count or the order of writing. Shards
are written one at a time, large tensors in row chunks, so memory stays small for any checkpoint size.
"""
import argparse
import dataclasses
import hashlib
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Tuple

import torch

from inference.config import ModelArgs
from inference.safetensors_io import StreamWriter, tensor_nbytes

# ModelArgs fields that are runtime-only: the HF root config has no place for them.
RUNTIME_FIELDS = ("max_batch_size", "max_seq_len", "temperature", "gate_temp")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
CHUNK_ELEMENTS = 1 << 22   # row chunks of about 4M elements (part of the seeding: do not change lightly)
_E2M1_BOUNDS = None


@dataclass
class Param:
    """One logical parameter: a quantized pair (weight + scale) or a plain tensor."""
    name: str              # full name for plain tensors; the prefix before ".weight"/".scale" for pairs
    fmt: str               # "plain" | "fp8" (32x32 blocks) | "fp4" (experts) | "engram" (per-row per-32 FP8)
    shape: Tuple[int, ...]  # logical shape ([out, in] for matrices)
    dtype: str = "BF16"    # storage dtype of plain tensors
    init: Tuple = ("normal", 0.0, 1.0)  # ("normal", mean, std) | ("uniform", low, high)

    def tensors(self) -> List[Tuple[str, str, List[int]]]:
        """(name, safetensors dtype, shape) of every stored tensor."""
        if self.fmt == "plain":
            return [(self.name, self.dtype, list(self.shape))]
        n, k = self.shape
        if self.fmt == "fp8":
            return [(self.name + ".weight", "F8_E4M3", [n, k]),
                    (self.name + ".scale", "F8_E8M0", [-(-n // 32), -(-k // 32)])]
        if self.fmt == "fp4":
            return [(self.name + ".weight", "I8", [n, k // 2]),
                    (self.name + ".scale", "F8_E8M0", [n, k // 32])]
        if self.fmt == "engram":
            return [(self.name + ".weight", "F8_E4M3", [n, k]),
                    (self.name + ".scale", "F8_E8M0", [n, k // 32])]
        raise ValueError(f"unknown format {self.fmt!r}")

    @property
    def nbytes(self) -> int:
        return sum(tensor_nbytes(d, s) for _, d, s in self.tensors())


# ----------------------------------------------------------------------------------------------------------
# The tensor list (docs/checkpoint.md §1.2, generalised to any config)

def engram_table_sizes(args: ModelArgs) -> List[int]:
    """engram_num_embeddings for a config of another Engram vocabulary size: per Engram layer, the sum of the
    table sizes its hashes use, the first unused primes above engram_vocab_size (one per n-gram order and
    head), as the released config's are made."""
    from inference.engram import is_prime
    seen, sums, c0 = set(), [], args.engram_vocab_size - 1
    for _ in args.engram_layer_ids:
        total = 0
        for _order in range(2, args.engram_max_ngram_size + 1):
            c = c0
            for _head in range(args.engram_n_heads):
                c += 1
                while not is_prime(c) or c in seen:
                    c += 1
                seen.add(c)
                total += c
        sums.append(total)
    return sums


def _linear(args: ModelArgs, name: str, out: int, inp: int, gain: float = 1.0) -> Param:
    std = ("normal", 0.0, gain * inp ** -0.5)
    if args.dtype == "fp8":
        return Param(name, "fp8", (out, inp), init=std)
    return Param(name + ".weight", "plain", (out, inp), "BF16", std)


def _expert(args: ModelArgs, name: str, out: int, inp: int, gain: float = 1.0) -> Param:
    if args.expert_dtype == "fp4":
        if inp % 32:
            raise ValueError(f"MXFP4 experts need in_features divisible by 32, got {inp} for {name}")
        return Param(name, "fp4", (out, inp), init=("normal", 0.0, gain * inp ** -0.5))
    return _linear(args, name, out, inp, gain)


def _bf16(name: str, shape: Sequence[int], init) -> Param:
    return Param(name, "plain", tuple(shape), "BF16", init)


def _f32(name: str, shape: Sequence[int], init) -> Param:
    return Param(name, "plain", tuple(shape), "F32", init)


def _norm(name: str, dim: int, mean: float = 1.0) -> Param:
    return _bf16(name, (dim,), ("normal", mean, 0.1 * mean))


def _gain(fan_in: int, gain: float = 1.0):
    return ("normal", 0.0, gain * fan_in ** -0.5)


def _block_params(args: ModelArgs, prefix: str, layer_id: int, n_experts: int) -> List[Param]:
    d, hc = args.dim, args.hc_mult
    mix = (2 + hc) * hc
    ps = [_norm(f"{prefix}.attn_norm.weight", d, 0.025), _norm(f"{prefix}.ffn_norm.weight", d, 0.2)]
    for site in ("attn", "ffn"):
        ps += [_f32(f"{prefix}.hc_{site}_fn", (mix, hc * d), _gain(hc * d)),
               _f32(f"{prefix}.hc_{site}_base", (mix,), ("normal", 0.0, 0.45)),
               _f32(f"{prefix}.hc_{site}_scale", (3,), ("normal", 0.0, 0.45))]
    a = f"{prefix}.attn"
    ps += [_f32(f"{a}.attn_sink", (args.n_heads,), ("normal", 0.0, 0.45)),
           _linear(args, f"{a}.wq_a", args.q_lora_rank, d, 1.6),
           _norm(f"{a}.q_norm.weight", args.q_lora_rank, 0.97),
           _linear(args, f"{a}.wq_b", args.n_heads * args.head_dim, args.q_lora_rank, 0.95),
           _linear(args, f"{a}.wkv", args.head_dim, d, 1.8),
           _norm(f"{a}.kv_norm.weight", args.head_dim, 0.4),
           _linear(args, f"{a}.wo_a", args.o_groups * args.o_lora_rank,
                   args.n_heads * args.head_dim // args.o_groups, 1.6),
           _linear(args, f"{a}.wo_b", d, args.o_groups * args.o_lora_rank, 1.9)]
    backbone = layer_id < args.n_layers
    if backbone and layer_id in args.kv_source_layers:
        ps.append(_bf16(f"{a}.compressor.wkv.weight", (args.head_dim, d), _gain(d, 1.8)))
        if args.compress_ratios[layer_id] >= 2:  # softmax pooling over a group needs gate logits
            ps.append(_bf16(f"{a}.compressor.wgate.weight", (args.head_dim, d), _gain(d)))
        ps.append(_norm(f"{a}.compressor.norm.weight", args.head_dim, 0.6))
    if backbone and layer_id in args.index_source_layers:
        ix = f"{a}.indexer"
        ps += [_linear(args, f"{ix}.wq_b", args.index_n_heads * args.index_head_dim, args.q_lora_rank, 0.95),
               _bf16(f"{ix}.weights_proj.weight", (args.index_n_heads, d), _gain(d))]
        if layer_id in args.kv_source_layers:  # owners of the index-key cache
            ps += [_bf16(f"{ix}.wk.weight", (args.index_head_dim, args.head_dim), _gain(args.head_dim)),
                   _norm(f"{ix}.k_norm.weight", args.index_head_dim, 0.5)]
    f = f"{prefix}.ffn"
    ps += [_bf16(f"{f}.gate.weight", (n_experts, d), _gain(d, 2.9)),
           _f32(f"{f}.gate.bias", (n_experts,), ("normal", 0.0, 0.1))]
    if args.vision_n_layers > 0:
        ps.append(_f32(f"{f}.gate.bias_vl", (n_experts,), ("normal", 0.0, 0.1)))
    inter = args.moe_inter_dim
    for e in range(n_experts):
        ps += [_expert(args, f"{f}.experts.{e}.w1", inter, d, 1.5),
               _expert(args, f"{f}.experts.{e}.w2", d, inter, 1.05),
               _expert(args, f"{f}.experts.{e}.w3", inter, d, 1.5)]
    ps += [_linear(args, f"{f}.shared_experts.w1", inter, d, 1.5),
           _linear(args, f"{f}.shared_experts.w2", d, inter, 1.05),
           _linear(args, f"{f}.shared_experts.w3", inter, d, 1.5)]
    return ps


def _engram_params(args: ModelArgs, layer_id: int, rows: int) -> Tuple[Param, List[Param]]:
    e, d = f"layers.{layer_id}.engram", args.dim
    width = (args.engram_max_ngram_size - 1) * args.engram_n_heads * args.engram_head_dim
    if args.engram_head_dim % 32:
        raise ValueError("engram_head_dim must be divisible by 32 (one scale per 32 columns)")
    table = Param(f"{e}.embed", "engram", (rows, args.engram_head_dim))
    rest = [_linear(args, f"{e}.wkv", (args.hc_mult + 1) * d, width, 1.8),
            _bf16(f"{e}.q_weight", (args.hc_mult, d), ("normal", 1.0, 0.1)),
            _bf16(f"{e}.k_weight", (args.hc_mult, d), ("normal", 1.0, 0.1))]
    return table, rest


def _vision_params(args: ModelArgs) -> List[Param]:
    vd, p, inter = args.vision_dim, args.vision_patch_size, args.vision_inter_dim
    bias = ("normal", 0.0, 0.01)
    ps = [_bf16("vision.patch_embed.proj.weight", (vd, 3 * p * p), _gain(3 * p * p)),
          _bf16("vision.patch_embed.proj.bias", (vd,), bias)]
    for i in range(args.vision_n_layers):
        b = f"vision.blocks.{i}"
        ps += [_norm(f"{b}.norm1.weight", vd), _norm(f"{b}.norm2.weight", vd),
               _bf16(f"{b}.attn.wqkv.weight", (3 * vd, vd), _gain(vd)),
               _bf16(f"{b}.attn.wqkv.bias", (3 * vd,), bias),
               _bf16(f"{b}.attn.wo.weight", (vd, vd), _gain(vd)), _bf16(f"{b}.attn.wo.bias", (vd,), bias),
               _bf16(f"{b}.mlp.w1.weight", (2 * inter, vd), _gain(vd)),  # gate ‖ up
               _bf16(f"{b}.mlp.w2.weight", (vd, inter), _gain(inter))]
    merged = vd * args.vision_downsample_ratio ** 2
    ps += [_norm("vision.norm.weight", vd),
           _bf16("aligner.w1.weight", (args.dim, merged), _gain(merged)),
           _bf16("aligner.w1.bias", (args.dim,), bias),
           _bf16("aligner.w2.weight", (args.dim, args.dim), _gain(args.dim)),
           _bf16("aligner.w2.bias", (args.dim,), bias)]
    return ps


def hf_params(args: ModelArgs) -> List[Param]:
    """Every parameter of the HF checkpoint, in the released shard grouping order: vision, embed and image
    vectors, one group per backbone layer (Engram tables excepted), head + norm, the DSpark stages, the
    Engram tables."""
    d, vocab = args.dim, args.vocab_size
    ps = _vision_params(args) if args.vision_n_layers > 0 else []
    ps.append(_bf16("embed.weight", (vocab, d), ("normal", 0.0, 0.12)))
    if args.vision_n_layers > 0:
        ps += [_bf16(n, (d,), ("normal", 0.0, 1.0)) for n in ("image_start", "image_end", "image_newline")]
    tables = []
    engram_rows = dict(zip(args.engram_layer_ids, args.engram_num_embeddings))
    for i in range(args.n_layers):
        ps += _block_params(args, f"layers.{i}", i, args.n_routed_experts)
        if i in engram_rows:
            table, rest = _engram_params(args, i, engram_rows[i])
            ps += rest
            tables.append(table)
    ps += [_bf16("head.weight", (vocab, d), _gain(d)), _norm("norm.weight", d)]
    n_stages = args.n_mtp_layers if args.dspark_block_size > 0 else 0
    rank = args.dspark_markov_rank
    for k in range(n_stages):
        m = f"mtp.{k}"
        ps += _block_params(args, m, args.n_layers + k, args.dspark_experts)
        if k == 0:
            width = len(args.dspark_target_layer_ids) * d
            ps += [_linear(args, f"{m}.main_proj", d, width), _norm(f"{m}.main_norm.weight", d)]
        if k == n_stages - 1:
            ps += [_norm(f"{m}.norm.weight", d),
                   _bf16(f"{m}.markov_head.embed.weight", (vocab, rank), _gain(rank)),
                   _bf16(f"{m}.markov_head.head.weight", (vocab, rank), _gain(rank)),
                   _bf16(f"{m}.confidence_head.proj.weight", (1, d + rank), _gain(d + rank))]
    return ps + tables


def hf_tensor_specs(args: ModelArgs) -> List[Tuple[str, str, List[int]]]:
    """(name, safetensors dtype, shape) of every tensor of the HF checkpoint for `args`."""
    return [t for p in hf_params(args) for t in p.tensors()]


# ----------------------------------------------------------------------------------------------------------
# HF root config (docs/checkpoint.md §1.4)

def hf_config(args: ModelArgs) -> dict:
    text = {
        "model_type": "deepseek_v41_text", "vocab_size": args.vocab_size, "hidden_size": args.dim,
        "moe_intermediate_size": args.moe_inter_dim, "num_hidden_layers": args.n_layers,
        "num_nextn_predict_layers": args.n_mtp_layers, "num_attention_heads": args.n_heads,
        "num_key_value_heads": 1, "head_dim": args.head_dim, "qk_rope_head_dim": args.rope_head_dim,
        "q_lora_rank": args.q_lora_rank, "o_groups": args.o_groups, "o_lora_rank": args.o_lora_rank,
        "rms_norm_eps": args.norm_eps, "n_routed_experts": args.n_routed_experts,
        "n_shared_experts": args.n_shared_experts, "num_experts_per_tok": args.n_activated_experts,
        "scoring_func": args.score_func, "topk_method": "noaux_tc", "routed_scaling_factor": args.route_scale,
        "norm_topk_prob": args.norm_topk_prob, "swiglu_limit": args.swiglu_limit, "hidden_act": "silu",
        "sliding_window": args.window_size, "compress_ratios": list(args.compress_ratios),
        "compress_rope_theta": args.compress_rope_theta, "kv_source_layer_ids": list(args.kv_source_layers),
        "index_source_layer_ids": list(args.index_source_layers), "index_n_heads": args.index_n_heads,
        "index_head_dim": args.index_head_dim, "index_topk": args.index_topk,
        "candidate_topk_blocks": args.candidate_topk_blocks,
        "candidate_block_size": args.candidate_block_size,
        "rope_theta": args.rope_theta,
        # Always written (even with original_seq_len 0) so that every rope value survives the round trip.
        "rope_scaling": {"rope_type": "yarn", "factor": args.rope_factor,
                         "original_max_position_embeddings": args.original_seq_len,
                         "beta_fast": args.beta_fast, "beta_slow": args.beta_slow},
        "hc_mult": args.hc_mult, "hc_sinkhorn_iters": args.hc_sinkhorn_iters, "hc_eps": args.hc_eps,
        "engram_layer_ids": list(args.engram_layer_ids),
        "engram_num_embeddings": list(args.engram_num_embeddings),
        "engram_max_ngram_size": args.engram_max_ngram_size, "engram_vocab_size": args.engram_vocab_size,
        "engram_n_heads": args.engram_n_heads, "engram_head_dim": args.engram_head_dim,
        "engram_compressed_vocab_size": args.engram_compressed_vocab_size,
        "engram_pad_token_id": args.engram_pad_id, "dspark_block_size": args.dspark_block_size,
        "dspark_noise_token_id": args.dspark_noise_token_id,
        "dspark_target_layer_ids": list(args.dspark_target_layer_ids),
        "dspark_markov_rank": args.dspark_markov_rank,
        "dspark_n_routed_experts": args.dspark_n_routed_experts,
        "dspark_num_experts_per_tok": args.dspark_n_activated_experts,
        "max_position_embeddings": 1048576, "tie_word_embeddings": False, "attention_bias": False,
        "attention_dropout": 0.0, "use_cache": True,
    }
    if args.candidate_source_layer >= 0:  # HF omits it when disabled
        text["candidate_source_layer_id"] = args.candidate_source_layer
    # Kept even with 0 layers (then the vision path is off) so that every vision value round-trips.
    vision = {
        "model_type": "deepseek_v41_vision", "num_hidden_layers": args.vision_n_layers,
        "hidden_size": args.vision_dim, "num_attention_heads": args.vision_n_heads,
        "intermediate_size": args.vision_inter_dim, "patch_size": args.vision_patch_size,
        "rope_theta": args.vision_rope_theta, "downsample_ratio": args.vision_downsample_ratio,
        "max_image_tokens": args.vision_max_n_token, "min_pixels": args.vision_min_pixels,
        "max_wh_ratio": args.vision_max_wh_ratio,
    }
    if args.dtype == "fp8":
        quant = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "scale_fmt": "ue8m0",
                 "weight_block_size": [32, 32], "expert_dtype": args.expert_dtype}
    else:
        quant = {"expert_dtype": args.expert_dtype} if args.expert_dtype else None
    cfg = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
           "transformers_version": "5.6.0", "image_token_id": args.image_token_id,
           "text_config": text, "vision_config": vision}
    if quant is not None:
        cfg["quantization_config"] = quant
    return cfg


# ----------------------------------------------------------------------------------------------------------
# Quantizers (exact power-of-two scales, round to nearest even)

def pow2_exponent(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """Smallest integer p with qmax * 2^p >= amax (exactly), clamped to the UE8M0 range."""
    a = amax.double().clamp(min=1e-30)
    p = torch.ceil(torch.log2(a / qmax))
    # log2 may be off by one next to a power of two: fix with exact comparisons (qmax * 2^p is exact).
    p += (a > qmax * torch.exp2(p)).double()
    p -= (a <= qmax * torch.exp2(p - 1)).double()
    return p.clamp(-127, 127).to(torch.int32)


def _ue8m0(p: torch.Tensor) -> torch.Tensor:
    return (p + 127).to(torch.uint8)


def quant_fp8_blocks(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp32 [N, K] -> (E4M3 [N, K] as uint8, UE8M0 [ceil(N/32), ceil(K/32)] as uint8), 32x32 blocks."""
    n, k = x.shape
    pn, pk = -n % 32, -k % 32
    xp = torch.nn.functional.pad(x, (0, pk, 0, pn)) if pn or pk else x
    blocks = xp.view((n + pn) // 32, 32, (k + pk) // 32, 32)
    p = pow2_exponent(blocks.abs().amax(dim=(1, 3)), 448.0)
    q = (blocks * torch.exp2(-p.float())[:, None, :, None]).clamp_(-448, 448).to(torch.float8_e4m3fn)
    q = q.view(n + pn, k + pk)[:n, :k]
    return q.contiguous().view(torch.uint8), _ue8m0(p)


def quant_fp8_rows(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp32 [N, K] -> (E4M3 [N, K], UE8M0 [N, K/32]): one scale per row per 32 columns (Engram tables)."""
    n, k = x.shape
    groups = x.view(n, k // 32, 32)
    p = pow2_exponent(groups.abs().amax(-1), 448.0)
    q = (groups * torch.exp2(-p.float()).unsqueeze(-1)).clamp_(-448, 448).to(torch.float8_e4m3fn)
    return q.view(n, k).view(torch.uint8), _ue8m0(p)


def quant_fp4(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp32 [N, K] -> (packed E2M1 I8 [N, K/2], UE8M0 [N, K/32]); low nibble = even column."""
    global _E2M1_BOUNDS
    if _E2M1_BOUNDS is None:
        # Midpoints of the E2M1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6. A tie goes to the even code: where the
        # upper neighbour is even the midpoint itself must round up, so compare against the float below it.
        mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
        even_up = torch.tensor([False, True, False, True, False, True, False])
        _E2M1_BOUNDS = torch.where(even_up, torch.nextafter(mids, torch.zeros(7)), mids).tolist()
    n, k = x.shape
    groups = x.view(n, k // 32, 32)
    p = pow2_exponent(groups.abs().amax(-1), 6.0)
    y = groups * torch.exp2(-p.float()).unsqueeze(-1)
    mag = y.abs()
    code = (mag > _E2M1_BOUNDS[0]).to(torch.uint8)
    for b in _E2M1_BOUNDS[1:]:
        code += mag > b
    code |= ((y < 0) & (code > 0)).to(torch.uint8) << 3
    code = code.view(n, k // 2, 2)
    return (code[..., 0] | (code[..., 1] << 4)).view(torch.int8), _ue8m0(p)


# ----------------------------------------------------------------------------------------------------------
# Writing

def _generator(seed: int, name: str, chunk: int) -> torch.Generator:
    h = hashlib.blake2b(f"{seed}:{name}:{chunk}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(h, "little") & ((1 << 63) - 1))


def _sample(shape: Sequence[int], init, gen: torch.Generator) -> torch.Tensor:
    kind, a, b = init
    if kind == "normal":
        return torch.randn(*shape, generator=gen).mul_(b).add_(a)
    if kind == "uniform":
        return torch.rand(*shape, generator=gen).mul_(b - a).add_(a)
    raise ValueError(f"unknown init {kind!r}")


def _row_chunks(p: Param) -> Iterator[Tuple[int, int]]:
    rows = p.shape[0] if p.shape else 1
    per_row = max(1, (p.shape[1] if len(p.shape) > 1 else 1))
    step = max(32, CHUNK_ELEMENTS // per_row // 32 * 32)
    for r0 in range(0, rows, step):
        yield r0, min(rows, r0 + step)


def _write_param(w: StreamWriter, p: Param, seed: int) -> None:
    if p.fmt == "plain" and len(p.shape) <= 1:
        t = _sample(p.shape, p.init, _generator(seed, p.name, 0))
        w.write_tensor(p.name, [_raw(t.to(_TORCH[p.dtype]))], 0)
        return
    names = [t[0] for t in p.tensors()]
    for i, (r0, r1) in enumerate(_row_chunks(p)):
        x = _sample((r1 - r0, *p.shape[1:]), p.init, _generator(seed, p.name, i))
        if p.fmt == "plain":
            w.write_tensor(p.name, [_raw(x.to(_TORCH[p.dtype]))], r0 * x[0].numel() * _ITEMSIZE[p.dtype])
            continue
        k = p.shape[1]
        if p.fmt == "fp8":
            q, s = quant_fp8_blocks(x)
            w.write_tensor(names[0], [_raw(q)], r0 * k)
            w.write_tensor(names[1], [_raw(s)], (r0 // 32) * s.shape[1])
        elif p.fmt == "fp4":
            q, s = quant_fp4(x)
            w.write_tensor(names[0], [_raw(q)], r0 * (k // 2))
            w.write_tensor(names[1], [_raw(s)], r0 * (k // 32))
        else:  # engram
            q, s = quant_fp8_rows(x)
            w.write_tensor(names[0], [_raw(q)], r0 * k)
            w.write_tensor(names[1], [_raw(s)], r0 * (k // 32))


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Fill a built model (one rank of W = 1, on any device) with synthetic weights without writing files:
    every tensor hf_params lists, sampled on the model's device with the same statistics and quantised to the
    same formats (not the files' values: another random stream). A weight the model holds in bf16 / fp32
    although stored quantized (wo_a) gets its quantized value, as convert.py and the loader make it."""
    from ..quant import dequant_fp8_weight
    state = model.state_dict(keep_vars=True)
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    args = model.args
    for p in hf_params(args):
        names = [t[0] for t in p.tensors()]
        if names[0] not in state:                           # tied copies, the vision tower when not built
            continue
        x = torch.randn(*p.shape, generator=gen, device=device)
        kind, a, b = p.init
        x = x.mul_(b).add_(a) if kind == "normal" else torch.rand_like(x).mul_(b - a).add_(a)
        target = state[names[0]]
        if p.fmt == "plain":
            target.copy_(x)
            continue
        q, sc = {"fp8": quant_fp8_blocks, "fp4": quant_fp4, "engram": quant_fp8_rows}[p.fmt](x)
        if names[1] not in state:                           # held dequantised (wo_a, in bf16)
            target.copy_(dequant_fp8_weight(q.view(torch.float8_e4m3fn), sc.view(torch.float8_e8m0fnu)))
            continue
        target.view(torch.uint8).copy_(q.view(torch.uint8))
        state[names[1]].view(torch.uint8).copy_(sc)


_TORCH = {"BF16": torch.bfloat16, "F32": torch.float32}
_ITEMSIZE = {"BF16": 2, "F32": 4}


def _raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def _assign_shards(params: List[Param], shards: int) -> List[List[Param]]:
    """Cut the ordered list into `shards` consecutive groups of about equal bytes (none empty)."""
    shards = max(1, min(shards, len(params)))
    total = sum(p.nbytes for p in params)
    groups, cur, done = [], [], 0
    for i, p in enumerate(params):
        left_params, left_groups = len(params) - i, shards - len(groups)
        if cur and (done >= total * (len(groups) + 1) / shards or left_params < left_groups):
            groups.append(cur)
            cur = []
        cur.append(p)
        done += p.nbytes
    groups.append(cur)
    while len(groups) < shards:  # only when a few huge tensors dominate: split the largest group
        big = max(range(len(groups)), key=lambda j: len(groups[j]))
        g = groups[big]
        groups[big:big + 1] = [g[:len(g) // 2], g[len(g) // 2:]]
    return groups


def _write_shard(path: str, params: List[Param], seed: int) -> None:
    entries = [t for p in params for t in p.tensors()]
    w = StreamWriter(path, entries, metadata={"format": "pt"})
    try:
        for p in params:
            _write_param(w, p, seed)
        w.close()
    except BaseException:
        w.abort()
        raise


def _shard_job(job) -> None:
    torch.set_num_threads(1)
    _write_shard(*job)


def copy_tokenizer(src_dir: str, dest_dir: str) -> List[str]:
    copied = []
    for f in TOKENIZER_FILES:
        src, dst = os.path.join(src_dir, f), os.path.join(dest_dir, f)
        if os.path.isfile(src):
            if os.path.abspath(src) != os.path.abspath(dst):
                shutil.copyfile(src, dst)
            copied.append(f)
    return copied


def write_synthetic_checkpoint(args: ModelArgs, out_dir: str, seed: int = 0, shards: int = 4,
                               tokenizer_dir: Optional[str] = None, workers: int = 1) -> str:
    """Write a synthetic HF checkpoint for `args` into out_dir; returns out_dir."""
    if tokenizer_dir is not None and not any(os.path.isfile(os.path.join(tokenizer_dir, f))
                                             for f in TOKENIZER_FILES):
        raise FileNotFoundError(f"no tokenizer.json / tokenizer_config.json in {tokenizer_dir}")
    os.makedirs(os.path.join(out_dir, "inference"), exist_ok=True)
    groups = _assign_shards(hf_params(args), shards)
    files = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    for f in os.listdir(out_dir):  # shards of an earlier checkpoint with another shard count
        if re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", f) and f not in files:
            os.remove(os.path.join(out_dir, f))
    jobs = [(os.path.join(out_dir, f), g, seed) for f, g in zip(files, groups)]
    if workers > 1 and len(jobs) > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor
        with ProcessPoolExecutor(min(workers, len(jobs)), mp_context=mp.get_context("spawn")) as pool:
            list(pool.map(_shard_job, jobs))
    else:
        # Many small ops: intra-op threads only cost barrier waits (20x slower on a busy machine).
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for job in jobs:
                _write_shard(*job)
        finally:
            torch.set_num_threads(threads)

    weight_map = {name: f for f, g in zip(files, groups) for p in g for name, _, _ in p.tensors()}
    total = sum(p.nbytes for g in groups for p in g)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(os.path.join(out_dir, "model.safetensors.index.json"), index)
    _write_json(os.path.join(out_dir, "config.json"), hf_config(args))
    _write_json(os.path.join(out_dir, "inference", "config.json"), dataclasses.asdict(args))
    if tokenizer_dir is not None:
        copy_tokenizer(tokenizer_dir, out_dir)
    else:
        from encoding.tokenizer import write_v41_tokenizer
        write_v41_tokenizer(out_dir)
    return out_dir


def _write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="Write a synthetic (random-weight) DeepSeek-V4.1-Flash HF "
                                             "checkpoint in the released layout and formats.")
    ap.add_argument("--config", required=True, help="flat inference config.json (reference key names)")
    ap.add_argument("--out", required=True, help="output directory (created)")
    ap.add_argument("--seed", type=int, default=0,
                    help="random seed; the output depends only on it (default 0)")
    ap.add_argument("--shards", type=int, default=4, help="number of *.safetensors shard files (default 4)")
    ap.add_argument("--tokenizer", default=None,
                    help="directory to copy tokenizer.json / tokenizer_config.json from "
                         "(default: write the real V4.1 tokenizer)")
    ap.add_argument("--workers", type=int, default=None,
                    help="processes writing shards in parallel (default: 1 below 256 MB, else the CPU count, "
                         "at most 8)")
    a = ap.parse_args(argv)
    try:
        args = ModelArgs.from_file(a.config)
        total = sum(p.nbytes for p in hf_params(args))
        workers = a.workers or (1 if total < 256 << 20 else min(os.cpu_count() or 1, 8))
        write_synthetic_checkpoint(args, a.out, seed=a.seed, shards=a.shards, tokenizer_dir=a.tokenizer,
                                   workers=workers)
    except (ValueError, OSError) as e:  # bad config, missing tokenizer files, unwritable output
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {a.out}: {total / 1e9:.3f} GB of tensors in {min(a.shards, len(hf_params(args)))} shard(s)")
    return 0

if __name__ == "__main__":
    sys.exit(main())
