"""Batched decoding on tiny models: the KV cache's slots, the cost model's choices, and every
sequence of a continuously batched run equal to its own batch-1 run (torch, ONNX Runtime, and
ONNX Runtime with the iteration graph: one call an iteration), with mixed prompt lengths,
per-sequence max_new_tokens and EOS, joins and leaves."""
from __future__ import annotations

import copy
import ctypes
import functools
import itertools
import threading

import numpy as np
import onnx
import pytest
import torch
from conftest import frozen_trim

from eagle_trt.checkpoints import random_drafter
from eagle_trt.config import ConfigError, SamplingConfig, TreeShape
from eagle_trt.export import export_drafter_tree, export_target
from eagle_trt.export.iteration import IterationGraphError, compose_iteration
from eagle_trt.runtime.backend import KeptRows, TargetBackend, TorchDrafter, TorchTarget
from eagle_trt.runtime.cost import CallCosts, CostModel, NodeTrim
from eagle_trt.runtime.decoder import Request, SpeculativeDecoder, generate_autoregressive
from eagle_trt.runtime import kv_cache
from eagle_trt.runtime.kv_cache import CHUNK, KVCache
from eagle_trt.runtime.onnxruntime_backend import OrtDrafter, OrtIteration, OrtTarget
from eagle_trt.runtime.ort_binding import Binding

