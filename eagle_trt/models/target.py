"""Llama-family target model written for export: the decoder layers of Llama, Mistral, Qwen2 /
2.5, Qwen3 and SmolLM3 are one class, the family's switches in `TargetConfig.arch` (biases, q/k
norm, sliding window, RoPE-less layers); RoPE default / linear / llama3 / yarn.

Everything is an explicit tensor: the KV cache comes in as `past_k` / `past_v` per layer in
head-major [B, Hkv, S, D] layout (attention reads it in place: no transpose, no copy) and only
the new rows go out, the attention mask is a boolean [B, T, P + T] tensor that can
carry a draft-tree mask, positions are an input, and the residual-stream states EAGLE-3
needs come out concatenated as `captured` ([B, T, A * hidden]).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import Arch, CaptureLayers, TargetConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Reduce in fp32 like transformers does, then return to the activation dtype.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> Tensor:
    wavelengths = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    inv_freq = 1.0 / wavelengths
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    old_ctx = float(scaling["original_max_position_embeddings"])
    if scaling["rope_type"] == "yarn":
        # Interpolate (divide by factor) the low frequencies, keep the high ones, linear ramp
        # between the dimensions that make beta_fast and beta_slow turns over the original context.
        def turns_dim(turns: float) -> float:
            return head_dim * math.log(old_ctx / (turns * 2 * math.pi)) / (2 * math.log(theta))
        low, high = turns_dim(scaling["beta_fast"]), turns_dim(scaling["beta_slow"])
        if scaling["truncate"]:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        high = high + 0.001 if low == high else high
        ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        return 1.0 / (factor * wavelengths) * ramp + inv_freq * (1 - ramp)   # transformers' operation order
    # llama3: long wavelengths divided by `factor`, short ones kept, smooth blend between.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float, scaling: dict | None):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)
        # YaRN scales cos and sin (so q.k by its square) to keep attention entropy across the longer context.
        self.attention_factor = float((scaling or {}).get("attention_factor", 1.0))

    def forward(self, position_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin [B, T, 1, D] for apply_rope, sin's first half negated (apply_rope's why)."""
        freqs = position_ids.float()[..., None] * self.inv_freq          # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)                           # [B, T, D]
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        half = sin.shape[-1] // 2
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        return cos.to(dtype)[:, :, None], sin.to(dtype)[:, :, None]       # [B, T, 1, D]


