"""ONNX exporters: the target graph, the drafter graph with the draft tree baked in, and
single-step drafter graphs; plus the TensorRT op-set check."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TextIO

from ..config import TreeShape
from .onnx_export import ExportedGraph, export_drafter_step, export_drafter_tree, export_target
from .opcheck import UnsupportedGraph, check_graph

__all__ = ["ExportedGraph", "UnsupportedGraph", "check_graph", "export_drafter_step", "export_drafter_tree",
           "export_pipeline", "export_target"]


def export_pipeline(models, shape: TreeShape, out_dir: Path, dtype: str = "float32", step_graphs: bool = False,
                    log: TextIO | None = sys.stderr) -> dict[str, Path]:
    """Export target + drafter-tree graphs (and optionally the single-step drafter graphs)
    into out_dir, skipping graphs whose recorded export key matches. Returns name -> path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    key = {"target": str(models.target.folder), "drafter": models.drafter_source, "dtype": dtype,
           "shape": [shape.depth, shape.top_k, shape.total_tokens],
           "capture": list(models.target.model.capture_streams)}
    stamp = out_dir / "export.json"
    previous = json.loads(stamp.read_text()) if stamp.is_file() else {}
    jobs = {"target": lambda p: export_target(models.target.model, p, dtype),
            "drafter_tree": lambda p: export_drafter_tree(models.drafter, shape, p, dtype)}
    if step_graphs:
        jobs["drafter_step_first"] = lambda p: export_drafter_step(models.drafter, p, True, dtype)
        jobs["drafter_step"] = lambda p: export_drafter_step(models.drafter, p, False, dtype)
    paths = {}
    for name, job in jobs.items():
        path = out_dir / f"{name}.onnx"
        paths[name] = path
        if previous.get(name) == key and path.is_file():
            continue
        result = job(path)
        previous[name] = key
        stamp.write_text(json.dumps(previous, indent=2))
        if log is not None:
            print(f"exported {name} to {path} in {result.seconds:.1f}s ({len(result.ops)} op types)", file=log)
    return paths
