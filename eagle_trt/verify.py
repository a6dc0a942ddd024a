"""Tree verification: which draft nodes the target accepts, and the token it adds.

Greedy: follow the child whose token equals the target's argmax at its parent.
Sampling: at each node try the children in order; accept child x with probability p(x)
under the target's processed distribution; on rejection set p(x) = 0 and renormalise before
the next sibling; if all are rejected sample from what is left, and at a leaf sample the
bonus from p. For a deterministic (top-k) draft this yields exactly the target's
distribution: P(x) = p(x), and after a rejection the residual is p restricted and rescaled.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .config import SamplingConfig
from .tree import DraftTree


NUCLEUS_FIRST = 64   # tokens a top-p cut looks at first; 8x more while their mass falls short of top_p


def target_probs(logits: Tensor, sampling: SamplingConfig, on_device: bool = False) -> Tensor:
    """Temperature, then top-k, then top-p (transformers' order); returns fp32 probabilities,
    on the CPU: the seeded torch.Generator that makes sampling reproducible is a CPU one, and
    the same seed then draws the same tokens whatever device the target ran on. on_device: do
    the selection and softmax where the logits are (a GPU's batch of 1024 rows would spend ~0.3 s
    a step on the host), and move only the probabilities.

    Top-k keeps the tokens tied with the k-th largest too, as transformers does. Top-p keeps the
    smallest most-probable-first prefix whose mass reaches top_p (at least one token), cut from
    the largest probabilities (torch.topk), not from a sort of the whole vocabulary: a nucleus
    holds tens of tokens, and sorting SmolLM2's 49,152 logits took 4.4 ms a row here against
    ~0.2 ms. Sampled acceptance calls this once per tree node it visits."""
    return target_distribution(logits, sampling, on_device)[0]


def target_distribution(logits: Tensor, sampling: SamplingConfig,
                        on_device: bool = False) -> tuple[Tensor, Tensor | None]:
    """target_probs, and with top-p the tokens that can have mass (most probable first; None
    without top-p): what sampling from the cut distribution needs to look at. The probabilities
    are on the CPU, the tokens where the selection ran (the CPU unless on_device)."""
    logits = (logits.float() if on_device else logits.float().cpu()) / sampling.temperature
    V = logits.shape[-1]
    if sampling.top_k and sampling.top_k < V:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p >= 1.0:
        return probs.cpu(), None
    n = min(NUCLEUS_FIRST, V)
    while True:     # the cut lies among the n most probable tokens once their mass reaches top_p
        head, index = torch.topk(probs, n, dim=-1) if n < V else torch.sort(probs, dim=-1, descending=True)
        mass = head.cumsum(-1)
        if n >= V or bool((mass[..., -1] >= sampling.top_p).all()):
            break
        n = V if 8 * n >= V // 4 else 8 * n     # a flat distribution: cut from the sorted whole
    head = head.masked_fill(mass - head >= sampling.top_p, 0.0)   # kept while the mass before is short
    return torch.zeros_like(probs).scatter_(-1, index, head / head.sum(-1, keepdim=True)).cpu(), index


def children_lists(parents: list[int]) -> list[list[int]]:
    children: list[list[int]] = [[] for _ in parents]
    for node, parent in enumerate(parents):
        if parent >= 0:
            children[parent].append(node)
    return children


def accept_greedy(tree: DraftTree, logits: Tensor) -> tuple[list[int], int]:
    """logits [N + 1, V] of the target over root + draft nodes.
    Returns the accepted node indices (root first) and the target's next token."""
    best = logits.argmax(dim=-1).tolist()
    tokens = [-1] + tree.tokens.tolist()
    children = children_lists(tree.parents.tolist())
    path, node = [0], 0
    while True:
        nxt = next((c for c in children[node] if tokens[c] == best[node]), None)
        if nxt is None:
            return path, best[node]
        path.append(nxt)
        node = nxt


def accept_greedy_batch(best: Tensor, ids: Tensor, tree_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Greedy acceptance for a batch of trees at once, as fixed-shape tensor code (no loop over
    nodes or sequences, so it is one step on any device and can be traced into a graph).

    best [B, T]: the target's argmax at each row; ids [B, T]: the rows' tokens (row 0 the root);
    tree_mask [B, T, T]: row j = node j and its ancestors (a row that does not reach the root,
    e.g. padding, is never accepted). Returns path [B, T] (accepted nodes in depth order, root
    first, zero past the end), length [B] (nodes on the path, root included: the tokens the
    iteration adds) and tokens [B, T] (the emitted tokens, best at each path node: the accepted
    drafts, then the bonus). Equal to `accept_greedy` per tree, including its choice of the
    first matching child when siblings carry the same token."""
    T = ids.shape[1]
    mask = tree_mask.bool()
    depth = mask.sum(-1) - 1                                                      # [B, T]
    parent = (mask & (depth[:, None, :] == depth[:, :, None] - 1)).long().argmax(-1)   # root: 0, unused
    order = torch.arange(T, device=ids.device)
    match = (ids == _pick(best, parent, order)) & (order > 0)
    # the walk takes the lowest-index matching child: a match with an earlier matching sibling is not taken
    earlier = (parent[:, None, :] == parent[:, :, None]) & (order[None, :] < order[:, None]) & match[:, None, :]
    taken = (match & ~earlier.any(-1)) | (order == 0)
    on_path = mask[:, :, 0] & ~(mask & ~taken[:, None, :]).any(-1)               # root reached, every step taken
    length = on_path.sum(-1)
    at_depth = on_path[:, None, :] & (depth[:, None, :] == order[None, :, None])  # [B, depth, node]
    path = at_depth.long().argmax(-1)
    return path, length, _pick(best, path, order)


def _pick(values: Tensor, index: Tensor, order: Tensor) -> Tensor:
    """values.gather(1, index) for [B, T] tensors, as a one-hot product: the same numbers, with
    ops every ONNX consumer evaluates alike (onnx.reference's GatherElements, which runs the
    NVFP4 graphs here, mis-shapes this gather)."""
    one_hot = index[:, :, None] == order[None, None, :]                          # [B, T, T]
    return (one_hot.long() * values[:, None, :]).sum(-1)


def accept_sampled(tree: DraftTree, logits: Tensor, sampling: SamplingConfig,
                   generator: torch.Generator | None) -> tuple[list[int], int]:
    tokens = [-1] + tree.tokens.tolist()
    children = children_lists(tree.parents.tolist())
    path, node = [0], 0
    while True:
        p, support = target_distribution(logits[node], sampling)
        accepted, mass = None, 1.0          # p's mass left once rejected drafts are set to 0
        for child in children[node]:
            x = tokens[child]
            px = float(p[x])
            if float(torch.rand((), generator=generator)) * mass < px:   # x with probability p(x) / mass
                accepted = child
                break
            p[x] = 0.0
            mass = float((p if support is None else p[support]).sum(dtype=torch.float64))
            if mass <= 0:       # every token with mass was drafted and rejected: cannot happen
                break           # (the last one is always accepted), kept as a guard against rounding
        if accepted is None:
            return path, draw(p, generator, support)
        path.append(accepted)
        node = accepted


def draw(p: Tensor, generator: torch.Generator | None, support: Tensor | None = None) -> int:
    """One index drawn with probabilities p (a CPU vector, not necessarily normalised; support:
    the only indices that can have mass, as target_distribution gives them): the inverse CDF of
    one uniform from the generator, where an entry of probability 0 has an empty interval.
    torch.multinomial takes 1 ms here for SmolLM2's 49,152 entries; a nucleus's support, ~10 us."""
    weights = p if support is None else p[support]
    cdf = torch.cumsum(weights, 0, dtype=torch.float64)
    u = torch.rand((), dtype=torch.float64, generator=generator) * cdf[-1]
    i = int(torch.searchsorted(cdf, u, right=True))
    if i == len(cdf):                    # u rounded up to the total: the last entry with mass
        i = int(weights.nonzero()[-1])
    return i if support is None else int(support[i])


def sample_token(logits: Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> int:
    if sampling.greedy:
        return int(logits.argmax(-1).item())
    p, support = target_distribution(logits, sampling)
    return draw(p, generator, support)