def apply_rope(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """x * cos + rotate_half(x) * sin, where rotate_half(x) = [-x2, x1]: the negation is in
    sin_signed = [-sin1, sin2] (RotaryEmbedding's), so the products are exactly the same and a
    graph swaps x's halves without a Neg node in every layer."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin_signed


class Attention(nn.Module):
    """GQA attention from plain ops (MatMul / Softmax / mask), so every backend runs it.
    The family's switches: q/k/v and o biases, a per-head RMSNorm on q and k before RoPE
    (Qwen3), and layers without RoPE (SmolLM3)."""

    def __init__(self, in_features: int, num_heads: int, num_kv_heads: int, head_dim: int, out_features: int,
                 arch: Arch = Arch(), eps: float = 1e-6, rope: bool = True):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.rope = num_heads, num_kv_heads, head_dim, rope
        self.q_proj = nn.Linear(in_features, num_heads * head_dim, bias=arch.qkv_bias)
        self.k_proj = nn.Linear(in_features, num_kv_heads * head_dim, bias=arch.qkv_bias)
        self.v_proj = nn.Linear(in_features, num_kv_heads * head_dim, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, out_features, bias=arch.o_bias)
        if arch.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(head_dim, eps), RMSNorm(head_dim, eps)
        self.qk_norm = arch.qk_norm
        self.record_probs, self.last_probs = False, None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, past_k: Tensor | None, past_v: Tensor | None,
                cache: tuple[Tensor, Tensor] | None = None, at: int = 0) -> tuple[Tensor, Tensor, Tensor]:
        """past_k / past_v [B, Hkv, P, D]: the committed rows (the exported form). The new rows'
        keys and values [B, Hkv, T, D] are returned and attended beside the past, not
        concatenated to it, so a graph reads the past once and copies none of it (the copies and
        the per-head transposes made a step after 4k tokens 1.45x slower). cache (k, v)
        [B, Hkv, S, D]: a preallocated cache instead; the new rows are written into it at rows
        at..at+T-1 and attention reads rows 0..at+T-1 in place (eager loops)."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        k, v = k.transpose(1, 2), v.transpose(1, 2)                      # [B, Hkv, T, D]
        if cache is not None:
            cache[0][:, :, at:at + T], cache[1][:, :, at:at + T] = k, v
            parts = [(cache[0][:, :, :at + T], cache[1][:, :, :at + T])]
        else:
            parts = [(past_k, past_v), (k, v)]
        return self._attend(q, parts, mask), k, v

    def _attend(self, q: Tensor, parts: list[tuple[Tensor, Tensor]], mask: Tensor) -> Tensor:
        """Attention of q [B, T, H, D] over key / value parts [B, Hkv, S_i, D], in order (mask
        [B, T, sum S_i]). Each KV head's query heads are stacked as the rows of one matmul, so
        keys and values are read once instead of copied `groups` times."""
        B, T, H, D = q.shape
        Hkv = self.num_kv_heads
        groups = H // Hkv
        q = q.view(B, T, Hkv, groups, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, groups * T, D)
        scores = torch.cat([torch.matmul(q, k.transpose(-1, -2)) for k, _ in parts], dim=-1) * (1.0 / math.sqrt(D))
        # The rows are each query head's T rows in turn: the mask, repeated to match, masks them
        # where they are (a [B, Hkv, groups, T, S] view and back cost an exported graph two
        # Reshapes whose sizes ONNX can only compute at run time).
        keep = (mask.repeat(1, groups, 1) if groups > 1 else mask)[:, None]
        probs = torch.softmax(scores.float().masked_fill(~keep, float("-inf")), dim=-1).to(q.dtype)
        if self.record_probs:          # diagnostics only (eagle_trt.diagnose); never set when exporting
            self.last_probs = probs.detach().reshape(B, H, T, -1)
        out, start = None, 0
        for k, v in parts:             # each part's share of the weighted sum, where its rows are
            rows = k.shape[2]
            part = torch.matmul(probs[..., start:start + rows], v)
            out, start = part if out is None else out + part, start + rows
        return self.o_proj(out.view(B, Hkv, groups, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, H * D))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TargetConfig, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                   cfg.head_dim, cfg.hidden_size, cfg.arch, cfg.rms_norm_eps,
                                   rope=index not in cfg.arch.nope_layers)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.arch.mlp_bias)

    def forward(self, h, cos, sin, mask, past_k, past_v, cache=None, at=0):
        attn, k, v = self.self_attn(self.input_layernorm(h), cos, sin, mask, past_k, past_v, cache, at)
        h = h + attn
        return h + self.mlp(self.post_attention_layernorm(h)), k, v


@dataclass
class TargetOutput:
    logits: Tensor          # [B, T, V], or [B, len(logits_index), V]
    captured: Tensor        # [B, T, A * hidden], streams in the configured order
    new_k: list[Tensor]     # per layer [B, Hkv, T, D]: only the rows of the T new tokens
    new_v: list[Tensor]


