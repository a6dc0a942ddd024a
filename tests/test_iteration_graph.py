"""The iteration graph (drafting and verification in one ONNX Runtime call, OrtIteration) on the
tiny graphs: one call equal to a drafter call and a verification call (whole trees and
subtrees), the accepted rows handed to the next call in the graph, seeded sampling kept, and
what it refuses."""
from __future__ import annotations

import itertools

import numpy as np
import onnx
import pytest
import torch
from conftest import LIMITS, TINY_SHAPE, on_graph, seeded_cost_model, tiny_backends, two_call

from eagle_trt.config import SamplingConfig
from eagle_trt.export.iteration import IterationGraphError, compose_iteration
from eagle_trt.runtime.backend import KeptRows
from eagle_trt.runtime.loop import Request
from eagle_trt.runtime.onnxruntime_backend import OrtIteration, OrtTarget

SHAPE = TINY_SHAPE


@pytest.mark.parametrize("nodes", [None, 2])
def test_iteration_graph_computes_what_the_two_graph_calls_do(tiny_graphs, tiny_iteration_graph, nodes):
    """One call of the iteration graph against a drafter call and a verification call from the
    same state, over sequences of different lengths: the same trees, logits, captured states,
    acceptance and KV rows, both caches; verifying whole trees, and each tree's 2 best nodes
    (verify_nodes: the subtree the two-call path verifies with DraftTree.top)."""
    target_model, _, graphs, prompts = tiny_graphs
    pairs = [tiny_backends(tiny_graphs, "onnxruntime") for _ in range(2)]
    iteration = OrtIteration(tiny_iteration_graph, *pairs[1])
    states = torch.randn(3, 3, pairs[0][1].captured_width, generator=torch.Generator().manual_seed(0))
    ids, new_lengths = [[5, 6, 7], [8, 9, 0], [10, 0, 0]], [3, 2, 1]
    for target, drafter in pairs:
        target.reset()
        drafter.reset()
        for p in prompts[:3]:
            slot = target.add_sequence()
            target.forward(torch.tensor([p]), torch.arange(len(p))[None], torch.ones(len(p), len(p)).tril().bool()[None],
                           range(slot, slot + 1), last_only=True)
            target.commit([list(range(len(p)))])
            drafter.add_sequence()
        drafter.draft(states[:, :1], [[4], [4], [4]])        # a drafter past of one row each
    target, drafter = pairs[0]
    tree = drafter.draft(states, ids, new_lengths)
    want = target.verify([7, 9, 10], tree if nodes is None else tree.top(nodes))   # roots: the last valid ids
    want_accept = [torch.as_tensor(t).clone() for t in target.accept_greedy(want)]
    got_tree, got = iteration.run(states, ids, new_lengths, nodes=nodes)
    assert got.logits.shape[1] == 1 + (nodes or SHAPE.total_tokens)
    for name in ("tokens", "parents", "mask", "depths", "scores"):
        assert torch.equal(getattr(got_tree, name), getattr(tree, name)), name
    for name in ("logits", "captured", "ids", "mask"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    got_accept = pairs[1][0].accept_greedy(got)
    assert all(torch.equal(torch.as_tensor(a), torch.as_tensor(b)) for a, b in zip(got_accept, want_accept))
    rows = [[0, 1], [0], [0, 2]]
    for target, _ in pairs:
        target.commit(rows)
    (t0, d0), (t1, d1) = pairs
    assert t0.lengths == t1.lengths and d0.lengths == d1.lengths == [4, 3, 2]
    for a, b in ((t0.cache, t1.cache), (d0.cache, d1.cache)):
        n = max(a.lengths)
        assert torch.equal(a.kv[:, :, :3, :, :n], b.kv[:, :, :3, :, :n])


def test_iteration_graph_hands_the_accepted_rows_to_its_next_call(tiny_graphs, tiny_iteration_graph):
    """The iteration graph gathers the accepted rows' states and tokens (next_captured,
    next_input_ids) and the next call reads them where the graph wrote them: each step's block
    equals the host's gather of the captured states and the engine's pending ids, and decoding
    with the hand-off drafts the same trees (accept lengths) and tokens as copying the states in
    on the host, at batch 1, 3 and 8 with sequences leaving."""
    _, _, _, prompts = tiny_graphs
    target, drafter = tiny_backends(tiny_graphs, "onnxruntime")
    iteration = OrtIteration(tiny_iteration_graph, target, drafter)
    assert iteration.has_handoff and iteration.handoff
    host_gathers = []

    def keep_states(out, paths, index=None):      # the engine's call, and the host's gather beside it
        host_gathers.append([r.copy() for r in OrtTarget.keep_states(target, out, paths, None)])
        return OrtTarget.keep_states(target, out, paths, index)

    target.keep_states = keep_states
    decoder = on_graph(iteration)
    for p, n in zip(prompts[:3], (30, 12, 21)):
        decoder.add(Request(p, n))
    checked = 0
    while decoder.active:
        decoder.step()
        kept = decoder.engine.handoff
        if isinstance(kept, KeptRows):
            checked += 1
            for i, (rows, host) in enumerate(zip(kept, host_gathers[-1])):
                assert np.array_equal(rows, host)
                assert kept.ids[i, :len(rows)].tolist() == decoder.engine.pending_ids[i]
    assert checked > 5 and iteration.handoffs > 0
    del target.keep_states
    limits = LIMITS
    runs = {}
    for handoff in (True, False):
        iteration = OrtIteration(tiny_iteration_graph, target, drafter, handoff=handoff)
        for batch in (1, 3, 8):
            results = on_graph(iteration).generate_batch(
                [Request(p, n) for p, n in zip(prompts, limits)], max_batch=batch)
            runs[handoff, batch] = [(r.tokens, r.accept_lengths) for r in results]
        assert (iteration.handoffs > 0) == handoff
    for batch in (1, 3, 8):
        assert runs[True, batch] == runs[False, batch], f"batch {batch}: the hand-off drafted other trees"
    # steps verifying other subtrees than the last (T differs: other bindings) still read the last
    # step's hand-off in place, and decode what the two-call loop decodes with the same choices
    sizes = itertools.cycle([2, SHAPE.total_tokens, 1])
    tokens = {}
    for one_call in (True, False):
        model = seeded_cost_model(per_row=0.0001, fixed=0.03, accepted=[1.0 + 0.2 * n for n in range(SHAPE.total_tokens + 1)])
        model.choose = lambda batch, backlog=0, remaining=None: next(sizes)
        iteration = OrtIteration(tiny_iteration_graph, target, drafter)
        decoder = on_graph(iteration, cost_model=model) if one_call else two_call(target, drafter, cost_model=model)
        results = decoder.generate_batch([Request(p, n) for p, n in zip(prompts, limits)], max_batch=3)
        tokens[one_call] = [r.tokens for r in results]
        if one_call:
            assert len(set(decoder.verified)) == 3 and iteration.graph_calls == len(decoder.verified)
            assert iteration.handoffs > len(decoder.verified) // 2, (iteration.handoffs, len(decoder.verified))
    assert tokens[True] == tokens[False]


def test_iteration_graph_keeps_seeded_sampling_and_composing_refuses_what_it_cannot_do(tiny_graphs, tiny_iteration_graph, tmp_path):
    """Sampled sequences (own settings and seeds) inside a batch: the same tokens in one call per
    iteration as in two. Composing refuses a drafter made for another target; a two-graph file is
    not an iteration graph."""
    _, _, graphs, prompts = tiny_graphs
    target, drafter = tiny_backends(tiny_graphs, "onnxruntime")
    iteration = OrtIteration(tiny_iteration_graph, target, drafter)
    configs = [SamplingConfig(1.0, seed=1), SamplingConfig(0.7, top_p=0.9, seed=2), SamplingConfig(),
               SamplingConfig(1.2, top_k=5, seed=3)]
    outputs = []
    for it in (None, iteration):
        decoder = on_graph(it) if it is not None else two_call(target, drafter)
        outputs.append([r.tokens for r in decoder.generate_batch([Request(p, 24, c) for p, c in zip(prompts, configs)],
                                                                  max_batch=4)])
    assert outputs[0] == outputs[1] and iteration.graph_calls > 0
    with pytest.raises(ValueError, match="not an iteration graph"):
        OrtIteration(graphs["target"], target, drafter)
    model = onnx.load(str(graphs["drafter_tree"]))
    model.graph.input[0].type.tensor_type.shape.dim[2].dim_value += 1     # captured states one wider
    other = tmp_path / "other_drafter.onnx"
    onnx.save(model, str(other))
    out = tmp_path / "iteration.onnx"
    with pytest.raises(IterationGraphError, match=f"{other}.*captured states .* wide"):
        compose_iteration(graphs["target"], other, out)
    with pytest.raises(IterationGraphError, match="not an eagle_trt drafter tree graph"):
        compose_iteration(graphs["target"], graphs["target"], out)
    assert not out.exists() and not list(tmp_path.glob(".iteration*"))   # nothing half-written
