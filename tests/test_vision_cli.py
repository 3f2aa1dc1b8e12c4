"""generate.py with images, end to end on the demo model (vision tower on; docs/cli.md §2.8,
docs/architecture.md §10): batch (JSON image blocks, text files with <image>path</image>), interactive,
--score with messages, at MP 1 and MP 2, and the one-line errors (unreadable image, placeholder/image
count, image outside the prefill chunk, --language-model-only, a model without a vision tower)."""
import dataclasses
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT
import convert
from test_generate import ScriptedModel, assert_clean_error, read_jsonl, run_cli

from encoding import IMAGE_PLACEHOLDER, encode_case
from inference.engine import prompts, scoring
from inference.engine.errors import InputError


IMAGES = {name: os.path.join(ROOT, "demo", "images", f"{name}.png") for name in ("gradient", "stripes")}
QUESTION = ": which one has stripes?"
TAGGED = f"Compare <image>{IMAGES['gradient']}</image> and <image>{IMAGES['stripes']}</image>{QUESTION}"


def two_image_messages(first=IMAGES["gradient"], second=IMAGES["stripes"]):
    """The same user turn as TAGGED, written as OpenAI blocks (both block spellings the encoder accepts)."""
    return [{"role": "user", "content": [
        {"type": "text", "text": "Compare "},
        {"type": "image_url", "image_url": {"url": first}},
        {"type": "text", "text": " and "},
        {"type": "image", "source": second},
        {"type": "text", "text": QUESTION}]}]