SHAPE = TreeShape(depth=4, top_k=3, total_tokens=10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_slots_compaction_and_moves(dtype):
    # float32: the commits' numpy slice copies; bfloat16 (no numpy dtype): the torch paths a GPU takes
    cache = KVCache(2, 2, 1, capacity=4, dtype=dtype)             # 2 layers, 2 KV heads: [L, B, Hkv, S, D]
    assert (cache.kv_np is None) == (dtype == torch.bfloat16)
    for _ in range(3):
        cache.add()
    cache.stage(range(3), 3)
    rows = torch.arange(3 * 3, dtype=dtype).reshape(3, 1, 3, 1) + 1   # sequence b, row t: 3b + t + 1
    rows = torch.cat((rows, -rows), 1)                            # head 1 holds the negated rows
    cache.write([rows, rows * 10], [rows, rows])
    cache.commit([[0, 2], [0, 1, 2], [1]])
    assert cache.lengths == [2, 3, 1]
    assert cache.k[0, 0, 0, :2, 0].tolist() == [1, 3]             # row 2 compacted into place
    assert cache.k[0, 0, 1, :2, 0].tolist() == [-1, -3]           # in every head
    assert cache.k[1, 2, :, :1, 0].tolist() == [[80], [-80]]      # sequence 2 kept only its row 1
    cache.remove(0)                                               # the last sequence moves into slot 0
    assert cache.lengths == [1, 3] and cache.k[0, 0, :, :1, 0].tolist() == [[8], [-8]]
    cache.stage(range(1, 2), 70)                                  # grows in chunks, keeps the rows
    assert cache.capacity == 2 * CHUNK and cache.k[0, 1, 1, :3, 0].tolist() == [-4, -5, -6]
    with pytest.raises(IndexError, match="outside the 70 staged rows"):
        cache.commit([[70]])
    cache.stage(range(1, 2), 2)                                   # one sequence, a run of rows: the slice path
    cache.write([rows[1:2]] * 2, [rows[1:2]] * 2)
    cache.commit([[0, 1]])
    assert cache.k[0, 1, 1, :5, 0].tolist() == [-4, -5, -6, -4, -5]
    cache.stage(range(1, 2), 3)                                   # rows that skip one: a copy per run
    cache.write([rows[1:2]] * 2, [rows[1:2]] * 2)
    cache.commit([[0, 2]])
    assert cache.k[0, 1, 1, :7, 0].tolist() == [-4, -5, -6, -4, -5, -4, -6] and cache.lengths == [1, 7]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_relayouts_reuse_storage_and_keep_rows(dtype):
    # float32: re-layouts in place inside one storage (numpy); bfloat16: between two storages in turn
    cache = KVCache(2, 2, 1, capacity=4, dtype=dtype)
    for b in range(5):                                             # slots double: 1 -> 2 -> 4 -> 8
        cache.add()
        cache.stage(range(b, b + 1), 2)
        cache.write([torch.full((1, 2, 2, 1), b + 1.0, dtype=dtype)] * 2, [torch.full((1, 2, 2, 1), -b - 1.0, dtype=dtype)] * 2)
        cache.commit([[0, 1]])
    assert cache.k.shape[1] == 8 and cache.lengths == [2] * 5
    cache.stage(range(4, 5), 3 * CHUNK)                            # more rows: a larger layout, zeroed
    assert cache.storages[cache.active].numel() >= cache.kv.numel() == 2 * cache.k.numel()
    assert cache.capacity == 4 * CHUNK
    assert cache.k[:, :5, :, :2, 0].tolist() == [[[[b + 1.0] * 2] * 2 for b in range(5)]] * 2
    assert cache.v[1, 3, 0, :3, 0].tolist() == [-4, -4, 0]
    cache.remove(0)                                                # no more rows needed: the layout shrinks
    cache.remove(0)
    cache.remove(0)
    assert cache.capacity == CHUNK
    assert cache.lengths == [2, 2] and cache.k[0, :2, 1, :2, 0].tolist() == [[3, 3], [2, 2]]   # each removal moved the last in
    assert cache.v[:, :2, 0, :2, 0].tolist() == [[[-3, -3], [-2, -2]]] * 2
    cache.clear()                                                  # a fresh start keeps the storages
    assert cache.lengths == [] and cache.k.shape[1] == 8
    assert all(torch.isfinite(t).all() for t in cache.storages if t is not None)
    cache.add()
    grown = None
    in_place = dtype == torch.float32
    for _ in range(3):       # once the storages are big enough, no allocation
        before = cache.active
        cache.reserve(range(0, 1), 4 * CHUNK)                      # a larger layout
        assert (cache.active == before) == in_place and cache.capacity == 4 * CHUNK
        cache.remove(0)                                            # and back
        cache.add()
        assert cache.active == before and cache.capacity == CHUNK
        assert grown is None or all(a is b for a, b in zip(cache.storages, grown))
        grown = list(cache.storages)
    assert (cache.storages[1 - cache.active] is None) == in_place  # in place: one storage


def test_kv_cache_relayout_in_place_moves_every_row():
    """Growing and shrinking inside one storage: more rows, then fewer, each row of each slot,
    layer and head where it belongs afterwards (blocks overlap their old places; more slots in
    place: the test above)."""
    cache = KVCache(3, 2, 2, capacity=CHUNK, batch=2)              # room for 4x the first layout
    storage = cache.storages[cache.active]
    for b in range(2):
        cache.add()

    def expected(b, n):    # [2, L, Hkv, n, D]: distinct values per K/V, layer, slot, head, row and dim
        k = torch.arange(2 * 3 * 2 * n * 2, dtype=torch.float32).reshape(2, 3, 2, n, 2)
        return k * 10 + 1000 * (b + 1)
    for b, n in enumerate((40, 23)):
        cache.stage(range(b, b + 1), n)
        cache.write(expected(b, n)[:, :, None])
        cache.commit([list(range(n))])
    cache.reserve(range(0, 1), 3 * CHUNK)                          # 64 -> 256 rows: blocks move up
    assert cache.storages[cache.active] is storage and cache.capacity == 4 * CHUNK
    for b, n in enumerate((40, 23)):
        assert torch.equal(cache.kv[:, :, b, :, :n], expected(b, n))
    cache.lengths[0] = 20                                          # rows beyond are dropped by a shrink
    cache.remove(1)
    assert cache.storages[cache.active] is storage and cache.capacity == CHUNK   # 256 -> 64 rows: down
    assert torch.equal(cache.kv[:, :, 0, :, :20], expected(0, 40)[:, :, :, :20])
    assert torch.isfinite(cache.kv).all()


def test_call_costs_interpolate_and_extend():
    costs = CallCosts()
    for rows, seconds in ((1, 0.030), (5, 0.036), (100, 0.15)):
        costs.add(rows, seconds)
    assert costs(5) == pytest.approx(0.036)
    assert costs(3) == pytest.approx(0.033)                       # halfway between 1 and 5 rows
    assert costs(200) > costs(100)                                 # extended with the line's slope
    costs.add(400, 1.0, table=False)                               # a prefill informs only the line
    assert 400 not in costs.means


def test_node_trim_verifies_the_nodes_that_pay_for_their_rows():
    scores = torch.tensor([[0.9, 0.5, 0.2, 0.05, 0.01]]).log()
    # 100 tok/s, 1.5 ms a row: a node pays for its row above p = 0.15
    assert frozen_trim(per_row=0.0015).choose(scores, 5) == 3
    assert frozen_trim(per_row=0.0015).choose(scores, 2) == 2          # never more than asked
    assert frozen_trim(per_row=0.02).choose(scores, 5) == 1            # at least one node
    assert frozen_trim(per_row=1e-9).choose(scores.to("meta"), 5) == 5  # rows free: scores never read
    # a batch: rank j is verified when the batch's summed probabilities at rank j pay for B rows
    pair = torch.tensor([[0.9, 0.5, 0.2, 0.05, 0.01], [0.9, 0.05, 0.04, 0.03, 0.02]]).log()
    assert frozen_trim(per_row=0.0015).choose(pair, 5) == 2
    # node order does not matter: ranks come from the scores
    assert frozen_trim(per_row=0.0015).choose(scores[:, [4, 2, 0, 3, 1]], 5) == 3
    fresh = NodeTrim()                                                    # warm-up: every node
    assert fresh.choose(scores, 5) == 5


def _model(per_row: float, fixed: float, accepted: list[float]) -> CostModel:
    m = CostModel(nodes=len(accepted) - 1, draft_rows_per_seq=6, warmup=1)
    for rows in range(1, 41):
        m.time_target(rows, fixed + per_row * rows)
    for batch in (1, 8):
        m.time_iteration(batch, 0, fixed + per_row * batch)
    m.time_draft(1, 1, 0.005)
    m.time_draft(8, 2, 0.008)
    m.gains = [0.0] + [b - a for a, b in zip(accepted, accepted[1:])]
    m.observed, m.full_trees = [1.0] * len(accepted), 1
    return m


def test_cost_model_falls_back_to_plain_decoding_when_verification_is_compute_bound():
    accepted = [1.0, 1.4, 1.55, 1.6, 1.62]
    flat = _model(per_row=0.0001, fixed=0.03, accepted=accepted)      # memory-bound: more rows are nearly free
    assert flat.choose(1) == 4 and flat.choose(8) >= 3
    linear = _model(per_row=0.004, fixed=0.001, accepted=accepted)   # compute-bound: time ~ rows
    assert linear.choose(8) == 0


def test_cost_model_warms_up_then_probes_plain_decoding():
    m = CostModel(nodes=4, draft_rows_per_seq=6, warmup=2)
    assert m.choose(3) == 4                                            # nothing measured: full tree
    m.time_target(15, 0.05)
    m.time_draft(3, 2, 0.01)
    m.observe([0, 2], 4)
    m.observe([1], 4)
    # n=1: 2 then 1 accepted; n=2: 2, 2; n>=3: 3, 2 (ranks below n count, in path order), recent-weighted
    second = 1 / (1 + m.decay)
    assert m.accepted[1:] == pytest.approx([2 - second, 2, 3 - second, 3 - second])
    assert m.choose(3) == 0                                            # batch 3 never decoded plainly: probe
    m.time_target(3, 0.05)
    for _ in range(3):                                                 # a (batch, n)'s first step is not counted
        m.time_iteration(3, 0, 0.05)
        m.time_iteration(3, 4, 0.05)                                   # measured: as fast as plain, 2.5 tokens
    m.time_iteration(3, 0, 0.5)
    assert m.seconds(3, 0) == 0.05                                     # one slow step (median of recent ones)
    m.time_iteration(3, 1, 0.001)
    assert m.seconds(3, 1) > 0.01                                      # a first step alone: estimated instead
    assert m.choose(3) in (3, 4)                                       # n = 3 and 4 accept the same here
    for _ in range(2):
        m.time_iteration(3, 4, 10.0)                                   # drafting steps turn out slow here:
    assert m.choose(3) == 0                                            # untried n scale with them too
    _timed(m, {(3, 0): 0.05, (3, 4): 0.04})
    m.time_catch_up(100, 0.1)
    assert m.choose(3) > 0 and m.choose(3, backlog=100) > 0             # 0.1 s over 64 steps: still worth it
    assert m.choose(3, backlog=100, remaining=2) == 0                   # but not for the last 2 tokens
    m.catch_up = type(m.catch_up)()
    m.time_catch_up(100, 10.0)
    assert m.choose(3, backlog=100) == 0                                # a catch-up too costly to pay off
    m.catch_up = type(m.catch_up)()
    m.since_full = m.explore_every
    assert m.choose(3) == 4                                             # drafting: now and then the full tree
    m.observe([0], 4)
    assert m.since_full == 0 and m.choose(3) == 3
    # a near tie goes to plain decoding: 1% more tokens per second is inside the margin
    _timed(m, {(3, 0): 0.05, **{(3, n): 0.05 * m.accepted[n] / 1.01 for n in range(1, 5)}})
    assert m.choose(3) == 0
    _timed(m, {(3, 0): 0.05, **{(3, n): 0.05 * m.accepted[n] / 1.03 for n in range(1, 5)}})
    assert m.choose(3) == 0                                             # 3%: not enough to start drafting
    _timed(m, {(3, 0): 0.05, **{(3, n): 0.05 * m.accepted[n] / 1.07 for n in range(1, 5)}})
    assert m.choose(3) > 0                                              # 7% is
    _timed(m, {(3, 0): 0.05, **{(3, n): 0.05 * m.accepted[n] / 1.03 for n in range(1, 5)}})
    assert m.choose(3) > 0                                              # and 3% is enough to go on


def _timed(m: CostModel, iterations: dict) -> None:
    """Measured step times, as if each (batch, n) had run more than once."""
    m.iterations, m.samples = dict(iterations), {k: [v] for k, v in iterations.items()}


def test_cost_model_re_times_the_choice_it_is_not_making():
    """A stale mean must not rule a choice out for good: drafting re-times plain decoding for 3
    steps every 32, and while drafting leads by 20% or more each re-timing waits twice as long
    (up to 8 periods); plain decoding drafts 8 full trees if drafting is nearly as good, less
    and less often while it does not win."""
    m = CostModel(nodes=4, draft_rows_per_seq=6, warmup=1)
    m.time_target(4, 0.03)
    m.time_draft(4, 2, 0.01)
    m.observe([0, 3], 4)                                      # 3 tokens from the full tree, 2 from fewer nodes
    lead_10 = {(4, 0): 0.05, **{(4, n): 0.05 / 1.1 * m.accepted[n] for n in range(1, 5)}}   # drafting 10% ahead
    _timed(m, lead_10)
    picks = [m.choose(4) for _ in range(70)]
    assert picks.count(0) == 6 and picks[31:34] == picks[65:68] == [0] * 3, picks   # 3 in a row, every 32
    _timed(m, {(4, 0): 0.06, **{(4, n): 0.05 for n in range(1, 5)}})      # drafting far ahead (3.6x)
    picks = "".join(str(m.choose(4)) for _ in range(1500))
    starts = [i for i in range(len(picks)) if picks[i:i + 3] == "000" and (i == 0 or picks[i - 1] != "0")]
    assert picks.count("0") == 3 * len(starts), picks
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert gaps[:3] == [2 * 32 + 2, 4 * 32 + 2, 8 * 32 + 2] and set(gaps[3:]) == {8 * 32 + 2}, gaps   # backing off
    _timed(m, lead_10)
    picks = "".join(str(m.choose(4)) for _ in range(300))
    assert "0" * 3 in picks[:8 * 32 + 3] and picks.count("0") >= 3 * 7, picks    # every 32 steps again
    _timed(m, {(4, 0): 0.03, **{(4, n): 0.1 for n in range(1, 5)}})       # drafting at 90% of plain: retried
    picks = "".join(map(str, (m.choose(4) for _ in range(1500))))
    assert set(picks) == {"0", "4"} and picks.count("04444444400") == picks.count("4") // 8, picks   # bursts of 8
    starts = [i for i in range(1, len(picks)) if picks[i - 1:i + 1] == "04"]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert len(starts) >= 3 and all(g2 > 1.8 * g1 for g1, g2 in zip(gaps, gaps[1:])), starts   # backing off
    _timed(m, {(4, 0): 0.03, **{(4, n): 0.11 for n in range(1, 5)}})      # at 82%: not worth a catch-up
    assert set(m.choose(4) for _ in range(1100)) == {0}


def test_cost_model_acceptance_never_falls_with_more_nodes():
    """Verified with fewer nodes later, the smaller trees' estimates move; the larger trees' must
    not fall below them (levels kept per n did: each n averaged different trees)."""
    m = CostModel(nodes=4, draft_rows_per_seq=6, warmup=1)
    for _ in range(10):
        m.observe([0, 3], 4)          # early: the full tree accepts 2 drafts (ranks 0 and 3)
    for _ in range(50):
        m.observe([0, 1, 2], 3)       # later: three nodes accept 3 drafts
    accepted = m.accepted
    assert accepted[3] > 3.7                      # recent trees weigh more (decay)
    assert all(a <= b for a, b in zip(accepted, accepted[1:])), accepted


@pytest.fixture(scope="module")
def setup(tiny_target, tmp_path_factory):
    drafter = random_drafter(tiny_target, "eagle3.1", seed=4, draft_vocab_size=48)
    tiny_target.model.set_capture(drafter.cfg.capture_for(tiny_target.config))
    folder = tmp_path_factory.mktemp("batching")
    graphs = {"target": export_target(tiny_target.model, folder / "target.onnx").path,
              "drafter_tree": export_drafter_tree(drafter, SHAPE, folder / "drafter_tree.onnx").path}
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, tiny_target.config.vocab_size, (n,), generator=gen).tolist()
               for n in (5, 31, 12, 1, 47, 9, 20, 3, 16, 26)]
    return tiny_target, drafter, graphs, prompts


