"""What the two-call engine (two_call.py) asks of a target and a drafter backend, for a batch of
sequences, and the PyTorch reference backends.

`TargetBackend` and `DrafterBackend` own the batched KV caches (runtime/kv_cache.py), the
masks and the bookkeeping; a backend supplies only `_run`, one graph call. The ONNX Runtime,
TensorRT and Triton-BLS backends subclass the same two classes, so the engine never sees which
one it runs, and batch 1 is the same code with B = 1. The PyTorch pair (TorchTarget,
TorchDrafter) is the reference the graph backends are tested against; decoding on PyTorch runs
on the fixed-shape engine (static.py), which calls the models directly.

Batching is by padding: every sequence of a call gets the same number T of new rows, and each
sequence's past is the first `width` rows of its slot with the rows beyond its own committed
length masked out. Padding keeps a sequence's rows one contiguous run, so positions, masks and
the KV rows a graph returns are plain per-sequence offsets."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..config import TreeShape
from ..models.drafter import EagleDrafter
from ..models.target import LlamaTarget
from ..tree import DraftTree, draft_trees
from ..verify import accept_greedy_batch
from .kv_cache import CHUNK, KVCache


class _Batched:
    """The batched KV cache and slot bookkeeping shared by target and drafter backends.

    contiguous_past: the graph runtime binds the past as one memory block (ONNX Runtime, TensorRT),
    so a call binds every row of the cache (`width` = capacity; rows beyond a sequence's length
    are masked), at any batch size: the bound shapes then change only when the cache grows (every
    CHUNK rows), so a backend can keep its bindings from call to call. PyTorch takes a strided
    view: width = longest past. Either way a call whose sequences have no committed rows (a
    prefill) binds width 0, except where the graph writes its new rows into the past it is given
    (`in_place`: the fused-attention target graph, export/cpu_attention.py), which always binds
    every row."""
    contiguous_past = True
    in_place = False
    cache: KVCache | None = None

    def _new_cache(self, num_layers: int, kv_heads: int, head_dim: int, capacity: int, dtype, device) -> None:
        """An empty cache: this backend's last one cleared where it has this layout (its storage
        reused), else a new one. A copy of a backend (copy.copy: the per-request decoders share
        the sessions) makes its own at its first reset instead of clearing the one it was copied with."""
        c = self.cache
        if (c is not None and c.owner is self and c.layout == (num_layers, kv_heads, head_dim) and c.dtype == dtype
                and torch.device(c.device) == torch.device(device)):
            c.clear(capacity)
        else:
            self.cache = KVCache(num_layers, kv_heads, head_dim, capacity, dtype, device)
            self.cache.owner = self
        self.cache.in_place = self.in_place

    def add_sequence(self, rows: int = 0) -> int:
        """A new sequence in the next free slot (room for `rows` rows); returns the slot."""
        return self.cache.add(rows)

    def add_prefilled(self, other: "_Batched") -> int:
        """A new sequence in the next slot holding the rows of `other`'s sequence 0 (a prompt
        prefilled in chunks on a copy of this backend); returns the slot."""
        return self.cache.take(other.cache)

    def remove_sequence(self, slot: int) -> None:
        """Free `slot`; the last sequence moves into it."""
        self.cache.remove(slot)

    @property
    def batch(self) -> int:
        return self.cache.batch

    @property
    def lengths(self) -> list[int]:
        return self.cache.lengths

    def _stage(self, slots: range | None, T: int) -> tuple[range, list[int], int]:
        """Stage T rows per sequence; returns the slots, their committed lengths (a list: a backend
        makes a tensor of them only where its graph needs one) and the past width."""
        slots = slots if slots is not None else range(self.cache.batch)
        if len(slots) == 0:
            raise ValueError("a forward pass needs at least one sequence (add_sequence first)")
        self.cache.stage(slots, T)
        committed = self.cache.lengths[slots.start:slots.stop]
        # Sequences with nothing committed yet (a prefill) bind no past at all: not the masked
        # rows of a cache that other sequences have grown (a TensorRT prefill profile stops at
        # its max_past, and those rows would only be read to be masked).
        longest = max(committed)
        width = self.cache.capacity if self.contiguous_past and (longest or self.in_place) else longest
        return slots, committed, width

    def _past(self, slots: range, width: int, layer: int) -> tuple[Tensor, Tensor]:
        return self.cache.past(slots, width, layer)


def _gather_rows(x: Tensor, index: Tensor) -> Tensor:
    """x[b, index[b, k]] for x [B, T, W], index [B, K]: one index_select over the flattened rows
    (a gather with the index expanded to W looks up every element: ~10x slower on a CPU)."""
    B, T, W = x.shape
    if B > 1:
        index = index + torch.arange(0, B * T, T, device=index.device)[:, None]
    return x.reshape(B * T, W).index_select(0, index.reshape(-1)).view(B, -1, W)


def verification_inputs(roots: Tensor, lengths: Tensor, tree: DraftTree | None) -> tuple[Tensor, Tensor, Tensor]:
    """A verification call's input ids [B, T], positions [B, T] and tree mask [B, T, T] (T = 1 +
    nodes): each sequence's root (roots [B], the last token it committed) and its tree's nodes,
    at the positions after its committed rows (lengths [B]); tree None: the roots alone, a step
    of plain decoding. Every backend builds them here, where the trees are (fixed shapes)."""
    if tree is None:
        ones = torch.ones(roots.shape[0], 1, 1, dtype=torch.bool, device=roots.device)
        return roots[:, None], lengths[:, None], ones
    return torch.cat((roots[:, None], tree.tokens), 1), lengths[:, None] + tree.depths, tree.mask


def attention_mask(past: Tensor, mask: Tensor) -> Tensor:
    """[B, T, P + T]: the committed rows each sequence sees (past [B, P], True up to its length),
    then the new rows' own mask [B, T, T] (causal, a tree, or identity for padding)."""
    B, T = mask.shape[0], mask.shape[1]
    return torch.cat((past[:, None].expand(B, T, past.shape[1]), mask.to(torch.bool)), dim=2)


