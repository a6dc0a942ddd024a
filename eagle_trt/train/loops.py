"""Where a self-distilled answer starts looping, and the training cut that follows from it.

A 135M target decoding greedily falls into loops: 63% of the committed ShareGPT answers run to
the 256-token cap, and 41% of their tokens continue a 9-gram already seen in the same sequence
(MT-bench answers at 128 tokens: 9%). Once greedy decoding repeats itself for a few dozen
tokens it stays in the loop, so the rest of the answer teaches the drafter only to copy, which
it learns from the first turns of the loop (held-out agreement 0.88 on such tokens against
0.66 on the rest). `--loop-cut N` trains on each sequence up to N tokens into its loop: the
loop is still seen, and the CPU time goes to text that is not a copy."""
from __future__ import annotations

import torch

NGRAM = 9     # a token repeats when it ends an n-gram already seen earlier in the sequence


class LoopRun:
    """Token by token: does each token end an n-gram seen earlier in the sequence (the prompt
    included), and how many answer tokens in a row have."""

    def __init__(self, prompt: list[int], n: int = NGRAM):
        self.n, self.ids, self.run = n, list(prompt), 0
        self.seen = {tuple(prompt[i - n + 1:i + 1]) for i in range(n - 1, len(prompt))}

    def add(self, token: int) -> int:
        """The run of repeated tokens this one ends (0: it does not repeat)."""
        self.ids.append(token)
        gram = tuple(self.ids[-self.n:])
        repeats = len(gram) == self.n and gram in self.seen
        if len(gram) == self.n:
            self.seen.add(gram)
        self.run = self.run + 1 if repeats else 0
        return self.run


def repeated(ids: list[int], n: int = NGRAM) -> list[bool]:
    """Per position: the token ends an n-gram that occurred earlier in `ids`."""
    loop = LoopRun([], n)
    return [loop.add(t) > 0 for t in ids]


def loop_cut_length(ids: torch.Tensor | list[int], mask: torch.Tensor | list[int], window: int) -> int:
    """The sequence length to train on: through the first run of `window` repeated answer tokens
    (mask 1: assistant text), so `window` tokens of the loop are kept; the whole sequence if it
    has no such run."""
    ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    mask = mask.tolist() if isinstance(mask, torch.Tensor) else list(mask)
    if window < 1:
        raise ValueError(f"loop cut window must be >= 1, got {window}")
    run = 0
    for i, (rep, answer) in enumerate(zip(repeated(ids), mask)):
        run = run + 1 if rep and answer else 0
        if run == window:
            return i + 1
    return len(ids)


__all__ = ["NGRAM", "LoopRun", "loop_cut_length", "repeated"]
