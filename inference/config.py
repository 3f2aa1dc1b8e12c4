"""Model arguments (flat, the keys of the released inference config.json) and runtime options."""
import dataclasses
import json
from dataclasses import dataclass, field
from typing import List, Optional


class ConfigError(ValueError):
    pass


@dataclass
class ModelArgs:
    # Runtime-only fields (not in config.json); generate.py overrides them.
    max_batch_size: int = 4
    max_seq_len: int = 4096
    temperature: float = 1.0
    gate_temp: float = 1.0
    norm_topk_prob: bool = True
    # Shape and vocabulary. Defaults are a small model that builds in a test; the released values
    # come only from config.json.
    vocab_size: int = 1024
    dim: int = 256
    n_layers: int = 4
    n_mtp_layers: int = 1
    n_heads: int = 4
    head_dim: int = 128
    rope_head_dim: int = 32
    q_lora_rank: int = 128
    o_groups: int = 2
    o_lora_rank: int = 64
    norm_eps: float = 1e-20
    dtype: str = "fp8"
    expert_dtype: Optional[str] = "fp4"
    # MoE
    moe_inter_dim: int = 128
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    n_activated_experts: int = 2
    score_func: str = "sqrtsoftplus"
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    # Attention, RoPE, compressed KV, indexer
    window_size: int = 32
    compress_ratios: List[int] = field(default_factory=lambda: [0, 2, 1, 1, 0])
    kv_source_layers: List[int] = field(default_factory=lambda: [1, 2])
    index_source_layers: List[int] = field(default_factory=lambda: [1, 2, 3])
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    original_seq_len: int = 128
    rope_factor: float = 4
    beta_fast: int = 32
    beta_slow: int = 1
    index_n_heads: int = 4
    index_head_dim: int = 64
    index_topk: int = 16
    candidate_source_layer: int = 2
    candidate_topk_blocks: int = 4
    candidate_block_size: int = 4
    # Hyper-connections
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # Engram
    engram_layer_ids: List[int] = field(default_factory=lambda: [0, 1])
    engram_num_embeddings: List[int] = field(default_factory=lambda: [6126, 6332])
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 1000
    engram_n_heads: int = 2
    engram_head_dim: int = 32
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 0  # 0: accept whatever the tokenizer gives (tests only)
    # Vision
    vision_n_layers: int = 0
    vision_dim: int = 1024
    vision_n_heads: int = 16
    vision_inter_dim: int = 2816
    vision_patch_size: int = 14
    vision_rope_theta: float = 10000.0
    vision_downsample_ratio: int = 3
    vision_max_n_token: int = 1024
    vision_min_pixels: int = 295936
    vision_max_wh_ratio: Optional[float] = None
    image_token_id: int = 129264
    # DSpark
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 3
    dspark_target_layer_ids: List[int] = field(default_factory=lambda: [3])
    dspark_markov_rank: int = 32
    dspark_n_routed_experts: int = 4
    dspark_n_activated_experts: int = 2

    @classmethod
    def from_dict(cls, d: dict, **overrides) -> "ModelArgs":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown config key(s): {', '.join(unknown)}")
        args = cls(**{**d, **overrides})
        args.validate()
        return args

    @classmethod
    def from_file(cls, path: str, **overrides) -> "ModelArgs":
        try:
            with open(path) as f:
                d = json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"config file {path} is not valid JSON: {e}") from None
        if "text_config" in d:
            d = hf_to_reference(d)
        return cls.from_dict(d, **overrides)

    # Derived helpers used across modules.
    @property
    def n_total_layers(self) -> int:
        return self.n_layers + (self.n_mtp_layers if self.dspark_block_size > 0 else 0)

    @property
    def has_dspark(self) -> bool:
        return self.dspark_block_size > 0 and self.n_mtp_layers > 0

    @property
    def dspark_experts(self) -> int:
        return self.dspark_n_routed_experts or self.n_routed_experts

    @property
    def dspark_topk(self) -> int:
        return self.dspark_n_activated_experts or self.n_activated_experts

    def kv_source_of(self, layer_id: int) -> int:
        """Nearest KV source at or before a layer with ratio > 0 (-1 if none)."""
        srcs = [s for s in self.kv_source_layers if s <= layer_id]
        return max(srcs) if srcs else -1

    def index_source_of(self, layer_id: int) -> int:
        srcs = [s for s in self.index_source_layers if s <= layer_id]
        return max(srcs) if srcs else -1

    def validate(self, world_size: int = 1) -> None:
        def need(cond, msg):
            if not cond:
                raise ConfigError(msg)

        need(len(self.compress_ratios) == self.n_layers + self.n_mtp_layers,
             f"compress_ratios has {len(self.compress_ratios)} entries, expected n_layers + n_mtp_layers = "
             f"{self.n_layers + self.n_mtp_layers}")
        need(self.rope_head_dim <= self.head_dim, "rope_head_dim must be <= head_dim")
        need(self.n_shared_experts == 1, f"n_shared_experts must be 1, got {self.n_shared_experts}")
        need(self.dtype in ("fp8", "bf16"), f"dtype must be 'fp8' or 'bf16', got {self.dtype!r}")
        need(self.expert_dtype in ("fp4", "fp8", None),
             f"expert_dtype must be 'fp4' or null, got {self.expert_dtype!r}")
        need(self.score_func in ("sqrtsoftplus", "softmax", "sigmoid"),
             f"unknown score_func {self.score_func!r}")
        need(self.n_heads % self.o_groups == 0, "n_heads must be divisible by o_groups")
        for s in self.kv_source_layers:
            need(0 <= s < self.n_layers and self.compress_ratios[s] > 0,
                 f"kv_source_layers entry {s} must be a backbone layer with compress ratio > 0")
        for i in range(self.n_layers):
            r = self.compress_ratios[i]
            if r > 0:
                src = self.kv_source_of(i)
                need(src >= 0 and self.compress_ratios[src] == r,
                     f"layer {i} (ratio {r}) has no KV source of the same ratio at or before it")
                need(self.index_source_of(i) >= 0,
                     f"layer {i} (ratio {r}) has no index source at or before it")
        for s in self.index_source_layers:
            need(0 <= s < self.n_layers and self.compress_ratios[s] > 0,
                 f"index_source_layers entry {s} must be a backbone layer with compress ratio > 0")
        if self.candidate_source_layer >= 0:
            c = self.candidate_source_layer
            need(c in self.index_source_layers, f"candidate_source_layer {c} must be an index source")
            for s in self.index_source_layers:
                if s > c:
                    need(self.compress_ratios[s] == self.compress_ratios[c],
                         f"index source {s} after the candidate source {c} must have the same ratio")
        need(len(self.engram_num_embeddings) == len(self.engram_layer_ids),
             "engram_num_embeddings and engram_layer_ids must have the same length")
        need(self.engram_max_ngram_size >= 2, "engram_max_ngram_size must be >= 2")
        if self.dspark_block_size > 0:
            need(len(self.dspark_target_layer_ids) > 0, "dspark_target_layer_ids must not be empty")
            need(all(0 <= t < self.n_layers for t in self.dspark_target_layer_ids),
                 "every dspark_target_layer_ids entry must be < n_layers")
        self.check_world_size(world_size)

    def check_world_size(self, world_size: int) -> None:
        checks = [("vocab_size", self.vocab_size), ("n_heads", self.n_heads),
                  ("index_n_heads", self.index_n_heads), ("o_groups", self.o_groups),
                  ("n_routed_experts", self.n_routed_experts)]
        if self.has_dspark:
            checks.append(("dspark_n_routed_experts", self.dspark_experts))
        for name, v in checks:
            if v % world_size:
                raise ConfigError(f"world size {world_size} does not divide {name} = {v}")