def _backends(setup, backend):
    target, drafter, graphs, _ = setup
    if backend == "torch":
        return TorchTarget(target.model), TorchDrafter(drafter, SHAPE)
    return OrtTarget(graphs["target"], target.config.max_position_embeddings), OrtDrafter(graphs["drafter_tree"], SHAPE)


@pytest.fixture(scope="module")
def iteration_graph(setup):
    """The setup's two graphs composed into one (export/iteration.py)."""
    _, _, graphs, _ = setup
    return compose_iteration(graphs["target"], graphs["drafter_tree"], graphs["target"].parent / "iteration.onnx").path


def test_inputs_are_bound_again_before_each_call_where_the_bind_copies_them(setup, iteration_graph, monkeypatch):
    """With a device provider (CUDA), ONNX Runtime copies a bound input to the device when it is
    bound (IOBinding::BindInput), so a graph bound once reads its host buffers as they were at
    the bind. Here each input bind on the CPU provider reads a copy of the host memory taken at
    the bind, as that copy would: bound once, decoding goes wrong; binding every input again
    before each call (what Binding does for device providers) decodes the target's own
    greedy tokens, with two graph calls an iteration and with one; so does it with the KV caches
    committed by torch as on a GPU (kv_device cuda keeps them there, read where they are)."""
    target_model, _, _, prompts = setup
    prompts = prompts[:4]
    refs = [generate_autoregressive(TorchTarget(target_model.model), p, 20, []).tokens for p in prompts]
    bind = Binding._bind

    def bind_a_copy(self, name, dtype, shape, address, output, where=("cpu", 0)):
        if not output:
            size = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
            copy = torch.empty(max(size, 1), dtype=torch.uint8)
            ctypes.memmove(copy.data_ptr(), address, size)
            self.__dict__.setdefault("copies", {})[name] = copy
            address = copy.data_ptr()
        bind(self, name, dtype, shape, address, output, where)
    monkeypatch.setattr(Binding, "_bind", bind_a_copy)
    tokens = {}
    for rebind, one_call in itertools.product((False, True), (False, True)):
        monkeypatch.setattr(Binding, "always_rebind", rebind)
        target, drafter = _backends(setup, "onnxruntime")
        iteration = OrtIteration(iteration_graph, target, drafter) if one_call else None
        try:
            results = SpeculativeDecoder(target, drafter, [], iteration=iteration).generate_batch(
                [Request(p, 20) for p in prompts], max_batch=4)
            tokens[rebind, one_call] = [r.tokens for r in results]
        except (IndexError, ValueError, RuntimeError) as exc:     # stale lengths can break the bookkeeping
            tokens[rebind, one_call] = repr(exc)
    assert tokens[True, False] == refs and tokens[True, True] == refs
    assert tokens[False, False] != refs and tokens[False, True] != refs
    # the caches as a GPU holds them (kv_device cuda): no numpy view, the new rows staged as
    # tensors and committed by torch's indexed copies, as on the device
    monkeypatch.setattr(kv_cache, "NUMPY_FLOATS", ())
    for one_call in (False, True):
        target, drafter = _backends(setup, "onnxruntime")
        iteration = OrtIteration(iteration_graph, target, drafter) if one_call else None
        results = SpeculativeDecoder(target, drafter, [], iteration=iteration).generate_batch(
            [Request(p, 20) for p in prompts], max_batch=4)
        assert target.cache.kv_np is None and not isinstance(target.bindings.entries[next(iter(
            target.bindings.entries))].staged, np.ndarray)
        assert [r.tokens for r in results] == refs
    monkeypatch.setattr(Binding, "always_rebind", False)
    assert not Binding(target.session).rebind         # the CPU provider reads the host memory itself


