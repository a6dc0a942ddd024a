"""Chunked prefill (DecodingLoop's prefill_chunk): a prompt prefilled a chunk per step, its rows
held apart from the running batch, gives exactly the tokens it gives prefilled whole, on every
engine, alone and continuously batched, greedy and seeded sampling; the running sequences
advance between a long prompt's chunks; real SmolLM2 prompts longer than two chunks too."""
from __future__ import annotations

import pytest
from conftest import LIMITS, TINY_SHAPE, capturing, on_graph, static, tiny_backends, two_call

from eagle_trt.config import ConfigError, SamplingConfig, TreeShape
from eagle_trt.runtime.loop import DecodingLoop, Request
from eagle_trt.runtime.onnxruntime_backend import OrtIteration

ENGINES = ["torch", "onnxruntime", "iteration", "static"]


def _loop(tiny_graphs, engine: str, request, eos=()) -> DecodingLoop:
    target_model, drafter, _, _ = tiny_graphs
    if engine == "static":
        return static(capturing(target_model, drafter).model, drafter, TINY_SHAPE, eos,
                      target_model.config.vocab_size, capacity=256, max_batch=4)
    target, draft = tiny_backends(tiny_graphs, "torch" if engine == "torch" else "onnxruntime")
    if engine == "iteration":
        return on_graph(OrtIteration(request.getfixturevalue("tiny_iteration_graph"), target, draft), eos)
    return two_call(target, draft, eos)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_prompt_prefilled_in_chunks_decodes_as_one_prefilled_whole(tiny_graphs, engine, request):
    """Each prompt alone and all of them batched 3 at a time (joins while others prefill), chunks
    of 1, 7 and 16 tokens (the longest prompt, 47 tokens, is cut in up to 47): the tokens of the
    whole prefill; a seeded sampled sequence among greedy ones keeps its tokens too."""
    _, _, _, prompts = tiny_graphs
    whole = _loop(tiny_graphs, engine, request)
    references = [whole.generate(p, n).tokens for p, n in zip(prompts, LIMITS)]
    sampled = SamplingConfig(temperature=0.8, top_p=0.9, seed=5)
    sampled_ref = whole.generate(prompts[4], 20, sampled).tokens
    for chunk in (1, 7, 16):
        loop = _loop(tiny_graphs, engine, request)
        loop.prefill_chunk = chunk
        assert [loop.generate(p, n).tokens for p, n in zip(prompts[:3], LIMITS)] == references[:3], \
            f"chunk {chunk}: a prompt alone decodes differently"
        requests = [Request(p, n) for p, n in zip(prompts, LIMITS)] + [Request(prompts[4], 20, sampled)]
        results = loop.generate_batch(requests, max_batch=3)
        assert [r.tokens for r in results[:-1]] == references, f"chunk {chunk}: batched sequences differ"
        assert results[-1].tokens == sampled_ref, f"chunk {chunk}: the seeded sampled sequence differs"
        assert not loop.prefilling and not loop.active


@pytest.mark.parametrize("engine", ["onnxruntime", "static"])
def test_running_sequences_advance_between_a_long_prompts_chunks(tiny_graphs, engine, request):
    """A 47-token prompt in chunks of 8 joins a running sequence: each step prefills one chunk
    and iterates the running one, so it keeps making tokens while the prompt waits (6 steps)."""
    _, _, _, prompts = tiny_graphs
    loop = _loop(tiny_graphs, engine, request)
    loop.prefill_chunk = 8
    running = loop.add(Request(prompts[0], 40))
    loop.step()                                   # its prefill (5 tokens), then its first iteration
    assert loop.active == [running] and len(running.result.tokens) >= 2
    long = loop.add(Request(prompts[4], 10))      # 47 tokens: 6 chunks of 8
    assert len(prompts[4]) == 47 and loop.prefilling == [long]
    for step in range(5):
        before = len(running.result.tokens)
        loop.step()
        assert loop.prefilling == [long] and loop.prefilled == 8 * (step + 1), f"step {step}: not one chunk"
        assert len(running.result.tokens) > before, f"step {step}: the running sequence waited for the prefill"
    loop.step()                                   # the last chunk: it joins with its first token
    assert not loop.prefilling and long in loop.active and len(long.result.tokens) >= 1


