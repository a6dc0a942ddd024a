"""Greedy acceptance as batched tensor code (`accept_greedy_batch`) against the tree walk
(`accept_greedy`) on random trees, with repeated sibling tokens, deep matches and padding rows.
The same code inside the exported target graph: tests/test_export.py."""
from __future__ import annotations

import torch

from eagle_trt.tree import DraftTree, ancestor_mask
from eagle_trt.verify import accept_greedy, accept_greedy_batch


def random_tree(n: int, vocab: int, gen: torch.Generator) -> DraftTree:
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n + 1)]
    parents_t = torch.tensor(parents)
    mask = ancestor_mask(parents_t[None], n + 1)[0]
    depths = mask.sum(-1) - 1
    tokens = torch.randint(0, vocab, (n,), generator=gen)
    return DraftTree(tokens, parents_t, mask, depths, torch.zeros(n))


def random_batch(seed: int, vocab: int = 4, n: int = 12, pad: int = 2, B: int = 64):
    """B random trees of n nodes (a small vocabulary: matches go deep and siblings repeat
    tokens), each followed by `pad` padding rows; returns trees, ids [B, T], mask [B, T, T]."""
    gen = torch.Generator().manual_seed(seed)
    trees = [random_tree(n, vocab, gen) for _ in range(B)]
    ids = torch.stack([torch.cat((torch.tensor([0]), t.tokens, torch.randint(0, vocab, (pad,), generator=gen)))
                       for t in trees])
    mask = torch.zeros(B, n + 1 + pad, n + 1 + pad, dtype=torch.bool)
    for b, t in enumerate(trees):
        mask[b, : n + 1, : n + 1] = t.mask
        mask[b, n + 1:, n + 1:] = torch.eye(pad, dtype=torch.bool)    # padding rows see only themselves
    return trees, ids, mask


def test_batched_greedy_acceptance_equals_the_tree_walk():
    vocab, n = 4, 12
    trees, ids, mask = random_batch(0, vocab, n)
    best = torch.randint(0, vocab, ids.shape, generator=torch.Generator().manual_seed(1))
    path, length, tokens = accept_greedy_batch(best, ids, mask)
    lengths, repeated = [], 0
    for b, t in enumerate(trees):
        logits = torch.nn.functional.one_hot(best[b, : n + 1], vocab).float()
        want_path, bonus = accept_greedy(t, logits)
        L = int(length[b])
        assert path[b, :L].tolist() == want_path
        assert tokens[b, :L].tolist() == [int(ids[b, j]) for j in want_path[1:]] + [bonus]
        lengths.append(L)
        siblings = [[int(t.tokens[c - 1]) for c in range(1, n + 1) if int(t.parents[c]) == p] for p in range(n + 1)]
        repeated += any(len(s) != len(set(s)) for s in siblings)
    assert max(lengths) >= 4 and min(lengths) == 1 and repeated > 10   # deep paths, rejections, repeated siblings


def test_batched_greedy_acceptance_can_fail_on_a_wrong_tree():
    """A mask that breaks the chain (node 2 made a child of the root) changes the answer."""
    ids = torch.tensor([[0, 5, 6]])
    best = torch.tensor([[5, 6, 9]])
    chain = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 1, 1]]], dtype=torch.bool)
    path, length, tokens = accept_greedy_batch(best, ids, chain)
    assert (path[0, :3].tolist(), int(length[0]), tokens[0, :3].tolist()) == ([0, 1, 2], 3, [5, 6, 9])
    flat = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool)
    path, length, tokens = accept_greedy_batch(best, ids, flat)
    assert (path[0, :2].tolist(), int(length[0]), tokens[0, :2].tolist()) == ([0, 1], 2, [5, 6])


def test_top_n_is_the_first_n_nodes_and_a_tree():
    """DraftTree.top(n) on a batch of trees: each tree's first n nodes, which are its n best when
    the nodes are in rank order (select_nodes), and a tree closed under ancestry in any order
    where parents come first (graphs exported before format 8)."""
    from eagle_trt.tree import rank_desc, rank_of
    gen = torch.Generator().manual_seed(5)
    trees = []
    for _ in range(6):
        t = random_tree(12, 50, gen)
        scores = torch.zeros(13)
        for i in range(1, 13):    # cumulative log-probs: a child never beats its parent; some ties
            scores[i] = scores[t.parents[i]] - torch.randint(0, 3, (1,), generator=gen).float()
        trees.append(DraftTree(t.tokens, t.parents, t.mask, t.depths, scores[1:]))
    fields = ("tokens", "parents", "mask", "depths", "scores")
    batch = DraftTree(*(torch.stack([getattr(t, f) for t in trees]) for f in fields))
    for n in (1, 4, 7, 12):
        top = batch.top(n)
        for b, t in enumerate(trees):
            got = top.row(b)
            assert got.tokens.tolist() == t.tokens[:n].tolist() and got.depths.tolist() == t.depths[:n + 1].tolist()
            assert torch.equal(got.mask, ancestor_mask(got.parents[None], n + 1)[0])      # closed under ancestry
            if bool((rank_desc(t.scores) == torch.arange(12)).all()):                      # rank order: the n best
                assert sorted(got.scores.tolist(), reverse=True) == sorted(t.scores.tolist(), reverse=True)[:n]
    # a tree in rank order, as select_nodes makes them: the first n are the n best
    t = trees[0]
    order = [0] + [int(i) + 1 for i in torch.sort(rank_desc(t.scores)).indices]
    new_of = {old: new for new, old in enumerate(order)}
    ranked = DraftTree(t.tokens[[i - 1 for i in order[1:]]],
                       torch.tensor([-1] + [new_of[int(t.parents[i])] for i in order[1:]]),
                       t.mask[order][:, order], t.depths[order], t.scores[[i - 1 for i in order[1:]]])
    assert torch.equal(ranked.mask, ancestor_mask(ranked.parents[None], 13)[0])
    for n in (1, 4, 7):
        assert ranked.top(n).scores.tolist() == sorted(t.scores.tolist(), reverse=True)[:n]
    # one node's rank from a list of scores (the decoder's on a CPU) as rank_desc's, ties included
    assert any(len(set(t.scores.tolist())) < 12 for t in trees)
    for t in trees:
        scores = t.scores.tolist()
        assert [rank_of(scores, i) for i in range(12)] == rank_desc(t.scores).tolist()
    assert batch.top(4) is batch.top(4) and batch.top(4) is not batch.top(5)     # top(n)'s views kept