# The demo model enlarges every image to at least 544 x 544 pixels (vision_min_pixels as released): 200 and
# 205 positions for the two small images. Here images are enlarged to 10,000 pixels only, so that the 40x200
# one still goes through the enlargement and the 160x96 one does not: 17 + 20 positions, a prompt of 53
# instead of 421, whose prefill is most of a run's time. What the tests prove does not depend on the size.
MIN_PIXELS = 10_000


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """demo/config.json (a 2-block ViT; images enlarged to MIN_PIXELS) as a random-weight checkpoint
    converted at MP 1 and MP 2."""
    from encoding.tokenizer import load_tokenizer
    from inference.config import ModelArgs
    from inference.tools.synthetic import write_synthetic_checkpoint

    root = tmp_path_factory.mktemp("vision_demo")
    with open(os.path.join(ROOT, "demo", "config.json"), encoding="utf-8") as f:
        data = json.load(f)
    data["vision_min_pixels"] = MIN_PIXELS
    config = str(root / "config.json")
    with open(config, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    margs = ModelArgs.from_file(config)
    assert margs.vision_n_layers > 0, "the demo model must have a vision tower"
    write_synthetic_checkpoint(margs, str(root / "hf"), seed=11, shards=2)
    mp = {}
    for w in (1, 2):
        mp[w] = str(root / f"mp{w}")
        convert.convert(str(root / "hf"), mp[w], w, workers=1, progress=False, log=lambda *_: None)
    return {"root": root, "config": config, "mp": mp, "margs": margs, "tok": load_tokenizer(mp[1])}


def cli_args(demo, mp=1):
    return ["--ckpt-path", demo["mp"][mp], "--config", demo["config"], "--device", "cpu", "--threads", "1"]


def expected_prompt_tokens(demo, messages):
    """The span formula of docs/architecture.md §10.2: text tokens with one placeholder per image, each
    placeholder replaced by its span of n_llm_h * (n_llm_w + 1) + 2 positions."""
    from PIL import Image
    from encoding import encode_messages
    from inference.vision import image_geometry

    text, data = encode_messages(messages, "chat", return_multi_modal_data=True)
    tok, margs = demo["tok"], demo["margs"]
    text = text.replace(IMAGE_PLACEHOLDER, tok.id_to_token(margs.image_token_id))
    n = len(tok.encode(text, add_special_tokens=False).ids) - len(data["images"])
    for record in data["images"]:
        with Image.open(record["url"] if "url" in record else record["source"]) as im:
            n += image_geometry(*im.size, margs)[-1]
    return n


# ---------------------------------------------------------------------------------------------------------
# Batch mode
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mp", [1, 2])
def test_batch_two_images(demo, mp):
    """MP 1 reads a JSON case with image blocks, MP 2 the same turn as a text file with <image> tags."""
    root = demo["root"]
    if mp == 1:
        src = root / "two_images.json"
        src.write_text(json.dumps([{"messages": two_image_messages()}]), encoding="utf-8")
    else:
        src = root / "two_images.txt"
        src.write_text(TAGGED + "\n", encoding="utf-8")
    out = root / f"batch_mp{mp}.jsonl"
    proc = run_cli(cli_args(demo, mp) + ["--input-file", str(src), "--max-new-tokens", "3",
                                         "--temperature", "0", "--output", str(out)], nproc=mp)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [record] = read_jsonl(out)
    assert record["prompt"] == (TAGGED if mp == 2 else json.dumps(two_image_messages(), ensure_ascii=False))
    assert f"Completion: {record['completion']}".split("\n")[0] in proc.stdout
    assert 1 <= record["completion_tokens"] <= 3
    # Both images expanded: here 17 + 20 span positions for the 160x96 and 40x200 images.
    assert record["prompt_tokens"] == expected_prompt_tokens(demo, two_image_messages()) > 37


# ---------------------------------------------------------------------------------------------------------
# Interactive mode
# ---------------------------------------------------------------------------------------------------------

def test_interactive_two_images_then_text(demo):
    """At MP 2 (rank 0 reads, both ranks run the turn; MP 1 is the same loop without the broadcast)."""
    root, mp = demo["root"], 2
    missing = root / "missing.png"
    out = root / f"chat_mp{mp}.jsonl"
    stdin = f"Look at <image>{missing}</image>\n{TAGGED}\nAnd now?\n/exit\n"
    proc = run_cli(cli_args(demo, mp) + ["--interactive", "--max-new-tokens", "3", "--max-seq-len", "1024",
                                         "--output", str(out)], nproc=mp, stdin=stdin)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(">>> ") == 4
    # The bad image: one error line, the turn is dropped, the session goes on.
    errors = [line for line in proc.stderr.splitlines() if "error: " in line]
    assert len(errors) == 1, proc.stderr
    assert "prompt: image 0 (" in errors[0] and "file not found" in errors[0], proc.stderr
    assert "the message was not added" in errors[0] and "Traceback" not in proc.stderr
    first, second = read_jsonl(out)
    assert [first["prompt"], second["prompt"]] == [TAGGED, "And now?"]
    assert first["prompt_tokens"] == expected_prompt_tokens(demo, two_image_messages())
    # The second turn re-encodes the whole conversation from position 0, images included.
    assert second["prompt_tokens"] > first["prompt_tokens"] + first["completion_tokens"]


# ---------------------------------------------------------------------------------------------------------
# Scoring mode
# ---------------------------------------------------------------------------------------------------------

COMPLETION = "The second."


@pytest.fixture(scope="module")
def scored(demo):
    """Two rows with the same ids: row 1's first image has the gradient's channels permuted."""
    from PIL import Image

    root = demo["root"]
    with Image.open(IMAGES["gradient"]) as im:
        r, g, b = im.convert("RGB").split()
        Image.merge("RGB", (b, r, g)).save(root / "permuted.png")
    prompt_ids, _, _ = prompts.tokenize_prompt(
        demo["tok"], demo["margs"], *encode_case({"messages": two_image_messages()}, "chat"), "test")
    spec = root / "score_images.json"
    spec.write_text(json.dumps({"sequences": [
        {"messages": two_image_messages(), "completion": COMPLETION},
        {"messages": two_image_messages(first=str(root / "permuted.png")), "completion": COMPLETION}],
        "prefill_len": len(prompt_ids)}))
    outs = {}
    for mp in (1, 2):
        path = root / f"score_mp{mp}.safetensors"
        proc = run_cli(cli_args(demo, mp) + ["--score", str(spec), "--dump-logits", str(path)], nproc=mp)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        outs[mp] = load_file(str(path))
    return outs, prompt_ids


def test_score_messages_with_images_mp1_vs_mp2(scored, demo):
    outs, prompt_ids = scored
    a, b = outs[1], outs[2]
    tail = demo["tok"].encode(COMPLETION, add_special_tokens=False).ids
    ids = torch.tensor([prompt_ids + tail] * 2)
    assert torch.equal(a["input_ids"], ids) and torch.equal(b["input_ids"], ids)
    assert a["logits"].shape == b["logits"].shape == (len(tail) + 1, 2, demo["margs"].vocab_size)
    assert not a["logits"].isnan().any() and not b["logits"].isnan().any()
    d = (a["logits"] - b["logits"]).abs()
    print(f"MP1 vs MP2 with images: max |d| {d.max():.4f}, mean |d| {d.mean():.5f}")
    assert d.max() <= 0.35 and d.mean() <= 0.05, (d.max(), d.mean())
    # The pixels reach the logits: same ids, different first image -> different logits (at both W).
    for out in (a, b):
        moved = (out["logits"][:, 0] - out["logits"][:, 1]).abs()
        assert moved.mean() > 10 * d.mean(), (moved.mean(), d.mean())


def test_score_raw_ids_with_image_paths_equals_messages(scored, demo):
    """The ids another engine would send (image spans expanded) plus the image paths give the logits of the
    same prompt given as chat messages, bit for bit (same batch, same order, same thread count)."""
    outs, prompt_ids = scored
    root = demo["root"]
    ids = outs[1]["input_ids"].tolist()
    spec = root / "score_raw.json"
    spec.write_text(json.dumps({"sequences": ids, "prefill_len": len(prompt_ids), "images": [
        [IMAGES["gradient"], IMAGES["stripes"]], [str(root / "permuted.png"), IMAGES["stripes"]]]}))
    out = root / "score_raw.safetensors"
    proc = run_cli(cli_args(demo) + ["--score", str(spec), "--dump-logits", str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    raw = load_file(str(out))
    assert torch.equal(raw["input_ids"], outs[1]["input_ids"])
    assert torch.equal(raw["logits"], outs[1]["logits"])
    # Without the images the same ids are refused (they used to be scored as text, silently).
    spec.write_text(json.dumps({"sequences": ids, "prefill_len": len(prompt_ids)}))
    proc = run_cli(cli_args(demo) + ["--score", str(spec), "--dump-logits", str(out) + ".x"])
    assert_clean_error(proc, "(image token id 129264) has no image: 0 image(s) given for 2 span(s)")
    assert not os.path.exists(str(out) + ".x")


def test_score_raw_ids_errors_name_the_span(demo, tmp_path):
    tok, margs = demo["tok"], demo["margs"]
    ids, _, images = prompts.tokenize_prompt(
        tok, margs, *encode_case({"messages": two_image_messages()}, "chat"), "test")
    (a, n_a), (b, n_b) = [(im.start, im.n_tokens) for im in images]
    spec = tmp_path / "s.json"
    both = [IMAGES["gradient"], IMAGES["stripes"]]

    def read(data):
        spec.write_text(json.dumps(data))
        return prompts.read_score_file(str(spec), margs.vocab_size, tok, margs)

    seqs, p, types, got = read({"sequences": [ids], "images": [both]})
    _, want_types, _ = prompts.tokenize_prompt(
        tok, margs, *encode_case({"messages": two_image_messages()}, "chat"), "test")
    assert types == [want_types] and [(im.start, im.n_tokens) for im in got[0]] == [(a, n_a), (b, n_b)]
    cases = [
        ({"sequences": [ids], "image": [both]}, r"unknown key\(s\) image \(expected"),
        ({"sequences": [ids], "images": both}, r"'images' must be a list of 1 entries \(one per sequence\)"),
        ({"sequences": [ids], "images": [both[::-1]]},
         rf"sequence 0: image span \[{a}, {a + n_a}\) holds {n_a} position\(s\) from {a} for image 0 "
         rf"\(.*stripes.png\), whose .* grid takes {n_b}"),
        ({"sequences": [ids], "images": [both + both[:1]]},
         r"3 image\(s\) given but the image spans .* hold only 2: image 2 \(.*gradient.png\) has no span"),
        ({"sequences": [ids[:a + 5] + ids[a + 6:]], "images": [both]},
         rf"image span \[{a}, {a + n_a - 1}\) holds {n_a - 1} position\(s\)"),
        ({"sequences": [{"messages": two_image_messages()}], "images": [both]},
         "a messages case brings its images in its messages"),
    ]
    for data, message in cases:
        with pytest.raises(InputError, match=message):
            read(data)
    # A text-only model reads image_token_id in raw ids as an ordinary token.
    text_only = dataclasses.replace(margs, vision_n_layers=0)
    spec.write_text(json.dumps({"sequences": [ids]}))
    assert prompts.read_score_file(str(spec), margs.vocab_size, tok, text_only)[2:] == (None, None)


def test_score_file_formats_in_process(demo, tmp_path):
    """Id lists keep their old meaning; a messages case brings its images and token types; rows without
    images get TEXT (-1) types; score() hands images and types to the prefill only."""
    tok, margs = demo["tok"], demo["margs"]
    spec = tmp_path / "s.json"
    spec.write_text(json.dumps({"sequences": [[5, 6, 7, 8], [9, 10, 11]]}))
    assert prompts.read_score_file(str(spec), margs.vocab_size, tok, margs) == (
        [[5, 6, 7, 8], [9, 10, 11]], 3, None, None)
    spec.write_text(json.dumps({"sequences": [{"messages": two_image_messages(), "completion": "Yes."},
                                              list(range(1000, 1500))]}))
    seqs, p, types, images = prompts.read_score_file(str(spec), margs.vocab_size, tok, margs)
    assert p == len(seqs[0]) and len(types[0]) == p and types[1] == [-1] * 500
    assert [len(row) for row in images] == [2, 0] and types[0][-2:] == [-1, -1]
    assert sum(t >= 0 for t in types[0]) == sum(im.n_tokens for im in images[0])
    # An undecodable image names the case and the image.
    bad = tmp_path / "not_an_image.png"
    bad.write_text("plain text")
    spec.write_text(json.dumps({"sequences": [{"messages": two_image_messages(second=str(bad))}]}))
    with pytest.raises(InputError, match=r"s\.json: sequence 0: image 1 \(.*\): cannot decode image"):
        prompts.read_score_file(str(spec), margs.vocab_size, tok, margs)

    model = ScriptedModel(max_seq_len=600)
    types = [[-1, 0, 1, 3] + [-1] * 6, [-1] * 12]
    scoring.score(model, [list(range(10)), list(range(12))], 6, token_types=types, images=[["x"], []])
    assert model.calls[0][2] == [["x"], []] and model.calls[0][3] == [[-1, 0, 1, 3, -1, -1], [-1] * 6]
    assert all(c[2] is None and c[3] is None for c in model.calls[1:])


# ---------------------------------------------------------------------------------------------------------
# Errors: one line on stderr, nonzero exit, no traceback, before the model is built
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["unreadable", "count", "outside-prefill", "lm-only", "no-vision"])
def test_image_errors(demo, case):
    root, mp = demo["root"], 1
    prompt = root / f"{case}.txt"
    args = cli_args(demo) + ["--input-file", str(prompt)]
    if case == "unreadable":       # at MP 2: both ranks stop with the message, no hang
        mp, bad = 2, root / "nowhere.png"
        prompt.write_text(f"See <image>{bad}</image>", encoding="utf-8")
        args, message = cli_args(demo, 2) + ["--input-file", str(prompt)], "): file not found"
    elif case == "count":
        prompt.write_text(f"See <image>{IMAGES['gradient']}</image> and <｜image2｜>", encoding="utf-8")
        message = "the prompt has 2 image placeholder(s) (token id 129264) but 1 image(s) were given"
    elif case == "outside-prefill":
        spec = root / "outside.json"
        spec.write_text(json.dumps({"sequences": [{"messages": two_image_messages()}], "prefill_len": 12}))
        args = cli_args(demo) + ["--score", str(spec), "--dump-logits", str(root / "never.safetensors")]
        message = "outside the first chunk [0, 12)"
    elif case == "lm-only":
        prompt.write_text(TAGGED, encoding="utf-8")
        args += ["--language-model-only"]
        message = "2 image(s) given, but --language-model-only skips the vision tower"
    else:
        config = json.loads(open(demo["config"]).read())
        config["vision_n_layers"] = 0
        (root / "text_only.json").write_text(json.dumps(config))
        prompt.write_text(TAGGED, encoding="utf-8")
        args[args.index("--config") + 1] = str(root / "text_only.json")
        message = "2 image(s) given, but this model has no vision tower (vision_n_layers = 0)"
    proc = run_cli(args, nproc=mp)
    assert_clean_error(proc, message)
    if case == "unreadable":   # names the prompt and the image (its path cut at 80 characters)
        assert f"{prompt}: prompt 1: image 0 (" in proc.stderr
    assert "build model" not in proc.stdout    # (torchrun's own launcher traceback is allowed at MP 2)
    errors = [line for line in proc.stderr.splitlines() if "error: " in line]
    assert len(errors) == mp, proc.stderr     # one line per rank


# ---------------------------------------------------------------------------------------------------------
# The endpoint: a request with images takes a cache row like any other (the scheduler)
# ---------------------------------------------------------------------------------------------------------

def test_the_endpoint_serves_a_reply_with_images_as_batch_mode_gives_it(demo):
    from test_serve import MODEL, Served
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "Compare "}, {"type": "image_url", "image_url": {"url": IMAGES["gradient"]}},
        {"type": "text", "text": " and "}, {"type": "image_url", "image_url": {"url": IMAGES["stripes"]}},
        {"type": "text", "text": QUESTION}]}]
    src, out = demo["root"] / "served_images.json", demo["root"] / "served_images.jsonl"
    src.write_text(json.dumps([{"messages": messages}]), encoding="utf-8")
    proc = run_cli(cli_args(demo) + ["--input-file", str(src), "--max-new-tokens", "3", "--temperature", "0",
                                     "--output", str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [record] = read_jsonl(out)
    served = Served(demo["mp"][1], demo["config"],
                    ["--allowed-local-media-path", os.path.dirname(IMAGES["stripes"])])
    try:
        r = served.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=3,
                                                    temperature=0)
    finally:
        served.stop()
    assert r.usage.prompt_tokens == record["prompt_tokens"] == expected_prompt_tokens(demo, messages)
    assert r.choices[0].message.content == record["content"]