class LlamaTarget(nn.Module):
    def __init__(self, cfg: TargetConfig, capture: CaptureLayers | None = None):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.set_capture(capture or CaptureLayers.eagle_default(cfg.num_hidden_layers))

    def tie_weights(self) -> None:
        """A tied head is the embedding table itself (again after loading assigns the table)."""
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def set_capture(self, capture: CaptureLayers) -> None:
        capture.validate(self.cfg.num_hidden_layers, self.cfg.source)
        self.capture = capture
        self.capture_streams = capture.streams()

    def empty_past(self, batch: int = 1, dtype: torch.dtype | None = None, device=None) -> tuple[list[Tensor], list[Tensor]]:
        dtype = dtype or self.embed_tokens.weight.dtype
        shape = (batch, self.cfg.num_key_value_heads, 0, self.cfg.head_dim)
        make = lambda: [torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers]  # noqa: E731
        return make(), make()

    def forward(self, input_ids: Tensor, position_ids: Tensor, attention_mask: Tensor,
                past_k: list[Tensor] | None, past_v: list[Tensor] | None, logits_index: Tensor | None = None,
                cache: Tensor | None = None, at: int = 0) -> TargetOutput:
        """logits_index [K] selects the positions that get logits (prefill needs only the last).
        cache [2, layers, B, Hkv, S, D]: a preallocated head-major KV cache written in place at
        rows at.. instead of past_k / past_v (Attention.forward; eager loops only)."""
        state = self.begin(input_ids, position_ids, attention_mask, past_k, past_v, cache, at)
        for i in range(len(self.layers)):
            self.step(i, state)
        return self.finish(state, logits_index)

    # The forward pass in three parts, so that a model holding one part's weights at a time
    # (models/streamed.py) runs exactly this arithmetic: begin (the embedding), step (one decoder
    # layer), finish (the captured states, the final norm and lm_head).

    def begin(self, input_ids: Tensor, position_ids: Tensor, attention_mask: Tensor, past_k: list[Tensor] | None,
              past_v: list[Tensor] | None, cache: Tensor | None = None, at: int = 0) -> "ForwardState":
        h = self.embed_tokens(input_ids)
        cos, sin = self.rope(position_ids, h.dtype)
        window = self.cfg.arch.sliding_window
        past = at if cache is not None else past_k[0].shape[2]
        windowed = None if window is None else attention_mask & window_mask(position_ids, past, window)
        return ForwardState(h, cos, sin, attention_mask, windowed, past_k, past_v, cache, at)

    def step(self, i: int, s: "ForwardState") -> None:
        """Decoder layer i on the state, in place."""
        if i in self.capture_streams:
            s.streams[i] = s.h
        mask = s.windowed if i in self.cfg.arch.sliding_layers else s.mask
        if s.cache is None:
            s.h, k, v = self.layers[i](s.h, s.cos, s.sin, mask, s.past_k[i], s.past_v[i])
        else:
            s.h, k, v = self.layers[i](s.h, s.cos, s.sin, mask, None, None, (s.cache[0, i], s.cache[1, i]), s.at)
        s.new_k.append(k)
        s.new_v.append(v)

    def finish(self, s: "ForwardState", logits_index: Tensor | None = None) -> TargetOutput:
        s.streams[len(self.layers)] = s.h
        captured = torch.cat([s.streams[i] for i in self.capture_streams], dim=-1)
        h = s.h if logits_index is None else s.h.index_select(1, logits_index)
        return TargetOutput(self.lm_head(self.norm(h)), captured, s.new_k, s.new_v)


@dataclass
class ForwardState:
    """One forward call between its parts (LlamaTarget.begin / step / finish)."""
    h: Tensor
    cos: Tensor
    sin: Tensor
    mask: Tensor
    windowed: Tensor | None
    past_k: list[Tensor] | None
    past_v: list[Tensor] | None
    cache: Tensor | None
    at: int
    streams: dict[int, Tensor] = field(default_factory=dict)
    new_k: list[Tensor] = field(default_factory=list)
    new_v: list[Tensor] = field(default_factory=list)


def causal_mask(new_tokens: int, past: int, device=None) -> Tensor:
    """Boolean [1, T, P + T]: every new token sees the whole past and the new tokens up to itself.
    Built from aranges so that traced sizes stay symbolic in an exported graph."""
    cols = torch.arange(past + new_tokens, device=device)[None, :]
    rows = torch.arange(new_tokens, device=device)[:, None] + past
    return (cols <= rows)[None]


def window_mask(position_ids: Tensor, past: int, window: int) -> Tensor:
    """Boolean [B, T, P + T]: key j is within the sliding window of query i when
    pos(i) - pos(j) < window (transformers' rule). The P cached rows sit at positions 0..P-1
    (the cache holds the committed sequence in order); the new rows, tree nodes included, at
    their position_ids. Computed in the graph, so the runtimes pass the usual mask."""
    q = position_ids[:, :, None]
    cached = torch.arange(past, device=position_ids.device)[None, None, :]
    return torch.cat((q - cached < window, q - position_ids[:, None, :] < window), dim=-1)
