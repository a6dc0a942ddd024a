"""The fixed-shape, device-resident iteration (runtime/static.py), on the CPU where it runs
without capture: token for token what the target's own greedy decoding gives, alone and
continuously batched, speculative and plain; the same trees and acceptance as the dynamic loop
(the two-call engine over the PyTorch reference backends) with the same drafter; and torch.compile(fullgraph=True) captures the
whole iteration as one graph that no later iteration recompiles, which is what a CUDA graph's
capture of it on a GPU needs (no host sync, no shape that depends on values)."""
from __future__ import annotations

import pytest
import torch

from conftest import (LIMITS, PROMPT_LENGTHS, capturing, oracle_drafter, plant_path, random_prompts, share, two_call,
                      write_tiny_hf_target)
from eagle_trt.checkpoints import load_target, random_drafter
from eagle_trt.config import ConfigError, SamplingConfig, TreeShape
from eagle_trt.runtime.backend import TorchDrafter, TorchTarget
from eagle_trt.runtime.loop import DecodingLoop, Request
from eagle_trt.runtime.static import StaticEngine

SHAPES = [TreeShape(depth=4, top_k=3, total_tokens=10), TreeShape.chain(3), TreeShape(depth=5, top_k=2, total_tokens=4)]


@pytest.fixture(scope="module")
def setup(request, tmp_path_factory):
    """A small-vocabulary target (its oracle drafter's drafts are accepted several deep), an
    oracle EAGLE 3.1 and a random EAGLE-3 drafter, prompts and their greedy continuations."""
    target = load_target(write_tiny_hf_target(tmp_path_factory.mktemp("static"), vocab=16, hidden=32, layers=4,
                                              heads=4, kv_heads=2, seed=3))
    drafters = {"oracle": oracle_drafter(target, "eagle3.1", noise=0.02, seed=1),
                "random": random_drafter(target, "eagle3", seed=4, draft_vocab_size=8, std=0.3)}
    prompts = random_prompts(target.config.vocab_size, PROMPT_LENGTHS)
    plain = two_call(TorchTarget(target.model))
    references = [plain.generate(p, n).tokens for p, n in zip(prompts, LIMITS)]
    share(request, target, "static target")
    return target, drafters, prompts, references


def _static(target, drafter, shape, eos=(), engine=StaticEngine, **kw) -> DecodingLoop:
    if drafter is not None:
        target = capturing(target, drafter)
    return DecodingLoop(engine(target.model, drafter, shape if drafter is not None else None,
                               capacity=kw.pop("capacity", 160), **kw), eos, target.config.vocab_size)


def _dynamic(target, drafter, shape) -> DecodingLoop:
    """The two-call engine over the PyTorch reference backends: the same trees, verified the same way."""
    return two_call(TorchTarget(capturing(target, drafter).model), TorchDrafter(drafter, shape), [],
                    target.config.vocab_size)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"D{s.depth}k{s.top_k}N{s.total_tokens}")
@pytest.mark.parametrize("kind", ["oracle", "random"])
def test_static_iteration_equals_greedy_and_the_dynamic_loop(setup, kind, shape):
    """Each prompt alone: the target's greedy tokens, and the dynamic loop's accept lengths (the
    same trees verified the same way); the oracle drafter's drafts are accepted several deep."""
    target, drafters, prompts, references = setup
    drafter = drafters[kind]
    static = _static(target, drafter, shape)
    dynamic = _dynamic(target, drafter, shape)
    accepted = []
    for p, n, ref in zip(prompts, LIMITS, references):
        got = static.generate(p, n)
        assert got.tokens == ref
        assert got.accept_lengths == dynamic.generate(p, n).accept_lengths
        assert got.target_calls == 1 + got.drafter_calls == 1 + len(got.accept_lengths)
        accepted += got.accept_lengths
    if kind == "oracle":
        assert max(accepted) >= min(3, shape.depth + 1), "drafts were not accepted deep: vacuous"


