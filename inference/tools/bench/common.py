"""What several bench subcommands share: the repository's root, the two random models (tiny, large) of
`models` that `offload` builds on, a synthetic checkpoint converted by convert.py and cached, and evicting
files from the page cache."""
import os
import subprocess
import sys

from ...config import ModelArgs
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


def make_args(name: str, max_seq_len: int) -> ModelArgs:
    cfg = dict(MODELS[name])
    if cfg["engram_num_embeddings"] is None:      # the sums of the first primes above engram_vocab_size
        cfg["engram_num_embeddings"] = engram_table_sizes(ModelArgs(**dict(cfg, engram_num_embeddings=[])))
    return ModelArgs.from_dict(cfg, max_seq_len=max_seq_len, max_batch_size=1, temperature=0.0)


def synthetic_checkpoint(name: str, args: ModelArgs, workdir: str, shards: int, log=None) -> str:
    """Synthetic HF checkpoint (workdir/NAME-hf) -> convert.py at MP 1 (workdir/NAME-mp1); returns the
    converted directory. Both are cached: a converted checkpoint there is used as it is, and an HF one
    written before is converted without being written again. `log` is told before anything is written."""
    hf, ckpt = os.path.join(workdir, f"{name}-hf"), os.path.join(workdir, f"{name}-mp1")
    if os.path.exists(os.path.join(ckpt, "model0-mp1.safetensors")):
        return ckpt
    if log is not None:
        log(f"writing the synthetic checkpoint {hf} (once) ...")
    if not os.path.exists(os.path.join(hf, "model.safetensors.index.json")):
        write_synthetic_checkpoint(args, hf, seed=0, shards=shards)
    # convert.py as a user runs it (a tool never imports a CLI)
    subprocess.run([sys.executable, os.path.join(ROOT, "convert.py"), "--hf-ckpt-path", hf, "--save-path",
                    ckpt, "--model-parallel", "1"], check=True, stdout=subprocess.DEVNULL)
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
