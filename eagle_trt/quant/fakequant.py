"""PyTorch fake-quant reference: nn.Linear replaced, in place and by module path, by QuantLinear,
which does exactly the arithmetic of the Q/DQ graph that onnx_qdq.py writes.

    FP8:    y = DQ(Q(x, s_x)) @ DQ(W_fp8, s_w).T       s_x = amax_x / 448 (static, calibrated)
                                                      s_w = amax_w / 448 per tensor or per row
    NVFP4:  y = DQ2(FP4DynamicQuantize(x, g_x)) @ DQ2(W_fp4, W_sb8, g_w).T
                                                      g_x = amax_x / (6 * 448) (calibrated),
                                                      block scales of x computed per call

This model is the golden reference for both ONNX Runtime (FP8) and onnx.reference (NVFP4)."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch.nn.functional as F
from torch import Tensor, nn

from .config import QuantConfig, QuantError
from .formats import (fp8_dequantize, fp8_fake_quant, fp8_scale, fp8_weight, nvfp4_dequantize, nvfp4_fake_quant,
                      nvfp4_global_scale, nvfp4_weight)


class QuantLinear(nn.Module):
    """A Linear layer with quantized weights and quantized inputs; a bias (Qwen2 q/k/v) stays in
    high precision, added after the MatMul as in the graph."""

    def __init__(self, linear: nn.Linear, fmt: str, input_amax: float, per_channel: bool = True):
        super().__init__()
        if fmt not in ("fp8", "nvfp4"):
            raise QuantError(f"QuantLinear format must be 'fp8' or 'nvfp4', got {fmt!r}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.format, self.per_channel = fmt, per_channel
        self.input_amax = float(input_amax)
        w = linear.weight.detach()
        self.weight_dtype = w.dtype
        # The quantized weight is kept (1 byte or less per value, not a float copy of a real-size
        # model's weights) and dequantized per call, as the graph's weight DQ does.
        if fmt == "fp8":
            q, scale = fp8_weight(w, per_channel)
            self.register_buffer("weight_q", q)
            self.register_buffer("weight_scale", scale[:, None] if per_channel else scale)
            self.register_buffer("input_scale", fp8_scale(self.input_amax).to(w.device))
        else:
            codes, sb8, g = nvfp4_weight(w)
            self.register_buffer("weight_q", codes)
            self.register_buffer("weight_block_scale", sb8)
            self.register_buffer("weight_scale", g)
            self.register_buffer("input_scale", nvfp4_global_scale(self.input_amax).to(w.device))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    @property
    def weight(self) -> Tensor:
        """[out, in] in the Linear's dtype: what the graph's weight DequantizeLinear produces
        (made on each access)."""
        if self.format == "fp8":
            dq = fp8_dequantize(self.weight_q, self.weight_scale)
        else:
            dq = nvfp4_dequantize(self.weight_q, self.weight_block_scale, self.weight_scale, axis=1)
        return dq.to(self.weight_dtype)

    def quantize_input(self, x: Tensor) -> Tensor:
        if self.format == "fp8":
            return fp8_fake_quant(x, self.input_scale).to(x.dtype)
        return nvfp4_fake_quant(x, self.input_scale, axis=-1).to(x.dtype)

    def forward(self, x: Tensor, bias: bool = True) -> Tensor:
        """bias=False: the MatMul alone, which is what a graph's MatMul node outputs."""
        return F.linear(self.quantize_input(x), self.weight.to(x.dtype), self.bias if bias else None)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}, "
                f"per_channel={self.per_channel}, input_amax={self.input_amax:.4g}")


@dataclass
class QuantSummary:
    format: str
    quantized: list[str] = field(default_factory=list)        # module paths
    skipped: dict[str, str] = field(default_factory=dict)     # module path -> reason

    def as_dict(self) -> dict:
        return {"format": self.format, "quantized": self.quantized, "skipped": self.skipped}


def linear_paths(model: nn.Module) -> dict[str, nn.Linear]:
    """Every nn.Linear of the model by module path (the keys calibration and configs use)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def check_amax(amax: dict[str, float], paths: list[str], source: str) -> None:
    """Every path must have a finite, non-negative calibrated amax; name all that do not."""
    missing = [p for p in paths if p not in amax]
    if missing:
        raise QuantError(f"{source}: no calibrated amax for module(s) {missing}; recalibrate with this model "
                         f"or skip them in the quantization config")
    for p in paths:
        v = amax[p]
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= 0 or v == float("inf"):
            raise QuantError(f"{source}: amax of module '{p}' must be a finite number >= 0, got {v!r}")


def quantize_model(model: nn.Module, cfg: QuantConfig, amax: dict[str, float],
                   source: str = "calibration") -> QuantSummary:
    """Swap the model's nn.Linear modules for QuantLinear in place, as `cfg` says; `amax` maps
    module path -> calibrated input amax (`source` names where it came from, for errors)."""
    summary = QuantSummary(cfg.format)
    # By path only (a comprehension holds no Linear afterwards): each replaced Linear's float
    # weight is freed as it goes.
    reasons = {path: cfg.skip_reason(path, linear.in_features) for path, linear in linear_paths(model).items()}
    todo = [path for path, reason in reasons.items() if reason is None]
    summary.skipped.update((path, reason) for path, reason in reasons.items() if reason is not None)
    check_amax(amax, todo, source)
    for path in todo:
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, name, QuantLinear(getattr(parent, name), cfg.format, amax[path], cfg.per_channel))
        summary.quantized.append(path)
    return summary


@dataclass(frozen=True)
class LinearQuantizer:
    """quantize_model for one Linear at a time, for a model that reads its parts one by one (a
    StreamedTarget's fake_quant): the Linear at `path` as its QuantLinear, None where cfg skips it."""
    cfg: QuantConfig
    amax: dict[str, float]
    source: str = "calibration"

    def __call__(self, path: str, linear: nn.Linear) -> QuantLinear | None:
        if self.cfg.skip_reason(path, linear.in_features) is not None:
            return None
        check_amax(self.amax, [path], self.source)
        return QuantLinear(linear, self.cfg.format, self.amax[path], self.cfg.per_channel)


def quantized_copy(model: nn.Module, cfg: QuantConfig, amax: dict[str, float],
                   source: str = "calibration") -> tuple[nn.Module, QuantSummary]:
    """A deep copy of `model` with quantize_model applied; the original is left unchanged.
    Flags that are plain attributes (EagleDrafter.embed_shared) come along with the copy. The
    weights of the Linears that get quantized are not copied (their QuantLinears only read them):
    beside the model, the copy holds its quantized weights and the rest of its parameters."""
    replaced = {id(linear.weight): linear.weight for path, linear in linear_paths(model).items()
                if cfg.skip_reason(path, linear.in_features) is None}
    quantized = copy.deepcopy(model, memo=replaced)
    return quantized.eval(), quantize_model(quantized, cfg, amax, source)


__all__ = ["LinearQuantizer", "QuantLinear", "QuantSummary", "check_amax", "linear_paths", "quantize_model",
           "quantized_copy"]
