"""EAGLE-2 dynamic draft tree, written as fixed-shape tensor code.

Shapes depend only on the tree shape (depth D, top_k k, total_tokens N) and the number of
newly committed tokens, never on values, so the same function is the PyTorch reference and
what the drafter exporter traces into one graph with the recurrence unrolled.

Node 0 of a tree is the root (the last committed token, not yet seen by the target); draft
nodes are 1..N in rank order (best cumulative score first, ties to the earlier candidate), which
puts every parent before its children: the first n nodes are the n best and a tree of their own,
and the path a confident drafter's tree gets accepted along is usually a run of consecutive
nodes (one copy to commit its KV rows).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from .config import TreeShape
from .models.drafter import EagleDrafter


@dataclass(frozen=True)
class DraftTree:
    """One tree, or a batch of trees with a leading [B] axis on every field (what the drafter
    backends return; `row(b)` is sequence b's tree). Frozen: a backend may hand out the same
    tree over its output buffers call after call; a wrapper that changes one makes a new one
    (dataclasses.replace)."""
    tokens: Tensor     # [N] int64 target-vocabulary ids of the draft nodes 1..N
    parents: Tensor    # [N + 1] int64, parents[0] = -1 (root), parents[i] < i
    mask: Tensor       # [N + 1, N + 1] bool, row i = node i and its ancestors
    depths: Tensor     # [N + 1] int64, root 0; node position = root position + depth
    scores: Tensor     # [N] float32 cumulative draft log-probs
    # ((tokens, mask, depths, scores), their numpy views), where a CPU backend made the views once
    # (the ONNX Runtime drafter's output buffers): `host_arrays` uses them while those are the fields
    arrays: tuple | None = field(default=None, repr=False, compare=False)
    # top(n)'s trees: a backend that hands out one tree over its output buffers call after call
    # gets the same views back (5 slices of tensors cost ~100 us right after a graph call)
    tops: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @functools.cached_property
    def size(self) -> int:
        """Draft nodes per tree (kept: a backend hands out one tree call after call, and a
        tensor's shape costs 5-20 us to read right after a graph call)."""
        return int(self.tokens.shape[-1])

    def host_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """tokens, mask and depths as numpy arrays (a CPU tree): the backend's views where it has them
        (each torch .numpy() costs ~10 us right after a graph call)."""
        views = self._views()
        return views[:3] if views is not None else (self.tokens.numpy(), self.mask.numpy(), self.depths.numpy())

    def host_scores(self) -> np.ndarray | Tensor:
        """scores as a numpy array on the CPU (the backend's view where it has one), else the tensor."""
        if self.scores.device.type != "cpu":
            return self.scores
        views = self._views()
        return views[3] if views is not None else self.scores.numpy()

    def _views(self) -> tuple[np.ndarray, ...] | None:
        """The backend's numpy views of tokens, mask, depths and scores, while those are the fields."""
        a = self.arrays
        if a is not None and all(x is y for x, y in zip(a[0], (self.tokens, self.mask, self.depths, self.scores))):
            return a[1]
        return None

    def to(self, device) -> "DraftTree":
        return DraftTree(*(t.to(device) for t in (self.tokens, self.parents, self.mask, self.depths, self.scores)))

    def row(self, b: int) -> "DraftTree":
        return DraftTree(self.tokens[b], self.parents[b], self.mask[b], self.depths[b], self.scores[b])

    def top(self, n: int) -> "DraftTree":
        """Each tree's first n nodes (a tree or a batch of trees): views, no copies. Nodes are in
        rank order (select_nodes), so these are the n best by score; in any order where parents
        come first (graphs exported before format 8: candidate order) they are still a tree
        closed under ancestry, so verifying them stays lossless. Verifying it is verifying
        fewer draft tokens."""
        if n >= self.size:
            return self
        if n in self.tops:
            return self.tops[n]

        def cut(tokens, mask, depths, scores):
            return tokens[..., :n], mask[..., :n + 1, :n + 1], depths[..., :n + 1], scores[..., :n]
        views = cut(self.tokens, self.mask, self.depths, self.scores)
        host = self._views()
        arrays = (views, cut(*host)) if host is not None else None
        top = self.tops[n] = DraftTree(views[0], self.parents[..., :n + 1], views[1], views[2], views[3], arrays)
        return top


@functools.cache
def root_only_tree() -> DraftTree:
    """The root alone (verifying it is one step of plain decoding), on the CPU where sampled
    acceptance reads it; made once: nothing writes it."""
    z = torch.zeros(0, dtype=torch.int64)
    return DraftTree(z, torch.full((1,), -1, dtype=torch.int64), torch.ones(1, 1, dtype=torch.bool),
                     torch.zeros(1, dtype=torch.int64), z.float())


def _topk(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Top-k along the last axis of float32 scores, sorted, with ties to the lower index.

    Traced for export it is one ONNX TopK, whose spec puts the lower index first on ties (and
    which TensorRT runs for k <= 3840, unlike a full sort over the draft vocabulary). Eagerly,
    torch.topk's tie order is unspecified (quantized drafters produce exact ties often enough for
    this to matter to parity), so the top-k runs over int64 keys that order the scores and then
    the indices: one fixed-shape op on any device, which a CUDA graph or torch.compile captures."""
    if torch.jit.is_tracing() or torch.onnx.is_in_onnx_export():
        return torch.topk(x, k, dim=-1, largest=True, sorted=True)
    indices = torch.topk(order_keys(x), k, dim=-1).indices
    return x.gather(x.dim() - 1, indices), indices


def order_keys(x: Tensor) -> Tensor:
    """int64 keys of float32 x [..., n] in the order of (x descending, index ascending): the
    float's bits as an int32 that orders like the float (negative floats' magnitude bits
    flipped), times 2^32, plus (2^32 - 1 - index)."""
    bits = (x.float() + 0.0).view(torch.int32)      # + 0.0: -0.0 becomes +0.0, equal as floats
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    index = torch.arange(x.shape[-1], dtype=torch.int64, device=x.device)
    return ordered * (1 << 32) + ((1 << 32) - 1 - index)


def rank_desc(x: Tensor) -> Tensor:
    """Rank of each element of short vectors [..., n] in descending order, ties to the lower
    index (a stable sort's order), computed from a comparison matrix so that every backend
    agrees exactly; TopK's own tie order is not specified the same way everywhere."""
    n = x.shape[-1]
    earlier = torch.ones(n, n, dtype=torch.bool, device=x.device).tril(-1)          # [i, j]: j < i
    a, b = x[..., None, :], x[..., :, None]
    beats = (a > b) | ((a == b) & earlier)
    return beats.sum(-1)


# Gathers and scatters along the last axis name it by its positive index: onnx's reference
# evaluator (which runs the NVFP4 graphs here) mishandles GatherElements with axis -1.


def rank_of(scores: list[float], i: int) -> int:
    """rank_desc(scores)[i] for one element, in Python: on a CPU the decoder ranks only the
    accepted nodes of each tree, from the scores as lists (tensor or numpy ops on a batch's few
    scores cost 100-180 us right after a graph call has flushed the caches)."""
    s = scores[i]
    return sum(1 for k, x in enumerate(scores) if x > s or (x == s and k < i))


def stable_topk(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Top-k along the last axis of short vectors [..., n] with ties to the lower index."""
    order = torch.topk(-rank_desc(x).float(), k, dim=-1).indices   # ranks are distinct: no ties left
    return x.gather(x.dim() - 1, order), order


def ancestor_mask(parents: Tensor, steps: int) -> Tensor:
    """[..., M] parent indices (-1 for the root) -> [..., M, M] bool: each node and its ancestors."""
    M = parents.shape[-1]
    eye = torch.eye(M, dtype=torch.float32, device=parents.device)
    adj = torch.zeros(*parents.shape, M + 1, dtype=torch.float32, device=parents.device)
    # Column M absorbs the root's "-1" parent and is dropped.
    adj = adj.scatter(adj.dim() - 1, torch.where(parents < 0, M, parents)[..., None], 1.0)[..., :M]
    reach = eye + adj
    for _ in range(steps):   # reach covers paths of length <= 2**steps
        reach = (reach @ reach).clamp(max=1.0)
    return reach > 0


def _pick(x: Tensor, index: Tensor) -> Tensor:
    """x [B, T, F], index [B, K] -> [B, K, F]: rows `index` of each sequence. A Gather over the
    flattened rows (a GatherElements along axis 1 is not run by every ONNX engine)."""
    B, T, F = x.shape
    flat = (torch.arange(B, device=x.device)[:, None] * T + index).reshape(-1)
    return x.reshape(B * T, F)[flat].reshape(B, index.shape[1], F)


def draft_trees(drafter: EagleDrafter, captured: Tensor, input_ids: Tensor, past_k: Tensor, past_v: Tensor,
                shape: TreeShape, past_lengths: Tensor | None = None, new_lengths: Tensor | None = None
                ) -> tuple[DraftTree, Tensor, Tensor]:
    """Run drafter step 0 over newly committed rows of B sequences, then the D-1 expansion steps.

    captured: [B, T, A * Ht] target states of committed tokens t..t+T-1
    input_ids: [B, T] the tokens one position later (t+1..t+T); sequence b's last valid one is its root
    past_k / past_v: [B, Hkv, P, D] drafter KV of earlier committed rows (position = row index)
    past_lengths: [B] committed rows of each sequence (rows beyond are padding, never seen); default P
    new_lengths: [B] valid new rows of each sequence (1..T; the rest is padding); default T
    Padding instead of packing: a sequence's rows stay one contiguous run, so positions, the
    drafter's causal mask and its KV rows are plain offsets, and batch 1 is the same code.
    Returns the batch of trees and the drafter KV rows of the T inputs (padding rows included;
    the caller keeps the valid ones).
    """
    D, K = shape.depth, shape.top_k
    B, T, P = input_ids.shape[0], input_ids.shape[1], past_k.shape[2]
    dev = input_ids.device   # every tensor made here lives with the inputs (CPU when exporting)
    if past_lengths is None:
        past_lengths = torch.full((B,), P, dtype=torch.int64, device=dev)
    if new_lengths is None:
        new_lengths = torch.full((B,), T, dtype=torch.int64, device=dev)
    new_rows = torch.arange(T, dtype=torch.int64, device=dev)
    positions = past_lengths[:, None] + new_rows[None]                                     # [B, T]
    past_seen = torch.arange(P, dtype=torch.int64, device=dev)[None] < past_lengths[:, None]   # [B, P]
    causal = new_rows[None, :] <= new_rows[:, None]                                        # [T, T]
    mask0 = torch.cat((past_seen[:, None].expand(B, T, P), causal[None].expand(B, T, T)), dim=2)
    step0 = drafter(drafter.project(captured), input_ids, positions, mask0, past_k, past_v, logits=False)
    ctx_k, ctx_v = torch.cat((past_k, step0.new_k), 2), torch.cat((past_v, step0.new_v), 2)

    last = (new_lengths - 1)[:, None]                                                      # [B, 1]
    logp = torch.log_softmax(drafter.logits_of(_pick(step0.feedback, last))[:, 0].float(), dim=-1)   # [B, Vd]
    scores, draft_ids = _topk(logp, K)                                                     # [B, K]
    tokens = drafter.to_target_ids(draft_ids)
    all_scores, all_tokens = [scores], [tokens]
    all_parents = [torch.full((B, K), -1, dtype=torch.int64, device=dev)]
    frontier = torch.arange(K, device=dev)[None].expand(B, K)          # candidate index of each frontier node
    state = _pick(step0.feedback, last).expand(B, K, step0.feedback.shape[-1])
    root_position = past_lengths + new_lengths - 1                                         # [B]
    # Tree KV rows and the frontier's visibility of them exist from step 2 on; keeping them
    # None before that avoids empty tensors in the exported graph.
    tree_k = tree_v = ancestors = None
    eye = torch.eye(K, dtype=torch.bool, device=dev)
    seen = torch.cat((past_seen, new_rows[None] < new_lengths[:, None]), dim=1)[:, None].expand(B, K, P + T)
    eyes = eye[None].expand(B, K, K)
    offset = K
    for step in range(1, D):
        pos = (root_position + step)[:, None].expand(B, K)
        if ancestors is None:
            mask, kv_k, kv_v = torch.cat((seen, eyes), dim=2), ctx_k, ctx_v
        else:
            mask = torch.cat((seen, ancestors, eyes), dim=2)
            kv_k, kv_v = torch.cat((ctx_k, tree_k), 2), torch.cat((ctx_v, tree_v), 2)
        out = drafter(state, tokens, pos, mask, kv_k, kv_v)
        tree_k = out.new_k if tree_k is None else torch.cat((tree_k, out.new_k), 2)
        tree_v = out.new_v if tree_v is None else torch.cat((tree_v, out.new_v), 2)
        child_logp, child_ids = _topk(torch.log_softmax(out.logits.float(), dim=-1), K)       # [B, K, K]
        cand_scores = (scores[:, :, None] + child_logp).reshape(B, K * K)
        cand_tokens = drafter.to_target_ids(child_ids).reshape(B, K * K)
        all_scores.append(cand_scores)
        all_tokens.append(cand_tokens)
        all_parents.append(frontier.repeat_interleave(K, dim=1))
        scores, best = stable_topk(cand_scores, K)
        parent_local = torch.div(best, K, rounding_mode="floor")                             # [B, K]
        tokens = cand_tokens.gather(1, best)
        state = _pick(out.feedback, parent_local)
        ancestors = eye[parent_local] if ancestors is None else \
            torch.cat((_pick(ancestors, parent_local), eye[parent_local]), dim=2)
        frontier = offset + best
        offset += K * K

    return select_nodes(torch.cat(all_scores, 1), torch.cat(all_tokens, 1), torch.cat(all_parents, 1), shape), \
        step0.new_k, step0.new_v


def draft_tree(drafter: EagleDrafter, captured: Tensor, input_ids: Tensor, past_k: Tensor, past_v: Tensor,
               shape: TreeShape) -> tuple[DraftTree, Tensor, Tensor]:
    """draft_trees for one sequence ([1, ...] inputs, every row valid), its tree unbatched."""
    trees, new_k, new_v = draft_trees(drafter, captured, input_ids, past_k, past_v, shape)
    return trees.row(0), new_k, new_v


def select_nodes(scores: Tensor, tokens: Tensor, parents: Tensor, shape: TreeShape) -> DraftTree:
    """Keep the N best candidates [..., M] by cumulative log-prob, in rank order.

    A child's score never exceeds its parent's (log-probs are <= 0) and parents come earlier
    in candidate order, so ranking with ties to the lower index puts every parent ahead of its
    children: the kept set, and every prefix of it in rank order, is closed under ancestry,
    even when a child's log-prob is exactly 0."""
    N, M, dev = shape.total_tokens, scores.shape[-1], scores.device
    lead = scores.shape[:-1]
    keep = stable_topk(scores, N)[1]      # kept candidate indices, best first
    slot = torch.zeros(*lead, M + 1, dtype=torch.int64, device=dev)
    last = scores.dim() - 1
    slot = slot.scatter(last, keep, torch.arange(1, N + 1, device=dev).expand(*lead, N))   # candidate -> node index
    kept_parents = parents.gather(last, keep)
    node_parents = slot.gather(last, torch.where(kept_parents < 0, M, kept_parents))      # root -> slot[M] = 0
    parents_full = torch.cat((torch.full((*lead, 1), -1, dtype=torch.int64, device=dev), node_parents), -1)
    mask = ancestor_mask(parents_full, shape.closure_steps())
    depths = mask.sum(-1) - 1
    return DraftTree(tokens.gather(last, keep), parents_full, mask, depths, scores.gather(last, keep))
