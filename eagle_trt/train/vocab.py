"""Reduced draft vocabulary: the N most frequent token ids among the training targets.

Conventions of the SafeAILab checkpoints: `used` (the kept target ids) is sorted, so draft id
d maps to target id used[d] = d + d2t[d] (d2t holds int64 OFFSETS), and t2d is a bool mask
over the target vocabulary marking the kept ids."""
from __future__ import annotations

import itertools
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


@dataclass
class DraftVocab:
    used: torch.Tensor     # [N] int64, sorted target ids
    d2t: torch.Tensor      # [N] int64 offsets: target id = draft id + d2t[draft id]
    t2d: torch.Tensor      # [V] bool
    coverage: float        # share of the counted target tokens that the kept ids cover

    @property
    def size(self) -> int:
        return int(self.used.numel())

    @classmethod
    def from_used(cls, used: torch.Tensor, vocab_size: int, coverage: float = float("nan")) -> DraftVocab:
        used = torch.sort(used.to(torch.int64)).values
        if used.numel() and (int(used[0]) < 0 or int(used[-1]) >= vocab_size):
            raise ValueError(f"draft vocabulary ids must lie in 0..{vocab_size - 1}, got {int(used[0])}..{int(used[-1])}")
        if torch.unique(used).numel() != used.numel():
            raise ValueError("draft vocabulary ids must be unique")
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[used] = True
        return cls(used, used - torch.arange(used.numel(), dtype=torch.int64), t2d, coverage)

    def save(self, path: Path) -> None:
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")    # two runs may build it at once
        save_file({"used": self.used.contiguous(), "d2t": self.d2t.contiguous(), "t2d": self.t2d.contiguous()},
                  str(tmp), metadata={"coverage": repr(self.coverage)})
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path, vocab_size: int) -> DraftVocab:
        t = load_file(str(path))
        if "used" not in t:
            raise ValueError(f"{path}: no 'used' tensor: not a draft vocabulary file")
        if t["t2d"].numel() != vocab_size:
            raise ValueError(f"{path}: draft vocabulary is over {t['t2d'].numel()} target ids, the target has "
                             f"vocab_size {vocab_size}")
        from safetensors import safe_open
        with safe_open(str(path), "pt") as f:
            coverage = float((f.metadata() or {}).get("coverage", "nan"))
        return cls.from_used(t["used"], vocab_size, coverage)


def count_tokens(sequences: Iterable[torch.Tensor], masks: Iterable[torch.Tensor] | None, vocab_size: int) -> torch.Tensor:
    """Frequency [V] of the ids the drafter must predict (masked positions only, if masks given)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    masks = masks if masks is not None else itertools.repeat(None)
    for ids, mask in zip(sequences, masks):
        ids = torch.as_tensor(ids, dtype=torch.int64)
        if mask is not None:
            ids = ids[torch.as_tensor(mask).bool()]
        counts += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts


DEFAULT_SIZE = 8192    # draft ids of a new drafter (the shipped ones have this many)


def build_draft_vocab(counts: torch.Tensor, size: int) -> DraftVocab:
    """Top `size` ids by count; ties (including never-seen ids) broken by the lower id."""
    V = counts.numel()
    if not 0 < size <= V:
        raise ValueError(f"draft vocabulary size {size} must be in 1..{V} (the target's vocab_size)")
    # Stable descending sort on counts keeps ascending id order among equal counts.
    order = torch.sort(counts, descending=True, stable=True).indices[:size]
    return DraftVocab.from_used(order, V, _coverage(counts, order))


def _coverage(counts: torch.Tensor, ids: torch.Tensor) -> float:
    total = int(counts.sum())
    return float(counts[ids].sum()) / total if total else float("nan")


def grow_draft_vocab(used: torch.Tensor, counts: torch.Tensor, size: int) -> DraftVocab:
    """`used` (a drafter's ids) and the most frequent other ids by `counts`, `size` in all: a
    trained drafter's vocabulary grown, its own ids kept (ties broken by the lower id); `size`
    equal to its own: that vocabulary, its coverage counted."""
    V = counts.numel()
    used = torch.as_tensor(used, dtype=torch.int64)
    if not used.numel() <= size <= V:
        raise ValueError(f"a grown draft vocabulary of {size} ids must hold the drafter's {used.numel()} and at "
                         f"most the target's vocab_size {V}")
    others = counts.clone()
    others[used] = -1
    added = torch.sort(others, descending=True, stable=True).indices[:size - used.numel()]
    kept = torch.cat([used, added])
    return DraftVocab.from_used(kept, V, _coverage(counts, kept))


__all__ = ["DEFAULT_SIZE", "DraftVocab", "build_draft_vocab", "count_tokens", "grow_draft_vocab"]
