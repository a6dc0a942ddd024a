"""EAGLE-2 dynamic draft tree (DESIGN.md section 2, "Draft tree").

`eagle_trt.tree.draft_tree` batches the k frontier nodes of each step into one masked drafter
call. The reference below is written independently: it runs the drafter one row / one node at
a time with an explicit list of KV rows per node (its committed context plus its ancestors),
does its own top-k and selection in float64 Python, and builds masks by walking parents. The
two must agree on tokens, parents, mask and depths, and on scores to float tolerance.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from conftest import capturing, oracle_drafter
from eagle_trt.checkpoints import random_drafter
from eagle_trt.config import ConfigError, TreeShape
from eagle_trt.models.target import causal_mask
from eagle_trt.tree import DraftTree, ancestor_mask, draft_tree, select_nodes


# ----------------------------------------------------------------------------- reference


@dataclass
class _Cand:
    score: float            # cumulative draft log-prob (float64)
    token: int              # target-vocabulary id
    parent: int             # candidate index of the parent, -1 for a child of the root
    depth: int              # 1 for children of the root
    state: torch.Tensor     # [1, 1, H] the state this node is fed with when it is expanded
    anc_k: list = field(default_factory=list)   # KV rows of its ancestors (depth 1 .. depth-1)
    anc_v: list = field(default_factory=list)


def _ref_topk(logp: list[float], k: int) -> list[int]:
    """k largest, ties to the lower index."""
    return sorted(range(len(logp)), key=lambda i: (-logp[i], i))[:k]


def _seq_dim(drafter) -> int:
    """The KV sequence axis of the drafter's cache layout (the axis of an empty past)."""
    return list(drafter.empty_past()[0].shape).index(0)


def _log_softmax64(logits: torch.Tensor) -> list[float]:
    x = logits.double()
    return (x - torch.logsumexp(x, dim=-1)).tolist()


@torch.no_grad()
def reference_tree(drafter, captured, input_ids, past_k, past_v, shape: TreeShape):
    """Straightforward EAGLE-2 tree. Returns (tokens, parents, mask, depths, scores, new_k, new_v)
    with the same layout as DraftTree (node 0 = root, draft nodes in rank order: best score
    first, ties to the earlier candidate)."""
    D, K, N = shape.depth, shape.top_k, shape.total_tokens
    S = _seq_dim(drafter)
    T, P = input_ids.shape[1], past_k.shape[S]
    d2t = drafter.d2t.tolist()

    # Step 0, one committed row at a time, each seeing every earlier row.
    f = drafter.project(captured)
    ctx_k, ctx_v = past_k, past_v
    for t in range(T):
        out = drafter(f[:, t:t + 1], input_ids[:, t:t + 1], torch.tensor([[P + t]]),
                      torch.ones(1, 1, P + t + 1, dtype=torch.bool), ctx_k, ctx_v)
        ctx_k, ctx_v = torch.cat((ctx_k, out.new_k), S), torch.cat((ctx_v, out.new_v), S)
    new_k, new_v = ctx_k.narrow(S, P, T), ctx_v.narrow(S, P, T)

    logp = _log_softmax64(out.logits[0, -1])
    cands = [_Cand(logp[d], d + d2t[d], -1, 1, out.feedback[:, -1:]) for d in _ref_topk(logp, K)]
    frontier = list(range(len(cands)))
    for _step in range(1, D):
        new = []
        for c in frontier:
            node = cands[c]
            keys = torch.cat([ctx_k] + node.anc_k, S)
            values = torch.cat([ctx_v] + node.anc_v, S)
            # the root sits at drafter position P + T - 1, a node of depth d at P + T - 1 + d
            out = drafter(node.state, torch.tensor([[node.token]]), torch.tensor([[P + T - 1 + node.depth]]),
                          torch.ones(1, 1, keys.shape[S] + 1, dtype=torch.bool), keys, values)
            child_logp = _log_softmax64(out.logits[0, 0])
            for d in _ref_topk(child_logp, K):
                cands.append(_Cand(node.score + child_logp[d], d + d2t[d], c, node.depth + 1, out.feedback,
                                   node.anc_k + [out.new_k], node.anc_v + [out.new_v]))
                new.append(len(cands) - 1)
        frontier = sorted(new, key=lambda i: (-cands[i].score, i))[:K]

    keep = sorted(range(len(cands)), key=lambda i: (-cands[i].score, i))[:N]
    node_of = {c: n + 1 for n, c in enumerate(keep)}
    parents = [-1] + [0 if cands[c].parent < 0 else node_of[cands[c].parent] for c in keep]
    mask = torch.zeros(N + 1, N + 1, dtype=torch.bool)
    depths = []
    for i in range(N + 1):
        j, d = i, 0
        mask[i, i] = True
        while parents[j] >= 0:
            j = parents[j]
            mask[i, j] = True
            d += 1
        depths.append(d)
    for n, c in enumerate(keep):
        assert depths[n + 1] == cands[c].depth
    return ([cands[c].token for c in keep], parents, mask, depths, [cands[c].score for c in keep], new_k, new_v)


