"""Target model parity with transformers' LlamaForCausalLM, KV-cache and tree-mask semantics."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from eagle_trt.checkpoints import load_target
from eagle_trt.config import CaptureLayers
from eagle_trt.models.target import causal_mask

from conftest import write_tiny_hf_target

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def full_forward(model, ids: torch.Tensor):
    T = ids.shape[1]
    past_k, past_v = model.empty_past()
    with torch.no_grad():
        return model(ids, torch.arange(T)[None], causal_mask(T, 0), past_k, past_v)


@pytest.mark.parametrize("rope_scaling,tie", [(None, False), (LLAMA3_ROPE, False), (LLAMA3_ROPE, True)])
def test_tiny_llama_matches_transformers(tmp_path, rope_scaling, tie):
    folder = write_tiny_hf_target(tmp_path / "t", rope_scaling=rope_scaling, tie=tie, heads=8, kv_heads=2, seed=3)
    ours = load_target(folder)
    if rope_scaling:
        assert ours.config.rope_scaling["rope_type"] == "llama3"
    assert ours.config.num_key_value_heads == 2 and ours.config.num_attention_heads == 8
    ref = LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = torch.randint(0, ours.config.vocab_size, (1, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ref(ids).logits
    got = full_forward(ours.model, ids).logits
    assert (got - expected).abs().max().item() <= 1e-4


def test_llama3_rope_scaling_changes_logits(tmp_path):
    """Guard against the scaling being silently ignored: it must matter past the original context."""
    plain = load_target(write_tiny_hf_target(tmp_path / "a", seed=3))
    scaled = load_target(write_tiny_hf_target(tmp_path / "b", seed=3, rope_scaling=LLAMA3_ROPE))
    ids = torch.randint(0, 96, (1, 200), generator=torch.Generator().manual_seed(1))
    assert (full_forward(plain.model, ids).logits - full_forward(scaled.model, ids).logits).abs().max() > 1e-3


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2, smollm2_tokenizer, mtbench):
    ref = LlamaForCausalLM.from_pretrained(str(smollm2.folder), dtype=torch.float32).eval()
    text = "\n\n".join(mtbench[:12])
    ids = torch.tensor([smollm2_tokenizer(text)["input_ids"][:320]])
    assert ids.shape[1] == 320
    with torch.no_grad():
        expected = ref(ids).logits
    got = full_forward(smollm2.model, ids).logits
    assert (got - expected).abs().max().item() <= 1e-4


def test_captured_states_follow_the_convention(tiny_target_dir):
    """layer_input ids (2, L//2, L-3) and layer_output ids (1, L//2-1, L-4) name the same tensors,
    which are transformers' hidden_states[2], [L//2], [L-3] (input of those layers)."""
    t = load_target(tiny_target_dir)
    L = t.config.num_hidden_layers
    ids = torch.randint(0, t.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(2))
    t.model.set_capture(CaptureLayers((2, L // 2, L - 3), "layer_input"))
    a = full_forward(t.model, ids).captured
    t.model.set_capture(CaptureLayers((1, L // 2 - 1, L - 4), "layer_output"))
    b = full_forward(t.model, ids).captured
    ref = LlamaForCausalLM.from_pretrained(str(tiny_target_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        hs = ref(ids, output_hidden_states=True).hidden_states
    expected = torch.cat([hs[2], hs[L // 2], hs[L - 3]], dim=-1)
    assert torch.equal(a, b)
    assert (a - expected).abs().max() <= 1e-5
    t.model.set_capture(CaptureLayers((1, 2, 3), "layer_input"))
    assert not torch.allclose(full_forward(t.model, ids).captured, a)


def test_kv_cache_decoding_equals_full_forward(tiny_target):
    model = tiny_target.model
    ids = torch.randint(0, tiny_target.config.vocab_size, (1, 50), generator=torch.Generator().manual_seed(4))
    full = full_forward(model, ids)
    past_k, past_v = model.empty_past()
    with torch.no_grad():
        out = model(ids[:, :30], torch.arange(30)[None], causal_mask(30, 0), past_k, past_v)
        past_k, past_v = out.new_k, out.new_v
        rows = [out.logits]
        for t in range(30, 50):
            step = model(ids[:, t:t + 1], torch.tensor([[t]]), causal_mask(1, t), past_k, past_v)
            past_k = [torch.cat((a, b), 2) for a, b in zip(past_k, step.new_k)]     # [B, Hkv, rows, D]
            past_v = [torch.cat((a, b), 2) for a, b in zip(past_v, step.new_v)]
            rows.append(step.logits)
    # fp32 rounding of one-row against 50-row matmuls: 1.06e-5 on an AVX2-only EPYC (below 1e-5 on
    # AVX-512 ones); a wrong past moves them by >= 0.1 (a row missing: 0.51, one key row wrong: 0.13)
    assert (torch.cat(rows, 1) - full.logits).abs().max() <= 3e-5


def test_tree_mask_equals_running_each_path(tiny_target):
    """A node's logits under the tree mask equal those of its root-to-node path run as a sequence."""
    model, V = tiny_target.model, tiny_target.config.vocab_size
    gen = torch.Generator().manual_seed(5)
    ctx = torch.randint(0, V, (1, 20), generator=gen)
    parents = [-1, 0, 0, 1, 1, 2, 3]                 # root + 6 nodes, two branches
    tokens = torch.randint(0, V, (1, len(parents)), generator=gen)
    mask = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    depth = []
    for i, p in enumerate(parents):
        mask[i] = mask[p] if p >= 0 else mask[i]
        mask[i, i] = True
        depth.append(0 if p < 0 else depth[p] + 1)
    past = full_forward(model, ctx)
    with torch.no_grad():
        tree = model(tokens, 20 + torch.tensor([depth]), torch.cat((torch.ones(len(parents), 20, dtype=torch.bool),
                                                                     mask), 1)[None], past.new_k, past.new_v)
    for i in range(len(parents)):
        path = [j for j in range(len(parents)) if mask[i, j]]
        seq = torch.cat((ctx, tokens[:, path]), 1)
        assert (full_forward(model, seq).logits[0, -1] - tree.logits[0, i]).abs().max() <= 1e-5
