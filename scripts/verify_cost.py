"""How the target graph's cost grows with the tokens verified in one call, on this machine:
ONNX Runtime, the exported SmolLM2 target graph, a committed context of --context tokens,
median of --repeats calls per token count. Prints one line per count.

    python scripts/verify_cost.py [--graph ~/.cache/eagle_trt/onnx/smollm2-135m-instruct/target.onnx]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing
from eagle_trt.checkpoints import cache_dir  # noqa: E402
from eagle_trt.models.target import causal_mask  # noqa: E402
from eagle_trt.runtime.onnxruntime_backend import OrtTarget  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--graph", type=Path, default=cache_dir() / "onnx" / "smollm2-135m-instruct" / "target.onnx",
                   help="target graph (python -m eagle_trt.bench exports it there)")
    p.add_argument("--tokens", default="1,2,4,6,8,12,17,24")
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=0, help="ONNX Runtime threads (0: its default)")
    args = p.parse_args(argv)
    if not args.graph.is_file():
        print(f"error: {args.graph}: no target graph; run python -m eagle_trt.bench first or pass --graph",
              file=sys.stderr)
        return 2
    counts = [int(t) for t in args.tokens.split(",")]
    capacity = args.context + max(counts) + 1
    target = OrtTarget(args.graph, capacity, args.threads or None, spin="always")
    gen = torch.Generator().manual_seed(0)
    target.reset()
    target.add_sequence(capacity)
    prompt = torch.randint(0, 1000, (1, args.context), generator=gen)
    target.forward(prompt, torch.arange(args.context)[None], causal_mask(args.context, 0), last_only=True)
    target.commit([list(range(args.context))])
    base = None
    for n in counts:
        times = []
        for _ in range(args.repeats + 1):             # the first call of a shape is a warm-up
            ids = torch.randint(0, 1000, (1, n), generator=gen)
            start = time.perf_counter()
            target.forward(ids, torch.arange(args.context, args.context + n)[None], causal_mask(n, 0), last_only=n == 1)
            times.append(time.perf_counter() - start)
        ms = 1e3 * statistics.median(times[1:])
        base = base or ms
        print(f"{n:3d} tokens: {ms:6.1f} ms  ({ms / base:.2f}x one token)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
