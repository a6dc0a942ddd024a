"""Continuous batching on the tiny graphs: every sequence of a batched run (batch 1, 3 and 8;
joins, leaves, mixed prompt lengths, max_new_tokens and EOS) equals its own batch-1 run on
the two-call engine over the PyTorch reference and ONNX Runtime backends, and the iteration
graph's engine; seeded sampled sequences follow their own seeds inside a batch; copied backends
decode side by side in threads with their own caches. (The PyTorch engine's batching:
test_static.py.)"""
from __future__ import annotations

import copy
import threading

import pytest
from conftest import LIMITS, on_graph, tiny_backends, two_call

from eagle_trt.config import SamplingConfig
from eagle_trt.runtime.backend import TorchTarget
from eagle_trt.runtime.loop import Request
from eagle_trt.runtime.onnxruntime_backend import OrtIteration


@pytest.mark.parametrize("backend", ["torch", "onnxruntime", "iteration"])
def test_batched_sequences_equal_their_batch_one_runs(tiny_graphs, backend, request):
    """iteration: ONNX Runtime with drafting and verification in one graph call (OrtIteration)."""
    target_model, _, _, prompts = tiny_graphs
    target, drafter = tiny_backends(tiny_graphs, "torch" if backend == "torch" else "onnxruntime")
    iteration = None
    if backend == "iteration":
        iteration = OrtIteration(request.getfixturevalue("tiny_iteration_graph"), target, drafter)
    def decoder_of(eos):
        return on_graph(iteration, eos) if iteration is not None else two_call(target, drafter, eos)
    limits = LIMITS
    # An EOS id that greedy decoding of some prompts produces: those sequences stop early, alone.
    plain = two_call(TorchTarget(target_model.model))
    references = [plain.generate(p, n).tokens for p, n in zip(prompts, limits)]
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
        assert not decoder.active and decoder.engine.target.batch == 0    # every slot freed
        if iteration is not None:   # each iteration one call (catching up on a prompt: the drafter's own)
            assert iteration.graph_calls - calls == len(decoder.verified) > 0
    plain = two_call(target, None, eos).generate_batch([Request(p, n) for p, n in zip(prompts, limits)], 8)
    assert [r.tokens for r in plain] == solo


def test_sampled_sequences_in_a_batch_follow_their_own_seeds(tiny_graphs):
    """Per-sequence sampling settings and seeds: a seeded request gives the same tokens alone and
    inside a batch with other settings."""
    _, _, _, prompts = tiny_graphs
    target, drafter = tiny_backends(tiny_graphs, "torch")
    configs = [SamplingConfig(1.0, seed=1), SamplingConfig(0.7, top_p=0.9, seed=2), SamplingConfig(),
               SamplingConfig(1.2, top_k=5, seed=3)]
    requests = [Request(p, 24, c) for p, c in zip(prompts, configs)]
    solo = [two_call(target, drafter).generate(r.prompt_ids, 24, r.sampling).tokens for r in requests]
    batched = two_call(target, drafter).generate_batch(
        [Request(r.prompt_ids, 24, r.sampling) for r in requests], max_batch=4)
    assert [r.tokens for r in batched] == solo


def test_copied_backends_decode_side_by_side_with_their_own_caches(tiny_graphs):
    """The per-request decoders copy one backend pair (copy.copy: shared sessions, own caches);
    a reset reuses only a cache the backend made, so threads never clear each other's."""
    target, drafter = tiny_backends(tiny_graphs, "onnxruntime")
    prompts = tiny_graphs[3]
    solo = [two_call(target, drafter).generate(p, 20).tokens for p in prompts[:4]]
    first = target.cache
    target.reset()
    assert target.cache is first                                     # its own: cleared, storage kept
    results = [None] * 4

    def worker(k):
        decoder = two_call(copy.copy(target), copy.copy(drafter))
        for i in (k, k + 2):
            results[i] = decoder.generate(prompts[i], 20).tokens
    threads = [threading.Thread(target=worker, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == solo and target.cache is first
