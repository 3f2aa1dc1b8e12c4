"""Special-token ids and prompt tokenize → decode round trip against the V4.1 tokenizer file."""
import pytest

from encoding import encoding as enc
from encoding.tokenizer import (
    IMAGE_TOKEN_ID,
    SPECIAL_TOKEN_IDS,
    image_token_spelling,
    load_tokenizer,
    read_special_ids,
    write_v41_tokenizer,
)



@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("v41_tokenizer")
    write_v41_tokenizer(str(path))
    return str(path)


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(tok_dir)


def test_special_token_ids(tok, tok_dir):
    for text, token_id in SPECIAL_TOKEN_IDS.items():
        assert tok.token_to_id(text) == token_id, text
        assert tok.encode(text, add_special_tokens=False).ids == [token_id], text
    # The encoder's strings are exactly the tokenizer's (docs/cli.md §5.2).
    strings = [enc.BOS, enc.EOS, enc.SYSTEM_TOKEN, enc.USER_TOKEN, enc.ASSISTANT_TOKEN, enc.THINK_START,
               enc.THINK_END, enc.DSML, enc.LATEST_REMINDER_TOKEN, *enc.TASK_TOKENS.values()]
    assert [tok.token_to_id(s) for s in strings] == \
        [0, 1, 128799, 128803, 128804, 128821, 128822, 128825, 128828, 128829, 128830, 128831, 128832, 128836,
         128845]
    assert read_special_ids(tok_dir) == {"bos": 0, "eos": 1}
    assert tok.get_vocab_size() == 129280


def test_image_token(tok):
    # The released file spells id 129264 `<｜image2｜>` and does not know the encoder's placeholder.
    assert tok.id_to_token(IMAGE_TOKEN_ID) == "<｜image2｜>"
    assert tok.token_to_id(enc.IMAGE_PLACEHOLDER) is None
    spelling = image_token_spelling(tok, enc.IMAGE_PLACEHOLDER)
    assert spelling == "<｜image2｜>"
    content = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x.png"}},
               {"type": "image", "url": "y.png"}]
    prompt, data = enc.encode_messages([{"role": "user", "content": content}], "chat",
                                       return_multi_modal_data=True)
    ids = tok.encode(prompt.replace(enc.IMAGE_PLACEHOLDER, spelling), add_special_tokens=False).ids
    assert ids.count(IMAGE_TOKEN_ID) == len(data["images"]) == 2


def test_prompt_round_trip(tok):
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    messages = [
        {"role": "system", "content": "Be brief. 简短", "tools": [weather]},
        {"role": "user", "content": "Weather in 北京? 🙂\n\n  spaces\ttab"},
        {"role": "assistant", "content": "", "reasoning_content": "need a tool",
         "tool_calls": [{"id": "1", "function": {"name": "get_weather",
                                                 "arguments": '{"city": "北京", "d": 3}'}}]},
        {"role": "tool", "tool_call_id": "1", "content": "{\"t\": 22}"},
        {"role": "assistant", "content": "22°C", "reasoning_content": "done"},
        {"role": "user", "content": "thanks", "task": "action"},
    ]
    prompt = enc.encode_messages(messages, "thinking", reasoning_effort="max")
    ids = tok.encode(prompt, add_special_tokens=False).ids
    assert tok.decode(ids, skip_special_tokens=False) == prompt
    assert ids[:2] == [0, 128799] and ids[-3:] == [128804, 128821, 128829]
    assert ids.count(128803) == 3 and ids.count(1) == 2  # three user turns, two EOS
