"""--cuda-graph (inference/engine/cuda_graph.py): what can be proved without a GPU. The step a graph captures
(a decode step at a tensor position, reading a length bucket under a mask) gives the eager decode step's bits
in the exact, fast and invariant orders, across the window, the compression groups, parities and buckets,
with the top-k and the candidate blocks binding; it reads no position on the host (its integer start_pos is
a sentinel no layer may use). On a CPU the option is one line. Capture and replay themselves are the device
check's `cudagraph` phase."""
import json
import os

import pytest
import torch

from conftest import FIXTURE, ROOT, fixture_file, fixture_model
from test_generate import assert_clean_error, run_cli

from inference.config import RuntimeOptions
from inference.engine.cuda_graph import GraphedDecode, bucket
from inference.engine.errors import InputError
from inference.state import DecodeStep

PROMPT, LAST = 58, 74        # decode steps at 58..73: the 64-token window, buckets 64 and 128, both parities


@pytest.fixture(scope="module")
def seqs():
    with open(fixture_file(os.path.join(FIXTURE, "score.json"))) as f:
        seq = json.load(f)["sequences"][0]
    return torch.tensor([seq[:LAST], seq[7:LAST + 7]])


@pytest.mark.parametrize("numerics", ["reference", "fast", "invariant"])
def test_the_captured_step_gives_the_eager_steps_bits(numerics, seqs):
    opts = RuntimeOptions.from_profile(numerics, deterministic_topk=True)       # --cuda-graph implies it
    model = fixture_model(opts, max_batch_size=2, index_topk=16,
                          candidate_topk_blocks=4)       # both levels of the indexer bind from position 64
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runs = []
        for graphed in (False, True):
            model.reset()
            model.prefill(seqs[:, :PROMPT])
            steps = []
            with torch.inference_mode():
                for p in range(PROMPT, LAST):
                    ids = seqs[:, p:p + 1]
                    if graphed:
                        length = bucket(p, model.args.max_seq_len, minimum=32)
                        step = DecodeStep(torch.tensor(p), p % 2, length)
                        steps.append(model.decode(ids, step).logits)       # no int position to read
                    else:
                        steps.append(model.decode(ids, p).logits)
            runs.append(torch.stack(steps))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(runs[1], runs[0])


def test_buckets():
    assert [bucket(p, 4096) for p in (0, 255, 256, 1000, 4095)] == [256, 256, 512, 1024, 4096]
    assert bucket(5000, 4096) == 4096 and bucket(40, 96, minimum=32) == 64


def test_cuda_graph_on_a_cpu_is_one_line(tmp_path):
    proc = run_cli(["--ckpt-path", FIXTURE, "--config", os.path.join(FIXTURE, "config.json"),
                    "--device", "cpu", "--input-file", os.path.join(ROOT, "demo", "prompts.txt"),
                    "--cuda-graph"])
    assert_clean_error(proc, "--cuda-graph: CUDA graphs need a CUDA device, not cpu")
    with pytest.raises(InputError, match="needs --deterministic-topk"):
        GraphedDecode(fixture_model())
    with pytest.raises(InputError, match="need a CUDA device, not cpu"):
        GraphedDecode(fixture_model(RuntimeOptions(deterministic_topk=True)))
