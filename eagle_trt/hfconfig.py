"""Reading Hugging Face config.json dicts, with one rule: every key that changes the arithmetic
is either implemented or refused.

A config is read through `Keys`, which records each key the parser asks for. After parsing,
every key that was not read and is not in `NEUTRAL_KEYS` (bookkeeping, training-only settings,
generation defaults) is refused, naming the key and the file. That makes the set of understood
keys an allow-list per model_type (the parser reads different keys for each family), not a
deny-list of known bad ones: a key added by a future transformers release is refused until we
implement it, instead of being silently ignored.

Families (decoder-layer arithmetic beyond plain Llama, as transformers computes it):
  llama    attention_bias (q, k, v and o), mlp_bias
  mistral  sliding_window on every layer
  qwen2    q, k, v biases; sliding window on layers >= max_window_layers (or per layer_types)
  qwen3    per-head RMSNorm on q and k before RoPE (q_norm, k_norm); attention_bias; sliding as qwen2
  smollm3  no_rope_layers (RoPE skipped in every no_rope_layer_interval-th layer); biases; sliding
RoPE types: default, linear, llama3, yarn (attention factor included).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any


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


# Keys that never change inference arithmetic: bookkeeping written by transformers and the
# training frameworks, training-only settings (dropout, init), and generation defaults that
# older transformers versions stored in config.json. Keys starting with "_" are private metadata.
NEUTRAL_KEYS = frozenset({
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "use_cache",
    "initializer_range", "attention_dropout", "hidden_dropout", "pad_token_id", "sep_token_id", "unk_token_id",
    "decoder_start_token_id", "id2label", "label2id", "problem_type", "return_dict", "output_attentions",
    "output_hidden_states", "is_encoder_decoder", "is_decoder", "add_cross_attention", "chunk_size_feed_forward",
    "tie_encoder_decoder", "cross_attention_hidden_size", "pruned_heads", "torchscript", "tf_legacy_loss",
    "use_bfloat16", "finetuning_task", "prefix", "task_specific_params", "tokenizer_class", "auto_map",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty",
    "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences",
    "output_scores", "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id",
    "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
    # tensor-parallel slicing of the projections in old Llama code; transformers >= 4.40 ignores it
    "pretraining_tp",
})

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "smollm3")
ROPE_KEYS = {"default": (), "linear": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
             "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor",
                      "mscale", "mscale_all_dim", "truncate")}


class Keys:
    """A config dict whose reads are recorded, so that every key nobody read can be refused."""

    def __init__(self, d: dict, source: str, prefix: str = ""):
        self.d, self.source, self.prefix = d, source, prefix
        self.read: set[str] = set()

    def has(self, key: str) -> bool:
        return self.d.get(key) is not None

    def raw(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        value = self.d.get(key)
        return default if value is None else value

    def get(self, key: str, kind: type | tuple, default: Any = ...) -> Any:
        """d[key] checked against `kind`; missing or null gives `default` (required when ...)."""
        self.read.add(key)
        name = self.prefix + key
        if self.d.get(key) is None:
            if default is ...:
                raise ConfigError(f"{self.source}: missing key '{name}'")
            return default
        value = self.d[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        # bool is an int subclass; refuse True where a size is expected.
        if isinstance(value, bool) and bool not in kinds:
            raise ConfigError(f"{self.source}: key '{name}' must be {kind}, got {value!r}")
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind):
            raise ConfigError(f"{self.source}: key '{name}' must be {kind}, got {type(value).__name__} {value!r}")
        return value

    def require(self, key: str, expected: Any, why: str) -> None:
        """A key we read only to check that it has the value our arithmetic implements."""
        value = self.raw(key)
        if value is not None and value != expected:
            raise ConfigError(f"{self.source}: key '{self.prefix}{key}' is {value!r}; only {expected!r} is "
                              f"implemented ({why})")

    def refuse_unread(self, what: str, neutral: frozenset[str] = frozenset()) -> None:
        # A null value is "not set": transformers then keeps the class default, which for a key
        # this family does not read changes nothing (the keys it does read are read above).
        unknown = sorted(k for k, v in self.d.items() if k not in self.read and k not in NEUTRAL_KEYS
                         and k not in neutral and not k.startswith("_") and v is not None)
        if unknown:
            more = f" (also not understood: {', '.join(self.prefix + k for k in unknown[1:])})" if unknown[1:] else ""
            raise ConfigError(f"{self.source}: key '{self.prefix}{unknown[0]}' is not understood for {what}: it may "
                              f"change the arithmetic, so it is refused rather than ignored{more}")


@dataclass(frozen=True)
class Arch:
    """What a family's decoder layers compute beyond plain Llama (all off: plain Llama)."""

    model_type: str = "llama"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False                    # Qwen3: RMSNorm over head_dim on q and k before RoPE
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()     # layers whose keys are limited to the last sliding_window positions
    nope_layers: tuple[int, ...] = ()        # layers that apply no RoPE (SmolLM3)