ENGRAM_PLACEMENTS = ("device", "host", "disk")
EXPERT_PLACEMENTS = ("device", "host")
CPU_LINEARS = ("fp32", "stored")
KERNEL_BUILDS = ("default", "plain")       # inference/kernels/tilelang_ops.py SETTINGS
ORDERS = ("auto", "exact", "fast", "invariant")
# --numerics: words over the three axes of RuntimeOptions (rounding points: reference or golden; the
# index-key fix; summation order), see docs/numerics.md §15.
NUMERICS_WORDS = ("reference", "golden", "fixed", "exact", "fast", "invariant")
KERNEL_BACKENDS = ("auto", "torch", "tilelang")
# (field, the values it takes, what it is called in an error)
_CHOICES = (("kernel_backend", KERNEL_BACKENDS, "kernel backend"),
            ("kernel_build", KERNEL_BUILDS, "kernel build"),
            ("order", ORDERS, "summation order"),
            ("engram_on", ENGRAM_PLACEMENTS, "Engram placement"),
            ("experts_on", EXPERT_PLACEMENTS, "expert placement"),
            ("cpu_linears", CPU_LINEARS, "CPU Linear form"))


@dataclass
class RuntimeOptions:
    """Project options that are not in config.json. Defaults reproduce the official numbers."""
    fix_index_k_publish: bool = False   # fix of the stale index-key defect (docs/numerics.md §14.1)
    deterministic_topk: bool = False    # stable lowest-index tie-breaking in every top-k
    kernel_backend: str = "auto"        # torch | tilelang | auto (inference/kernels/__init__.py picks)
    # How the TileLang kernels are built: default (TileLang's passes) or plain (no warp specialization and no
    # TMA lowering, as DeepSeek builds its kernels). The same numbers either way; the device check says
    # which one ran on a given GPU.
    kernel_build: str = "default"
    # Summation order of the torch kernels: exact (the reference's, bit for bit on CPU), fast (loop-free, the
    # same rounding points), invariant (every reduction in an order fixed by the shapes: the same bits on
    # every CPU, thread count, batch, chunking and world size) or auto (exact on CPU, fast on CUDA).
    order: str = "auto"
    # "What the math says": fp32 weights and activations, no fake quantization (parity baseline only).
    golden: bool = False
    # Where the Engram tables live: device (GPU memory), host (CPU memory, the rows a step needs are copied
    # over) or disk (memory-mapped from the converted shard file). Results are identical.
    engram_on: str = "device"
    # Keep the KV caches (window, compressed, indexer keys) as FP8 / FP4 codes plus scales instead of bf16:
    # the same values come back bit for bit. Golden numerics, which do not round, always use full precision.
    packed_kv: bool = True
    # Where the routed experts live: device (with the rest of the model) or host (CPU memory at their stored
    # precision, computed there by the host-expert kernel; a GPU holds everything else). docs/numerics.md
    # says how far its summation order lies from the reference's.
    experts_on: str = "device"
    # How the FP8/FP4 Linears other than the routed experts are computed on the CPU: fp32 (from an exact fp32
    # copy of the weight, made once and kept: 4 bytes a weight) or stored (from the stored bytes by the
    # host-expert kernel, no copy: a quarter of the memory and of the bytes a decode step reads, the kernel's
    # summation order; goes with experts_on host). docs/numerics.md states its distance.
    cpu_linears: str = "fp32"

    def __post_init__(self):
        """The one place RuntimeOptions are validated, whichever way they are made: every field's value and
        the combinations that exclude each other (what depends on the device is kernels.check_device's)."""
        for name, allowed, what in _CHOICES:
            value = getattr(self, name)
            if value not in allowed:
                raise ConfigError(f"unknown {what} {value!r} (expected one of {', '.join(allowed)})")
        if self.kernel_backend == "tilelang" and self.order == "invariant":
            raise ConfigError("--numerics invariant runs the torch kernels: drop --kernel-backend tilelang")
        if self.kernel_backend == "tilelang" and self.golden:
            raise ConfigError("--kernel-backend tilelang does not run golden numerics (fp32, no "
                              "quantization): use --kernel-backend torch")
        if self.experts_on == "host" and (self.golden or self.order == "invariant"):
            raise ConfigError(f"--experts-on host sums the routed experts in the host kernel's order, with "
                              f"the reference's rounding points: not with --numerics "
                              f"{'golden' if self.golden else 'invariant'}")
        if self.cpu_linears == "stored" and self.experts_on != "host":
            raise ConfigError("--cpu-linears stored computes the other Linears as --experts-on host computes "
                              "the routed experts, and goes with it")

    @classmethod
    def from_profile(cls, numerics: str = "reference", **kw) -> "RuntimeOptions":
        """`numerics`: words joined by commas, at most one per axis (docs/numerics.md §15):
        rounding points `reference` (default) or `golden`; `fixed` (the stale-index-key fix); summation
        order `exact`, `fast` or `invariant` (default: exact on CPU, fast on CUDA). E.g. "fixed,invariant".
        `kw`: the other fields."""
        words = [w.strip() for w in numerics.split(",") if w.strip()] or ["reference"]
        unknown = [w for w in words if w not in NUMERICS_WORDS]
        if unknown:
            raise ConfigError(f"unknown --numerics word {unknown[0]!r} (expected words from "
                              f"{', '.join(NUMERICS_WORDS)}, joined by commas)")
        rounding = [w for w in words if w in ("reference", "golden")]
        order = [w for w in words if w in ("exact", "fast", "invariant")]
        if len(rounding) > 1 or len(order) > 1:
            clash = rounding if len(rounding) > 1 else order
            raise ConfigError(f"--numerics {numerics}: {' and '.join(clash)} exclude each other")
        if order:
            kw["order"] = order[0]
        # Which of several exactly tied top-k entries torch keeps depends on the tensor's shape: the invariant
        # order breaks ties by the lowest index, or chunking and batching would move its bits.
        kw["deterministic_topk"] = kw.get("deterministic_topk", False) or kw.get("order") == "invariant"
        kw["fix_index_k_publish"] = kw.get("fix_index_k_publish", False) or "fixed" in words
        kw["golden"] = kw.get("golden", False) or "golden" in words
        return cls(**kw)


