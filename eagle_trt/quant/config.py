"""Which format each model is quantized to, and which of its Linear layers stay unquantized.

Precision is chosen per model: the target and the drafter each get a QuantConfig. Layers are
named by their torch module path inside LlamaTarget / EagleDrafter (`layers.3.mlp.down_proj`,
`midlayer.self_attn.q_proj`, `fc`, `lm_head`) and skipped by glob patterns on those paths."""
from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

from ..config import ConfigError
from .formats import NVFP4_BLOCK

FORMATS = ("none", "fp8", "nvfp4")
# lm_head is the most sensitive layer (its error goes straight into acceptance decisions);
# every recipe we know of keeps it in 16 bits.
DEFAULT_SKIP = ("lm_head",)


class QuantError(ConfigError):
    """A quantization config, calibration file or graph does not fit what was asked."""


@dataclass(frozen=True)
class QuantConfig:
    format: str = "none"                 # "none" | "fp8" | "nvfp4"
    per_channel: bool = True             # FP8 weights: one scale per output channel (else per tensor)
    skip: tuple[str, ...] = DEFAULT_SKIP  # glob patterns on module paths left unquantized
    source: str = field(default="<memory>", compare=False)

    def __post_init__(self):
        if self.format not in FORMATS:
            raise QuantError(f"{self.source}: quantization format must be one of {', '.join(FORMATS)}, "
                             f"got {self.format!r}")
        if not isinstance(self.per_channel, bool):
            raise QuantError(f"{self.source}: 'per_channel' must be true or false, got {self.per_channel!r}")
        if isinstance(self.skip, str) or not all(isinstance(p, str) and p for p in self.skip):
            raise QuantError(f"{self.source}: 'skip' must be a list of non-empty glob patterns, got {self.skip!r}")
        object.__setattr__(self, "skip", tuple(self.skip))

    @property
    def enabled(self) -> bool:
        return self.format != "none"

    @classmethod
    def from_dict(cls, d: Any, source: str = "<quant config>") -> QuantConfig:
        """{"format": "fp8", "per_channel": true, "skip": ["lm_head", "fc"]}; a bare string is
        taken as the format. Unknown keys are errors (a misspelt key would silently do nothing)."""
        if isinstance(d, str):
            d = {"format": d}
        if not isinstance(d, dict):
            raise QuantError(f"{source}: expected a mapping with 'format', 'per_channel', 'skip', got {d!r}")
        known = {"format", "per_channel", "skip"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise QuantError(f"{source}: unknown quantization key(s) {unknown}; known keys are {sorted(known)}")
        skip = d.get("skip", DEFAULT_SKIP)
        if isinstance(skip, str):
            skip = [skip]
        if not isinstance(skip, (list, tuple)):
            raise QuantError(f"{source}: 'skip' must be a list of glob patterns, got {skip!r}")
        fmt = d.get("format", "none")
        if not isinstance(fmt, str):
            raise QuantError(f"{source}: 'format' must be one of {', '.join(FORMATS)}, got {fmt!r}")
        return cls(format=fmt.lower(), per_channel=d.get("per_channel", True), skip=tuple(skip), source=source)

    def to_dict(self) -> dict:
        return {"format": self.format, "per_channel": self.per_channel, "skip": list(self.skip)}

    def skip_reason(self, path: str, in_features: int) -> str | None:
        """Why the Linear at `path` stays unquantized, or None when it is quantized."""
        if not self.enabled:
            return "format none"
        for pattern in self.skip:
            if fnmatchcase(path, pattern):
                return f"skip pattern {pattern!r}"
        if self.format == "nvfp4" and in_features % NVFP4_BLOCK:
            return f"in_features {in_features} is not a multiple of the NVFP4 block ({NVFP4_BLOCK})"
        return None


@dataclass(frozen=True)
class QuantPlan:
    """Per-model precision: {"target": {...}, "drafter": {...}}, each a QuantConfig mapping."""
    target: QuantConfig = QuantConfig()
    drafter: QuantConfig = QuantConfig()

    @classmethod
    def from_dict(cls, d: Any, source: str = "<quant config>") -> QuantPlan:
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise QuantError(f"{source}: expected a mapping with 'target' and/or 'drafter', got {d!r}")
        unknown = sorted(set(d) - {"target", "drafter"})
        if unknown:
            raise QuantError(f"{source}: unknown model(s) {unknown} in the quantization section; "
                             f"expected 'target' and/or 'drafter'")
        return cls(**{k: QuantConfig.from_dict(v, f"{source}: {k}") for k, v in d.items()})

    def to_dict(self) -> dict:
        return {"target": self.target.to_dict(), "drafter": self.drafter.to_dict()}


__all__ = ["DEFAULT_SKIP", "FORMATS", "QuantConfig", "QuantError", "QuantPlan"]
