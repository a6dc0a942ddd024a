"""Shared fixtures: tiny random Llama targets written as real HF checkpoints, the real
SmolLM2-135M-Instruct target, real MT-bench prompts, and drafters that accept often."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eagle_trt.checkpoints import LoadedTarget, load_target
from eagle_trt.config import CaptureLayers, DrafterConfig
from eagle_trt.data import mtbench_prompts
from eagle_trt.models.drafter import EagleDrafter

torch.set_num_threads(2)


def write_tiny_hf_target(folder: Path, *, vocab: int = 96, hidden: int = 64, layers: int = 6, heads: int = 4,
                         kv_heads: int = 2, rope_scaling: dict | None = None, tie: bool = False,
                         seed: int = 0, max_pos: int = 512) -> Path:
    """A random Llama checkpoint saved by transformers itself (config.json + model.safetensors)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
                      rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=rope_scaling, tie_word_embeddings=tie,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():   # larger weights than the init default, so logits are far from uniform
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    model.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory) -> Path:
    return write_tiny_hf_target(tmp_path_factory.mktemp("tiny_target"))


@pytest.fixture(scope="session")
def tiny_target(tiny_target_dir) -> LoadedTarget:
    return load_target(tiny_target_dir)


@pytest.fixture(scope="session")
def smollm2() -> LoadedTarget:
    return load_target("smollm2")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2):
    return smollm2.tokenizer()


@pytest.fixture(scope="session")
def mtbench() -> list[str]:
    return mtbench_prompts()


def oracle_drafter(target: LoadedTarget, variant: str, noise: float = 0.02, seed: int = 0,
                   draft_vocab_size: int | None = None) -> EagleDrafter:
    """A drafter built from the target's own last hidden state, so the first draft token is
    usually the target's next token and deeper ones sometimes are: acceptance well above 1,
    which exercises the accept / compact paths that a random drafter never reaches.

    It captures the output of the last decoder layer (layer_output convention), fc copies
    that chunk, attention and MLP are small random noise, and norm / lm_head are the target's.
    Every flag of the variant stays active, so the real EAGLE-3 / 3.1 code paths run."""
    t = target.config
    L, H = t.num_hidden_layers, t.hidden_size
    is31 = variant == "eagle3.1"
    vd = draft_vocab_size or t.vocab_size
    cfg = DrafterConfig(hidden_size=H, intermediate_size=t.intermediate_size, num_attention_heads=t.num_attention_heads,
                        num_key_value_heads=t.num_key_value_heads, head_dim=t.head_dim, vocab_size=t.vocab_size,
                        draft_vocab_size=vd, target_hidden_size=H, rms_norm_eps=t.rms_norm_eps,
                        rope_theta=t.rope_theta, rope_scaling=t.rope_scaling,
                        max_position_embeddings=t.max_position_embeddings,
                        capture=CaptureLayers((1, L // 2 - 1, L - 1), "layer_output"),
                        fc_norm=is31, norm_output=is31)
    d = EagleDrafter(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in d.named_parameters():
            p.copy_(noise * torch.randn(p.shape, generator=gen))
        for name, p in d.named_parameters():
            if name.endswith("norm.weight") or name.startswith("fc_norm"):
                p.fill_(1.0)
        d.fc.weight.zero_()
        d.fc.weight[:, 2 * H:] = torch.eye(H)
        d.norm.weight.copy_(target.model.norm.weight)
        if vd == t.vocab_size:
            d.lm_head.weight.copy_(target.model.lm_head.weight)
        else:   # the vd most frequent ids are unknown here: take the first vd ids
            d.lm_head.weight.copy_(target.model.lm_head.weight[:vd])
    d.embed_tokens.weight = target.model.embed_tokens.weight
    d.embed_shared = True
    return d.eval()


def write_json(path: Path, data: dict) -> Path:
    path.write_text(json.dumps(data))
    return path


class PlantedDrafter:
    """Wraps a real drafter backend and overwrites the first root-to-leaf path of each tree
    with a known continuation (up to a random depth), so trees are accepted several tokens
    deep. The real EAGLE drafter still builds every tree (shape, siblings, masks, KV); only
    the tokens on one path are replaced. Used to exercise acceptance and KV compaction in
    losslessness tests, where the right answer comes from transformers, not from us."""

    def __init__(self, inner, prompt_len: int, continuation: list[int], seed: int = 0):
        import random
        self.inner, self.shape = inner, inner.shape
        self.prompt_len, self.continuation = prompt_len, continuation
        self.rng = random.Random(seed)
        self.rows = 0

    def reset(self, capacity: int) -> None:
        self.inner.reset(capacity)
        self.rows = 0

    def draft(self, captured, input_ids):
        tree = self.inner.draft(captured, input_ids)
        self.rows += int(input_ids.shape[0])
        generated = self.rows - (self.prompt_len - 1)     # tokens committed after the prompt
        parents = tree.parents.tolist()
        tree.tokens = tree.tokens.clone()   # the drafter returns inference-mode tensors
        plant_depth = self.rng.randint(0, self.shape.depth)
        node, depth = 0, 0
        while depth < plant_depth:
            children = [i for i, p in enumerate(parents) if p == node]
            if not children or generated + depth >= len(self.continuation):
                break
            node = self.rng.choice(children[:2])          # the best child, or its first sibling
            tree.tokens[node - 1] = self.continuation[generated + depth]
            depth += 1
        return tree
