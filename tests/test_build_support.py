"""Helpers for the build tests (no tests here): a tiny Llama target with a real tokenizer, so
the build's calibration, parity and serving paths run on it as on a real checkpoint."""
from __future__ import annotations

import string
from pathlib import Path

import yaml
from conftest import write_tiny_hf_target

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}:{{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}")


def write_char_tokenizer(folder: Path, vocab: int = 96) -> Path:
    """A character-level fast tokenizer with `vocab` ids and a chat template (saved by
    transformers itself: tokenizer.json + tokenizer_config.json)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    chars = (" " + string.ascii_letters + string.digits + string.punctuation)[: vocab - len(SPECIALS)]
    table = {t: i for i, t in enumerate(SPECIALS + list(chars))}
    tok = Tokenizer(models.WordLevel(table, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("<s>|</s>|."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))
    return folder


def write_tiny_target(folder: Path, **kwargs) -> Path:
    write_tiny_hf_target(folder, **kwargs)
    return write_char_tokenizer(folder, kwargs.get("vocab", 96))


def tiny_config(target: Path, **sections) -> dict:
    """A build config for the tiny target: small tree and profiles, one ORT thread, 2 calibration prompts."""
    cfg = {"name": "tiny", "target": {"source": str(target)},
           "tree": {"depth": 3, "top_k": 2, "total_tokens": 4},
           "calibration": {"prompts": 2, "max_tokens": 128},
           "parity": {"prompts": 1},
           "engines": {"profiles": {"prefill": {"opt_tokens": 16, "max_tokens": 128},
                                    "verify": {"opt_tokens": 5, "max_tokens": 5, "max_past": 256},
                                    "drafter": {"max_tokens": 128, "max_past": 256}}},
           "serving": {"threads": 1, "max_tokens": 8}}
    for key, value in sections.items():
        cfg.setdefault(key, {}).update(value) if isinstance(value, dict) else cfg.__setitem__(key, value)
    return cfg


def write_config(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path