# HF root config -> reference keys (docs/checkpoint.md §1.4).
_HF_TEXT_MAP = {
    "vocab_size": "vocab_size", "hidden_size": "dim", "moe_intermediate_size": "moe_inter_dim",
    "num_hidden_layers": "n_layers", "num_nextn_predict_layers": "n_mtp_layers",
    "num_attention_heads": "n_heads", "head_dim": "head_dim", "qk_rope_head_dim": "rope_head_dim",
    "q_lora_rank": "q_lora_rank", "o_groups": "o_groups", "o_lora_rank": "o_lora_rank",
    "rms_norm_eps": "norm_eps", "n_routed_experts": "n_routed_experts",
    "n_shared_experts": "n_shared_experts", "num_experts_per_tok": "n_activated_experts",
    "scoring_func": "score_func", "routed_scaling_factor": "route_scale", "norm_topk_prob": "norm_topk_prob",
    "swiglu_limit": "swiglu_limit", "sliding_window": "window_size", "compress_ratios": "compress_ratios",
    "compress_rope_theta": "compress_rope_theta", "kv_source_layer_ids": "kv_source_layers",
    "index_source_layer_ids": "index_source_layers", "index_n_heads": "index_n_heads",
    "index_head_dim": "index_head_dim", "index_topk": "index_topk",
    "candidate_source_layer_id": "candidate_source_layer", "candidate_topk_blocks": "candidate_topk_blocks",
    "candidate_block_size": "candidate_block_size", "rope_theta": "rope_theta", "hc_mult": "hc_mult",
    "hc_sinkhorn_iters": "hc_sinkhorn_iters", "hc_eps": "hc_eps", "engram_layer_ids": "engram_layer_ids",
    "engram_num_embeddings": "engram_num_embeddings", "engram_max_ngram_size": "engram_max_ngram_size",
    "engram_vocab_size": "engram_vocab_size", "engram_n_heads": "engram_n_heads",
    "engram_head_dim": "engram_head_dim", "engram_compressed_vocab_size": "engram_compressed_vocab_size",
    "engram_pad_token_id": "engram_pad_id", "dspark_block_size": "dspark_block_size",
    "dspark_noise_token_id": "dspark_noise_token_id", "dspark_target_layer_ids": "dspark_target_layer_ids",
    "dspark_markov_rank": "dspark_markov_rank", "dspark_n_routed_experts": "dspark_n_routed_experts",
    "dspark_num_experts_per_tok": "dspark_n_activated_experts",
}
_HF_VISION_MAP = {
    "num_hidden_layers": "vision_n_layers", "hidden_size": "vision_dim",
    "num_attention_heads": "vision_n_heads", "intermediate_size": "vision_inter_dim",
    "patch_size": "vision_patch_size", "rope_theta": "vision_rope_theta",
    "downsample_ratio": "vision_downsample_ratio", "max_image_tokens": "vision_max_n_token",
    "min_pixels": "vision_min_pixels", "max_wh_ratio": "vision_max_wh_ratio",
}