@functools.lru_cache(maxsize=256)
def logits_rows(T: int, last_only: bool) -> Tensor:
    """The rows of a T-row call that get logits: the last one (prefill) or all (made once per
    shape: read, never written)."""
    return torch.arange(T - 1 if last_only else 0, T)


@functools.lru_cache(maxsize=64)
def _row_numbers(width: int, device: torch.device) -> Tensor:
    return torch.arange(width, device=device)


class KeptRows(list):
    """keep_states' rows per sequence as views of one block the next drafting call can take as
    it is: `states` [B, Tp, W] and `ids` [B, Tp] (the accepted tokens), row i sequence i's, rows
    past its length padding. An iteration graph's hand-off: the graph gathered them itself."""

    def __init__(self, rows: list, states, ids):
        super().__init__(rows)
        self.states, self.ids = states, ids


@dataclass
class Verification:
    """What one target call returns, on any backend (its own buffers, valid until its next call of
    the same shape): logits [b, K, V], captured states [b, T, A * H], and for a verification its
    input ids [b, T] and tree mask [b, T, T]. accepted: (path [b, K], length [b], tokens [b, K]),
    the graph's own greedy acceptance where it computed one (every exported target graph does).
    handoff: (states [b, R, W], ids [b, R]), the iteration graph's block of the accepted rows in
    the shape of its drafter inputs. captured_host: `captured` as a numpy view, where there is one."""
    logits: Tensor
    captured: Tensor
    ids: Tensor | None = None
    mask: Tensor | None = None
    accepted: tuple | None = None
    handoff: tuple | None = None
    captured_host: np.ndarray | None = None