@pytest.mark.parametrize("backend", ["torch", "onnxruntime", "iteration"])
def test_batched_sequences_equal_their_batch_one_runs(setup, backend, request):
    """iteration: ONNX Runtime with drafting and verification in one graph call (OrtIteration)."""
    target_model, _, _, prompts = setup
    target, drafter = _backends(setup, "torch" if backend == "torch" else "onnxruntime")
    iteration = None
    if backend == "iteration":
        iteration = OrtIteration(request.getfixturevalue("iteration_graph"), target, drafter)
    decoder_of = functools.partial(SpeculativeDecoder, target, drafter, iteration=iteration)
    limits = [40, 25, 33, 40, 17, 40, 8, 29, 40, 36]
    # An EOS id that greedy decoding of some prompts produces: those sequences stop early, alone.
    references = [generate_autoregressive(TorchTarget(target_model.model), p, n, []).tokens
                  for p, n in zip(prompts, limits)]
    eos = {references[1][10]}
    solo = [decoder_of(eos).generate(p, n).tokens for p, n in zip(prompts, limits)]
    assert any(len(s) < n for s, n in zip(solo, limits)), "no sequence hit EOS: the check would be vacuous"
    for s, ref in zip(solo, references):
        assert s == ref[:len(s)]
    for batch in (1, 3, 8):
        calls = iteration.graph_calls if iteration is not None else 0
        decoder = decoder_of(eos)
        results = decoder.generate_batch([Request(p, n) for p, n in zip(prompts, limits)], max_batch=batch)
        assert [r.tokens for r in results] == solo, f"batch {batch} differs from batch 1"
        assert not decoder.active and decoder.target.batch == 0    # every slot freed
        if iteration is not None:   # each iteration one call (catching up on a prompt: the drafter's own)
            assert iteration.graph_calls - calls == len(decoder.verified) > 0
    plain = SpeculativeDecoder(target, None, eos).generate_batch([Request(p, n) for p, n in zip(prompts, limits)], 8)
    assert [r.tokens for r in plain] == solo