# ----------------------------------------------------------------------------- helpers


def _inputs(drafter, vocab: int, P: int, T: int, seed: int, captured_scale: float = 1.0):
    """Committed-context KV (P rows, produced by the drafter itself over a random prefix) and T
    pending rows: target states [1, T, A * Ht] and token ids [1, T]."""
    gen = torch.Generator().manual_seed(seed)
    width = drafter.cfg.num_aux_hidden_states * drafter.cfg.target_hidden_size
    past_k, past_v = drafter.empty_past()
    if P:
        with torch.no_grad():
            out = drafter(drafter.project(torch.randn(1, P, width, generator=gen)),
                          torch.randint(0, vocab, (1, P), generator=gen), torch.arange(P)[None],
                          causal_mask(P, 0), past_k, past_v)
        past_k, past_v = out.new_k, out.new_v
    captured = captured_scale * torch.randn(1, T, width, generator=gen)
    ids = torch.randint(0, vocab, (1, T), generator=gen)
    return captured, ids, past_k, past_v


def _target_inputs(target, drafter, prompt: list[int], P: int):
    """Real captured target states for `prompt`: the first P rows become drafter context, the
    rest are pending. The drafter pairs the state of token t with the id of token t + 1."""
    model = capturing(target, drafter).model
    with torch.no_grad():
        n = len(prompt)
        out = model(torch.tensor([prompt]), torch.arange(n)[None], causal_mask(n, 0), *model.empty_past())
    captured = out.captured[:, :-1]
    ids = torch.tensor([prompt[1:]])
    past_k, past_v = drafter.empty_past()
    if P:
        with torch.no_grad():
            o = drafter(drafter.project(captured[:, :P]), ids[:, :P], torch.arange(P)[None], causal_mask(P, 0),
                        past_k, past_v)
        past_k, past_v = o.new_k, o.new_v
    return captured[:, P:], ids[:, P:], past_k, past_v


def _compare(drafter, captured, ids, past_k, past_v, shape: TreeShape):
    with torch.no_grad():
        tree, new_k, new_v = draft_tree(drafter, captured, ids, past_k, past_v, shape)
    r_tokens, r_parents, r_mask, r_depths, r_scores, r_k, r_v = reference_tree(drafter, captured, ids, past_k,
                                                                               past_v, shape)
    assert tree.size == shape.total_tokens
    assert tree.tokens.tolist() == r_tokens
    assert tree.parents.tolist() == r_parents
    assert torch.equal(tree.mask, r_mask)
    assert tree.depths.tolist() == r_depths
    torch.testing.assert_close(tree.scores.double(), torch.tensor(r_scores, dtype=torch.float64),
                               atol=2e-4, rtol=1e-4)   # fp32 log-softmax of a random drafter's large logits
    torch.testing.assert_close(new_k, r_k, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(new_v, r_v, atol=1e-4, rtol=1e-4)
    return tree


def check_invariants(tree: DraftTree, shape: TreeShape, committed: int = 7) -> None:
    N = shape.total_tokens
    parents = tree.parents.tolist()
    depths = tree.depths.tolist()
    mask = tree.mask
    assert tree.size == N
    assert tree.tokens.shape == (N,) and tree.scores.shape == (N,)
    assert tree.parents.shape == (N + 1,) and tree.depths.shape == (N + 1,)
    assert mask.shape == (N + 1, N + 1) and mask.dtype == torch.bool
    assert parents[0] == -1 and depths[0] == 0
    assert mask[0].tolist() == [True] + [False] * N
    positions = committed + tree.depths
    for i in range(1, N + 1):
        p = parents[i]
        assert 0 <= p < i, f"node {i} has parent {p}"
        expected = mask[p].clone()
        expected[i] = True
        assert torch.equal(mask[i], expected), f"mask row {i} is not parent row + self"
        # depth = path length to the root
        j, length = i, 0
        while parents[j] >= 0:
            j, length = parents[j], length + 1
        assert depths[i] == length == int(mask[i].sum()) - 1
        assert int(positions[i]) == int(positions[p]) + 1
        assert 1 <= depths[i] <= shape.depth
        # a child's cumulative log-prob never exceeds its parent's
        if p > 0:
            assert float(tree.scores[i - 1]) <= float(tree.scores[p - 1])
    # every kept node's ancestors are kept: all mask columns refer to nodes in the tree, and
    # the mask is lower triangular (ancestors precede)
    assert not torch.triu(mask, diagonal=1).any()
    assert (tree.scores <= 0).all()


# ----------------------------------------------------------------------------- reference parity

SHAPES = [
    TreeShape(depth=4, top_k=1, total_tokens=4),     # chain
    TreeShape(depth=3, top_k=2, total_tokens=5),
    TreeShape(depth=4, top_k=3, total_tokens=12),
    TreeShape(depth=5, top_k=4, total_tokens=30),
    TreeShape(depth=2, top_k=3, total_tokens=12),    # every candidate kept (N == max_nodes)
    TreeShape(depth=1, top_k=4, total_tokens=3),     # step 0 only
]


@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"D{s.depth}k{s.top_k}N{s.total_tokens}")
@pytest.mark.parametrize("P,T", [(0, 1), (6, 3)])
def test_matches_reference_random_drafter(tiny_target, variant, shape, P, T):
    drafter = random_drafter(tiny_target, variant, seed=11 + P, std=0.3)
    captured, ids, past_k, past_v = _inputs(drafter, tiny_target.config.vocab_size, P, T, seed=5 + T)
    tree = _compare(drafter, captured, ids, past_k, past_v, shape)
    check_invariants(tree, shape)


