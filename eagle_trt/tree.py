"""EAGLE-2 dynamic draft tree, written as fixed-shape tensor code.

Shapes depend only on the tree shape (depth D, top_k k, total_tokens N) and the number of
newly committed tokens, never on values, so the same function is the PyTorch reference and
what the drafter exporter traces into one graph with the recurrence unrolled.

Node 0 of a tree is the root (the last committed token, not yet seen by the target); draft
nodes are 1..N, ordered so that every parent precedes its children.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .config import TreeShape
from .models.drafter import EagleDrafter
from .models.target import causal_mask


@dataclass
class DraftTree:
    tokens: Tensor     # [N] int64 target-vocabulary ids of the draft nodes 1..N
    parents: Tensor    # [N + 1] int64, parents[0] = -1 (root), parents[i] < i
    mask: Tensor       # [N + 1, N + 1] bool, row i = node i and its ancestors
    depths: Tensor     # [N + 1] int64, root 0; node position = root position + depth
    scores: Tensor     # [N] float32 cumulative draft log-probs

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])


def _topk(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Top-k along the last axis with ties to the lower index.

    Traced for export it is one ONNX TopK, whose spec puts the lower index first on ties (and
    which TensorRT runs for k <= 3840, unlike a full sort over the draft vocabulary). Eagerly,
    torch.topk's tie order is unspecified, so the boundary value's candidates are re-ranked
    stably; quantized drafters produce exact ties often enough for this to matter to parity."""
    if torch.jit.is_tracing() or torch.onnx.is_in_onnx_export():
        return torch.topk(x, k, dim=-1, largest=True, sorted=True)
    kth = torch.topk(x, k, dim=-1).values[..., -1:]
    rows = x.reshape(-1, x.shape[-1])
    picked = []
    for row, bound in zip(rows, kth.reshape(-1)):
        candidates = torch.nonzero(row >= bound).flatten()          # increasing index
        order = torch.sort(row[candidates], descending=True, stable=True).indices[:k]
        picked.append(candidates[order])
    indices = torch.stack(picked).reshape(*x.shape[:-1], k)
    return x.gather(-1, indices), indices


def rank_desc(x: Tensor) -> Tensor:
    """Rank of each element of a short 1-D vector in descending order, ties to the lower index
    (a stable sort's order), computed from a comparison matrix so that every backend agrees
    exactly; TopK's own tie order is not specified the same way everywhere."""
    n = x.shape[0]
    earlier = torch.ones(n, n, dtype=torch.bool, device=x.device).tril(-1)          # [i, j]: j < i
    beats = (x[None, :] > x[:, None]) | ((x[None, :] == x[:, None]) & earlier)
    return beats.sum(1)


