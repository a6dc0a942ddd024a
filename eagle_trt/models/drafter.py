"""EAGLE-3 and EAGLE 3.1 drafter: one class, variants switched by config flags.

Step 0 (over newly committed tokens):   f = fc(norms(concat of captured target states))
Later steps (tree expansion):           f = the state the previous step fed back
Every step:
    u  = concat(input_layernorm(embed(ids)), hidden_norm(f))          # embeddings first, 2H wide
    h1 = o_proj(attn(u)) + (hidden_norm(f) if norm_before_residual else f)
    h2 = h1 + mlp(post_attention_layernorm(h1))
    z  = norm(h2); logits = lm_head(z) over the draft vocabulary
    feedback = z (EAGLE 3.1, norm_output) or h2 (EAGLE-3)
Module names follow the SafeAILab checkpoint layout (`midlayer.*`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..config import DrafterConfig
from .target import MLP, Attention, RMSNorm, RotaryEmbedding


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        H = cfg.hidden_size
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        # The layer follows its family (speculators writes Qwen3 layers with q_norm / k_norm).
        self.self_attn = Attention(2 * H, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, H,
                                   cfg.arch, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = MLP(H, cfg.intermediate_size, cfg.arch.mlp_bias)


@dataclass
class DrafterOutput:
    logits: Tensor | None   # [B, T, draft_vocab]; None when not asked for (see logits_of)
    feedback: Tensor   # [B, T, H]: the state the next draft step takes in place of f
    new_k: Tensor      # [B, Hkv, T, D]
    new_v: Tensor


class EagleDrafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        A, Ht, H = cfg.num_aux_hidden_states, cfg.target_hidden_size, cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(Ht, cfg.rms_norm_eps) for _ in range(A))
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(A * Ht, cfg.rms_norm_eps)
        self.fc = nn.Linear(A * Ht, H, bias=False)
        self.midlayer = DrafterLayer(cfg)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        # d2t holds offsets: target id = draft id + d2t[draft id].
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool)
                             if cfg.draft_vocab_size == cfg.vocab_size else torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.embed_shared = False   # True when embed_tokens came from the target

    def project(self, captured: Tensor) -> Tensor:
        """fc input from the target's captured states [B, T, A * Ht] -> f [B, T, H]."""
        if self.cfg.fc_norm:
            chunks = captured.split(self.cfg.target_hidden_size, dim=-1)
            captured = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks)], dim=-1)
        elif self.cfg.norm_before_fc:
            captured = self.input_norm(captured)
        return self.fc(captured)

    def forward(self, hidden: Tensor, input_ids: Tensor, position_ids: Tensor, attention_mask: Tensor,
                past_k: Tensor, past_v: Tensor, logits: bool = True) -> DrafterOutput:
        """logits=False: skip the lm_head (for step 0 over many rows, of which tree drafting needs
        one per sequence: the lm_head is ~40% of a row's work); logits_of gives the rows needed."""
        layer = self.midlayer
        e = self.embed_tokens(input_ids).to(hidden.dtype)
        normed_hidden = layer.hidden_norm(hidden)
        u = torch.cat((layer.input_layernorm(e), normed_hidden), dim=-1)
        cos, sin = self.rope(position_ids, hidden.dtype)
        attn, k, v = layer.self_attn(u, cos, sin, attention_mask, past_k, past_v)
        h1 = attn + (normed_hidden if self.cfg.norm_before_residual else hidden)
        h2 = h1 + layer.mlp(layer.post_attention_layernorm(h1))
        z = self.norm(h2)
        return DrafterOutput(self.lm_head(z) if logits else None, z if self.cfg.norm_output else h2, k, v)

    def logits_of(self, feedback: Tensor) -> Tensor:
        """The logits of rows from their fed-back states (z itself in 3.1, h2 in EAGLE-3)."""
        return self.lm_head(feedback if self.cfg.norm_output else self.norm(feedback))

    def to_target_ids(self, draft_ids: Tensor) -> Tensor:
        return draft_ids + self.d2t[draft_ids]

    def empty_past(self, batch: int = 1) -> tuple[Tensor, Tensor]:
        w = self.fc.weight
        shape = (batch, self.cfg.num_key_value_heads, 0, self.cfg.head_dim)
        return torch.zeros(shape, dtype=w.dtype, device=w.device), torch.zeros(shape, dtype=w.dtype, device=w.device)
