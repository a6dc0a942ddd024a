"""A preallocated KV cache with an explicit committed length.

A forward pass writes its rows after the committed length without committing them; after
verification `commit(rows)` moves the accepted rows into place, in order, and advances the
length. Nothing is reallocated during generation."""
from __future__ import annotations

import torch
from torch import Tensor


class ContextOverflow(RuntimeError):
    pass


class KVCache:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype = torch.float32, device=None, batch: int = 1):
        shape = (num_layers, batch, capacity, kv_heads, head_dim)   # the graphs' [B, S, Hkv, D] per layer
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.length = 0
        self.staged = 0

    def past(self) -> tuple[list[Tensor], list[Tensor]]:
        n = self.length
        return [k[:, :n] for k in self.k], [v[:, :n] for v in self.v]

    def stage(self, T: int) -> None:
        """Reserve T rows after the committed length for a forward pass (which may write them
        itself, as the ONNX Runtime backend's bound outputs do)."""
        if self.length + T > self.capacity:
            raise ContextOverflow(f"KV cache holds {self.capacity} rows; {self.length} committed + {T} new do not fit")
        self.staged = T

    def write(self, new_k: list[Tensor], new_v: list[Tensor]) -> None:
        """Stage the rows of a forward pass right after the committed length."""
        T = new_k[0].shape[1]
        self.stage(T)
        end = self.length + T
        for layer, (k, v) in enumerate(zip(new_k, new_v)):
            self.k[layer, :, self.length:end] = k
            self.v[layer, :, self.length:end] = v

    def commit(self, rows: list[int]) -> None:
        """Keep staged rows `rows` (indices into the last write, increasing) as the next committed rows."""
        if any(not 0 <= r < self.staged for r in rows):
            raise IndexError(f"commit rows {rows} outside the {self.staged} staged rows")
        if rows != list(range(len(rows))):   # accepted tree nodes: compact them into place
            src = torch.tensor(rows, dtype=torch.int64, device=self.k.device) + self.length
            dst = slice(self.length, self.length + len(rows))
            self.k[:, :, dst] = self.k.index_select(2, src)
            self.v[:, :, dst] = self.v.index_select(2, src)
        self.length += len(rows)
        self.staged = 0
