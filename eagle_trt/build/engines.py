"""TensorRT engines from the exported graphs (TensorRT 10.x Python API).

Strongly typed networks from the ONNX parser: every tensor keeps the type the graph gives it
(fp32 / fp16 graphs, FP8 and NVFP4 Q/DQ), so no precision flags are set on the builder. The
target engine gets two optimization profiles, prefill (0) and verification (1); the drafter-tree
engine one. Profile shapes come from the graphs' named dynamic axes (new_tokens, past_tokens,
total_tokens, logit_tokens) and the config's engines.profiles. One timing cache is shared by
all engines of a build and saved beside the plans.

Where `tensorrt` cannot be imported or no GPU is visible, `tensorrt_status` says so and the
stage is skipped with that reason (nothing here is emulated)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import onnx

from .config import BuildConfig, ProfileSection
from .store import Progress

PROFILES = {"target": ("prefill", "verify"), "drafter_tree": ("drafter",)}


class EngineError(RuntimeError):
    pass


def tensorrt_status():
    """(tensorrt module, None) where engines can be built here, else (None, the reason)."""
    try:
        import tensorrt as trt
    except Exception as exc:  # noqa: BLE001 - ImportError, or a broken install raising anything
        return None, f"TensorRT is not installed (import tensorrt failed: {exc})"
    try:
        import torch
        if not torch.cuda.is_available():
            return None, "no CUDA GPU is visible (torch.cuda.is_available() is False)"
    except ImportError:
        pass
    try:
        trt.Builder(trt.Logger(trt.Logger.ERROR))
    except Exception as exc:  # noqa: BLE001 - TensorRT raises a bare TypeError when CUDA cannot start
        return None, f"TensorRT cannot create a builder on this machine ({exc})"
    return trt, None


def input_dims(path: Path) -> dict[str, list]:
    """{input name: [int | axis name]} from the ONNX graph (weights not loaded)."""
    model = onnx.load(str(path), load_external_data=False)
    inits = {i.name for i in model.graph.initializer}
    return {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
            for i in model.graph.input if i.name not in inits}


def profile_shapes(dims: dict[str, list], p: ProfileSection, source: str, max_batch: int = 1) -> dict[str, tuple]:
    """(min, opt, max) shape per input for one profile; the batch axis spans 1..max_batch."""
    sizes = {"batch": (1, max_batch, max_batch), "new_tokens": (p.min_tokens, p.opt_tokens, p.max_tokens),
             "logit_tokens": (1, p.opt_tokens, p.max_tokens),
             "past_tokens": (p.min_past, p.opt_past, p.max_past),
             "total_tokens": (p.min_tokens + p.min_past, p.opt_tokens + p.opt_past, p.max_tokens + p.max_past)}
    out = {}
    for name, shape in dims.items():
        per = []
        for d in shape:
            if isinstance(d, str):
                if d not in sizes:
                    raise EngineError(f"{source}: input '{name}' has dynamic axis '{d}' that no profile sizes")
                per.append(sizes[d])
            else:
                per.append((d, d, d))
        out[name] = tuple(tuple(x[i] for x in per) for i in range(3))
    return out


def _monitor(trt, progress_log):
    class Monitor(trt.IProgressMonitor):
        """Top-level builder phases as progress lines (TensorRT calls this from the build)."""
        def __init__(self):
            trt.IProgressMonitor.__init__(self)
            self.last = 0.0

        def phase_start(self, phase_name, parent_phase, num_steps):
            if parent_phase is None and progress_log is not None:
                print(f"    tensorrt: {phase_name} ({num_steps} steps)", file=progress_log, flush=True)

        def step_complete(self, phase_name, step):
            return True   # never cancel

        def phase_finish(self, phase_name):
            pass
    return Monitor()


def build_engine(trt, onnx_path: Path, plan_path: Path, profiles: dict[str, dict[str, tuple]],
                 timing_cache: Path, workspace_gib: float, optimization_level: int, log=None) -> dict:
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):   # reads external weights beside the file too
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise EngineError(f"{onnx_path}: TensorRT's ONNX parser rejected the graph: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * (1 << 30)))
    config.builder_optimization_level = optimization_level
    cache = config.create_timing_cache(timing_cache.read_bytes() if timing_cache.is_file() else b"")
    config.set_timing_cache(cache, ignore_mismatch=False)
    config.progress_monitor = _monitor(trt, log)
    index = {}
    for name, shapes in profiles.items():
        profile = builder.create_optimization_profile()
        for tensor, (lo, opt, hi) in shapes.items():
            profile.set_shape(tensor, lo, opt, hi)
        index[name] = config.add_optimization_profile(profile)
    start = time.perf_counter()
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise EngineError(f"{onnx_path}: TensorRT failed to build an engine (see the TensorRT log above)")
    plan_path.write_bytes(memoryview(plan))
    timing_cache.write_bytes(memoryview(config.get_timing_cache().serialize()))
    return {"plan": plan_path.name, "onnx": onnx_path.name, "profiles": index, "seconds": round(time.perf_counter() - start, 1),
            "shapes": {n: {t: list(map(list, s)) for t, s in sh.items()} for n, sh in profiles.items()}}


def build_engines(trt, graphs: dict[str, Path], cfg: BuildConfig, out: Path, log=None) -> dict:
    """`<graph>.plan` for the target and drafter-tree graphs, plus timing.cache and engines.json."""
    import torch
    progress = Progress("engines", len(PROFILES), log)
    info = {"tensorrt": trt.__version__, "device": torch.cuda.get_device_name(0), "engines": {}}
    for graph, names in PROFILES.items():
        dims = input_dims(graphs[graph])
        # Prefill runs one sequence at a time (runtime/two_call.py); verification and drafting the running batch.
        profiles = {n: profile_shapes(dims, getattr(cfg.engines.profiles, n), str(graphs[graph]),
                                      1 if n == "prefill" else cfg.engines.max_batch) for n in names}
        info["engines"][graph] = build_engine(trt, graphs[graph], out / f"{graph}.plan", profiles, out / "timing.cache",
                                              cfg.engines.workspace_gib, cfg.engines.optimization_level, log)
        progress.step(f"{graph}.plan")
    (out / "engines.json").write_text(json.dumps(info, indent=2))
    return info


__all__ = [
    "PROFILES",
    "EngineError",
    "build_engine",
    "build_engines",
    "input_dims",
    "profile_shapes",
    "tensorrt_status",
]
