"""Greedy speculative decoding is token-identical to the target's own greedy output.

The reference is transformers' `generate` on the same SmolLM2 weights, not our own code.
The EAGLE-3 and EAGLE 3.1 drafters are untrained (no trained SmolLM2 drafter ships yet), so
on their own they are almost never accepted; `PlantedDrafter` overwrites one path of each
real draft tree with the reference continuation up to a random depth, so that multi-token
acceptance, sibling order and KV compaction all run. An unplanted run is checked as well."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from eagle_trt.checkpoints import random_drafter
from eagle_trt.config import TreeShape
from eagle_trt.runtime.backend import TorchDrafter, TorchTarget
from eagle_trt.runtime.decoder import SpeculativeDecoder, generate_autoregressive

from conftest import PlantedDrafter

NUM_PROMPTS, NEW_TOKENS = 20, 64
SHAPES = {"chain": TreeShape.chain(5), "tree": TreeShape(depth=5, top_k=4, total_tokens=24)}


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer, mtbench) -> list[list[int]]:
    out = []
    for text in mtbench[:NUM_PROMPTS]:
        ids = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


@pytest.fixture(scope="module")
def hf_greedy(smollm2, prompts) -> list[list[int]]:
    hf = LlamaForCausalLM.from_pretrained(str(smollm2.folder), dtype=torch.float32).eval()
    eos = list(smollm2.config.eos_token_ids)
    refs = []
    with torch.no_grad():
        for ids in prompts:
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
            refs.append(out[0, len(ids):].tolist())
    return refs


@pytest.mark.slow
@pytest.mark.parametrize("shape_name", list(SHAPES))
@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
def test_speculative_greedy_equals_transformers_generate(smollm2, prompts, hf_greedy, variant, shape_name):
    drafter = TorchDrafter(random_drafter(smollm2, variant, seed=1, draft_vocab_size=4096), SHAPES[shape_name])
    smollm2.model.set_capture(drafter.model.cfg.capture_for(smollm2.config))
    target = TorchTarget(smollm2.model)
    accepted = []
    for i, (ids, ref) in enumerate(zip(prompts, hf_greedy)):
        planted = PlantedDrafter(drafter, len(ids), ref, seed=i)
        res = SpeculativeDecoder(target, planted, smollm2.config.eos_token_ids).generate(ids, NEW_TOKENS)
        assert res.tokens == ref, f"prompt {i}: speculative output diverges from transformers' greedy output"
        accepted += res.accept_lengths
    # Vacuity guard: drafts were really accepted several tokens deep.
    assert sum(accepted) / len(accepted) > 2.0
    assert max(accepted) == SHAPES[shape_name].depth + 1


@pytest.mark.slow
def test_unplanted_drafter_and_autoregressive_equal_transformers(smollm2, prompts, hf_greedy):
    drafter = random_drafter(smollm2, "eagle3.1", seed=0, draft_vocab_size=4096)
    smollm2.model.set_capture(drafter.cfg.capture_for(smollm2.config))
    dec = SpeculativeDecoder(TorchTarget(smollm2.model), TorchDrafter(drafter, TreeShape(3, 2, 6)),
                             smollm2.config.eos_token_ids)
    for ids, ref in zip(prompts[:3], hf_greedy[:3]):
        assert dec.generate(ids, NEW_TOKENS).tokens == ref
        assert generate_autoregressive(TorchTarget(smollm2.model), ids, NEW_TOKENS,
                                       smollm2.config.eos_token_ids).tokens == ref