@pytest.mark.parametrize("speculative", [True, False], ids=["speculative", "plain"])
def test_static_batches_join_leave_and_equal_their_solo_runs(setup, speculative):
    """Continuous batching at 1, 3 and 8 slots: mixed prompt lengths and limits, sequences that
    stop at an EOS, joins into freed slots (the last slot moves into a freed one)."""
    target, drafters, prompts, references = setup
    eos = {references[1][10]}
    solo = []
    for ref, n in zip(references, LIMITS):
        cut = next((i + 1 for i, t in enumerate(ref) if t in eos), len(ref))
        solo.append(ref[:cut])
    assert any(len(s) < n for s, n in zip(solo, LIMITS)), "no sequence hit EOS: vacuous"
    for batch in (1, 3, 8):
        dec = _static(target, drafters["oracle"] if speculative else None, SHAPES[0], eos, max_batch=batch)
        results = dec.generate_batch([Request(p, n) for p, n in zip(prompts, LIMITS)], max_batch=batch)
        assert [r.tokens for r in results] == solo, f"batch {batch} differs from greedy decoding"
        engine = dec.engine      # every slot freed, never re-laid out
        assert not dec.active and engine.tkv.batch == 0 and engine.capacity == engine.tkv.capacity == 160


def test_static_iteration_compiles_to_one_graph_without_recompiling(setup):
    """torch.compile(fullgraph=True) of the whole iteration: one graph per batch size (a graph
    break raises under fullgraph), none compiled again over later iterations, same tokens."""
    import torch._dynamo
    target, drafters, prompts, references = setup
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    torch._dynamo.reset()
    dec = _static(target, drafters["oracle"], SHAPES[0], compile=True, compile_backend=counting)
    for p, n, ref in list(zip(prompts, LIMITS, references))[:3]:
        res = dec.generate(p, n)
        assert res.tokens == ref
        assert len(res.accept_lengths) > 5
    assert len(graphs) == 1, f"{len(graphs)} graphs for one batch size: the iteration recompiled"
    nodes = sum(1 for n in graphs[0].graph.nodes if n.op == "call_function")
    assert nodes > 200, f"the graph holds {nodes} ops: not the whole iteration"


def test_static_engine_refuses_what_it_cannot_hold_and_grows_for_what_it_can(setup):
    """Beyond the target's context: refused before anything runs. Beyond the slots' capacity:
    the caches are laid out again, larger, the running sequences' rows kept (a long request
    joins a batch mid-run and every sequence still decodes its greedy tokens)."""
    target, drafters, prompts, references = setup
    dec = _static(target, drafters["oracle"], SHAPES[0], max_batch=2)
    with pytest.raises(ConfigError, match="exceeds the target's context of 512 tokens"):
        dec.generate(prompts[4], 500)
    short, long = dec.add(Request(prompts[0], LIMITS[0])), None
    dec.step()
    long = dec.add(Request(prompts[4], 150))      # 47 + 150 + the staged rows do not fit 160
    assert dec.engine.capacity == dec.engine.tkv.capacity == 256
    while dec.active:
        dec.step()
    assert short.result.tokens == references[0]
    assert long.result.tokens[:LIMITS[4]] == references[4] and len(long.result.tokens) == 150
    with pytest.raises(ConfigError, match="capacity 12 leaves no room"):
        _static(target, drafters["oracle"], SHAPES[0], capacity=12)
    with pytest.raises(ConfigError, match="capture='sometimes'"):
        _static(target, None, SHAPES[0], capture="sometimes")
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        _static(target, None, SHAPES[0], capture="cuda-graph")
    dec.add(Request(prompts[0], 5))
    dec.add(Request(prompts[1], 5))
    with pytest.raises(ConfigError, match="batch is full"):
        dec.add(Request(prompts[2], 5))


def test_static_sampled_sequences_keep_their_seeds_beside_greedy_ones(setup):
    """Sampled sequences accept on the host with their own generators: a seeded request draws
    the same tokens as in the dynamic loop (same trees, same draws), alone or batched with greedy
    sequences, and the greedy ones still equal greedy decoding."""
    target, drafters, prompts, references = setup
    shape = SHAPES[0]
    sampling = [SamplingConfig(temperature=0.8, top_p=0.9, seed=s) for s in range(4)]
    dynamic = _dynamic(target, drafters["oracle"], shape)
    want = [dynamic.generate(prompts[i], 30, sampling[i]).tokens for i in range(4)]
    dec = _static(target, drafters["oracle"], shape)
    assert [dec.generate(prompts[i], 30, sampling[i]).tokens for i in range(4)] == want
    requests = [Request(prompts[i], 30, sampling[i]) for i in range(4)] + [Request(prompts[5], 40)]
    results = dec.generate_batch(requests, max_batch=8)
    assert [r.tokens for r in results[:4]] == want and results[4].tokens == references[5]