def test_ort_verify_writes_the_inputs_the_general_path_builds(setup):
    """OrtTarget.verify writes ids, positions and mask straight into its bound buffers (numpy);
    TargetBackend.verify builds them as tensors and goes through forward. Same outputs, for full
    trees, the cost model's subtrees and plain steps, over sequences of different lengths; and
    the same accepted rows' states from OrtTarget.keep_states (numpy) as from the tensor gather."""
    target_model, _, graphs, prompts = setup
    fast, general = (OrtTarget(graphs["target"], target_model.config.max_position_embeddings) for _ in range(2))
    drafter = OrtDrafter(graphs["drafter_tree"], SHAPE)
    for backend in (fast, general, drafter):
        backend.reset()

    def prefill(p):
        for backend in (fast, general):
            slot = backend.add_sequence()
            backend.forward(torch.tensor([p]), torch.arange(len(p))[None], torch.ones(len(p), len(p)).tril().bool()[None],
                            range(slot, slot + 1), last_only=True)
            backend.commit([list(range(len(p)))])

    for p in prompts[:3]:
        prefill(p)
        drafter.add_sequence()
    states = torch.randn(3, 2, drafter.captured_width, generator=torch.Generator().manual_seed(0))
    trees = drafter.draft(states, [[5, 6], [7, 8], [9, 10]])
    roots = [11, 12, 13]
    # each call shape twice: its mask buffer written whole, then only where lengths moved; a
    # sequence leaving and a shorter one joining in between moves a slot's length back
    for rnd in range(2):
        for tree in (trees, trees.top(3), None):
            got = fast.verify(roots, tree)
            want = TargetBackend.verify(general, roots, tree)
            for name, a, b in zip(("logits", "captured", "ids", "mask"), got, want):
                assert torch.equal(a, b.to(a.dtype)), (rnd, name)
            # the accepted rows' states: numpy slices / fancy indexing against the tensor gather
            paths = [[0, 2], [0, 1], [0]] if tree is not None and tree.size > 2 else [[0]] * 3
            for kept, gathered in zip(fast.keep_states(got[1], paths), TargetBackend.keep_states(general, want[1], paths)):
                assert torch.equal(torch.from_numpy(kept), gathered)
            rows = [[0], [0, 1], [0]] if tree is not None else [[0]] * 3
            fast.commit(rows)
            general.commit(rows)
        for backend in (fast, general):
            backend.remove_sequence(0)
        prefill(prompts[3][:5])
    assert fast.lengths == general.lengths
    assert torch.equal(fast.cache.k[:, :3, :, :max(fast.lengths)], general.cache.k[:, :3, :, :max(general.lengths)])


