"""Typed model configs: the Llama-family target, the EAGLE-3 / 3.1 drafter, the captured
layers and the draft-tree shape. Each config is built from a Hugging Face style config.json
dict and says which file a bad value came from."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Convention = Literal["layer_input", "layer_output"]


class ConfigError(ValueError):
    """A config value is missing, has the wrong type, or does not fit its partner model."""


def read_json(path: Path, error: type[Exception] = ConfigError, what: str = "file",
              expected: str = "a JSON object at top level") -> dict:
    """A JSON object from `path`; any problem raises `error` naming the file."""
    path = Path(path)
    if not path.is_file():
        raise error(f"{path}: {what} not found")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise error(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: expected {expected}")
    return data


def _get(d: dict, key: str, kind: type | tuple, source: str, default: Any = ...) -> Any:
    if key not in d or d[key] is None:
        if default is ...:
            raise ConfigError(f"{source}: missing key '{key}'")
        return default
    value = d[key]
    # bool is an int subclass; refuse True where a size is expected.
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise ConfigError(f"{source}: key '{key}' must be {kind}, got {value!r}")
    if kind is float and isinstance(value, int):
        value = float(value)
    if not isinstance(value, kind):
        raise ConfigError(f"{source}: key '{key}' must be {kind}, got {type(value).__name__} {value!r}")
    return value


def _rope_from_hf(d: dict, source: str) -> tuple[float, dict | None]:
    """transformers <5 writes rope_theta + rope_scaling; >=5 writes rope_parameters."""
    params = d.get("rope_parameters")
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
        kind = params.get("rope_type", "default")
        scaling = None if kind == "default" else {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = _get(d, "rope_theta", float, source, 10000.0)
        scaling = d.get("rope_scaling")
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind not in ("llama3", "linear", "default"):
            raise ConfigError(f"{source}: rope scaling type {kind!r} is not supported (llama3, linear)")
        if kind == "default":
            scaling = None
        else:
            scaling = dict(scaling, rope_type=kind)
    return theta, scaling


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
    source: str = "<memory>"

    @classmethod
    def from_hf(cls, d: dict, source: str = "<memory>") -> "TargetConfig":
        arch = d.get("model_type", "llama")
        if arch not in ("llama", "mistral", "qwen2", "smollm", "smollm3"):
            raise ConfigError(f"{source}: model_type {arch!r} is not a Llama-family model")
        if d.get("attention_bias") or d.get("mlp_bias"):
            raise ConfigError(f"{source}: attention_bias / mlp_bias are not supported")
        if d.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{source}: hidden_act {d.get('hidden_act')!r} is not supported (silu)")
        hidden = _get(d, "hidden_size", int, source)
        heads = _get(d, "num_attention_heads", int, source)
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        theta, scaling = _rope_from_hf(d, source)
        cfg = cls(
            vocab_size=_get(d, "vocab_size", int, source),
            hidden_size=hidden,
            intermediate_size=_get(d, "intermediate_size", int, source),
            num_hidden_layers=_get(d, "num_hidden_layers", int, source),
            num_attention_heads=heads,
            num_key_value_heads=_get(d, "num_key_value_heads", int, source, heads),
            head_dim=_get(d, "head_dim", int, source, hidden // heads),
            rms_norm_eps=_get(d, "rms_norm_eps", float, source, 1e-5),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=_get(d, "max_position_embeddings", int, source, 2048),
            tie_word_embeddings=_get(d, "tie_word_embeddings", bool, source, False),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            source=source,
        )
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ConfigError(f"{source}: num_attention_heads {heads} is not a multiple of "
                              f"num_key_value_heads {cfg.num_key_value_heads}")
        return cfg

    def to_hf(self) -> dict:
        d = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling, "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
        }
        return d


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
    source: str = "<memory>"

    @property
    def variant(self) -> str:
        return "eagle3.1" if (self.fc_norm or self.norm_output) else "eagle3"

    @classmethod
    def from_hf(cls, d: dict, source: str = "<memory>") -> "DrafterConfig":
        # speculators nests the layer shape under transformer_layer_config.
        layer = d.get("transformer_layer_config") if isinstance(d.get("transformer_layer_config"), dict) else d
        eagle = d.get("eagle_config") if isinstance(d.get("eagle_config"), dict) else {}
        hidden = _get(layer, "hidden_size", int, source)
        heads = _get(layer, "num_attention_heads", int, source)
        vocab = _get(layer, "vocab_size", int, source)
        theta, scaling = _rope_from_hf(layer, source)
        aux = d.get("eagle_aux_hidden_state_layer_ids", eagle.get("eagle_aux_hidden_state_layer_ids"))
        capture = None
        if aux is not None:
            if not (isinstance(aux, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in aux)):
                raise ConfigError(f"{source}: eagle_aux_hidden_state_layer_ids must be a list of ints, got {aux!r}")
            # Our own writer states the convention; checkpoints from the EAGLE / vLLM /
            # speculators ecosystem number by layer input, ModelOpt exports by layer output.
            conv = d.get("aux_hidden_state_layer_convention",
                         "layer_output" if "eagle_config" in d and "eagle_aux_hidden_state_layer_ids" not in d
                         else "layer_input")
            capture = CaptureLayers(tuple(aux), conv)
        num_aux = _get(d, "num_aux_hidden_states", int, source, len(aux) if aux else 3)
        if capture is not None and len(capture.layer_ids) != num_aux:
            raise ConfigError(f"{source}: num_aux_hidden_states is {num_aux} but eagle_aux_hidden_state_layer_ids "
                              f"lists {len(capture.layer_ids)} layers")
        norm_output = bool(d.get("norm_output", eagle.get("return_hidden_post_norm", False)))
        cfg = cls(
            hidden_size=hidden,
            intermediate_size=_get(layer, "intermediate_size", int, source),
            num_attention_heads=heads,
            num_key_value_heads=_get(layer, "num_key_value_heads", int, source, heads),
            head_dim=_get(layer, "head_dim", int, source, hidden // heads),
            vocab_size=vocab,
            draft_vocab_size=_get(d, "draft_vocab_size", int, source, vocab),
            target_hidden_size=_get(d, "target_hidden_size", int, source, hidden),
            num_aux_hidden_states=num_aux,
            rms_norm_eps=_get(layer, "rms_norm_eps", float, source, 1e-5),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=_get(layer, "max_position_embeddings", int, source, 2048),
            capture=capture,
            fc_norm=_get(d, "fc_norm", bool, source, False),
            norm_before_fc=_get(d, "norm_before_fc", bool, source, bool(eagle.get("norm_before_fc", False))),
            norm_output=norm_output,
            norm_before_residual=_get(d, "norm_before_residual", bool, source, False),
            source=source,
        )
        if cfg.fc_norm and cfg.norm_before_fc:
            raise ConfigError(f"{source}: fc_norm and norm_before_fc are exclusive (per-chunk vs whole-concat norm)")
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ConfigError(f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads "
                              f"{cfg.num_key_value_heads}")
        if not 0 < cfg.draft_vocab_size <= cfg.vocab_size:
            raise ConfigError(f"{source}: draft_vocab_size {cfg.draft_vocab_size} must be in 1..vocab_size {vocab}")
        return cfg

    def to_hf(self) -> dict:
        """SafeAILab layout config.json, plus the 3.1 flags and the captured layers."""
        d = {
            "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "num_hidden_layers": 1, "hidden_act": "silu",
            "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size, "num_aux_hidden_states": self.num_aux_hidden_states,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
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


__all__ = ["CaptureLayers", "ConfigError", "DrafterConfig", "SamplingConfig", "TargetConfig", "TreeShape",
           "read_json"]
