"""How long does exporting SmolLM2-135M-Instruct and its drafter take, and in how much memory?
Exports the target graph, the drafter-tree graph and both single-step drafter graphs and prints
the wall time and the process's peak memory (RSS).

    python scripts/export_smollm2.py [--out artifacts/onnx] [--drafter PATH] [--dtype float32]
"""
from __future__ import annotations

import argparse
import resource
import sys
import time

import torch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="artifacts/onnx")
    p.add_argument("--drafter", default=None)
    p.add_argument("--dtype", choices=("float32", "float16"), default="float32")
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--tree-top-k", type=int, default=8)
    p.add_argument("--total-tokens", type=int, default=60)
    args = p.parse_args()
    torch.set_num_threads(2)
    start = time.perf_counter()
    from eagle_trt.api import prepare_models
    from eagle_trt.config import TreeShape
    from eagle_trt.export import export_drafter_step, export_drafter_tree, export_target
    from pathlib import Path

    shape = TreeShape(args.depth, args.tree_top_k, args.total_tokens).validate()
    models = prepare_models("smollm2", args.drafter, log=sys.stdout)
    loaded = time.perf_counter()
    out = Path(args.out)
    results = [export_target(models.target.model, out / "target.onnx", args.dtype),
               export_drafter_tree(models.drafter, shape, out / "drafter_tree.onnx", args.dtype),
               export_drafter_step(models.drafter, out / "drafter_step_first.onnx", True, args.dtype),
               export_drafter_step(models.drafter, out / "drafter_step.onnx", False, args.dtype)]
    total = time.perf_counter() - start
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 ** 2
    for r in results:
        print(f"{r.path}: {r.path.stat().st_size / 1e6:.0f} MB, {r.seconds:.1f}s, {len(r.ops)} op types, TensorRT op check ok")
    print(f"loading {loaded - start:.1f}s, export {total - (loaded - start):.1f}s, total {total:.1f}s; "
          f"peak memory {peak_gb:.2f} GB (tree depth {shape.depth}, top_k {shape.top_k}, total_tokens {shape.total_tokens})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