@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
@pytest.mark.parametrize("shape", [TreeShape(3, 2, 5), TreeShape(4, 3, 12), TreeShape(5, 4, 30)],
                         ids=lambda s: f"D{s.depth}k{s.top_k}N{s.total_tokens}")
def test_matches_reference_reduced_draft_vocab(tiny_target, variant, shape):
    drafter = random_drafter(tiny_target, variant, seed=3, draft_vocab_size=40, std=0.3)
    assert drafter.d2t.abs().sum() > 0   # a real (non-identity) draft -> target map
    captured, ids, past_k, past_v = _inputs(drafter, tiny_target.config.vocab_size, P=5, T=2, seed=9)
    tree = _compare(drafter, captured, ids, past_k, past_v, shape)
    used = drafter.to_target_ids(torch.arange(40))
    assert torch.isin(tree.tokens, used).all()
    assert drafter.t2d[tree.tokens].all()


@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
@pytest.mark.parametrize("shape", [TreeShape.chain(5), TreeShape(3, 2, 5), TreeShape(4, 3, 12),
                                   TreeShape(5, 4, 30)], ids=lambda s: f"D{s.depth}k{s.top_k}N{s.total_tokens}")
def test_matches_reference_oracle_drafter(tiny_target, variant, shape):
    drafter = oracle_drafter(tiny_target, variant, noise=0.05, seed=2)
    prompt = torch.randint(3, tiny_target.config.vocab_size, (12,), generator=torch.Generator().manual_seed(4))
    captured, ids, past_k, past_v = _target_inputs(tiny_target, drafter, prompt.tolist(), P=8)
    assert ids.shape[1] == 3 and past_k.shape[_seq_dim(drafter)] == 8
    tree = _compare(drafter, captured, ids, past_k, past_v, shape)
    check_invariants(tree, shape)


def _uniform_drafter(tiny_target):
    drafter = random_drafter(tiny_target, "eagle3", seed=1)
    with torch.no_grad():
        drafter.lm_head.weight.zero_()   # every draft distribution is exactly uniform
    return drafter