def test_copied_backends_decode_side_by_side_with_their_own_caches(setup):
    """The per-request decoders copy one backend pair (copy.copy: shared sessions, own caches);
    a reset reuses only a cache the backend made, so threads never clear each other's."""
    target, drafter = _backends(setup, "onnxruntime")
    prompts = setup[3]
    solo = [SpeculativeDecoder(target, drafter, []).generate(p, 20).tokens for p in prompts[:4]]
    first = target.cache
    target.reset()
    assert target.cache is first                                     # its own: cleared, storage kept
    results = [None] * 4

    def worker(k):
        decoder = SpeculativeDecoder(copy.copy(target), copy.copy(drafter), [])
        for i in (k, k + 2):
            results[i] = decoder.generate(prompts[i], 20).tokens
    threads = [threading.Thread(target=worker, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == solo and target.cache is first


@pytest.mark.parametrize("one_call", [False, True])
def test_cost_model_choices_keep_outputs_identical(setup, one_call, request):
    """Whatever the cost model verifies (full trees in warm-up, plain decoding, subtrees), the
    tokens stay those of batch 1; a compute-bound cost table makes it stop drafting. one_call:
    with an iteration graph, which every drafting step goes through once the model is warm,
    subtrees too (verify_nodes)."""
    _, _, _, prompts = setup
    target, drafter = _backends(setup, "onnxruntime")
    iteration = OrtIteration(request.getfixturevalue("iteration_graph"), target, drafter) if one_call else None
    solo = [SpeculativeDecoder(target, drafter, []).generate(p, 30).tokens for p in prompts]
    level = [1.0, 1.3, 1.4, 1.45, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5]     # deeper nodes add nothing
    rising = [1.0 + 0.2 * n for n in range(SHAPE.total_tokens + 1)]    # each node adds: whole trees win
    subtrees = set()
    # memory-bound (a GPU), compute-bound (a CPU), memory-bound with a drafter that pays to the last node
    for per_row, fixed, accepted in ((0.0001, 0.03, level), (0.004, 0.001, level), (0.0001, 0.03, rising)):
        model = _model(per_row=per_row, fixed=fixed, accepted=accepted)
        for batch in range(1, 5):
            model.time_iteration(batch, 0, fixed + per_row * batch)
        # keep the seeded costs and acceptance: the tiny model's real ones (and a loaded machine's
        # drafter timings) would decide otherwise
        model.time_target = lambda rows, seconds, prefill=False: None
        model.time_draft = lambda batch, new_rows, seconds: None
        model.time_catch_up = lambda rows, seconds: None
        model.time_iteration = lambda batch, n, seconds: None
        model.observe = lambda ranks, verified: None
        calls = iteration.graph_calls if one_call else 0
        decoder = SpeculativeDecoder(target, drafter, [], cost_model=model, iteration=iteration)
        results = decoder.generate_batch([Request(p, 30) for p in prompts], max_batch=4)
        assert [r.tokens for r in results] == solo
        if one_call:     # every drafting step in one call, whole trees and subtrees (verify_nodes)
            assert iteration.graph_calls - calls == sum(1 for n in decoder.verified if n)
            subtrees |= set(decoder.verified) - {0, SHAPE.total_tokens}
        if accepted is rising:
            assert decoder.verified.count(SHAPE.total_tokens) > len(decoder.verified) // 2, decoder.verified
        elif per_row > 0.001:
            assert decoder.verified.count(0) > len(decoder.verified) // 2, decoder.verified
        else:
            assert decoder.verified.count(0) <= 3 * (len(decoder.verified) // 32 + 1), decoder.verified   # re-timing
    assert subtrees or not one_call     # some steps verified subtrees in the one call


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_node_trim_keeps_outputs_identical(setup, backend):
    """Trees trimmed to the nodes that pay for their rows (sizes varying per iteration) decode
    exactly what whole trees decode, alone and in batches."""
    _, _, _, prompts = setup
    target, drafter = _backends(setup, backend)
    solo = [SpeculativeDecoder(target, drafter, []).generate(p, 30).tokens for p in prompts]
    sizes = set()
    for batch, per_row in ((1, 1e-4), (1, 1e-5), (4, 1e-4)):
        decoder = SpeculativeDecoder(target, drafter, [], trim=frozen_trim(per_row=per_row))
        results = decoder.generate_batch([Request(p, 30) for p in prompts], max_batch=batch)
        assert [r.tokens for r in results] == solo
        sizes |= set(decoder.verified)
    assert len(sizes - {SHAPE.total_tokens}) >= 2, sizes            # trimmed trees of several sizes ran
    with pytest.raises(ConfigError, match="not both"):
        SpeculativeDecoder(target, drafter, [], cost_model=CostModel(4, 6), trim=NodeTrim())


def test_sampled_sequences_in_a_batch_follow_their_own_seeds(setup):
    """Per-sequence sampling settings and seeds: a seeded request gives the same tokens alone and
    inside a batch with other settings."""
    _, _, _, prompts = setup
    target, drafter = _backends(setup, "torch")
    configs = [SamplingConfig(1.0, seed=1), SamplingConfig(0.7, top_p=0.9, seed=2), SamplingConfig(),
               SamplingConfig(1.2, top_k=5, seed=3)]
    requests = [Request(p, 24, c) for p, c in zip(prompts, configs)]
    solo = [SpeculativeDecoder(target, drafter, []).generate(r.prompt_ids, 24, r.sampling).tokens for r in requests]
    batched = SpeculativeDecoder(target, drafter, []).generate_batch(
        [Request(r.prompt_ids, 24, r.sampling) for r in requests], max_batch=4)
    assert [r.tokens for r in batched] == solo


@pytest.mark.parametrize("nodes", [None, 2])
def test_iteration_graph_computes_what_the_two_graph_calls_do(setup, iteration_graph, nodes):
    """One call of the iteration graph against a drafter call and a verification call from the
    same state, over sequences of different lengths: the same trees, logits, captured states,
    acceptance and KV rows, both caches; verifying whole trees, and each tree's 2 best nodes
    (verify_nodes: the subtree the two-call path verifies with DraftTree.top)."""
    target_model, _, graphs, prompts = setup
    pairs = [_backends(setup, "onnxruntime") for _ in range(2)]
    iteration = OrtIteration(iteration_graph, *pairs[1])
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
    want_accept = [torch.as_tensor(t).clone() for t in target.accept_greedy(want[0], want[2], want[3])]
    got_tree, *got = iteration.run(states, ids, new_lengths, nodes=nodes)
    assert got[0].shape[1] == 1 + (nodes or SHAPE.total_tokens)
    for name in ("tokens", "parents", "mask", "depths", "scores"):
        assert torch.equal(getattr(got_tree, name), getattr(tree, name)), name
    for name, a, b in zip(("logits", "captured", "ids", "mask"), got, want):
        assert torch.equal(a, b), name
    got_accept = pairs[1][0].accept_greedy(got[0], got[2], got[3])
    assert all(torch.equal(torch.as_tensor(a), torch.as_tensor(b)) for a, b in zip(got_accept, want_accept))
    rows = [[0, 1], [0], [0, 2]]
    for target, _ in pairs:
        target.commit(rows)
    (t0, d0), (t1, d1) = pairs
    assert t0.lengths == t1.lengths and d0.lengths == d1.lengths == [4, 3, 2]
    for a, b in ((t0.cache, t1.cache), (d0.cache, d1.cache)):
        n = max(a.lengths)
        assert torch.equal(a.kv[:, :, :3, :, :n], b.kv[:, :, :3, :, :n])


def test_iteration_graph_hands_the_accepted_rows_to_its_next_call(setup, iteration_graph):
    """The iteration graph gathers the accepted rows' states and tokens (next_captured,
    next_input_ids) and the next call reads them where the graph wrote them: each step's block
    equals the host's gather of the captured states and the decoder's pending ids, and decoding
    with the hand-off drafts the same trees (accept lengths) and tokens as copying the states in
    on the host, at batch 1, 3 and 8 with sequences leaving."""
    _, _, _, prompts = setup
    target, drafter = _backends(setup, "onnxruntime")
    iteration = OrtIteration(iteration_graph, target, drafter)
    assert iteration.has_handoff and iteration.handoff
    host_gathers = []

    def keep_states(captured, paths, index=None):      # the decoder's call, and the host's gather beside it
        host_gathers.append([r.copy() for r in OrtTarget.keep_states(target, captured, paths, None)])
        return OrtTarget.keep_states(target, captured, paths, index)

    target.keep_states = keep_states
    decoder = SpeculativeDecoder(target, drafter, [], iteration=iteration)
    for p, n in zip(prompts[:3], (30, 12, 21)):
        decoder.add(Request(p, n))
    checked = 0
    while decoder.active:
        batch = list(decoder.active)
        decoder.step()
        kept = decoder.kept
        if isinstance(kept, KeptRows):
            checked += 1
            for i, (s, rows, host) in enumerate(zip(batch, kept, host_gathers[-1])):
                assert np.array_equal(rows, host) and kept.ids[i, :len(rows)].tolist() == s.pending_ids
    assert checked > 5 and iteration.handoffs > 0
    del target.keep_states
    limits = [40, 25, 33, 40, 17, 40, 8, 29, 40, 36]
    runs = {}
    for handoff in (True, False):
        iteration = OrtIteration(iteration_graph, target, drafter, handoff=handoff)
        for batch in (1, 3, 8):
            results = SpeculativeDecoder(target, drafter, [], iteration=iteration).generate_batch(
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
        model = _model(per_row=0.0001, fixed=0.03, accepted=[1.0 + 0.2 * n for n in range(SHAPE.total_tokens + 1)])
        model.choose = lambda batch, backlog=0, remaining=None: next(sizes)
        iteration = OrtIteration(iteration_graph, target, drafter)
        decoder = SpeculativeDecoder(target, drafter, [], cost_model=model, iteration=iteration if one_call else None)
        results = decoder.generate_batch([Request(p, n) for p, n in zip(prompts, limits)], max_batch=3)
        tokens[one_call] = [r.tokens for r in results]
        if one_call:
            assert len(set(decoder.verified)) == 3 and iteration.graph_calls == len(decoder.verified)
            assert iteration.handoffs > len(decoder.verified) // 2, (iteration.handoffs, len(decoder.verified))
    assert tokens[True] == tokens[False]


def test_iteration_graph_keeps_seeded_sampling_and_refuses_what_it_cannot_do(setup, iteration_graph, tmp_path):
    """Sampled sequences (own settings and seeds) inside a batch: the same tokens in one call per
    iteration as in two. A decoder refuses an iteration graph with a node trim (it picks the
    nodes between the two calls) or over other backends; composing refuses a drafter made for another
    target; a two-graph file is not an iteration graph."""
    _, _, graphs, prompts = setup
    target, drafter = _backends(setup, "onnxruntime")
    iteration = OrtIteration(iteration_graph, target, drafter)
    configs = [SamplingConfig(1.0, seed=1), SamplingConfig(0.7, top_p=0.9, seed=2), SamplingConfig(),
               SamplingConfig(1.2, top_k=5, seed=3)]
    outputs = []
    for it in (None, iteration):
        decoder = SpeculativeDecoder(target, drafter, [], iteration=it)
        outputs.append([r.tokens for r in decoder.generate_batch([Request(p, 24, c) for p, c in zip(prompts, configs)],
                                                                  max_batch=4)])
    assert outputs[0] == outputs[1] and iteration.graph_calls > 0
    with pytest.raises(ConfigError, match="takes no iteration graph"):
        SpeculativeDecoder(target, drafter, [], trim=NodeTrim(), iteration=iteration)
    with pytest.raises(ConfigError, match="must be the decoder's"):
        SpeculativeDecoder(*_backends(setup, "onnxruntime"), [], iteration=iteration)
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
