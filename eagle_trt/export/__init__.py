"""ONNX exporters: the target graph, the drafter graph with the draft tree baked in, and
single-step drafter graphs; plus the TensorRT op-set check, and for ONNX Runtime on the CPU the
int8-weight copy of the drafter tree graph (cpu_int8.py) and the 4-bit target (cpu_int4.py)."""
from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path
from typing import TextIO

import onnx
import torch

from ..codehash import code_digest
from ..config import TreeShape
from .cpu_attention import fuse_attention
from .cpu_int4 import quantize_int4
from .cpu_int8 import quantize_int8
from .iteration import ITERATION_FORMAT, compose_iteration
from .onnx_export import ExportedGraph, export_drafter_step, export_drafter_tree, export_target
from .opcheck import UnsupportedGraph, check_graph

__all__ = ["GRAPH_FORMAT", "ExportedGraph", "UnsupportedGraph", "check_graph", "export_drafter_step",
           "export_drafter_tree", "export_pipeline", "export_target"]


# 2: batch axis on every graph, past_lengths / new_lengths on the drafter tree; 3: step 0 lm_head on
# the last row only; 4: a tied lm_head reads the embedding table (stored once), the greedy accept graph;
# 5: greedy acceptance at the end of the target graph (accept_* outputs), no accept graph; 6: weights
# attached by name from the module (Linear weights as `<name>.weight_t`), not folded by the exporter;
# 7: head-major KV [B, Hkv, rows, D], attended in place beside the new rows (no concat of the past);
# 8: draft tree nodes in rank order (best first), so the n best nodes are the first n
GRAPH_FORMAT = 8
# The code each kind of graph is made by: its hash is part of every cached graph's key (codehash.py)
EXPORTER, INT8_WEIGHTS, COMPOSER = "eagle_trt.export.onnx_export", "eagle_trt.export.cpu_int8", "eagle_trt.export.iteration"
INT4_WEIGHTS = "eagle_trt.export.cpu_int4"
FUSED_ATTENTION = "eagle_trt.export.cpu_attention"


