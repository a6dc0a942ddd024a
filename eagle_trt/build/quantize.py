"""The quantize stage's one call into eagle_trt.quant: calibrate each quantized model on
ShareGPT validation prompts, then rewrite its float graph into Q/DQ form.

Calibration files (`<model>.amax.json`) are written beside the graphs so that the parity
stage can rebuild the exact fake-quant reference (QuantLinear with the same amax)."""
from __future__ import annotations

from pathlib import Path

from .config import BuildConfig, ModelPrecision
from .store import Progress, progress_callback


def quant_config(p: ModelPrecision, source: str):
    from ..quant import QuantConfig
    return QuantConfig(format=p.format, per_channel=p.per_channel, skip=tuple(p.skip), source=source)


def quantize_graphs(models, graphs: dict[str, Path], cfg: BuildConfig, out: Path, log=None,
                    release=None) -> dict:
    """Write `<model>.<format>.onnx` and `<model>.amax.json` into `out` for each model whose
    precision is fp8 / nvfp4 (and `target.int4.onnx` for an int4 target); returns {model: summary}. `graphs` maps 'target' /
    'drafter_tree' to the float graphs of the export stage. Every model is calibrated first;
    then `release()` (when given) drops the PyTorch models. A StreamedTarget (the build's) is
    calibrated part by part, every prompt through each part in turn."""
    from ..quant import (
        calibrate_drafter,
        calibrate_target,
        calibration_prompts,
        calibration_steps,
        linear_paths,
        quantize_onnx,
        save_calibration,
    )
    todo = [(name, graph) for name, graph in (("target", "target"), ("drafter", "drafter_tree"))
            if getattr(cfg.precision, name).quantized]
    int4 = cfg.precision.target.weight_only
    progress = Progress("quantize", 2 * len(todo) + int4, log)
    summaries = {}
    if int4:     # weight-only: no calibration (export/cpu_int4.py)
        from ..export.cpu_int4 import quantize_int4
        counts = quantize_int4(graphs["target"], out / "target.int4.onnx")
        summaries["target"] = {"graph": "target.int4.onnx", "format": "int4", "quantized": counts["int4_matmuls"],
                               "block_size": counts["block_size"]}
        progress.step(f"target.int4.onnx: {counts['int4_matmuls']} MatMuls in 4-bit blocks of {counts['block_size']}")
        if not todo:
            return summaries
    prompts = calibration_prompts(models.tokenizer, cfg.calibration.prompts, cfg.calibration.max_tokens,
                                  Path(cfg.calibration.path) if cfg.calibration.path else None)
    ids = [p for _, p in prompts]
    target = _calibration_target(models.target)
    calibrated = {}
    for name, graph in todo:
        # a line per part of the target (or per prompt), with an ETA
        step = Progress(f"calibrate {name}", calibration_steps(target, ids), log, f"{len(ids)} prompts", every=10.0).step
        if name == "target":
            module = target.model      # its Linears, which the calibration hooks (no weights)
            amax = calibrate_target(target, ids, step)
        else:
            module = models.drafter
            amax = calibrate_drafter(module, target, ids, cfg.tree.shape, step)
        # module paths only: holding the Linears would keep the float weights through the rewrites
        calibrated[name] = (amax, save_calibration(out / f"{name}.amax.json", amax), list(linear_paths(module)))
        progress.step(f"calibrated {name} on {len(ids)} prompts")
    del models, module, target
    if release is not None:
        release()
    for name, graph in todo:
        precision = getattr(cfg.precision, name)
        amax, calib, paths = calibrated[name]
        dst = out / f"{graph}.{precision.format}.onnx"
        rewritten = progress_callback("quantize", log, f"{dst.name} MatMuls")   # as the MatMuls are rewritten
        summary = quantize_onnx(graphs[graph], dst, quant_config(precision, f"{cfg.source}: precision.{name}"),
                                amax, paths, source=str(calib), on_matmul=rewritten)
        progress.step(f"{dst.name}: {len(summary.quantized)} MatMuls quantized, {len(summary.skipped)} kept")
        summaries[name] = {"graph": dst.name, "calibration": calib.name, "format": precision.format,
                           "prompts": len(ids), "quantized": len(summary.quantized),
                           "skipped": sorted(set(summary.skipped.values()))}
    return summaries


def _calibration_target(target):
    """The target calibration runs: on the CPU a float16 StreamedTarget is read as float32 (PyTorch's
    float16 matmuls there run ~5x slower than float32 ones: an 8B target's calibration would take
    over an hour on two cores); the statistic, each Linear's largest input, is the same to float16's
    rounding, and the graph and its fake-quant reference are made from the one recorded."""
    import torch

    from ..models.streamed import StreamedTarget
    if isinstance(target, StreamedTarget) and target.device.type == "cpu" and target.dtype == torch.float16:
        return target.with_dtype(torch.float32)
    return target


__all__ = ["quant_config", "quantize_graphs"]