# transformers' config-class defaults for the arithmetic keys a config.json may leave out.
FAMILY_DEFAULTS = {
    "llama": dict(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=2048, tie_word_embeddings=False),
    "mistral": dict(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=4096 * 32,
                    tie_word_embeddings=False),
    "qwen2": dict(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=32768, tie_word_embeddings=False),
    "qwen3": dict(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=32768, tie_word_embeddings=False,
                  head_dim=128),
    "smollm3": dict(rms_norm_eps=1e-6, rope_theta=2000000.0, max_position_embeddings=32768,
                    tie_word_embeddings=True),
}


def model_type(k: Keys, default: str = "llama") -> str:
    arch = k.raw("model_type", default)
    if arch not in FAMILIES:
        raise ConfigError(f"{k.source}: model_type {arch!r} is not supported (supported: {', '.join(FAMILIES)})")
    return arch


def read_arch(k: Keys, arch: str, num_layers: int) -> Arch:
    """The family's layer switches from its config keys, as transformers derives them."""
    if k.raw("hidden_act", "silu") != "silu":
        raise ConfigError(f"{k.source}: key '{k.prefix}hidden_act' is {k.d['hidden_act']!r}; only 'silu' is implemented")
    bias = k.get("attention_bias", bool, False) if arch in ("llama", "qwen3", "smollm3") else False
    mlp_bias = k.get("mlp_bias", bool, False) if arch in ("llama", "smollm3") else False
    nope: tuple[int, ...] = ()
    if arch == "smollm3":
        interval = k.get("no_rope_layer_interval", int, 4)
        flags = k.raw("no_rope_layers")
        if flags is None:
            flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
        if not (isinstance(flags, list) and len(flags) == num_layers and all(f in (0, 1) for f in flags)):
            raise ConfigError(f"{k.source}: key '{k.prefix}no_rope_layers' must list 0 or 1 for each of the "
                              f"{num_layers} layers (1 = RoPE), got {flags!r}")
        nope = tuple(i for i, f in enumerate(flags) if not f)
    window, sliding = _read_sliding(k, arch, num_layers, nope)
    return Arch(model_type=arch, qkv_bias=bias or arch == "qwen2", o_bias=bias, mlp_bias=mlp_bias,
                qk_norm=arch == "qwen3", sliding_window=window, sliding_layers=sliding, nope_layers=nope)


def _read_sliding(k: Keys, arch: str, num_layers: int, nope: tuple[int, ...]) -> tuple[int | None, tuple[int, ...]]:
    if arch == "llama":
        return None, ()
    # transformers' default window applies when the key is absent; an explicit null means none.
    size = k.get("sliding_window", int, None) if "sliding_window" in k.d else (None if arch == "smollm3" else 4096)
    if size is not None and size < 1:
        raise ConfigError(f"{k.source}: key '{k.prefix}sliding_window' must be >= 1, got {size}")
    if arch == "mistral":   # one window on every layer
        return (size, tuple(range(num_layers))) if size is not None else (None, ())
    on = k.get("use_sliding_window", bool, False)
    window = size if on else None
    types = k.raw("layer_types")
    # Qwen derives layer_types from max_window_layers when they are absent; SmolLM3-3B's
    # config.json carries the key too, and transformers derives nothing from it there.
    first = k.get("max_window_layers", int, 28)
    if types is None:
        if arch == "smollm3":
            types = ["sliding_attention" if window and i in nope else "full_attention" for i in range(num_layers)]
        else:
            types = ["sliding_attention" if window and i >= first else "full_attention" for i in range(num_layers)]
    if not (isinstance(types, list) and len(types) == num_layers
            and all(t in ("full_attention", "sliding_attention") for t in types)):
        raise ConfigError(f"{k.source}: key '{k.prefix}layer_types' must name 'full_attention' or 'sliding_attention' "
                          f"for each of the {num_layers} layers, got {types!r}")
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if sliding and window is None:
        raise ConfigError(f"{k.source}: key '{k.prefix}layer_types' marks layer {sliding[0]} 'sliding_attention' but "
                          f"no window is in effect (use_sliding_window {on}, sliding_window {size}): ambiguous, refused")
    return window, sliding