@pytest.mark.slow
def test_static_engine_with_the_shipped_drafter_equals_transformers(smollm2, mtbench_ids, hf_greedy):
    """SmolLM2 and the shipped EAGLE 3.1 drafter on the static path: transformers' greedy tokens
    on real MT-bench prompts, 2 one at a time and 12 continuously batched 8 at a time (joins into
    freed slots); plain static decoding too (8 prompts, batched). Capacity 256 holds the longest prompt (138 tokens)
    and its 64 new ones."""
    from conftest import NEW_TOKENS
    from eagle_trt.api import SHIPPED_DRAFTERS
    from eagle_trt.checkpoints import load_drafter
    drafter = load_drafter(SHIPPED_DRAFTERS / "smollm2-eagle3.1", smollm2)
    eos = smollm2.config.eos_token_ids
    dec = _static(smollm2, drafter, TreeShape(3, 2, 4), eos, capacity=256)
    accepted = []
    for i, (ids, ref) in enumerate(zip(mtbench_ids[:2], hf_greedy)):
        res = dec.generate(ids, NEW_TOKENS)
        assert res.tokens == ref, f"prompt {i}: the static path diverges from transformers"
        accepted += res.accept_lengths
    assert sum(accepted) / len(accepted) > 1.8 and max(accepted) == 4, "the shipped drafter's drafts were not accepted"
    results = dec.generate_batch([Request(ids, NEW_TOKENS) for ids in mtbench_ids[:12]], max_batch=8)
    assert [r.tokens for r in results] == hf_greedy[:12]
    plain = _static(smollm2, None, TreeShape(3, 2, 4), eos, capacity=256)
    results = plain.generate_batch([Request(ids, NEW_TOKENS) for ids in mtbench_ids[:8]], max_batch=8)
    assert [r.tokens for r in results] == hf_greedy[:8]


class PlantedStatic(StaticEngine):
    """The static loop with conftest.PlantedDrafter's trick inside its iteration (eager, on the
    CPU): after the real drafter builds each tree, one root-to-leaf path (up to a random depth,
    through the first or second child) carries the sequence's known greedy continuation, so
    drafts are accepted deep and the device-side commit and hand-off run on long paths."""

    def __init__(self, *args, continuations: dict[int, list[int]], seed: int = 0, **kwargs):
        import random
        super().__init__(*args, **kwargs)
        self.continuations, self.rng = continuations, random.Random(seed)

    def iterate(self, batch, greedy):
        self.batch = batch
        return super().iterate(batch, greedy)

    def _draft(self, B):
        import dataclasses
        tree = super()._draft(B)
        tokens = tree.tokens.clone()
        for i, seq in enumerate(self.batch[:B]):
            continuation = self.continuations[id(seq.request)]
            done = int(self.lengths[i]) - len(seq.request.prompt_ids) + 1      # generated, the root included
            plant_path(tokens[i], tree.parents[i].tolist(), continuation[done:], self.rng.randint(0, self.shape.depth),
                       self.rng)
        return dataclasses.replace(tree, tokens=tokens)


@pytest.mark.parametrize("batch", [1, 8])
def test_static_loop_with_planted_paths_equals_greedy(setup, batch):
    """A random (untrained) drafter with planted paths: every prompt's greedy tokens, alone and 8
    at a time, with drafts accepted up to the tree's full depth."""
    target, drafters, prompts, references = setup
    shape = TreeShape(depth=5, top_k=3, total_tokens=12)
    target = capturing(target, drafters["random"])
    requests = [Request(p, n) for p, n in zip(prompts, LIMITS)]
    dec = DecodingLoop(PlantedStatic(target.model, drafters["random"], shape, max_batch=batch, capacity=160,
                                     continuations={id(r): ref for r, ref in zip(requests, references)}),
                       [], target.config.vocab_size)
    results = dec.generate_batch(requests, max_batch=batch)
    assert [r.tokens for r in results] == references
    accepted = [a for r in results for a in r.accept_lengths]
    assert max(accepted) == shape.depth + 1 and sum(accepted) / len(accepted) > 2.0, "planted paths not accepted"
