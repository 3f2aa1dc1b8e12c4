"""generate.py (docs/cli.md §2): the generate loop, completion parsing, and the CLI end to end (batch files,
JSONL output, interactive sessions under 2 ranks, early errors, scoring mode): MP 2 under torchrun, MP 1 as
generate.main in the test's process (run_in_process; one run in a process of its own)."""
import io
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import FIXTURE, ROOT, TOKENIZER_CONFIG, fixture_file
import convert
import ranks

from inference.engine import generation, prompts
from inference.engine.batch import Budget, PromptBatch
from inference.engine.errors import InputError
from encoding import IMAGE_PLACEHOLDER, encode_messages, parse_tagged_text
from encoding.tokenizer import load_tokenizer

GENERATE = os.path.join(ROOT, "generate.py")
TIMEOUT = 180   # seconds per subprocess: an error that hangs a rank fails the test instead of the suite


# ---------------------------------------------------------------------------------------------------------
# In-process: the generate loop with a scripted model, and the parse fallback
# ---------------------------------------------------------------------------------------------------------

class ScriptedModel(torch.nn.Module):
    """Its logits pick next id = 100 + position for every row (greedy), except `eos_at` {row: position};
    records calls (start position, ids, images, token types)."""

    def __init__(self, max_seq_len=64, eos_at=None):
        super().__init__()
        self.args = type("Args", (), {"max_seq_len": max_seq_len, "temperature": 0.0})()
        self.nx = None                                    # greedy: the engine's argmax needs no numerics
        self.dummy = torch.nn.Parameter(torch.zeros(1))
        self.eos_at, self.calls = eos_at or {}, []

    def prefill(self, ids, start=0, images=None, token_types=None, all_logits=False):
        types = None if token_types is None else token_types.tolist()
        return self._call(ids, start, images, types)

    def decode(self, ids, pos):
        return self._call(ids, pos, None, None)

    def _call(self, ids, start_pos, images, types):
        from inference.model import Output
        self.calls.append((start_pos, ids.tolist(), images, types))
        pos = start_pos + ids.shape[1]   # the position being predicted
        nxt = torch.full((ids.shape[0],), 100 + pos, dtype=torch.long)
        for row, p in self.eos_at.items():
            if p == pos:
                nxt[row] = 1
        return Output(torch.nn.functional.one_hot(nxt, 256).float(), None)


def test_generate_loop_right_padding_teacher_forcing_and_eos():
    model = ScriptedModel(eos_at={1: 7})
    completions, reasons = generation.generate(model, PromptBatch([[5, 6, 7], [5, 6, 7, 8, 9]]), Budget(4, 1))
    # Prefill = the shortest prompt; then one token per call, starting where the previous call ended.
    assert model.calls[0][:2] == (0, [[5, 6, 7], [5, 6, 7]])
    assert [(c[0], len(c[1][0])) for c in model.calls[1:]] == [(3, 1), (4, 1), (5, 1), (6, 1), (7, 1)]
    # Row 1 is still inside its prompt at positions 3 and 4: it is fed its own tokens there.
    assert [c[1][1][0] for c in model.calls[1:3]] == [8, 9]
    assert completions == [[103, 104, 105, 106], [105, 106]]
    assert reasons == ["length", "eos"]


def test_generate_loop_stops_when_all_rows_finished_and_respects_max_seq_len():
    model = ScriptedModel(eos_at={0: 4})
    completions, reasons = generation.generate(model, PromptBatch([[5, 6, 7]]), Budget(50, 1))
    assert completions == [[103]] and reasons == ["eos"] and len(model.calls) == 2
    model = ScriptedModel(max_seq_len=6)
    completions, reasons = generation.generate(model, PromptBatch([[5, 6, 7]]), Budget(50, 1))
    assert completions == [[103, 104, 105]] and reasons == ["length"]
    with pytest.raises(InputError, match=r"Prompt length exceeds model maximum sequence length "
                                                r"\(max_seq_len=6\)"):
        generation.generate(model, PromptBatch([[5] * 7]), Budget(1, 1))