class TargetBackend(_Batched):
    max_context: int

    def reset(self, capacity: int = CHUNK) -> None:
        """Drop every sequence; with `capacity`, preallocate that many rows per slot."""
        raise NotImplementedError

    def forward(self, input_ids: Tensor, positions: Tensor, mask: Tensor, slots: range | None = None,
                last_only: bool = False) -> tuple[Tensor, Tensor]:
        """Run T new tokens after the committed ones of each sequence in `slots` (default: all).
        input_ids / positions [b, T]; mask [b, T, T] says which new tokens each new token sees
        (causal for prefill, the tree mask for verification, identity for padding); each
        sequence's committed tokens are all visible. Returns a Verification: logits [b, T or 1, V]
        and captured states [b, T, A * H]; the rows are staged. Inputs may live on any device;
        outputs stay on the backend's, so a CUDA loop moves only token ids and the accepted
        paths. Outputs may be the backend's own buffers, valid until its next call: copy what
        must outlive it."""
        return self._forward(input_ids, positions, mask, slots, logits_rows(int(input_ids.shape[1]), last_only))

    def _forward(self, input_ids, positions, mask, slots, index):
        T, dev = int(input_ids.shape[1]), mask.device     # built where the tree mask is (no transfer)
        slots, lengths, width = self._stage(slots, T)
        full = attention_mask(_row_numbers(width, dev) < torch.tensor(lengths, device=dev)[:, None], mask)
        out, new_k, new_v = self._run(input_ids, positions, full, index, slots, width)
        self.cache.write(new_k, new_v)          # held until commit copies the accepted rows
        return out

    def _run(self, input_ids: Tensor, positions: Tensor, mask: Tensor, logits_index: Tensor, slots: range,
             width: int) -> tuple[Verification, list[Tensor], list[Tensor]]:
        """One target-graph call: its Verification (logits, captured, and the graph's own
        acceptance where it has one), and the new K / V rows per layer [b, Hkv, T, D] (or new_k
        the K and V rows of every layer as one [2, L, b, Hkv, T, D] block, new_v None)."""
        raise NotImplementedError

    def commit(self, rows: list[list[int]]) -> None:
        """Keep these staged rows of each sequence of the last forward, in order, as its next committed tokens."""
        self.cache.commit(rows)

    def verify(self, roots: list[int], tree: DraftTree | None) -> Verification:
        """Verify each sequence's root token (roots[i], the last token it committed) and the nodes
        of its draft tree (a batch of trees; None: the roots alone, a step of plain decoding), at
        the positions after its committed rows. Returns the Verification with the call's input
        ids [b, T] and tree mask [b, T, T], T = 1 + nodes. Built where the trees are, so a GPU
        loop copies only the roots and lengths."""
        dev = tree.tokens.device if tree is not None else torch.device("cpu")
        ids, positions, mask = verification_inputs(torch.tensor(roots, device=dev),
                                                   torch.tensor(self.lengths, device=dev), tree)
        out = self.forward(ids, positions, mask)
        out.ids, out.mask = ids, mask
        return out

    def keep_states(self, out: Verification, paths: list[list[int]], index: Tensor | None = None) -> list:
        """Each sequence's captured states at the rows of its path, [len(path), A * H], copied (the
        outputs are the backend's buffers): what the drafter encodes when the batch next drafts.
        index: the paths as a [b, K] tensor where the caller has one (the graph's accept_path, zero
        past each path's end: on a GPU it is already there), else made from `paths`."""
        if index is None:
            width = max(len(p) for p in paths)
            index = torch.tensor([p + p[-1:] * (width - len(p)) for p in paths])
        captured = out.captured
        kept = _gather_rows(captured, torch.as_tensor(index).to(captured.device))
        return [kept[i, :len(p)] for i, p in enumerate(paths)]

    @staticmethod
    def greedy_next(out: Verification) -> list[int]:
        """Each sequence's greedy token after the last row of a call's logits (a prefill's one row):
        the graph's own argmax where it computed its acceptance in that call (a prefill's is its
        last row's argmax), else on the host (torch's argmax over a 49k vocabulary costs 60-270 us
        on this CPU, per join)."""
        if out.accepted is not None and out.logits.shape[1] == 1:
            return out.accepted[2][:, 0].tolist()
        return out.logits[:, -1].argmax(-1).tolist()

    @staticmethod
    def accept_greedy(out: Verification) -> tuple[Tensor, Tensor, Tensor]:
        """Greedy acceptance of the trees a verification call scored: the target graph's own,
        where it computed one in that call (no second computation); else
        verify.accept_greedy_batch on the argmax of the logits [b, T, V], where the logits are.
        Returns path [b, T], length [b], tokens [b, T]."""
        if out.accepted is not None:
            return out.accepted
        dev = out.logits.device
        return accept_greedy_batch(out.logits.argmax(-1), out.ids.to(dev), out.mask.to(dev))


