"""The two things the speculative loop asks of a backend, and the PyTorch implementation.

ONNX Runtime and TensorRT backends implement the same two protocols; the loop in
`decoder.py` never sees which one it runs."""
from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from ..config import TreeShape
from ..models.drafter import EagleDrafter
from ..models.target import LlamaTarget
from ..tree import DraftTree, draft_tree
from .kv_cache import KVCache


class TargetBackend(Protocol):
    max_context: int

    def reset(self, capacity: int) -> None:
        """Start a new sequence with room for `capacity` KV rows."""

    @property
    def length(self) -> int:
        """Committed tokens in the KV cache."""

    def forward(self, input_ids: Tensor, positions: Tensor, mask: Tensor, last_only: bool = False
                ) -> tuple[Tensor, Tensor]:
        """Run T new tokens after the committed ones. mask [T, T] says which new tokens each new
        token sees (causal for prefill, the tree mask for verification); all committed tokens
        are visible. Returns logits [T or 1, V] and captured states [T, A * H]. Rows are staged.
        Inputs may live on any device; outputs stay on the backend's (the PyTorch backend's
        model device), so a CUDA loop moves only token ids and the accepted path."""

    def commit(self, rows: list[int]) -> None:
        """Keep these staged rows, in order, as the next committed tokens."""


class DrafterBackend(Protocol):
    shape: TreeShape

    def reset(self, capacity: int) -> None: ...

    def draft(self, captured: Tensor, input_ids: Tensor) -> DraftTree:
        """Encode T newly committed rows (target states [T, A * H] of tokens t.., token ids
        [T] of tokens t+1..) into the drafter cache and expand a draft tree from the last."""


class TorchTarget:
    def __init__(self, model: LlamaTarget):
        self.model = model.eval()
        self.max_context = model.cfg.max_position_embeddings
        self.device = model.embed_tokens.weight.device
        self.cache: KVCache | None = None

    def reset(self, capacity: int) -> None:
        cfg, w = self.model.cfg, self.model.embed_tokens.weight
        self.cache = KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, capacity, w.dtype, w.device)

    @property
    def length(self) -> int:
        return self.cache.length

    @torch.inference_mode()
    def forward(self, input_ids, positions, mask, last_only=False):
        T, P, dev = input_ids.shape[0], self.cache.length, self.device
        input_ids, positions, mask = input_ids.to(dev), positions.to(dev), mask.to(dev)   # no-ops when there already
        full = torch.cat((torch.ones(T, P, dtype=torch.bool, device=dev), mask), dim=1)[None]
        index = torch.full((1,), T - 1, device=dev) if last_only else None
        out = self.model(input_ids[None], positions[None], full, *self.cache.past(), index)
        self.cache.write(out.new_k, out.new_v)
        return out.logits[0], out.captured[0]

    def commit(self, rows: list[int]) -> None:
        self.cache.commit(rows)


class TorchDrafter:
    def __init__(self, model: EagleDrafter, shape: TreeShape):
        self.model = model.eval()
        self.shape = shape.validate(model.cfg.draft_vocab_size)
        self.cache: KVCache | None = None

    def reset(self, capacity: int) -> None:
        cfg, w = self.model.cfg, self.model.fc.weight
        self.cache = KVCache(1, cfg.num_key_value_heads, cfg.head_dim, capacity, w.dtype, w.device)

    @torch.inference_mode()
    def draft(self, captured: Tensor, input_ids: Tensor) -> DraftTree:
        past_k, past_v = self.cache.past()
        w = self.model.fc.weight
        tree, new_k, new_v = draft_tree(self.model, captured[None].to(w.device, w.dtype), input_ids[None].to(w.device),
                                        past_k[0], past_v[0], self.shape)
        self.cache.write([new_k], [new_v])
        self.cache.commit(list(range(new_k.shape[1])))
        return tree
