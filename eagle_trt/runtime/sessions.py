"""ONNX Runtime sessions, made in one place for the runtime's backends, parity and the
quantization checks: the execution providers, how the worker threads wait (`spin`), and the
settings FP8 graphs need.

FP8 Q/DQ graphs run on ONNX Runtime, but only at graph optimization ORT_ENABLE_BASIC: at
higher levels ORT's QDQ fusions either reject FP8 graphs (SmolLM2's fails to load at
ORT_ENABLE_ALL) or change their results. With the session option `session.disable_quant_qdq`
the QDQ transformers stay off and constant folding may fold the weights' DequantizeLinear
nodes into float32 initializers (the same q * scale products); without it every call
dequantizes every weight again, 2.5x (prefill) to 6x (one token) slower on SmolLM2. A backend
runs an FP8 graph with these settings as keyword arguments: `OrtDrafter(path, shape, threads,
**FP8_SESSION)`, and the FP8 target `OrtTarget(path, max_context, threads, min_rows=2,
**FP8_SESSION)` (min_rows: see OrtTarget)."""
from __future__ import annotations

from pathlib import Path

import onnxruntime as ort

from . import huge_pages as pages

# The execution providers of each device a session runs on ("cuda": onnxruntime-gpu)
PROVIDERS = {"cpu": ["CPUExecutionProvider"], "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"]}

# How a session's worker threads wait for work (make_session's `spin`).
SPIN_MODES = ("in-call", "always", "off")


def make_session(path: str | Path, threads: int | None = None,
                 level: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
                 config: dict[str, str] | None = None, spin: str = "in-call",
                 providers: list[str] | None = None, huge_pages: bool = True) -> ort.InferenceSession:
    """config: ONNX Runtime session config entries (e.g. FP8_SESSION's, below).
    huge_pages: on the CPU, once the session is made, the process's filled memory (its weights
    among it) is collapsed into 2 MB pages (runtime/huge_pages.py: a few percent faster decoding,
    ~2.5 s a GB of new memory): off for sessions that only check a graph.
    providers: ONNX Runtime's execution providers (default: the CPU's); with CUDAExecutionProvider
    (onnxruntime-gpu) the CUDA and cuDNN libraries PyTorch brings are loaded first.

    spin, how the worker threads wait between the graph's ~2,000 small ops and between calls:
    - "in-call" (default): busy-wait inside a call, sleep when it ends
      (session.force_spinning_stop). Speculative decoding alternates two sessions (drafter,
      target): each call gets fast hand-offs between its ops and leaves the cores to the other
      session. On a 2-core AVX-512 EPYC (2026-11-25, docs/benchmarks.md's findings: 3 MT-bench
      prompts, int8 drafter, tree 3,2,4) speculative decoding ran at 82.9 tok/s, against 70.1 with "off" and 48.4 with
      "always".
    - "always": ONNX Runtime's default, workers keep spinning after a call; as fast for one
      session run call after call (plain decoding: 61.5 tok/s against 61.4 "in-call", 49.7 "off").
    - "off": workers sleep whenever idle (allow_spinning 0)."""
    if spin not in SPIN_MODES:
        raise ValueError(f"spin={spin!r}: expected one of {', '.join(SPIN_MODES)}")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: ONNX graph not found")
    so = ort.SessionOptions()
    so.graph_optimization_level = level
    entries = dict(config or {})
    if spin == "off":
        entries.setdefault("session.intra_op.allow_spinning", "0")
    elif spin == "in-call":
        entries.setdefault("session.force_spinning_stop", "1")
    for key, value in entries.items():
        so.add_session_config_entry(key, value)
    if threads:
        so.intra_op_num_threads = threads
    so.log_severity_level = 3
    providers = providers or ["CPUExecutionProvider"]
    if "CUDAExecutionProvider" in providers and hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    try:
        session = ort.InferenceSession(str(path), so, providers=providers)
    except Exception as exc:  # noqa: BLE001 - name the file with ORT's reason
        raise ValueError(f"{path}: ONNX Runtime cannot load this graph ({exc})") from None
    if huge_pages and providers == ["CPUExecutionProvider"]:
        pages.collapse_filled_memory()          # the weights it prepacked into 2 MB pages
    return session


# make_session's keyword arguments for FP8 Q/DQ graphs (module docstring); float graphs run with
# them too, as an iteration graph composed of an FP8 and a float graph does
FP8_SESSION = {"level": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC, "config": {"session.disable_quant_qdq": "1"}}


def fp8_session(path: str | Path, threads: int | None = 1) -> ort.InferenceSession:
    """A CPU session for a one-off run of an FP8 (or float) graph file, its weights' dequantization
    folded (a real-size target's layer check runs it unoptimized instead, its weights fed as
    memory maps: parity_sessions.probe_session). Its workers keep spinning between calls (ONNX
    Runtime's default: no call alternates with another session's)."""
    return make_session(path, threads, level=FP8_SESSION["level"], config=FP8_SESSION["config"], spin="always",
                        huge_pages=False)


__all__ = ["FP8_SESSION", "PROVIDERS", "SPIN_MODES", "fp8_session", "make_session"]
