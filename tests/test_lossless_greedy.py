"""Greedy speculative decoding is token-identical to the target's own greedy output.

The reference is transformers' `generate` on the same SmolLM2 weights, not our own code.
Two kinds of drafters: the shipped trained EAGLE 3.1 and EAGLE-3 drafters as they are, and
untrained drafters wrapped in `PlantedDrafter`, which overwrites one path of each real draft
tree with the reference continuation up to a random depth, so that deep acceptance, sibling
order and KV compaction run on every prompt whatever the drafter's quality."""
from __future__ import annotations

import pytest

from eagle_trt.api import SHIPPED_DRAFTERS
from eagle_trt.checkpoints import load_drafter, random_drafter
from eagle_trt.config import TreeShape
from eagle_trt.runtime.backend import TorchDrafter, TorchTarget
from eagle_trt.runtime.loop import Request

from conftest import NEW_TOKENS, NUM_PROMPTS, capturing, check_planted_greedy, static

SHAPES = {"chain": TreeShape.chain(5), "tree": TreeShape(depth=5, top_k=4, total_tokens=24)}
# Each variant once and each shape once, not their product: the decoding loop and backends never
# branch on the variant (it lives inside the drafter, whose trees are checked per variant x shape
# against a reference in test_tree.py); test_onnx_smollm2.py runs the other two pairings.
PAIRS = [("eagle3", "chain"), ("eagle3.1", "tree")]


@pytest.mark.slow
@pytest.mark.parametrize("variant,shape_name", PAIRS)
def test_speculative_greedy_equals_transformers_generate(smollm2, mtbench_ids, hf_greedy, variant, shape_name):
    drafter = TorchDrafter(random_drafter(smollm2, variant, seed=1, draft_vocab_size=4096), SHAPES[shape_name])
    check_planted_greedy(TorchTarget(capturing(smollm2, drafter.model).model), drafter, mtbench_ids, hf_greedy, smollm2.config.eos_token_ids,
                         batch=3 if shape_name == "chain" else 8)


@pytest.mark.slow
def test_unplanted_drafter_and_autoregressive_equal_transformers(smollm2, mtbench_ids, hf_greedy):
    """The PyTorch engine (what "torch" runs everywhere) with an untrained drafter, and plainly."""
    drafter = random_drafter(smollm2, "eagle3.1", seed=0, draft_vocab_size=4096)
    target = capturing(smollm2, drafter)
    eos = smollm2.config.eos_token_ids
    dec = static(target.model, drafter, TreeShape(3, 2, 6), eos, max_batch=1)
    plain = static(target.model, eos=eos, max_batch=1)
    for ids, ref in zip(mtbench_ids[:3], hf_greedy[:3]):
        assert dec.generate(ids, NEW_TOKENS).tokens == ref
        assert plain.generate(ids, NEW_TOKENS).tokens == ref


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
def test_shipped_drafters_are_lossless(smollm2, mtbench_ids, hf_greedy, variant):
    drafter = load_drafter(SHIPPED_DRAFTERS / f"smollm2-{variant}", smollm2)
    assert drafter.cfg.variant == variant
    # The planted tests above cover every prompt, one at a time and batched; the trained drafters'
    # real trees, half of them, decoded as one batch (half the seconds of one at a time) on the
    # PyTorch engine.
    prompts = mtbench_ids[:NUM_PROMPTS // 2]
    dec = static(capturing(smollm2, drafter).model, drafter, TreeShape(5, 4, 16), smollm2.config.eos_token_ids,
                 max_batch=len(prompts))
    results = dec.generate_batch([Request(ids, NEW_TOKENS) for ids in prompts], max_batch=len(prompts))
    accepted = []
    for i, (res, ref) in enumerate(zip(results, hf_greedy)):
        assert res.tokens == ref, f"prompt {i}: speculative output with the shipped {variant} drafter diverges"
        accepted += res.accept_lengths
    assert sum(accepted) / len(accepted) > 1.5, "the shipped drafter is barely accepted: is it trained?"
