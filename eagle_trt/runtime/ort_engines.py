"""The one place ONNX Runtime backends are made: sessions over a build's graphs (the target
graph, the drafter-tree graph, the iteration graph composed of the two), with the session
settings each graph's precision needs, and the decoding engine over them. Every command
(generate, bench, evaluate, demo) and the Triton model open their graphs here."""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from ..config import ConfigError, TreeShape
from .cost import CostModel
from .onnxruntime_backend import OrtDrafter, OrtIteration, OrtTarget
from .sessions import FP8_SESSION
from .two_call import IterationEngine, TwoCallEngine

# graph precisions whose sessions need ONNX Runtime's FP8 settings (and the target 2-row calls)
FP8 = "fp8"


def _session(precision: str | None) -> dict:
    return FP8_SESSION if precision == FP8 else {}


class OrtBackends(NamedTuple):
    """A target backend, and for speculative decoding a drafter backend and the iteration graph
    over the two (each None where not opened)."""
    target: OrtTarget | None
    drafter: OrtDrafter | None = None
    iteration: OrtIteration | None = None

    def engine(self, cost_model: CostModel | None = None) -> TwoCallEngine:
        """The decoding engine over them: one iteration-graph call an iteration where there is
        one, else the two calls."""
        if self.iteration is not None:
            return IterationEngine(self.iteration, cost_model)
        return TwoCallEngine(self.target, self.drafter, cost_model)


def open_backends(graphs: dict[str, str | Path], shape: TreeShape | None, max_context: int, *,
                  threads: int | None = None, providers: list[str] | None = None, kv_device=None,
                  precision: dict[str, str] | None = None, spin: str = "in-call",
                  target: OrtTarget | None = None) -> OrtBackends:
    """Sessions over `graphs` (names 'target', 'drafter_tree', 'iteration', the build's; a
    drafter graph needs `shape`), on ONNX Runtime's `providers` (default: the CPU's), the KV
    caches on `kv_device` (onnxruntime_backend.kv_device_for). precision: each graph's, as the
    build's manifest gives it ('fp8' graphs get ONNX Runtime's FP8 settings, sessions.FP8_SESSION, and
    an FP8 target pads its calls to 2 rows, see OrtTarget). spin: how the sessions' threads
    wait (make_session). target: a target backend already open on the same graph, shared (or
    none: graphs without 'target' open only the drafter)."""
    precision = precision or {}
    if "drafter_tree" in graphs and shape is None:
        raise ConfigError("a drafter graph needs its tree shape")
    common = dict(providers=providers, kv_device=kv_device, spin=spin)
    if target is None and "target" in graphs:
        fp8 = precision.get("target") == FP8
        target = OrtTarget(graphs["target"], max_context, threads, min_rows=2 if fp8 else 1, **common,
                           **_session(precision.get("target")))
    if "drafter_tree" not in graphs:
        return OrtBackends(target)
    if target is not None and target.lossless_trees == "chains" and shape.top_k > 1:
        raise ConfigError(f"{target.path}: speculative decoding on this target graph equals its own greedy decoding "
                          f"for chain trees only (top_k 1, e.g. tree 3,1,3), not the tree {shape.depth},{shape.top_k},"
                          f"{shape.total_tokens}: its int8-activation kernels would round a tree node off the first "
                          f"chain differently (export/cpu_attention.py)")
    drafter = OrtDrafter(graphs["drafter_tree"], shape, threads, **common, **_session(precision.get("drafter_tree")))
    iteration = None
    if graphs.get("iteration") is not None:
        # an iteration graph composed of an FP8 graph runs its nodes as that graph's session does
        fp8 = FP8 in (precision.get("target"), precision.get("drafter_tree"))
        iteration = OrtIteration(graphs["iteration"], target, drafter, threads, providers=providers, spin=spin,
                                 **_session(FP8 if fp8 else None))
    return OrtBackends(target, drafter, iteration)
