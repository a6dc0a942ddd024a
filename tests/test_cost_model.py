"""The cost model (runtime/cost.py): call costs interpolated, plain decoding when verification is
compute-bound, warm-up, probes and re-timing; and whatever it chooses (full trees, subtrees,
plain decoding), batched decoding on the tiny graphs gives the tokens of batch 1."""
from __future__ import annotations

import pytest
from conftest import TINY_SHAPE, on_graph, seeded_cost_model, tiny_backends, two_call

from eagle_trt.runtime.cost import CallCosts, CostModel
from eagle_trt.runtime.loop import Request
from eagle_trt.runtime.onnxruntime_backend import OrtIteration

SHAPE = TINY_SHAPE


def test_call_costs_interpolate_and_extend():
    costs = CallCosts()
    for rows, seconds in ((1, 0.030), (5, 0.036), (100, 0.15)):
        costs.add(rows, seconds)
    assert costs(5) == pytest.approx(0.036)
    assert costs(3) == pytest.approx(0.033)                       # halfway between 1 and 5 rows
    assert costs(200) > costs(100)                                 # extended with the line's slope
    costs.add(400, 1.0, table=False)                               # a prefill informs only the line
    assert 400 not in costs.means


def test_cost_model_falls_back_to_plain_decoding_when_verification_is_compute_bound():
    accepted = [1.0, 1.4, 1.55, 1.6, 1.62]
    flat = seeded_cost_model(per_row=0.0001, fixed=0.03, accepted=accepted)      # memory-bound: more rows are nearly free
    assert flat.choose(1) == 4 and flat.choose(8) >= 3
    linear = seeded_cost_model(per_row=0.004, fixed=0.001, accepted=accepted)   # compute-bound: time ~ rows
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


@pytest.mark.parametrize("one_call", [False, True])
def test_cost_model_choices_keep_outputs_identical(tiny_graphs, one_call, request):
    """Whatever the cost model verifies (full trees in warm-up, plain decoding, subtrees), the
    tokens stay those of batch 1; a compute-bound cost table makes it stop drafting. one_call:
    with an iteration graph, which every drafting step goes through once the model is warm,
    subtrees too (verify_nodes)."""
    _, _, _, prompts = tiny_graphs
    target, drafter = tiny_backends(tiny_graphs, "onnxruntime")
    iteration = OrtIteration(request.getfixturevalue("tiny_iteration_graph"), target, drafter) if one_call else None
    solo = [two_call(target, drafter).generate(p, 30).tokens for p in prompts]
    level = [1.0, 1.3, 1.4, 1.45, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5]     # deeper nodes add nothing
    rising = [1.0 + 0.2 * n for n in range(SHAPE.total_tokens + 1)]    # each node adds: whole trees win
    subtrees = set()
    # memory-bound (a GPU), compute-bound (a CPU), memory-bound with a drafter that pays to the last node
    for per_row, fixed, accepted in ((0.0001, 0.03, level), (0.004, 0.001, level), (0.0001, 0.03, rising)):
        model = seeded_cost_model(per_row=per_row, fixed=fixed, accepted=accepted)
        for batch in range(1, 5):
            model.time_iteration(batch, 0, fixed + per_row * batch)
        # keep the seeded costs and acceptance: the tiny model's real ones (and a loaded machine's
        # drafter timings) would decide otherwise
        model.time_target = model.time_prefill = lambda rows, seconds: None
        model.time_draft = lambda batch, new_rows, seconds: None
        model.time_catch_up = lambda rows, seconds: None
        model.time_iteration = lambda batch, n, seconds: None
        model.observe = lambda ranks, verified: None
        calls = iteration.graph_calls if one_call else 0
        decoder = on_graph(iteration, cost_model=model) if one_call else two_call(target, drafter, cost_model=model)
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
