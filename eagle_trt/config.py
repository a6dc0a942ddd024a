"""Typed model configs: the Llama-family target, the EAGLE-3 / 3.1 drafter, the captured
layers and the draft-tree shape. Each config is built from a Hugging Face style config.json
dict through hfconfig.Keys: keys that change the arithmetic are implemented or refused, and
errors name the file a bad value came from."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from .hfconfig import (FAMILY_DEFAULTS, Arch, ConfigError, Keys, arch_to_hf, model_type, read_arch, read_json,
                       read_rope)

Convention = Literal["layer_input", "layer_output"]


@dataclass(frozen=True)
class CaptureLayers:
    """Which residual-stream tensors of the target feed the drafter.

    Two conventions name the same tensors: "layer_input" (input of decoder layer i: EAGLE
    reference, vLLM, SGLang) and "layer_output" (output of decoder layer i: TensorRT-LLM,
    ModelOpt). Internally we use stream indices: stream s is the hidden state after s layers,
    so input of layer i is stream i and output of layer i is stream i + 1.
    """

    layer_ids: tuple[int, ...]
    convention: Convention = "layer_input"

    @staticmethod
    def eagle_default(num_layers: int) -> "CaptureLayers":
        # Clamped so that very shallow (test) models still get valid ids.
        ids = (2, num_layers // 2, num_layers - 3)
        return CaptureLayers(tuple(min(max(i, 0), num_layers - 1) for i in ids), "layer_input")

    def streams(self) -> tuple[int, ...]:
        shift = 0 if self.convention == "layer_input" else 1
        return tuple(i + shift for i in self.layer_ids)

    def validate(self, num_layers: int, source: str) -> None:
        if self.convention not in ("layer_input", "layer_output"):
            raise ConfigError(f"{source}: capture convention must be 'layer_input' or 'layer_output', got {self.convention!r}")
        for i in self.layer_ids:
            if not 0 <= i < num_layers:
                raise ConfigError(f"{source}: captured layer id {i} ({self.convention}) is outside the target's "
                                  f"{num_layers} decoder layers")


def _read_layer(k: Keys, family: str) -> dict:
    """The decoder-layer shape shared by targets and drafters, with the family's defaults."""
    defaults = FAMILY_DEFAULTS[family]
    hidden = k.get("hidden_size", int)
    heads = k.get("num_attention_heads", int)
    max_pos = k.get("max_position_embeddings", int, defaults["max_position_embeddings"])
    theta, scaling = read_rope(k, max_pos, defaults["rope_theta"])
    layer = dict(hidden_size=hidden, intermediate_size=k.get("intermediate_size", int), num_attention_heads=heads,
                 num_key_value_heads=k.get("num_key_value_heads", int, heads),
                 head_dim=k.get("head_dim", int, defaults.get("head_dim", hidden // heads)),
                 rms_norm_eps=k.get("rms_norm_eps", float, defaults["rms_norm_eps"]), rope_theta=theta,
                 rope_scaling=scaling, max_position_embeddings=max_pos)
    if heads % layer["num_key_value_heads"]:
        raise ConfigError(f"{k.source}: num_attention_heads {heads} is not a multiple of num_key_value_heads "
                          f"{layer['num_key_value_heads']}")
    return layer


def _layer_hf(cfg) -> dict:
    """The config.json keys of the shared layer shape (the inverse of _read_layer)."""
    return {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps,
            "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling,
            "max_position_embeddings": cfg.max_position_embeddings}


@dataclass
class TargetConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    arch: Arch = field(default_factory=Arch)   # family switches: biases, q/k norm, sliding window, RoPE-less layers
    source: str = "<memory>"

    @classmethod
    def from_hf(cls, d: dict, source: str = "<memory>") -> "TargetConfig":
        k = Keys(d, source)
        family = model_type(k)
        layers = k.get("num_hidden_layers", int)
        eos = k.raw("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        cfg = cls(vocab_size=k.get("vocab_size", int), num_hidden_layers=layers, **_read_layer(k, family),
                  tie_word_embeddings=k.get("tie_word_embeddings", bool, FAMILY_DEFAULTS[family]["tie_word_embeddings"]),
                  bos_token_id=k.raw("bos_token_id"), eos_token_ids=eos_ids, arch=read_arch(k, family, layers),
                  source=source)
        k.refuse_unread(f"model_type {family!r} targets")
        return cfg

    def to_hf(self) -> dict:
        arch = self.arch.model_type
        return {
            "architectures": [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                               "qwen3": "Qwen3ForCausalLM", "smollm3": "SmolLM3ForCausalLM"}[arch]],
            **arch_to_hf(self.arch, self.num_hidden_layers), **_layer_hf(self),
            "vocab_size": self.vocab_size, "num_hidden_layers": self.num_hidden_layers,
            "tie_word_embeddings": self.tie_word_embeddings, "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
        }


# Drafter config keys that do not change the arithmetic: speculators' bookkeeping, training-only
# settings, the special token ids (the target's decide), and the layer's own tie flag (a
# drafter's lm_head is its own draft-vocabulary head).
DRAFTER_NEUTRAL = frozenset({"speculators_version", "speculators_config", "embed_requires_grad",
                             "has_no_defaults_at_init", "tie_word_embeddings", "bos_token_id", "eos_token_id"})
# ModelOpt's eagle_config: switches whose only implemented value is the EAGLE-3 arithmetic.
MODELOPT_REQUIRED = {"use_input_layernorm_in_first_layer": True, "use_last_layernorm": True,
                     "use_aux_hidden_state": True, "use_mtp_layernorm": False, "parallel_draft_step": 1}
MODELOPT_NEUTRAL = frozenset({"next_layer_regular", "parallel_draft_heads_num_layers"})


@dataclass
class DrafterConfig:
    """EAGLE-3 and EAGLE 3.1 drafters: one decoder layer, variants switched by flags."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    num_aux_hidden_states: int = 3
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    capture: CaptureLayers | None = None   # None: the EAGLE default for the target's depth
    fc_norm: bool = False               # EAGLE 3.1: RMSNorm per captured chunk before fc
    norm_before_fc: bool = False        # one RMSNorm over the whole concat before fc
    norm_output: bool = False           # EAGLE 3.1: feed back the post-norm state
    norm_before_residual: bool = False  # residual is hidden_norm(f) instead of f
    arch: Arch = field(default_factory=Arch)   # the decoder layer's family (Qwen3 layers: q/k norm)
    source: str = "<memory>"

    @property
    def variant(self) -> str:
        return "eagle3.1" if (self.fc_norm or self.norm_output) else "eagle3"

    @classmethod
    def from_hf(cls, d: dict, source: str = "<memory>") -> "DrafterConfig":
        top = Keys(d, source)
        # speculators nests the layer shape under transformer_layer_config.
        nested = top.raw("transformer_layer_config")
        layer = Keys(nested, source, "transformer_layer_config.") if isinstance(nested, dict) else top
        family = model_type(layer)
        shape = _read_layer(layer, family)
        vocab = layer.get("vocab_size", int)
        depth = layer.get("num_hidden_layers", int, 1)
        if depth != 1:
            raise ConfigError(f"{source}: key '{layer.prefix}num_hidden_layers' is {depth}: only one-layer EAGLE-3 "
                              f"drafters are implemented")
        arch = read_arch(layer, family, 1)
        if arch.sliding_layers or arch.nope_layers:
            raise ConfigError(f"{source}: the drafter layer uses a sliding window or skips RoPE; only full-attention "
                              f"RoPE drafter layers are implemented")
        kind = top.raw("speculators_model_type", "eagle3")
        if kind != "eagle3":
            raise ConfigError(f"{source}: speculators_model_type {kind!r} is not supported (eagle3)")
        eagle_d = top.raw("eagle_config")
        eagle = Keys(eagle_d if isinstance(eagle_d, dict) else {}, source, "eagle_config.")
        for key, value in MODELOPT_REQUIRED.items():
            eagle.require(key, value, "the EAGLE-3 drafter step")
        aux = top.raw("eagle_aux_hidden_state_layer_ids")
        from_eagle = aux is None
        aux = aux if aux is not None else eagle.raw("eagle_aux_hidden_state_layer_ids")
        capture = None
        if aux is not None:
            if not (isinstance(aux, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in aux)):
                raise ConfigError(f"{source}: eagle_aux_hidden_state_layer_ids must be a list of ints, got {aux!r}")
            # Our own writer states the convention; checkpoints from the EAGLE / vLLM /
            # speculators ecosystem number by layer input, ModelOpt exports by layer output.
            conv = top.raw("aux_hidden_state_layer_convention", "layer_output" if from_eagle else "layer_input")
            capture = CaptureLayers(tuple(aux), conv)
        num_aux = top.get("num_aux_hidden_states", int, len(aux) if aux else 3)
        if capture is not None and len(capture.layer_ids) != num_aux:
            raise ConfigError(f"{source}: num_aux_hidden_states is {num_aux} but eagle_aux_hidden_state_layer_ids "
                              f"lists {len(capture.layer_ids)} layers")
        norm_output = top.get("norm_output", bool, eagle.get("return_hidden_post_norm", bool, False))
        norm_before_fc = top.get("norm_before_fc", bool, eagle.get("norm_before_fc", bool, False))
        cfg = cls(**shape, vocab_size=vocab, draft_vocab_size=top.get("draft_vocab_size", int, vocab),
                  target_hidden_size=top.get("target_hidden_size", int, shape["hidden_size"]),
                  num_aux_hidden_states=num_aux, capture=capture, fc_norm=top.get("fc_norm", bool, False),
                  norm_before_fc=norm_before_fc, norm_output=norm_output,
                  norm_before_residual=top.get("norm_before_residual", bool, False), arch=arch, source=source)
        top.refuse_unread("EAGLE-3 drafter configs", DRAFTER_NEUTRAL)
        if layer is not top:
            layer.refuse_unread(f"model_type {family!r} drafter layers", DRAFTER_NEUTRAL)
        eagle.refuse_unread("ModelOpt's eagle_config", MODELOPT_NEUTRAL)
        if cfg.fc_norm and cfg.norm_before_fc:
            raise ConfigError(f"{source}: fc_norm and norm_before_fc are exclusive (per-chunk vs whole-concat norm)")
        if not 0 < cfg.draft_vocab_size <= cfg.vocab_size:
            raise ConfigError(f"{source}: draft_vocab_size {cfg.draft_vocab_size} must be in 1..vocab_size {vocab}")
        return cfg

    def to_hf(self) -> dict:
        """SafeAILab layout config.json, plus the 3.1 flags and the captured layers."""
        d = {
            "architectures": ["LlamaForCausalLMEagle3"], **arch_to_hf(self.arch, 1), **_layer_hf(self),
            "num_hidden_layers": 1, "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size, "num_aux_hidden_states": self.num_aux_hidden_states,
            "fc_norm": self.fc_norm, "norm_before_fc": self.norm_before_fc, "norm_output": self.norm_output,
            "norm_before_residual": self.norm_before_residual, "tie_word_embeddings": False,
        }
        if self.capture is not None:
            d["eagle_aux_hidden_state_layer_ids"] = list(self.capture.layer_ids)
            d["aux_hidden_state_layer_convention"] = self.capture.convention
        return d

    def capture_for(self, target: TargetConfig) -> CaptureLayers:
        return self.capture or CaptureLayers.eagle_default(target.num_hidden_layers)


@dataclass(frozen=True)
class TreeShape:
    """EAGLE-2 dynamic tree: `depth` drafter steps, `top_k` children per frontier node,
    `total_tokens` draft nodes kept (the root, the last committed token, comes on top)."""

    depth: int = 5
    top_k: int = 8
    total_tokens: int = 60

    @property
    def max_nodes(self) -> int:
        return self.top_k + (self.depth - 1) * self.top_k * self.top_k

    def validate(self, draft_vocab_size: int | None = None) -> "TreeShape":
        for name in ("depth", "top_k", "total_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"tree {name} must be a positive integer, got {v!r}")
        if self.total_tokens > self.max_nodes:
            raise ConfigError(f"tree total_tokens {self.total_tokens} exceeds the {self.max_nodes} candidates that "
                              f"depth {self.depth} and top_k {self.top_k} produce")
        if self.total_tokens < self.depth and self.top_k == 1:
            raise ConfigError(f"chain (top_k 1) of depth {self.depth} needs total_tokens >= depth, got {self.total_tokens}")
        if draft_vocab_size is not None and self.top_k > draft_vocab_size:
            raise ConfigError(f"tree top_k {self.top_k} exceeds the draft vocabulary ({draft_vocab_size})")
        return self

    @staticmethod
    def chain(depth: int) -> "TreeShape":
        return TreeShape(depth=depth, top_k=1, total_tokens=depth)

    def closure_steps(self) -> int:
        """Squarings of (I + parent matrix) needed to reach every ancestor at this depth."""
        return max(1, math.ceil(math.log2(self.depth + 1)))


def parse_tree(text: str) -> TreeShape:
    """A tree shape as the command lines take it: depth,top_k,total_tokens."""
    parts = text.split(",")
    if len(parts) != 3 or not all(x.strip().isdigit() for x in parts):
        raise ConfigError(f"tree {text!r}: expected depth,top_k,total_tokens (e.g. 3,2,4)")
    return TreeShape(*(int(x) for x in parts)).validate()


@dataclass
class SamplingConfig:
    temperature: float = 0.0   # 0: greedy
    top_p: float = 1.0
    top_k: int = 0             # 0: off
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> "SamplingConfig":
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ConfigError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        return self


__all__ = ["Arch", "CaptureLayers", "ConfigError", "DrafterConfig", "SamplingConfig", "TargetConfig", "TreeShape",
           "parse_tree", "read_json"]
