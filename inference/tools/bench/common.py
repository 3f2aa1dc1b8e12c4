"""What several bench subcommands share: the repository's root, the random models of `models` (tiny, large,
and the released widths with a mix of the released layer kinds) that `offload` builds on, a synthetic
checkpoint converted by convert.py and cached, a model built from it, warmed up and timed by module kind, and
evicting files from the page cache."""
import json
import os
import shutil
import subprocess
import sys
import time

import torch

from ...config import ModelArgs, RuntimeOptions
from ..synthetic import engram_table_sizes, write_synthetic_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# A model shaped like tests/fixtures/reference-tiny (every layer role), with the real vocabulary.
TINY = dict(vocab_size=129280, dim=256, n_layers=8, n_mtp_layers=2, n_heads=4, head_dim=128, rope_head_dim=32,
            q_lora_rank=128, o_groups=2, o_lora_rank=64, moe_inter_dim=128, n_routed_experts=8,
            n_activated_experts=3, window_size=64, compress_ratios=[0, 2, 2, 1, 1, 1, 1, 1, 0, 0],
            kv_source_layers=[1, 3], index_source_layers=[1, 3, 5, 7], candidate_source_layer=3,
            index_n_heads=16, index_head_dim=64, index_topk=512, candidate_topk_blocks=64,
            candidate_block_size=8, engram_layer_ids=[0, 1], engram_vocab_size=1000, engram_n_heads=2,
            engram_head_dim=32, engram_num_embeddings=[6126, 6332], engram_compressed_vocab_size=99092,
            dspark_block_size=5, dspark_noise_token_id=128799, dspark_target_layer_ids=[5, 6, 7],
            dspark_markov_rank=64, dspark_n_routed_experts=4, dspark_n_activated_experts=2)
# A larger one: released head geometry, width 1024, 8 layers, 32 experts.
LARGE = dict(TINY, dim=1024, n_heads=8, head_dim=512, rope_head_dim=64, q_lora_rank=512, o_groups=4,
             o_lora_rank=512, moe_inter_dim=512, n_routed_experts=32, n_activated_experts=6, window_size=128,
             index_n_heads=32, index_head_dim=128, candidate_topk_blocks=2048, engram_head_dim=256,
             engram_n_heads=8, engram_num_embeddings=None, dspark_markov_rank=256, dspark_n_routed_experts=8)
MODELS = {"tiny": TINY, "large": LARGE}

# The released model's layer kinds, each by what its attention computes and owns (config.json: layers 0-1 keep
# a window only; 2-19 compress by 2, of which 2, 8 and 14 write the compressed KV and the index keys; 20-39 by
# 1, of which 20 writes them and picks the candidate blocks and 24, 28, 32, 36 score their own index queries;
# Engram sits in layers 1 and 14): (name, ratio, KV source, index source, candidate source), and how many
# layers of each the released 40 hold. Engram is timed as a module of its own (RELEASED_ENGRAM layers).
LAYER_KINDS = (("window", 0, False, False, False, 2),
               ("ratio-2 source", 2, True, True, False, 3),
               ("ratio-2", 2, False, False, False, 15),
               ("ratio-1 source", 1, True, True, True, 1),
               ("ratio-1 index source", 1, False, True, False, 4),
               ("ratio-1", 1, False, False, False, 15))
RELEASED_ENGRAM = 2
# Config keys tied to the tokenizer a synthetic checkpoint carries (the real one): --widths leaves them be.
TOKENIZER_KEYS = ("vocab_size", "engram_compressed_vocab_size", "engram_pad_id", "dspark_noise_token_id",
                  "image_token_id")
MIN_RELEASED_LAYERS = len(LAYER_KINDS) + 1       # one layer of each kind, and a window layer for Engram