def test_a_cancelled_prompt_leaves_the_prefill_queue_and_the_next_one_starts_clean(tiny_graphs, request):
    """A prompt cancelled halfway through its chunks is dropped; the next prompt's tokens are its own."""
    _, _, _, prompts = tiny_graphs
    whole = _loop(tiny_graphs, "onnxruntime", request)
    reference = whole.generate(prompts[1], 20).tokens
    loop = _loop(tiny_graphs, "onnxruntime", request)
    loop.prefill_chunk = 8
    doomed = loop.add(Request(prompts[4], 10))
    loop.step()
    assert loop.prefilled == 8
    loop.cancel(doomed)
    assert doomed.result.stop_reason == "cancelled" and not loop.prefilling and loop.prefilled == 0
    assert loop.generate(prompts[1], 20).tokens == reference


def test_stop_ids_end_a_sequence_as_eos_does(tiny_graphs, request):
    """A request's stop ids: the sequence ends at the first one (kept as its last token), others
    decode on; an id outside the vocabulary is refused before anything runs."""
    _, _, _, prompts = tiny_graphs
    loop = _loop(tiny_graphs, "onnxruntime", request)
    reference = loop.generate(prompts[1], 25).tokens
    stop = reference[6]
    cut = reference[:reference.index(stop) + 1]
    results = loop.generate_batch([Request(prompts[1], 25, stop_ids=(stop,)), Request(prompts[1], 25)])
    assert results[0].tokens == cut and results[0].stop_reason == "eos" and results[1].tokens == reference
    with pytest.raises(ConfigError, match="stop id 100000 is outside the vocabulary"):
        DecodingLoop(loop.engine, (), 96).add(Request(prompts[1], 5, stop_ids=(100000,)))
    with pytest.raises(ConfigError, match="prefill_chunk must be a positive integer"):
        DecodingLoop(loop.engine, (), prefill_chunk=0)


@pytest.mark.slow
def test_smollm2_prompts_prefilled_in_chunks_decode_as_prefilled_whole(smollm2, mtbench_ids, smollm2_onnx_dir):
    """Real MT-bench prompts (chat template, 35-138 tokens) on SmolLM2: the PyTorch engine with the
    shipped EAGLE 3.1 drafter and plain decoding on the exported target graph (ONNX Runtime),
    chunks of 16 and 50 tokens (every prompt longer than two chunks of 16), 4 at a time: the
    tokens of the whole prefill."""
    from eagle_trt.api import SHIPPED_DRAFTERS
    from eagle_trt.checkpoints import load_drafter
    from eagle_trt.runtime.onnxruntime_backend import OrtTarget
    drafter = load_drafter(SHIPPED_DRAFTERS / "smollm2-eagle3.1", smollm2)
    eos, vocab = smollm2.config.eos_token_ids, smollm2.config.vocab_size
    prompts = mtbench_ids[:6]
    assert min(map(len, prompts)) > 32
    loops = {"static": lambda: static(capturing(smollm2, drafter).model, drafter, TreeShape(3, 2, 4), eos, vocab,
                                      capacity=256),
             "onnxruntime": lambda: two_call(OrtTarget(smollm2_onnx_dir / "target.onnx",
                                                       smollm2.config.max_position_embeddings, threads=1), None, eos)}
    for name, make in loops.items():
        whole = make()
        references = [r.tokens for r in whole.generate_batch([Request(p, 24) for p in prompts], max_batch=4)]
        for chunk in (16, 50):
            loop = make()
            loop.prefill_chunk = chunk
            results = loop.generate_batch([Request(p, 24) for p in prompts], max_batch=4)
            assert [r.tokens for r in results] == references, f"{name}, chunks of {chunk}: tokens differ"
