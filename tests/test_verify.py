"""Greedy acceptance as batched tensor code (`accept_greedy_batch`) against the tree walk
(`accept_greedy`) on random trees, with repeated sibling tokens, deep matches and padding rows;
and the same code as an ONNX graph (the greedy accept graph) on ONNX Runtime."""
from __future__ import annotations

import numpy as np
import pytest
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


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_greedy_accept_graph_equals_the_batched_code(dtype, tmp_path):
    """The exported graph (traced at 2 trees of 5 rows) at other sizes, on ONNX Runtime: the
    same paths, lengths and tokens as accept_greedy_batch on the argmax of the same logits,
    bit for bit (fp16 logits with ties included: both take the first maximum)."""
    from eagle_trt.export import check_graph, export_accept_greedy
    from eagle_trt.runtime.onnxruntime_backend import make_session
    graph = export_accept_greedy(tmp_path / "accept.onnx", dtype).path
    check_graph(str(graph))
    session = make_session(graph, threads=1)
    lengths = []
    for seed, (vocab, n, B) in enumerate([(4, 12, 64), (3, 30, 5), (6, 1, 3)]):
        _, ids, mask = random_batch(seed, vocab, n, B=B)
        logits = torch.randn(B, ids.shape[1], vocab, generator=torch.Generator().manual_seed(seed))
        logits = logits.to(getattr(torch, dtype))
        if dtype == "float16":
            logits[:, :, 1] = logits[:, :, 0]          # ties: the first index wins in both
        want = accept_greedy_batch(logits.argmax(-1), ids, mask)
        got = session.run(None, {"logits": logits.numpy(), "input_ids": ids.numpy(), "tree_mask": mask.numpy()})
        for w, g in zip(want, got):
            assert g.dtype == np.int64 and np.array_equal(g, w.numpy())
        lengths += got[1].tolist()
    assert max(lengths) >= 4 and min(lengths) == 1
