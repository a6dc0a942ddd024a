"""Running quantized graphs on CPU.

FP8 Q/DQ graphs run on ONNX Runtime with the session settings in runtime/sessions.py
(FP8_SESSION, fp8_session).

NVFP4 graphs run on onnx.reference.ReferenceEvaluator (ORT has no FLOAT4E2M1
DequantizeLinear), with TRT_FP4DynamicQuantize implemented below in numpy + ml_dtypes,
independently of the torch reference in formats.py (the tests compare the two)."""
from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from ..runtime.sessions import fp8_session
from .config import QuantError


class TRT_FP4DynamicQuantize(OpRun):
    """trt::TRT_FP4DynamicQuantize(x, global_scale; axis, block_size, scale_type) -> (x_fp4, scale_fp8).

    Per block of `block_size` along `axis`: sb8 = fp8((amax_block / 6) / g), saturated at 448;
    x_fp4 = fp4(x / (float(sb8) * g)), 0 where that scale is 0."""
    op_domain = "trt"

    def _run(self, x, scale, axis=-1, block_size=16, scale_type=TensorProto.FLOAT8E4M3FN):
        if scale_type != TensorProto.FLOAT8E4M3FN:
            raise QuantError(f"TRT_FP4DynamicQuantize: scale_type {scale_type} is not FLOAT8E4M3FN (17)")
        x = np.moveaxis(x.astype(np.float32), axis, -1)
        if x.shape[-1] % block_size:
            raise QuantError(f"TRT_FP4DynamicQuantize: block_size {block_size} does not divide axis length "
                             f"{x.shape[-1]}")
        g = np.float32(np.asarray(scale, dtype=np.float32).reshape(()))
        xb = x.reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size)
        amax = np.abs(xb).max(axis=-1)
        sb = (amax / np.float32(6.0)) / g
        sb8 = np.clip(sb, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn)   # E4M3FN overflow would be NaN
        d = (sb8.astype(np.float32) * g)[..., None]
        with np.errstate(divide="ignore", invalid="ignore"):
            scaled = np.where(d > 0, xb / np.where(d > 0, d, np.float32(1.0)), np.float32(0.0))
        # ml_dtypes rounds to nearest even and saturates at +-6 for E2M1 (no Inf / NaN encodings).
        q = scaled.astype(np.float32).astype(ml_dtypes.float4_e2m1fn).reshape(x.shape)
        return np.moveaxis(q, -1, axis), np.moveaxis(sb8, -1, axis)


def is_nvfp4_graph(model: onnx.ModelProto) -> bool:
    return any(n.domain == "trt" for n in model.graph.node) or \
        any(i.data_type == TensorProto.FLOAT4E2M1 for i in model.graph.initializer)


def reference_evaluator(model: str | Path | onnx.ModelProto) -> ReferenceEvaluator:
    """onnx.reference with TensorRT's FP4 dynamic quantization op."""
    if not isinstance(model, onnx.ModelProto):
        if not Path(model).is_file():
            raise QuantError(f"{model}: ONNX graph not found")
        model = onnx.load(str(model))
    return ReferenceEvaluator(model, new_ops=[TRT_FP4DynamicQuantize])


def run_graph(path: str | Path, feeds: dict[str, np.ndarray], threads: int | None = 1) -> dict[str, np.ndarray]:
    """Run a float, FP8 or NVFP4 graph once on the engine that runs it correctly here."""
    model = onnx.load(str(path))
    names = [o.name for o in model.graph.output]
    if is_nvfp4_graph(model):
        return dict(zip(names, reference_evaluator(model).run(None, feeds)))
    return dict(zip(names, fp8_session(Path(path), threads).run(None, feeds)))


__all__ = ["TRT_FP4DynamicQuantize", "is_nvfp4_graph", "reference_evaluator", "run_graph"]