def test_tied_scores_structure_matches_reference(tiny_target):
    """Uniform drafts: all siblings tie, and so do all candidates of one depth. Candidate
    ranking breaks ties to the earlier candidate, so the tree's shape is fully determined
    whatever order the vocabulary top-k returns tied tokens in."""
    drafter = _uniform_drafter(tiny_target)
    shape = TreeShape(4, 3, 14)
    captured, ids, past_k, past_v = _inputs(drafter, tiny_target.config.vocab_size, P=3, T=2, seed=1)
    with torch.no_grad():
        tree, _, _ = draft_tree(drafter, captured, ids, past_k, past_v, shape)
    _, r_parents, r_mask, r_depths, r_scores, _, _ = reference_tree(drafter, captured, ids, past_k, past_v, shape)
    check_invariants(tree, shape)
    assert tree.parents.tolist() == r_parents
    assert torch.equal(tree.mask, r_mask)
    assert tree.depths.tolist() == r_depths
    torch.testing.assert_close(tree.scores.double(), torch.tensor(r_scores, dtype=torch.float64), atol=2e-4, rtol=0)
    # the first-ranked frontier node is expanded first, and the first 14 candidates are kept
    assert tree.parents.tolist()[:5] == [-1, 0, 0, 0, 1]
    assert tree.depths.tolist() == [0, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3]
    # siblings are distinct tokens
    parents = tree.parents.tolist()
    for node in range(N := shape.total_tokens + 1):
        sib = [int(tree.tokens[c - 1]) for c in range(1, N) if parents[c] == node]
        assert len(sib) == len(set(sib))


def test_vocab_topk_ties_go_to_lower_index(tiny_target):
    """Tied draft logits: the PyTorch reference must pick the lower draft ids, as ONNX TopK
    specifies ("the element with the lower index will appear first"), so that the exported
    drafter graph and this reference build the same tree. Ties are common once the drafter's
    logits are quantized (FP8 / NVFP4)."""
    drafter = _uniform_drafter(tiny_target)
    shape = TreeShape(4, 3, 14)
    captured, ids, past_k, past_v = _inputs(drafter, tiny_target.config.vocab_size, P=3, T=2, seed=1)
    with torch.no_grad():
        tree, _, _ = draft_tree(drafter, captured, ids, past_k, past_v, shape)
    r_tokens = reference_tree(drafter, captured, ids, past_k, past_v, shape)[0]
    assert r_tokens[:3] == [0, 1, 2]
    assert tree.tokens.tolist() == r_tokens


# ----------------------------------------------------------------------------- invariants


def test_invariants_on_many_random_trees(tiny_target):
    gen = torch.Generator().manual_seed(123)
    vocab = tiny_target.config.vocab_size
    drafters = {(v, vd): random_drafter(tiny_target, v, seed=7, draft_vocab_size=vd, std=0.5)
                for v in ("eagle3", "eagle3.1") for vd in (None, 24)}
    checked = 0
    for trial in range(40):
        D = int(torch.randint(1, 7, (), generator=gen))
        K = int(torch.randint(1, 6, (), generator=gen))
        max_nodes = K + (D - 1) * K * K
        lo = D if K == 1 else 1
        N = int(torch.randint(lo, max_nodes + 1, (), generator=gen))
        shape = TreeShape(D, K, N).validate(24)
        key = list(drafters)[trial % len(drafters)]
        drafter = drafters[key]
        P = int(torch.randint(0, 5, (), generator=gen))
        T = int(torch.randint(1, 4, (), generator=gen))
        captured, ids, past_k, past_v = _inputs(drafter, vocab, P, T, seed=1000 + trial, captured_scale=3.0)
        with torch.no_grad():
            tree, new_k, new_v = draft_tree(drafter, captured, ids, past_k, past_v, shape)
        check_invariants(tree, shape, committed=P + T)
        assert new_k.shape[_seq_dim(drafter)] == T and new_v.shape[_seq_dim(drafter)] == T
        if K == 1:   # a chain keeps exactly one node per depth
            assert tree.parents.tolist() == list(range(-1, N))
        checked += 1
    assert checked == 40


def _synthetic_candidates(shape: TreeShape, logp_fn):
    """Candidates laid out exactly as draft_tree lays them out: K children of the root, then
    per step K children of each of the K frontier nodes (the K best of the previous step)."""
    D, K = shape.depth, shape.top_k
    scores = [logp_fn() for _ in range(K)]
    parents = [-1] * K
    frontier = list(range(K))
    for _ in range(1, D):
        new = []
        for f in frontier:
            for _c in range(K):
                scores.append(scores[f] + logp_fn())
                parents.append(f)
                new.append(len(scores) - 1)
        frontier = sorted(new, key=lambda i: (-scores[i], i))[:K]
    tokens = torch.arange(len(scores), dtype=torch.int64) % 50
    return torch.tensor(scores, dtype=torch.float32), tokens, torch.tensor(parents, dtype=torch.int64)


@pytest.mark.parametrize("shape", [TreeShape(3, 2, 5), TreeShape(4, 3, 12), TreeShape(5, 4, 30),
                                   TreeShape(6, 8, 60), TreeShape.chain(4)],
                         ids=lambda s: f"D{s.depth}k{s.top_k}N{s.total_tokens}")