class DrafterBackend(_Batched):
    shape: TreeShape

    def reset(self, capacity: int = CHUNK) -> None:
        raise NotImplementedError

    def draft(self, captured: Tensor, input_ids: Tensor | list[list[int]], new_lengths: list[int] | None = None,
              slots: range | None = None) -> DraftTree:
        """Encode newly committed rows (target states [b, T, A * H] of tokens t.., a tensor or,
        from a CPU target's keep_states, a numpy array; token ids [b, T] of tokens t+1.., a tensor
        or lists; sequence i has new_lengths[i] valid rows, the rest padding) into the drafter
        cache and expand a draft tree from each sequence's last valid row. Returns the batch of
        trees ([b, ...] fields)."""
        T = int(captured.shape[1])
        slots, lengths, width = self._stage(slots, T)
        new_lengths = new_lengths or [T] * len(slots)
        tree, new_k, new_v = self._run(captured, input_ids, lengths, new_lengths, slots, width)
        self.commit_new_rows(new_k, new_v, new_lengths)
        return tree

    def commit_new_rows(self, new_k, new_v, new_lengths: list[int]) -> None:
        """Keep the valid new rows of the staged call (every sequence's first new_lengths[i])."""
        if new_v is None:                              # K and V as one [2, 1, b, Hkv, T, D] block
            self.cache.write(new_k)
        else:                                          # the one cache layer, [1, b, Hkv, T, D] each
            self.cache.write(new_k[None], new_v[None])
        self.cache.commit([list(range(n)) for n in new_lengths])

    def _run(self, captured: Tensor, input_ids: Tensor | list[list[int]], past_lengths: list[int],
             new_lengths: list[int], slots: range, width: int) -> tuple[DraftTree, Tensor, Tensor]:
        """One drafter-tree call: the trees and the drafter KV rows of the T inputs [b, Hkv, T, D]
        (or new_k both as one [2, 1, b, Hkv, T, D] block, new_v None)."""
        raise NotImplementedError


def tree_from_outputs(out: dict[str, Tensor], arrays: dict | None = None, prefix: str = "") -> DraftTree:
    """A DraftTree from a drafter-tree graph's named outputs (any backend; `prefix` + name where
    the graph prefixes them, as the iteration graph does), where they are: the decoder builds
    the verification inputs from it on the same device. arrays: numpy views of the same
    outputs, where the backend has them (DraftTree.arrays)."""
    names = [prefix + n for n in ("tree_tokens", "tree_parents", "tree_mask", "tree_depths", "tree_scores")]
    scores = out[names[4]]
    scores = scores if scores.dtype == torch.float32 else scores.float()
    host = None
    if arrays is not None:
        host = (tuple(out[names[i]] for i in (0, 2, 3)) + (scores,),
                tuple(arrays[names[i]] for i in (0, 2, 3)) + (arrays[names[4]] if scores is out[names[4]] else scores.numpy(),))
    return DraftTree(*(out[n] for n in names[:4]), scores, host)


class TorchTarget(TargetBackend):
    contiguous_past = False

    def __init__(self, model: LlamaTarget):
        self.model = model.eval()
        self.max_context = model.cfg.max_position_embeddings
        self.device = model.embed_tokens.weight.device

    def reset(self, capacity: int = CHUNK) -> None:
        cfg, w = self.model.cfg, self.model.embed_tokens.weight
        self._new_cache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, capacity, w.dtype, w.device)

    @torch.inference_mode()
    def _run(self, input_ids, positions, mask, logits_index, slots, width):
        dev = self.device
        past = [self._past(slots, width, i) for i in range(self.model.cfg.num_hidden_layers)]
        out = self.model(input_ids.to(dev), positions.to(dev), mask.to(dev), [k for k, _ in past],
                         [v for _, v in past], logits_index.to(dev))
        return Verification(out.logits, out.captured), out.new_k, out.new_v


class TorchDrafter(DrafterBackend):
    contiguous_past = False

    def __init__(self, model: EagleDrafter, shape: TreeShape):
        self.model = model.eval()
        self.shape = shape.validate(model.cfg.draft_vocab_size)

    def reset(self, capacity: int = CHUNK) -> None:
        cfg, w = self.model.cfg, self.model.fc.weight
        self._new_cache(1, cfg.num_key_value_heads, cfg.head_dim, capacity, w.dtype, w.device)

    @torch.inference_mode()
    def _run(self, captured, input_ids, past_lengths, new_lengths, slots, width):
        w = self.model.fc.weight
        past_k, past_v = self._past(slots, width, 0)
        tree, new_k, new_v = draft_trees(self.model, torch.as_tensor(captured).to(w.device, w.dtype),
                                         torch.as_tensor(input_ids, device=w.device), past_k, past_v, self.shape,
                                         torch.tensor(past_lengths, device=w.device),
                                         torch.tensor(new_lengths, device=w.device))
        return tree, new_k, new_v