def hf_to_reference(hf: dict) -> dict:
    if hf.get("model_type") != "deepseek_v41":  # exact comparison: "deepseek_v4" must not match
        raise ConfigError(f"unsupported model_type {hf.get('model_type')!r} (expected 'deepseek_v41')")
    text, vision = hf.get("text_config", {}), hf.get("vision_config") or {}
    out = {ref: text[k] for k, ref in _HF_TEXT_MAP.items() if k in text}
    if "candidate_source_layer_id" not in text:
        out["candidate_source_layer"] = -1
    rs = text.get("rope_scaling") or {}
    if rs:
        out["original_seq_len"] = rs.get("original_max_position_embeddings", 0)
        out["rope_factor"] = rs.get("factor", 1)
        out["beta_fast"] = rs.get("beta_fast", 32)
        out["beta_slow"] = rs.get("beta_slow", 1)
    else:
        out["original_seq_len"] = 0
    out.update({ref: vision[k] for k, ref in _HF_VISION_MAP.items() if k in vision})
    if not vision:
        out["vision_n_layers"] = 0
    if "image_token_id" in hf:
        out["image_token_id"] = hf["image_token_id"]
    q = hf.get("quantization_config") or {}
    out["dtype"] = "fp8" if q.get("quant_method") == "fp8" else "bf16"
    out["expert_dtype"] = q.get("expert_dtype") if q else None
    return out