def read_rope(k: Keys, max_positions: int, default_theta: float) -> tuple[float, dict | None]:
    """rope_theta and a resolved scaling dict; transformers <5 writes rope_theta + rope_scaling,
    >=5 writes rope_parameters. Every key of the scaling dict is checked against its type."""
    params = k.raw("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise ConfigError(f"{k.source}: key '{k.prefix}rope_parameters' must be an object, got {params!r}")
    theta = k.get("rope_theta", float, default_theta)
    legacy = k.raw("rope_scaling")
    if params is not None and legacy and _rope_type(legacy) != _rope_type(params):
        raise ConfigError(f"{k.source}: rope_parameters ({_rope_type(params)}) and rope_scaling ({_rope_type(legacy)}) "
                          f"disagree: ambiguous, refused")
    scaling = params if params is not None else legacy
    partial = k.get("partial_rotary_factor", float, 1.0)
    if scaling is None:
        scaling = {}
    if not isinstance(scaling, dict):
        raise ConfigError(f"{k.source}: key '{k.prefix}rope_scaling' must be an object or null, got {scaling!r}")
    where = "rope_parameters" if params is not None else "rope_scaling"
    r = Keys(scaling, k.source, f"{k.prefix}{where}.")
    theta = r.get("rope_theta", float, theta)
    partial = r.get("partial_rotary_factor", float, partial)
    if partial != 1.0:
        raise ConfigError(f"{k.source}: partial_rotary_factor {partial} is not supported (RoPE on the whole head only)")
    kind = r.raw("rope_type", r.raw("type", "default"))
    if kind not in ROPE_KEYS:
        raise ConfigError(f"{k.source}: rope scaling type {kind!r} is not supported ({', '.join(ROPE_KEYS)})")
    if kind == "default":
        r.refuse_unread("RoPE type 'default'")
        return theta, None
    out: dict = {"rope_type": kind}
    if kind != "linear":
        out["original_max_position_embeddings"] = r.get("original_max_position_embeddings", int, max_positions)
    if kind == "yarn":
        factor = r.get("factor", float, None)
        out["factor"] = factor if factor is not None else max_positions / out["original_max_position_embeddings"]
        out.update(beta_fast=r.get("beta_fast", float, None) or 32.0, beta_slow=r.get("beta_slow", float, None) or 1.0,
                   truncate=r.get("truncate", bool, True))
        attention = r.get("attention_factor", float, None)
        mscale, mscale_all = r.get("mscale", float, None), r.get("mscale_all_dim", float, None)
        if attention is None:
            attention = (_yarn_mscale(out["factor"], mscale) / _yarn_mscale(out["factor"], mscale_all)
                         if mscale and mscale_all else _yarn_mscale(out["factor"]))
        out["attention_factor"] = float(attention)
    else:
        out["factor"] = r.get("factor", float)
        for key in ROPE_KEYS[kind][1:]:
            if key not in out:
                out[key] = r.get(key, float)
    r.refuse_unread(f"RoPE type {kind!r}", frozenset({"type"}))
    return theta, out


def _rope_type(d) -> object:
    return d.get("rope_type", d.get("type", "default")) if isinstance(d, dict) else d


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def arch_to_hf(arch: Arch, num_layers: int) -> dict:
    """The config.json keys that state `arch` for its model_type (the inverse of read_arch)."""
    d: dict = {"model_type": arch.model_type}
    if arch.model_type in ("llama", "qwen3", "smollm3"):
        d["attention_bias"] = arch.o_bias
    if arch.model_type in ("llama", "smollm3"):
        d["mlp_bias"] = arch.mlp_bias
    if arch.model_type == "smollm3":
        d["no_rope_layers"] = [int(i not in arch.nope_layers) for i in range(num_layers)]
    if arch.model_type == "mistral":
        d["sliding_window"] = arch.sliding_window
    elif arch.model_type != "llama":
        d["use_sliding_window"] = arch.sliding_window is not None
        d["sliding_window"] = arch.sliding_window
        d["layer_types"] = ["sliding_attention" if i in arch.sliding_layers else "full_attention"
                            for i in range(num_layers)]
    return d
