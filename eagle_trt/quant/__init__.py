"""FP8 and NVFP4 quantization in TensorRT's explicit Q/DQ ONNX form.

    formats.py     FP8 E4M3FN / FP4 E2M1 / NVFP4 numerics in torch (bit-exact with ONNX)
    config.py      QuantConfig per model: format, per-channel FP8 weights, skipped layers
    fakequant.py   QuantLinear: the PyTorch golden reference of the quantized graphs
    calibrate.py   max calibration on real (non-evaluation) prompts, JSON files
    onnx_qdq.py    rewrite exported graphs into Q/DQ form (FP8 opset 19, NVFP4 opset 23)
    check.py       layer-by-layer parity of a quantized graph with the reference
    run.py         a graph run once: FP8 on ONNX Runtime (its settings: runtime/sessions.py), NVFP4 on
                   onnx.reference

(The int8-weight drafter graph for ONNX Runtime on the CPU, not a TensorRT form, is made by the
exporters: export/cpu_int8.py.)

Typical use:

    amax = calibrate_target(target.model, [ids for _, ids in calibration_prompts(tokenizer)])
    save_calibration("target.amax.json", amax)
    cfg = QuantConfig("fp8")
    quantize_onnx("target.onnx", "target.fp8.onnx", cfg, amax, linear_paths(target.model))
    reference, summary = quantized_copy(target.model, cfg, amax)     # same arithmetic in torch
"""
from .calibrate import (AmaxRecorder, calibrate_drafter, calibrate_target, calibration_prompts, calibration_steps,
                        load_calibration, save_calibration)
from .check import LayerParity, layer_parity
from .config import FORMATS, QuantConfig, QuantError, QuantPlan
from .fakequant import LinearQuantizer, QuantLinear, QuantSummary, linear_paths, quantize_model, quantized_copy
from .onnx_qdq import QDQSummary, module_for_node, quantize_graph, quantize_onnx
from .run import TRT_FP4DynamicQuantize, reference_evaluator, run_graph

__all__ = ["FORMATS", "AmaxRecorder", "LayerParity", "LinearQuantizer", "QDQSummary", "QuantConfig",
           "QuantError", "QuantLinear", "QuantPlan", "QuantSummary", "TRT_FP4DynamicQuantize",
           "calibrate_drafter", "calibrate_target", "calibration_prompts", "calibration_steps", "layer_parity",
           "linear_paths", "load_calibration", "module_for_node", "quantize_graph", "quantize_model",
           "quantize_onnx", "quantized_copy", "reference_evaluator", "run_graph", "save_calibration"]