def test_select_nodes_tied_scores_keep_parent_closure(shape):
    scores, tokens, parents = _synthetic_candidates(shape, lambda: 0.0)
    assert (scores == 0).all()
    tree = select_nodes(scores, tokens, parents, shape)
    check_invariants(tree, shape)
    # all tied: the N earliest candidates are kept, in candidate order
    assert tree.tokens.tolist() == tokens[:shape.total_tokens].tolist()


def test_select_nodes_partial_ties_and_random_scores():
    gen = torch.Generator().manual_seed(0)
    for trial in range(30):
        shape = TreeShape(int(torch.randint(2, 6, (), generator=gen)), int(torch.randint(2, 5, (), generator=gen)), 1)
        N = int(torch.randint(1, shape.max_nodes + 1, (), generator=gen))
        shape = TreeShape(shape.depth, shape.top_k, N)
        # log-probs drawn from a tiny set, so many exact ties (including zeros) occur
        choices = torch.tensor([0.0, -0.5, -1.0])
        scores, tokens, parents = _synthetic_candidates(
            shape, lambda: float(choices[torch.randint(0, 3, (), generator=gen)]))
        tree = select_nodes(scores, tokens, parents, shape)
        check_invariants(tree, shape)
        # the kept set is the N best by score, ties to the earlier candidate
        best = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))[:N]
        assert tree.tokens.tolist() == tokens[best].tolist()       # best first
        # kept parents map back to the right candidates
        keep = best
        for n, c in enumerate(keep):
            p = int(parents[c])
            assert int(tree.parents[n + 1]) == (0 if p < 0 else keep.index(p) + 1)


def test_ancestor_mask_deep_chain():
    """closure by repeated squaring reaches ancestors at every depth the shape allows."""
    for D in (1, 2, 3, 4, 7, 8, 9, 16):
        shape = TreeShape.chain(D)
        parents = torch.arange(-1, D)
        mask = ancestor_mask(parents, shape.closure_steps())
        assert torch.equal(mask, torch.tril(torch.ones(D + 1, D + 1, dtype=torch.bool)))


# ----------------------------------------------------------------------------- TreeShape.validate


def test_tree_shape_max_nodes_and_valid_shapes():
    assert TreeShape(5, 8, 60).max_nodes == 8 + 4 * 64
    for shape in (TreeShape(5, 8, 60), TreeShape.chain(3), TreeShape(3, 2, 10), TreeShape(1, 4, 4),
                  TreeShape(2, 3, 12)):
        assert shape.validate(shape.top_k) is shape
    TreeShape(3, 2, 1).validate()   # a small tree of a deep shape is allowed


@pytest.mark.parametrize("shape,match", [
    (TreeShape(3, 2, 11), "exceeds"),            # 2 + 2*4 = 10 candidates
    (TreeShape(1, 4, 5), "exceeds"),             # only the 4 children of the root
    (TreeShape(2, 3, 13), "exceeds"),
    (TreeShape(3, 1, 4), "exceeds"),             # a chain of depth 3 has 3 candidates
    (TreeShape(0, 2, 2), "depth"),
    (TreeShape(-1, 2, 2), "depth"),
    (TreeShape(3, 0, 2), "top_k"),
    (TreeShape(3, -2, 2), "top_k"),
    (TreeShape(3, 2, 0), "total_tokens"),
    (TreeShape(3, 2, -5), "total_tokens"),
    (TreeShape(3, 2.0, 4), "top_k"),
    (TreeShape(True, 2, 2), "depth"),
    (TreeShape(4, 1, 3), "chain"),
])
def test_tree_shape_validate_errors(shape, match):
    with pytest.raises(ConfigError, match=match):
        shape.validate()


def test_tree_shape_top_k_exceeds_draft_vocab():
    with pytest.raises(ConfigError, match="draft vocabulary"):
        TreeShape(3, 9, 10).validate(draft_vocab_size=8)
    TreeShape(3, 8, 10).validate(draft_vocab_size=8)


def test_torch_drafter_rejects_top_k_above_draft_vocab(tiny_target):
    from eagle_trt.runtime.backend import TorchDrafter
    drafter = random_drafter(tiny_target, "eagle3", draft_vocab_size=6)
    with pytest.raises(ConfigError, match="draft vocabulary"):
        TorchDrafter(drafter, TreeShape(2, 7, 7))
