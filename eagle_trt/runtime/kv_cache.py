"""A KV cache for a batch of sequences, each with its own committed length.

Layout [L, B, S, Hkv, D]: sequence b owns slot b, its committed rows are 0..length[b]-1 in
order (row index = position), and a forward pass stages its new rows right after them. After
verification `commit(rows)` moves each sequence's accepted rows into place and advances its
length. Sequences join (`add`) and leave (`remove`, which moves the last slot into the freed
one) between forward passes, so the live sequences always fill slots 0..B-1 and a batched call
binds one contiguous block. Rows grow in chunks when a sequence needs more (`reserve`)."""
from __future__ import annotations

import torch
from torch import Tensor

CHUNK = 64   # rows added at a time: a bound graph past is at most this much wider than needed


class KVCache:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, capacity: int = CHUNK,
                 dtype: torch.dtype = torch.float32, device=None, batch: int = 1):
        self.layout = (num_layers, kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.k = self.v = None
        self._allocate(max(batch, 1), max(capacity, 1))
        self.lengths: list[int] = []
        self.staged = 0                       # rows staged per sequence by the last forward
        self.staged_slots = range(0)

    def _allocate(self, batch: int, rows: int) -> None:
        L, H, D = self.layout
        k = torch.zeros((L, batch, rows, H, D), dtype=self.dtype, device=self.device)
        v = torch.zeros_like(k)
        if self.k is not None:
            b, s = min(batch, self.k.shape[1]), min(rows, self.k.shape[2])
            k[:, :b, :s], v[:, :b, :s] = self.k[:, :b, :s], self.v[:, :b, :s]
        self.k, self.v = k, v

    @property
    def capacity(self) -> int:
        return int(self.k.shape[2])

    @property
    def batch(self) -> int:
        return len(self.lengths)

    def add(self, rows: int = 0) -> int:
        """A new empty sequence in the next slot, with room for `rows` rows; returns its slot."""
        if self.batch == self.k.shape[1]:
            self._allocate(self.batch + 1, self.capacity)
        self.lengths.append(0)
        self.reserve(range(self.batch - 1, self.batch), rows)
        return self.batch - 1

    def remove(self, slot: int) -> None:
        """Drop sequence `slot`; the last sequence moves into its slot (its new index is `slot`)."""
        last = self.batch - 1
        if slot != last:
            n = self.lengths[last]
            self.k[:, slot, :n], self.v[:, slot, :n] = self.k[:, last, :n], self.v[:, last, :n]
            self.lengths[slot] = n
        self.lengths.pop()
        keep = -(-(max(self.lengths, default=0) + 1) // CHUNK) * CHUNK
        if self.capacity > keep + 2 * CHUNK:   # a long sequence left: stop binding its rows for the others
            self._allocate(self.k.shape[1], keep)

    def reserve(self, slots: range, rows: int) -> None:
        """Make room for `rows` more rows after each sequence's committed ones."""
        need = max((self.lengths[b] for b in slots), default=0) + rows
        if need > self.capacity:
            self._allocate(self.k.shape[1], -(-need // CHUNK) * CHUNK)

    def stage(self, slots: range, T: int) -> None:
        """Reserve T rows after the committed ones of each sequence in `slots` for a forward pass."""
        self.reserve(slots, T)
        self.staged, self.staged_slots = T, slots

    def past(self, slots: range, width: int, layer: int) -> tuple[Tensor, Tensor]:
        """The first `width` rows of each sequence in `slots`: a [b, width, Hkv, D] view, contiguous
        when there is one sequence or width is the capacity."""
        return self.k[layer, slots.start:slots.stop, :width], self.v[layer, slots.start:slots.stop, :width]

    def write(self, new_k: list[Tensor] | Tensor, new_v: list[Tensor] | Tensor) -> None:
        """Store the staged rows ([b, T, Hkv, D] per layer, or all layers as one [L, b, T, Hkv, D]
        tensor) after each sequence's committed ones."""
        T = self.staged
        for buf, new in ((self.k, new_k), (self.v, new_v)):
            rows = new if isinstance(new, Tensor) else torch.stack(new)   # [L, b, T, Hkv, D]
            for i, b in enumerate(self.staged_slots):                     # one run of rows per sequence
                buf[:, b, self.lengths[b]:self.lengths[b] + T] = rows[:, i]

    def _index(self, pairs: list[tuple[int, int]]) -> tuple[Tensor, Tensor]:
        """(slot, row) pairs as the two index tensors of an advanced-indexing read or write."""
        index = torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2).to(self.k.device)
        return index[:, 0], index[:, 1]

    def _moved_rows(self, moved: list[tuple[int, list[int]]], source: bool) -> tuple[Tensor, Tensor]:
        return self._index([(b, self.lengths[b] + (r if source else i)) for b, rows in moved
                            for i, r in enumerate(rows)])

    def commit(self, rows: list[list[int]]) -> None:
        """Keep staged rows rows[i] (increasing indices into the last forward's T rows) of the i-th
        staged sequence as its next committed rows."""
        slots = self.staged_slots
        if len(rows) != len(slots):
            raise ValueError(f"commit got rows for {len(rows)} sequences, {len(slots)} were staged")
        if any(not 0 <= r < self.staged for seq in rows for r in seq):
            raise IndexError(f"commit rows {rows} outside the {self.staged} staged rows")
        moved = [(b, r) for b, r in zip(slots, rows) if r != list(range(len(r)))]
        if moved:   # accepted tree nodes: compact them into place
            sb, sr = self._moved_rows(moved, source=True)
            db, dr = self._moved_rows(moved, source=False)
            self.k[:, db, dr] = self.k[:, sb, sr]
            self.v[:, db, dr] = self.v[:, sb, sr]
        for b, r in zip(slots, rows):
            self.lengths[b] += len(r)
        self.staged, self.staged_slots = 0, range(0)