def released_kinds(n_layers: int):
    """The layer kinds of a `released` bench model of n_layers (>= MIN_RELEASED_LAYERS), in layer order: one
    of each kind, layer 1 a window layer with Engram, the layers beyond the minimum alternately ratio-2 and
    ratio-1 sharers (each after the sources of its ratio)."""
    if n_layers < MIN_RELEASED_LAYERS:
        raise ValueError(f"--layers {n_layers}: the released mix needs at least {MIN_RELEASED_LAYERS} layers "
                         f"(one of each kind: {', '.join(k[0] for k in LAYER_KINDS)}; Engram in a second "
                         f"window layer)")
    extra = n_layers - MIN_RELEASED_LAYERS
    two, one = (extra + 1) // 2, extra // 2
    names = ["window", "window", "ratio-2 source"] + ["ratio-2"] * (1 + two) + \
        ["ratio-1 source", "ratio-1 index source"] + ["ratio-1"] * (1 + one)
    return names


def released_config(widths: str = None) -> dict:
    """The released config.json, with another flat config's values over it (`widths`; its keys tied to the
    tokenizer aside: a synthetic checkpoint carries the real one)."""
    with open(os.path.join(ROOT, "config.json")) as f:
        cfg = json.load(f)
    if widths is not None:
        with open(widths) as f:
            cfg.update({k: v for k, v in json.load(f).items() if k not in TOKENIZER_KEYS})
    return cfg


def released_args(n_layers: int, n_experts: int, max_seq_len: int, max_batch_size: int,
                  engram_vocab_size: int = 20000, config: str = None) -> ModelArgs:
    """The released config.json's widths (dim 5120, 64 heads of 512, the LoRA ranks, 8 output groups, experts
    of 2304 with top-6, the indexer's 32 heads of 128, Engram's 8 heads of 256) on n_layers in the released
    mix (released_kinds), n_experts routed experts a layer, Engram in layer 1 with tables for a vocabulary of
    engram_vocab_size (the released 16M would be 189 GiB), one DSpark stage (up to 16 routed experts) reading
    the last three layers, no vision tower. `config`: another flat config's widths (released_config)."""
    cfg = released_config(config)
    kinds = {k[0]: k for k in LAYER_KINDS}
    names = released_kinds(n_layers)
    ratios = [kinds[n][1] for n in names]
    cfg.update(n_layers=n_layers, n_mtp_layers=1, compress_ratios=ratios + [0],
               kv_source_layers=[i for i, n in enumerate(names) if kinds[n][2]],
               index_source_layers=[i for i, n in enumerate(names) if kinds[n][3]],
               candidate_source_layer=next(i for i, n in enumerate(names) if kinds[n][4]),
               engram_layer_ids=[1], engram_vocab_size=engram_vocab_size, engram_num_embeddings=[],
               n_routed_experts=n_experts, dspark_n_routed_experts=min(n_experts, 16),
               dspark_target_layer_ids=list(range(n_layers - 3, n_layers)), vision_n_layers=0)
    cfg["engram_num_embeddings"] = engram_table_sizes(ModelArgs(**cfg))
    return ModelArgs.from_dict(cfg, max_seq_len=max_seq_len, max_batch_size=max_batch_size, temperature=0.0)


def make_args(name: str, max_seq_len: int) -> ModelArgs:
    cfg = dict(MODELS[name])
    if cfg["engram_num_embeddings"] is None:      # the sums of the first primes above engram_vocab_size
        cfg["engram_num_embeddings"] = engram_table_sizes(ModelArgs(**dict(cfg, engram_num_embeddings=[])))
    return ModelArgs.from_dict(cfg, max_seq_len=max_seq_len, max_batch_size=1, temperature=0.0)