def test_generate_loop_passes_images_only_to_the_prefill():
    model = ScriptedModel()
    images = [["image-0"]]
    generation.generate(model, PromptBatch([[5, 6, 7, 8]], [[-1, 0, 3, -1]], images), Budget(2, 1))
    assert model.calls[0][2] is images and model.calls[0][3] == [[-1, 0, 3, -1]]
    assert all(c[2] is None and c[3] is None for c in model.calls[1:])
    with pytest.raises(InputError, match="prefill chunk"):
        generation.generate(ScriptedModel(),
                            PromptBatch([[5, 6], [5, 6, 7, 8]], [[-1, -1], [-1, 0, 1, 3]], [[], ["x"]]),
                            Budget(2, 1))


def test_parse_completion_reappends_eos_and_falls_back_to_raw_text():
    msg, problem = prompts.parse_completion("Hello.", "eos", "chat")
    assert problem is None and msg["content"] == "Hello." and msg["tool_calls"] == []
    msg, problem = prompts.parse_completion("Let me think</think>Yes.", "eos", "thinking")
    assert problem is None and (msg["reasoning_content"], msg["content"]) == ("Let me think", "Yes.")
    calls = ('\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n'
             '<｜DSML｜ parameter name="x" string="true">1'
             '</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>')
    msg, problem = prompts.parse_completion("ok" + calls, "eos", "chat")
    assert problem is None and msg["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"x": "1"}'}
    # Budget exhausted: raw text kept, split at the first </think> in thinking mode.
    msg, problem = prompts.parse_completion("a</think>b</think>c", "length", "thinking")
    assert problem and (msg["reasoning_content"], msg["content"]) == ("a", "b</think>c")
    msg, problem = prompts.parse_completion("still thinking", "length", "thinking")
    assert problem and (msg["reasoning_content"], msg["content"]) == ("still thinking", "")
    msg, problem = prompts.parse_completion("x</think>y", "eos", "chat")     # </think> in chat: parse error
    assert "does not parse" in problem and msg["content"] == "x</think>y"


# ---------------------------------------------------------------------------------------------------------
# The CLI on a tiny converted checkpoint (one per session)
# ---------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """Tiny random-weight model converted at MP 1 and MP 2: the fixture's config and small tokenizer."""
    from inference.config import ModelArgs
    from inference.tools.synthetic import write_synthetic_checkpoint

    root = tmp_path_factory.mktemp("tiny")
    with open(fixture_file(os.path.join(FIXTURE, "config.json"))) as f:
        config = json.load(f)
    tok_dir = root / "tok"
    tok_dir.mkdir()
    shutil.copy(os.path.join(FIXTURE, "tokenizer.json"), tok_dir / "tokenizer.json")
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, ensure_ascii=False))
    for runtime_key in ("max_batch_size", "temperature"):
        config.pop(runtime_key, None)
    config["max_seq_len"] = 512
    cfg = root / "config.json"
    cfg.write_text(json.dumps(config, indent=1))

    hf = root / "hf"
    write_synthetic_checkpoint(ModelArgs.from_dict(config), str(hf), seed=3, shards=2,
                               tokenizer_dir=str(tok_dir))
    dirs = {}
    for mp in (1, 2):
        dirs[mp] = root / f"mp{mp}"
        convert.convert(str(hf), str(dirs[mp]), mp, workers=1, progress=False, log=lambda *_: None)
    return {"config": str(cfg), "mp": {k: str(v) for k, v in dirs.items()}, "root": root,
            "vocab": config["vocab_size"]}