def weights_digest(module: torch.nn.Module) -> str:
    """A hash of a module's parameters and buffers (names, dtypes, shapes, bytes)."""
    h = hashlib.blake2b(digest_size=16)
    for name, t in sorted(module.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{list(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _files_stamp(folder: Path, name: str | None = None) -> list:
    """Name, size and modification time of each file in a checkpoint folder, or of the one
    named (hashing a large target's weights on every run would cost seconds per GB)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in sorted(folder.iterdir())
            if f.is_file() and name in (None, f.name)]


def _rewritten(rewrite, src: Path, dst: Path, *args) -> ExportedGraph:
    """A CPU variant of a graph (the int8 or int4 weights of cpu_int8.py / cpu_int4.py, the fused
    attention of cpu_attention.py), with its time and ops for the log."""
    start = time.perf_counter()
    rewrite(src, dst, *args)
    model = onnx.load(str(dst), load_external_data=False)
    return ExportedGraph(dst, time.perf_counter() - start, sorted({n.op_type for n in model.graph.node}))


# the iteration graphs and the drafter tree graph each composes with the target graph
ITERATION_GRAPHS = {"iteration": "drafter_tree", "iteration_int8": "drafter_tree_int8"}


def export_pipeline(models, shape: TreeShape, out_dir: Path, dtype: str = "float32", step_graphs: bool = False,
                    log: TextIO | None = sys.stderr, only: tuple[str, ...] | None = None,
                    target_graph: Path | None = None) -> dict[str, Path]:
    """Export target (with greedy acceptance) + drafter-tree graphs (and optionally the single-step drafter graphs)
    into out_dir, skipping graphs whose recorded export key matches; `only` names a subset, and
    may name `drafter_tree_int8` (the tree graph with int8 weights), `target_int4` (the target
    graph with 4-bit weights), `target_fused` / `target_int4_fused` (the target
    graph / the 4-bit one with ONNX Runtime's fused attention, the 4-bit one with int8 activations) and `iteration` /
    `iteration_int8` (target and drafter tree graph composed into one, export/iteration.py;
    with the target graph at `target_graph` where given, else out_dir's), made only when asked for.
    The target graph's key leaves out the drafter and the tree (its token count is dynamic), so
    another tree shape re-exports only the drafter graph. Returns name -> path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    base = {"target": str(models.target.folder), "target_files": _files_stamp(models.target.folder), "dtype": dtype,
            "capture": list(models.target.model.capture_streams), "format": GRAPH_FORMAT,
            "code": code_digest(EXPORTER)}
    # the drafter's weights themselves: a drafter retrained into the same folder is re-exported
    drafter_key = dict(base, drafter=models.drafter_source, drafter_weights=weights_digest(models.drafter))
    stamp = out_dir / "export.json"
    previous = json.loads(stamp.read_text()) if stamp.is_file() else {}
    jobs = {"target": (base, lambda p: export_target(models.target.model, p, dtype)),
            "drafter_tree": (dict(drafter_key, shape=[shape.depth, shape.top_k, shape.total_tokens]),
                             lambda p: export_drafter_tree(models.drafter, shape, p, dtype))}
    iterations = [(n, d) for n, d in ITERATION_GRAPHS.items() if only is not None and n in only]
    for name, drafter in iterations:     # asked for only: the two graphs composed (export/iteration.py)
        only = (*only, drafter) + (("target",) if target_graph is None else ())
    if only is not None and ("target_int4" in only or "target_int4_fused" in only):
        # asked for only: the target graph with 4-bit MatMulNBits weights, for ONNX Runtime on the CPU (cpu_int4.py)
        jobs["target_int4"] = (dict(base, weights="int4", int4_code=code_digest(INT4_WEIGHTS)),
                               lambda p: _rewritten(quantize_int4, out_dir / "target.onnx", p))
        only = (*only, "target")     # quantized from it
    for name, source in (("target_fused", "target"), ("target_int4_fused", "target_int4")):
        if only is not None and name in only:
            # asked for only: the (4-bit) target graph with ONNX Runtime's fused attention, for its
            # CPU provider (cpu_attention.py), rewritten from the graph it names; the 4-bit one
            # computes with int8 activations (lossless for chain trees)
            int8 = name == "target_int4_fused"
            jobs[name] = (dict(jobs[source][0], attention="fused", fused_code=code_digest(FUSED_ATTENTION),
                               int8_activations=int8),
                          lambda p, s=source, i=int8: _rewritten(fuse_attention, out_dir / f"{s}.onnx", p,
                                                                 models.target.config, True, i))
            only = (*only, source)
    if only is not None and "drafter_tree_int8" in only:
        # asked for only: the tree graph with int8 weights, for ONNX Runtime on the CPU (cpu_int8.py)
        jobs["drafter_tree_int8"] = (dict(jobs["drafter_tree"][0], weights="int8", int8_code=code_digest(INT8_WEIGHTS)),
                                     lambda p: _rewritten(quantize_int8, out_dir / "drafter_tree.onnx", p))
        only = (*only, "drafter_tree")     # quantized from it
    target_path = Path(target_graph) if target_graph is not None else out_dir / "target.onnx"
    for name, drafter in iterations:
        jobs[name] = (dict(jobs[drafter][0], composed_with=str(target_path), iteration_format=ITERATION_FORMAT,
                           composer_code=code_digest(COMPOSER)),
                      lambda p, d=drafter: compose_iteration(target_path, out_dir / f"{d}.onnx", p,
                                                             tensorrt=d == "drafter_tree"))
    if step_graphs:
        jobs["drafter_step_first"] = (drafter_key, lambda p: export_drafter_step(models.drafter, p, True, dtype))
        jobs["drafter_step"] = (drafter_key, lambda p: export_drafter_step(models.drafter, p, False, dtype))
    paths = {}
    for name, (key, job) in jobs.items():
        if only is not None and name not in only:
            continue
        path = out_dir / f"{name}.onnx"
        paths[name] = path
        if name in ITERATION_GRAPHS:   # made from the target graph on disk: remade when it is
            key = dict(key, target_file=_files_stamp(target_path.parent, target_path.name))
        if previous.get(name) == key and path.is_file():
            continue
        result = job(path)
        previous[name] = key
        stamp.write_text(json.dumps(previous, indent=2))
        if log is not None:
            print(f"exported {name} to {path} in {result.seconds:.1f}s ({len(result.ops)} op types)", file=log)
    return paths