def synthetic_checkpoint(name: str, args: ModelArgs, workdir: str, shards: int, log=None, workers: int = 1,
                         keep_hf: bool = True) -> str:
    """Synthetic HF checkpoint (workdir/NAME-hf) -> convert.py at MP 1 (workdir/NAME-mp1); returns the
    converted directory. Both are cached: a converted checkpoint there is used as it is, and an HF one
    written before is converted without being written again (`keep_hf` False: deleted once converted, for the
    large ones). `log` is told before anything is written; `workers` processes write the shards."""
    hf, ckpt = os.path.join(workdir, f"{name}-hf"), os.path.join(workdir, f"{name}-mp1")
    if os.path.exists(os.path.join(ckpt, "model0-mp1.safetensors")):
        return ckpt
    if log is not None:
        log(f"writing the synthetic checkpoint {hf} (once) ...")
    if not os.path.exists(os.path.join(hf, "model.safetensors.index.json")):
        write_synthetic_checkpoint(args, hf, seed=0, shards=shards, workers=workers)
    # convert.py as a user runs it (a tool never imports a CLI)
    subprocess.run([sys.executable, os.path.join(ROOT, "convert.py"), "--hf-ckpt-path", hf, "--save-path",
                    ckpt, "--model-parallel", "1"], check=True, stdout=subprocess.DEVNULL)
    if not keep_hf:
        shutil.rmtree(hf, ignore_errors=True)
    return ckpt


def drop_cache(paths) -> None:
    # Evict the files from the page cache so that the next reader hits the disk.
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# ---- a model of `models` built, warmed and timed by module kind ----

def build(name: str, args: ModelArgs, workdir: str, device: str, opts: RuntimeOptions = None, large=False):
    """Synthetic HF checkpoint -> convert.py at MP 1 -> Transformer (all cached in workdir). `large`: shards
    written by a process per core, the HF copy deleted once converted."""
    from encoding.tokenizer import load_tokenizer
    from ...engine.checkpoint import load_checkpoint
    from ...model import Transformer
    say = (lambda m: print(m, file=sys.stderr, flush=True)) if large else None      # (stdout may be JSON)
    ckpt = synthetic_checkpoint(name, args, workdir, shards=8 if large else 2, workers=os.cpu_count() or 1
                                if large else 1, keep_hf=not large, log=say)
    model = Transformer(args, opts=opts, device=device, tokenizer=load_tokenizer(ckpt))
    load_checkpoint(model, ckpt)
    return model


WARM_UP = 64


def warm_up(model, gen: torch.Generator) -> float:
    """A short prefill and a decode step before anything is timed -> their seconds: the first call builds
    what the numerics derive from the weights once (dequantized copies, packed layouts), a cost of the
    model's first prompt, not of a prefill's length."""
    model.reset()
    ids = torch.randint(3, model.args.vocab_size, (1, WARM_UP + 1), generator=gen).to(model.ctx.device)
    t = time.perf_counter()
    model.prefill(ids[:, :WARM_UP])
    model.decode(ids[:, WARM_UP:], WARM_UP)
    return time.perf_counter() - t


class KindTimer:
    """Wall seconds per module kind (launches.module_kind: attention, indexer, gate, routed experts, ...),
    each second charged to the innermost module of a kind that runs then ("other": outside all, the call's
    set-up and the head's sampling). `kinds` is the stack launches.attribute keeps."""

    def __init__(self):
        timer = self

        class Kinds(list):
            def append(self, kind):
                timer.switch()
                super().append(kind)

            def pop(self):
                timer.switch()
                return super().pop()
        self.kinds, self.seconds, self.mark = Kinds(), {}, time.perf_counter()

    def restart(self) -> None:
        """Time from now (what ran before is nobody's)."""
        self.seconds, self.mark = {}, time.perf_counter()

    def switch(self) -> None:
        now = time.perf_counter()
        kind = self.kinds[-1] if self.kinds else "other"
        self.seconds[kind] = self.seconds.get(kind, 0.0) + now - self.mark
        self.mark = now

    def shares(self) -> str:
        total = sum(self.seconds.values()) or 1.0
        rows = sorted(self.seconds.items(), key=lambda kv: -kv[1])
        return ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in rows if v / total >= 0.005)