def run_cli(args, nproc=1, stdin=None, timeout=TIMEOUT, own_process=False, torchrun=False):
    """generate.py with `args`: at MP 1 in this process (generate.main, see run_in_process) unless
    `own_process`; at MP 2 and above as ranks forked with torchrun's environment (tests/ranks.py), or under
    torchrun itself with `torchrun`."""
    if nproc == 1 and not own_process:
        return run_in_process(args, stdin)
    if nproc > 1 and not torchrun:
        return ranks.run_generate(args, nproc, stdin=stdin, timeout=timeout)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    if nproc == 1:   # one thread: several threads on a busy 2-core machine are many times slower
        cmd = [sys.executable, GENERATE, *([] if "--threads" in args else ["--threads", "1"]), *args]
    else:   # --standalone picks a free rendezvous port
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               GENERATE, *args]
    return subprocess.run(cmd, input=stdin, stdin=None if stdin is not None else subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def run_in_process(args, stdin=None):
    """What `python generate.py --threads 1 ARGS` prints and returns, run as generate.main(ARGS) here: a new
    interpreter's imports (2-3 s a run) spared. Standard streams are swapped for the call; an exception
    main() lets out is printed as the interpreter would (a traceback, exit status 1); the torch thread count
    and RNG state the call sets are put back."""
    out, err = io.StringIO(), io.StringIO()
    threads, rng = torch.get_num_threads(), torch.get_rng_state()
    streams = sys.stdin, sys.stdout, sys.stderr
    sys.stdin, sys.stdout, sys.stderr = io.StringIO(stdin or ""), out, err
    try:
        code = ranks.call_main([*([] if "--threads" in args else ["--threads", "1"]), *args])
    finally:
        sys.stdin, sys.stdout, sys.stderr = streams
        torch.set_num_threads(threads)
        torch.set_rng_state(rng)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def base_args(tiny, mp=1):
    return ["--ckpt-path", tiny["mp"][mp], "--config", tiny["config"], "--device", "cpu"]


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def assert_clean_error(proc, message):
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert any("error: " in line and message in line for line in proc.stderr.splitlines()), out
    # torchrun prints its own launcher traceback when a worker fails; ours must not print one.
    assert 'generate.py", line' not in out, out


PROMPTS = ["Hello! Who are you?", "Write a haiku about the sea.", "What is 17 * 23?"]


@pytest.fixture(scope="session")
def batch_run(tiny):
    """One batch run over a text file, shared by the tests that read its output."""
    root = tiny["root"]
    (root / "prompts.txt").write_text("\n\n".join(PROMPTS) + "\n\n\n", encoding="utf-8")
    out = root / "batch.jsonl"
    args = base_args(tiny) + ["--input-file", str(root / "prompts.txt"), "--max-new-tokens", "6",
                              "--max-batch-size", "2", "--output", str(out)]
    proc = run_cli(args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, read_jsonl(out), args


def test_batch_text_file(batch_run, tiny):
    proc, records, _ = batch_run
    assert [r["prompt"] for r in records] == PROMPTS           # chunks of 2 keep the input order
    tok = load_tokenizer(tiny["mp"][1])
    for prompt, r in zip(PROMPTS, records):
        expected = encode_messages([{"role": "user", "content": prompt}], "chat")
        assert r["prompt_tokens"] == len(tok.encode(expected, add_special_tokens=False).ids)
        assert r["finish_reason"] in ("eos", "length")
        assert 0 <= r["completion_tokens"] <= 6
        assert r["completion_tokens"] == 6 or r["finish_reason"] == "eos"
        assert set(r) >= {"completion", "content", "reasoning_content", "tool_calls", "parse_error"}
    # Output format: "Prompt: ..." / "Completion: ..." / blank line, in input order, then the statistics.
    lines = proc.stdout.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Prompt: ")]
    assert [lines[i] for i in starts] == [f"Prompt: {p}" for p in PROMPTS]
    for i, r in zip(starts, records):
        assert lines[i + 1] == f"Completion: {r['completion']}".split("\n")[0]
    assert "model ready" in proc.stdout
    assert "prefill:" in lines[-1] and "tokens/s" in lines[-1] and "decode:" in lines[-1]


def test_same_seed_gives_identical_output(batch_run):
    _, first, args = batch_run
    out = args[args.index("--output") + 1]
    rerun = out + ".again"
    args = list(args)
    args[args.index("--output") + 1] = rerun
    proc = run_cli(args + ["--temperature", "1.0"])
    assert proc.returncode == 0, proc.stderr
    assert read_jsonl(rerun) == first


def test_batch_json_cases_with_tools_and_thinking(tiny):
    out = tiny["root"] / "cases.jsonl"
    cases = os.path.join(ROOT, "demo", "cases.json")
    proc = run_cli(base_args(tiny) + ["--input-file", cases, "--max-new-tokens", "5", "--max-seq-len", "2048",
                                      "--max-batch-size", "1", "--output", str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = read_jsonl(out)
    with open(cases, encoding="utf-8") as f:
        raw = json.load(f)
    assert len(records) == len(raw) == 2
    # The printed prompt is the JSON of the messages, with the tools attached to the first message.
    tools_prompt = json.loads(records[0]["prompt"])
    assert tools_prompt[0]["tools"] == raw[0]["tools"] and tools_prompt[1:] == raw[0]["messages"][1:]
    assert f"Prompt: {records[0]['prompt']}" in proc.stdout
    thinking = records[1]
    if thinking["finish_reason"] == "length":   # raw text kept, split at the first </think>
        assert thinking["reasoning_content"] == thinking["completion"].partition("</think>")[0]
        if not thinking["content"]:
            assert "thinking used the whole --max-new-tokens budget" in proc.stderr


def test_interactive_two_ranks_with_clear_and_exit(tiny):
    out = tiny["root"] / "chat.jsonl"
    proc = run_cli(base_args(tiny, mp=2) + ["--interactive", "--max-new-tokens", "4", "--max-seq-len", "512",
                                            "--output", str(out)],
                   nproc=2, stdin="Hello\nAnd then?\n/clear\nNew topic\n/exit\nnever read\n",
                   torchrun=True)                   # stdin through torchrun to rank 0, as a user types it
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(">>> ") == 5
    records = read_jsonl(out)
    assert [r["prompt"] for r in records] == ["Hello", "And then?", "New topic"]
    tok = load_tokenizer(tiny["mp"][2])

    def n_tokens(text):
        prompt = encode_messages([{"role": "user", "content": text}], "chat")
        return len(tok.encode(prompt, add_special_tokens=False).ids)

    assert records[0]["prompt_tokens"] == n_tokens("Hello")
    assert records[1]["prompt_tokens"] > records[0]["prompt_tokens"] + n_tokens("And then?") - n_tokens("")
    assert records[2]["prompt_tokens"] == n_tokens("New topic")    # /clear emptied the conversation


def test_interactive_end_of_input_exits(tiny):
    proc = run_cli(base_args(tiny) + ["--interactive", "--max-new-tokens", "3", "--max-seq-len", "512"],
                   stdin="Hello\n")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(">>> ") == 2 and "error" not in proc.stderr


def test_wrong_world_size_for_shards(tiny):
    # One process on a checkpoint converted for two (test_missing_shard covers the two-rank exit).
    proc = run_cli(base_args(tiny, mp=2) + ["--input-file", os.path.join(ROOT, "demo", "prompts.txt")])
    assert_clean_error(proc, f"missing shard {tiny['mp'][2]}/model0-mp1.safetensors for world size 1")
    assert "launch with --nproc-per-node 2" in proc.stderr


def test_missing_shard(tiny):
    partial = tiny["root"] / "partial"
    partial.mkdir(exist_ok=True)
    for name in ("model0-mp2.safetensors", "tokenizer.json", "tokenizer_config.json"):
        target = partial / name
        if not target.exists():
            target.symlink_to(os.path.join(tiny["mp"][2], name))
    args = ["--ckpt-path", str(partial), "--config", tiny["config"], "--input-file",
            os.path.join(ROOT, "demo", "prompts.txt")]
    proc = run_cli(args, nproc=2, torchrun=True)        # the launcher users run, its exit path included
    assert_clean_error(proc, f"missing shard {partial}/model1-mp2.safetensors")


def test_prompt_longer_than_max_seq_len_stops_every_rank(tiny):
    # Found on rank 0 (which alone reads the input) and broadcast, so rank 1 does not wait forever.
    proc = run_cli(base_args(tiny, mp=2) + ["--input-file", os.path.join(ROOT, "demo", "prompts.txt"),
                                            "--max-seq-len", "8"], nproc=2)
    assert_clean_error(proc, "Prompt length exceeds model maximum sequence length (max_seq_len=8)")
    assert "build model" not in proc.stdout     # caught before the model is built


@pytest.mark.parametrize("case", ["no-mode", "effort", "tokenizer", "image", "input", "score-file",
                                  "dump-folder"])
def test_setup_errors(tiny, case):
    root = tiny["root"]
    args = base_args(tiny) + ["--input-file", os.path.join(ROOT, "demo", "prompts.txt")]
    if case == "no-mode":
        args, message = base_args(tiny), "Either input-file or interactive mode must be specified"
    elif case == "effort":
        args, message = args + ["--reasoning-effort", "xhigh"], "reasoning_effort must be an int in 1..100"
    elif case == "tokenizer":
        bare = root / "no_tokenizer"
        bare.mkdir(exist_ok=True)
        shard = bare / "model0-mp1.safetensors"
        if not shard.exists():
            shard.symlink_to(os.path.join(tiny["mp"][1], "model0-mp1.safetensors"))
        args[1], message = str(bare), f"tokenizer file not found: {bare}/tokenizer.json"
    elif case == "image":
        (root / "image.txt").write_text("Describe <image>cat.png</image> please", encoding="utf-8")
        args[-1], message = str(root / "image.txt"), "1 image(s) given, but this model has no vision tower"
    elif case == "input":
        args[-1], message = str(root / "missing.txt"), f"input file not found: {root / 'missing.txt'}"
    elif case == "dump-folder":    # checked before the model is built, not after the scoring
        (root / "ok_score.json").write_text('{"sequences": [[1, 2, 3]]}')
        args = base_args(tiny) + ["--score", str(root / "ok_score.json"),
                                  "--dump-logits", str(root / "no_such_folder" / "x.safetensors")]
        message = f"output folder does not exist: {root / 'no_such_folder'}"
    else:
        (root / "bad_score.json").write_text('{"sequences": [[1, 2, 3]], "prefill_len": 5}')
        args = base_args(tiny) + ["--score", str(root / "bad_score.json"),
                                  "--dump-logits", str(root / "x.safetensors")]
        message = "prefill_len must be an int in 1..3"
    proc = run_cli(args, own_process=case == "no-mode")   # one in a process of its own: generate.py's exit
    assert_clean_error(proc, message)
    assert "Traceback" not in proc.stderr
    assert "build model" not in proc.stdout


@pytest.fixture(scope="module")
def vision_tiny(tmp_path_factory):
    """The demo model with a one-block ViT that enlarges images to 10,000 pixels (not 544 x 544: a span of 14
    positions, not about 200), and the real tokenizer (it knows image_token_id 129264)."""
    from inference.config import ModelArgs
    from inference.tools.synthetic import write_synthetic_checkpoint

    root = tmp_path_factory.mktemp("vision_tiny")
    with open(os.path.join(ROOT, "demo", "config.json")) as f:
        config = json.load(f)
    config.update(vision_n_layers=1, vision_dim=64, vision_n_heads=4, vision_inter_dim=128,
                  vision_min_pixels=10_000)
    (root / "config.json").write_text(json.dumps(config))
    write_synthetic_checkpoint(ModelArgs.from_dict(config), str(root / "hf"), seed=5, shards=2)
    convert.convert(str(root / "hf"), str(root / "mp1"), 1, workers=1, progress=False, log=lambda *_: None)
    return root, config


def test_images_are_expanded_and_generated_one_at_a_time(vision_tiny):
    from PIL import Image
    from inference.config import ModelArgs
    from inference.vision import image_geometry

    root, config = vision_tiny
    Image.new("RGB", (100, 80), (200, 30, 30)).save(root / "red.png")
    prompts = [f"Describe <image>{root / 'red.png'}</image> briefly.", "No image here."]
    (root / "images.txt").write_text("\n\n".join(prompts), encoding="utf-8")
    args = ["--ckpt-path", str(root / "mp1"), "--config", str(root / "config.json"), "--device", "cpu"]
    out = root / "images.jsonl"
    proc = run_cli(args + ["--input-file", str(root / "images.txt"), "--max-new-tokens", "3",
                           "--output", str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = read_jsonl(out)
    assert [r["prompt"] for r in records] == prompts
    # The placeholder becomes the image's whole span: [START] + ([IMAGE] * w + [NEWLINE]) * h + [END].
    tok = load_tokenizer(str(root / "mp1"))
    text = encode_messages([{"role": "user", "content": parse_tagged_text(prompts[0])}], "chat")
    text = text.replace(IMAGE_PLACEHOLDER, tok.id_to_token(config["image_token_id"]))
    *_, n_llm_h, n_llm_w, _ = image_geometry(100, 80, ModelArgs.from_dict(config))
    span = n_llm_h * (n_llm_w + 1) + 2
    assert records[0]["prompt_tokens"] == len(tok.encode(text, add_special_tokens=False).ids) - 1 + span

    # An image token in the text without an image: the count check fails before the model is built.
    (root / "stray.txt").write_text("A stray <｜image2｜> token", encoding="utf-8")
    proc = run_cli(args + ["--input-file", str(root / "stray.txt")])
    assert_clean_error(proc, "image placeholder(s) (token id 129264) but 0 image(s) were given")
    assert "build model" not in proc.stdout


# ---------------------------------------------------------------------------------------------------------
# Scoring mode
# ---------------------------------------------------------------------------------------------------------

def assert_close_to_reference(ours, ref, max_tol, mean_tol):
    """Max and mean |Δ| within tolerance, and the same argmax wherever the reference's top-1/top-2
    margin exceeds twice our max |Δ| (docs/numerics.md §13.3; tests/fixtures/reference-tiny/README.md §8.3:
    step 18 has a margin of only 0.015)."""
    d = (ours - ref).abs()
    assert d.max() <= max_tol and d.mean() <= mean_tol, (d.max(), d.mean())
    top2 = ref.topk(2, dim=-1).values
    decided = (top2[..., 0] - top2[..., 1]) > 2 * d.max()
    assert torch.equal(ours.argmax(-1)[decided], ref.argmax(-1)[decided])
    return decided


@pytest.fixture(scope="module")
def fixture_w1(tmp_path_factory):
    fixture = fixture_file(FIXTURE)
    out = tmp_path_factory.mktemp("fixture_w1") / "logits.safetensors"
    proc = run_cli(["--ckpt-path", fixture, "--config", os.path.join(fixture, "config.json"),
                    "--device", "cpu", "--score", os.path.join(fixture, "score.json"),
                    "--dump-logits", str(out), "--all-prefill-logits"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return load_file(str(out)), load_file(os.path.join(fixture, "reference_logits.safetensors"))


def test_score_reproduces_reference_fixture(fixture_w1):
    ours, ref = fixture_w1
    assert torch.equal(ours["input_ids"], torch.cat([ref["prompt_ids"], ref["generated_ids"][:, :-1]], dim=1))
    assert ours["logits"].shape == ref["step_logits"].shape
    assert_close_to_reference(ours["logits"], ref["step_logits"], 0.25, 0.03)
    assert ours["prefill_logits"].shape == ref["prefill_all_logits"].shape
    decided = assert_close_to_reference(ours["prefill_logits"], ref["prefill_all_logits"], 0.25, 0.03)
    assert decided.sum() > 50


def test_score_two_ranks_on_fixture_weights(fixture_w1, tmp_path):
    """MP 2 through torchrun: the fixture's weights split as convert.py splits them."""
    from test_tensor_parallel import reshard
    ours_w1, ref = fixture_w1
    tensors = load_file(os.path.join(FIXTURE, "model0-mp1.safetensors"))
    from safetensors.torch import save_file
    for rank in range(2):
        save_file(reshard(tensors, 2, rank), str(tmp_path / f"model{rank}-mp2.safetensors"))
    shutil.copy(os.path.join(FIXTURE, "tokenizer.json"), tmp_path / "tokenizer.json")
    out = tmp_path / "logits.safetensors"
    proc = run_cli(["--ckpt-path", str(tmp_path), "--config", os.path.join(FIXTURE, "config.json"),
                    "--device", "cpu", "--score", os.path.join(FIXTURE, "score.json"),
                    "--dump-logits", str(out)], nproc=2)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ours_w2 = load_file(str(out))
    assert torch.equal(ours_w2["input_ids"], ours_w1["input_ids"])
    assert_close_to_reference(ours_w2["logits"], ref["step_logits"], 0.35, 0.05)
    d = (ours_w2["logits"] - ours_w1["logits"]).abs()
    assert d.max() <= 0.35 and d.mean() <= 0.05, (d.max(), d.mean())


def test_score_padding_and_mp1_vs_mp2_on_converted_checkpoint(tiny):
    g = torch.Generator().manual_seed(0)
    lens = [40, 33]
    seqs = [[0] + torch.randint(4, tiny["vocab"], (n - 1,), generator=g).tolist() for n in lens]
    spec = tiny["root"] / "score.json"
    spec.write_text(json.dumps({"sequences": seqs, "prefill_len": 30}))
    outs = {}
    for mp in (1, 2):
        outs[mp] = tiny["root"] / f"score_mp{mp}.safetensors"
        extra = ["--all-prefill-logits"] if mp == 1 else []
        proc = run_cli(base_args(tiny, mp) + ["--score", str(spec), "--dump-logits", str(outs[mp])] + extra,
                       nproc=mp)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    a, b = load_file(str(outs[1])), load_file(str(outs[2]))
    assert a["logits"].shape == (40 - 30 + 1, 2, tiny["vocab"])
    expected_ids = torch.full((2, 40), -1)
    for i, s in enumerate(seqs):
        expected_ids[i, :len(s)] = torch.tensor(s)
    assert torch.equal(a["input_ids"], expected_ids) and torch.equal(b["input_ids"], expected_ids)
    # Row 1 ends at 33: forwards past position 32 have no token of it, so its logits there are NaN.
    nan = a["logits"].isnan().all(-1)
    assert nan[:, 0].sum() == 0 and nan[4:, 1].all() and not nan[:4, 1].any()
    assert torch.equal(nan, b["logits"].isnan().all(-1))
    assert a["prefill_logits"].shape == (2, 30, tiny["vocab"])
    assert torch.allclose(a["prefill_logits"][:, -1], a["logits"][0], atol=1e-3)
    # W = 2 reduces bf16 partials in another order (docs/numerics.md §12): close, not equal
    d = (a["logits"][~nan] - b["logits"][~nan]).abs()
    assert d.max() <= 0.35 and d.mean() <= 0.05, (d.max(), d.mean())
