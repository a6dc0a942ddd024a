"""Running quantized graphs on CPU.

FP8 Q/DQ graphs run on ONNX Runtime, but only at graph optimization ORT_ENABLE_BASIC: at
higher levels ORT's QDQ fusions either reject FP8 graphs (SmolLM2's fails to load at
ORT_ENABLE_ALL) or change their results. With the session option `session.disable_quant_qdq`
the QDQ transformers stay off and constant folding may fold the weights' DequantizeLinear
nodes into float32 initializers (the same q * scale products); without it every call
dequantizes every weight again, 2.5x (prefill) to 6x (one token) slower on SmolLM2.

NVFP4 graphs run on onnx.reference.ReferenceEvaluator (ORT has no FLOAT4E2M1
DequantizeLinear), with TRT_FP4DynamicQuantize implemented below in numpy + ml_dtypes,
independently of the torch reference in formats.py (the tests compare the two)."""
from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from ..config import TreeShape
from ..runtime.onnxruntime_backend import OrtDrafter, OrtIteration, OrtTarget
from .config import QuantError

FP8_ORT_LEVEL = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC


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


# Lets constant folding fold the weights' DequantizeLinear nodes (see the module docstring).
FP8_SESSION_CONFIG = {"session.disable_quant_qdq": "1"}


def fp8_session_options(threads: int | None = 1, fold_weights: bool = True) -> ort.SessionOptions:
    """fold_weights=False: no graph optimization, so each weight is dequantized when its MatMul
    runs and freed after it, instead of all held as float32 initializers (a one-off run of a
    real-size target: the layer parity check)."""
    so = ort.SessionOptions()
    so.graph_optimization_level = FP8_ORT_LEVEL if fold_weights else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    for key, value in FP8_SESSION_CONFIG.items():
        so.add_session_config_entry(key, value)
    if threads:
        so.intra_op_num_threads = threads
    so.log_severity_level = 3
    return so


def fp8_session(path: str | Path | bytes, threads: int | None = 1, fold_weights: bool = True) -> ort.InferenceSession:
    """A CPU session for an FP8 (or float) graph file, or serialized graph bytes."""
    if not isinstance(path, bytes) and not Path(path).is_file():
        raise QuantError(f"{path}: ONNX graph not found")
    try:
        return ort.InferenceSession(path if isinstance(path, bytes) else str(path),
                                    fp8_session_options(threads, fold_weights),
                                    providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - name the file with ORT's reason
        raise QuantError(f"{path if not isinstance(path, bytes) else 'graph'}: ONNX Runtime cannot load this "
                         f"graph ({exc})") from None


def run_graph(path: str | Path, feeds: dict[str, np.ndarray], threads: int | None = 1) -> dict[str, np.ndarray]:
    """Run a float, FP8 or NVFP4 graph once on the engine that runs it correctly here."""
    model = onnx.load(str(path))
    names = [o.name for o in model.graph.output]
    if is_nvfp4_graph(model):
        return dict(zip(names, reference_evaluator(model).run(None, feeds)))
    return dict(zip(names, fp8_session(Path(path), threads).run(None, feeds)))


class Fp8OrtTarget(OrtTarget):
    """OrtTarget with the FP8 session settings."""

    def __init__(self, path: str | Path, max_context: int, threads: int | None = 1, min_rows: int = 2):
        # min_rows=2: token-by-token calls take the arithmetic path of verification (see OrtTarget)
        super().__init__(path, max_context, threads, min_rows=min_rows, level=FP8_ORT_LEVEL, config=FP8_SESSION_CONFIG)


class Fp8OrtDrafter(OrtDrafter):
    """OrtDrafter with the FP8 session settings."""

    def __init__(self, path: str | Path, shape: TreeShape, threads: int | None = 1):
        super().__init__(path, shape, threads, level=FP8_ORT_LEVEL, config=FP8_SESSION_CONFIG)


class Fp8OrtIteration(OrtIteration):
    """OrtIteration with the FP8 session settings: an iteration graph composed of FP8 graphs
    runs their nodes as Fp8OrtTarget and Fp8OrtDrafter run them (every call has >= 2 target
    rows, so the 2-row padding never applies)."""

    def __init__(self, path: str | Path, target: OrtTarget, drafter: OrtDrafter, threads: int | None = 1, **kwargs):
        super().__init__(path, target, drafter, threads, level=FP8_ORT_LEVEL, config=FP8_SESSION_CONFIG, **kwargs)


def fp8_backends(target_graph: str | Path | None, drafter_graph: str | Path | None, shape: TreeShape,
                 max_context: int, threads: int | None = 1) -> tuple[OrtTarget | None, OrtDrafter | None]:
    """ONNX Runtime target / drafter-tree backends for FP8 (or float) graphs."""
    target = Fp8OrtTarget(target_graph, max_context, threads) if target_graph else None
    drafter = Fp8OrtDrafter(drafter_graph, shape, threads) if drafter_graph else None
    return target, drafter


__all__ = ["FP8_ORT_LEVEL", "FP8_SESSION_CONFIG", "Fp8OrtDrafter", "Fp8OrtIteration", "Fp8OrtTarget", "TRT_FP4DynamicQuantize", "fp8_backends", "fp8_session",
           "fp8_session_options", "is_nvfp4_graph", "reference_evaluator", "run_graph"]