def stable_topk(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Top-k of a short 1-D vector with ties to the lower index."""
    order = torch.topk(-rank_desc(x).float(), k).indices   # ranks are distinct: no ties left
    return x[order], order


def ancestor_mask(parents: Tensor, steps: int) -> Tensor:
    """[M] parent indices (-1 for the root) -> [M, M] bool: each node and its ancestors."""
    M = parents.shape[0]
    eye = torch.eye(M, dtype=torch.float32, device=parents.device)
    adj = torch.zeros(M, M + 1, dtype=torch.float32, device=parents.device)
    # Column M absorbs the root's "-1" parent and is dropped.
    adj = adj.scatter(1, torch.where(parents < 0, M, parents)[:, None], 1.0)[:, :M]
    reach = eye + adj
    for _ in range(steps):   # reach covers paths of length <= 2**steps
        reach = (reach @ reach).clamp(max=1.0)
    return reach > 0


def draft_tree(drafter: EagleDrafter, captured: Tensor, input_ids: Tensor, past_k: Tensor, past_v: Tensor,
               shape: TreeShape) -> tuple[DraftTree, Tensor, Tensor]:
    """Run drafter step 0 over T newly committed rows, then the D-1 expansion steps.

    captured: [1, T, A * Ht] target states of committed tokens t..t+T-1
    input_ids: [1, T] the tokens one position later (t+1..t+T); the last one is the root
    past_k / past_v: [1, P, Hkv, D] drafter KV of earlier committed rows (position = row index)
    Returns the tree and the drafter KV rows of the T committed inputs (to append to the cache).
    """
    D, K = shape.depth, shape.top_k
    T, P = input_ids.shape[1], past_k.shape[1]
    dev = input_ids.device   # every tensor made here lives with the inputs (CPU when exporting)
    positions = torch.arange(T, dtype=torch.int64, device=dev)[None] + P
    step0 = drafter(drafter.project(captured), input_ids, positions, causal_mask(T, P, dev), past_k, past_v)
    ctx_k, ctx_v = torch.cat((past_k, step0.new_k), 1), torch.cat((past_v, step0.new_v), 1)

    logp = torch.log_softmax(step0.logits[0, -1].float(), dim=-1)
    scores, draft_ids = _topk(logp, K)                                   # [K]
    tokens = drafter.to_target_ids(draft_ids)
    all_scores, all_tokens = [scores], [tokens]
    all_parents = [torch.full((K,), -1, dtype=torch.int64, device=dev)]
    frontier = torch.arange(K, device=dev)                               # candidate index of each frontier node
    state = step0.feedback[:, -1:].expand(1, K, step0.feedback.shape[-1])
    # Tree KV rows and the frontier's visibility of them exist from step 2 on; keeping them
    # None before that avoids empty tensors in the exported graph.
    tree_k = tree_v = ancestors = None
    eye = torch.eye(K, dtype=torch.bool, device=dev)
    seen = torch.ones(K, P + T, dtype=torch.bool, device=dev)
    offset = K
    for step in range(1, D):
        pos = (positions[:, -1:] + step).expand(1, K)
        if ancestors is None:
            mask, kv_k, kv_v = torch.cat((seen, eye), dim=1), ctx_k, ctx_v
        else:
            mask = torch.cat((seen, ancestors, eye), dim=1)
            kv_k, kv_v = torch.cat((ctx_k, tree_k), 1), torch.cat((ctx_v, tree_v), 1)
        out = drafter(state, tokens[None], pos, mask[None], kv_k, kv_v)
        tree_k = out.new_k if tree_k is None else torch.cat((tree_k, out.new_k), 1)
        tree_v = out.new_v if tree_v is None else torch.cat((tree_v, out.new_v), 1)
        child_logp, child_ids = _topk(torch.log_softmax(out.logits[0].float(), dim=-1), K)   # [K, K]
        cand_scores = (scores[:, None] + child_logp).reshape(-1)                             # [K*K]
        cand_tokens = drafter.to_target_ids(child_ids).reshape(-1)
        all_scores.append(cand_scores)
        all_tokens.append(cand_tokens)
        all_parents.append(frontier.repeat_interleave(K))
        scores, best = stable_topk(cand_scores, K)
        parent_local = torch.div(best, K, rounding_mode="floor")
        tokens = cand_tokens[best]
        state = out.feedback[:, parent_local]
        ancestors = eye[parent_local] if ancestors is None else \
            torch.cat((ancestors[parent_local], eye[parent_local]), dim=1)
        frontier = offset + best
        offset += K * K

    return select_nodes(torch.cat(all_scores), torch.cat(all_tokens), torch.cat(all_parents), shape), \
        step0.new_k, step0.new_v


def select_nodes(scores: Tensor, tokens: Tensor, parents: Tensor, shape: TreeShape) -> DraftTree:
    """Keep the N best candidates by cumulative log-prob.

    A child's score never exceeds its parent's (log-probs are <= 0) and parents come earlier
    in candidate order, so ranking with ties to the lower index puts every parent ahead of its
    children: the kept set is closed under ancestry, even when a child's log-prob is exactly 0.
    Keeping candidate order puts parents first."""
    N, M, dev = shape.total_tokens, scores.shape[0], scores.device
    kept = rank_desc(scores) < N
    # Kept candidate indices in increasing order: one TopK over (M - index) of the kept ones.
    keep = M - torch.topk(torch.where(kept, M - torch.arange(M, device=dev), 0), N).values
    slot = torch.zeros(scores.shape[0] + 1, dtype=torch.int64, device=dev)
    slot = slot.scatter(0, keep, torch.arange(1, N + 1, device=dev))      # candidate -> node index
    node_parents = slot[torch.where(parents[keep] < 0, scores.shape[0], parents[keep])]   # root -> slot[M] = 0
    parents_full = torch.cat((torch.full((1,), -1, dtype=torch.int64, device=dev), node_parents))
    mask = ancestor_mask(parents_full, shape.closure_steps())
    depths = mask.sum(-1) - 1
    return DraftTree(tokens[keep], parents_full, mask, depths, scores[keep])
