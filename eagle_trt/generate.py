"""python -m eagle_trt.generate: speculative decoding from the command line.

A thin skin over `eagle_trt.api.load_pipeline` and `DecodingLoop.generate`."""
from __future__ import annotations

import argparse
import json
import sys

from .config import ConfigError, SamplingConfig, TreeShape
from .devices import add_device_options


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eagle_trt.generate", description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2",
                   help="target checkpoint: a Hugging Face folder, a .gguf file, or 'smollm2' (default)")
    p.add_argument("--drafter", default=None,
                   help="EAGLE-3 / 3.1 drafter folder; default: the shipped drafter for smollm2 if present, "
                        "else a random EAGLE 3.1 drafter (written to a temporary checkpoint, loaded, removed)")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="target sampling top-k, 0 = off")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--depth", type=int, default=5, help="draft tree depth (drafter steps)")
    p.add_argument("--tree-top-k", type=int, default=8, help="children per frontier node; 1 = chain")
    p.add_argument("--total-tokens", type=int, default=None,
                   help="draft nodes verified per step (default: 60 for a tree, depth for a chain)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    add_device_options(p)   # the onnxruntime backend runs on the CPU
    p.add_argument("--backend", choices=("torch", "onnxruntime"), default="torch",
                   help="torch: the PyTorch models; onnxruntime: the exported graphs (exported on first use)")
    p.add_argument("--iteration-graph", choices=("on", "off"), default="on",
                   help="onnxruntime: drafting and verification in one graph call an iteration (the drafter and "
                        "target graphs composed, as the build serves them; on, the default) or two (off)")
    p.add_argument("--attention", choices=("portable", "fused"), default="portable",
                   help="onnxruntime: the target graph's attention, portable ops (as TensorRT parses) or fused (ONNX "
                        "Runtime's GroupQueryAttention CPU operator, the KV caches written in place: faster on a CPU; "
                        "float32)")
    p.add_argument("--onnx-dir", default=None,
                   help="where the onnxruntime backend finds or exports its graphs (default: a cache folder)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .api import load_pipeline   # heavy imports after argument errors
    try:
        total = args.total_tokens or (args.depth if args.tree_top_k == 1 else min(60, TreeShape(
            args.depth, args.tree_top_k, 1).max_nodes))
        shape = TreeShape(args.depth, args.tree_top_k, total).validate()
        sampling = SamplingConfig(args.temperature, args.top_p, args.top_k, args.seed).validate()
        pipe = load_pipeline(args.target, args.drafter, shape, dtype=args.dtype, log=sys.stderr,
                             backend=args.backend, onnx_dir=args.onnx_dir, device=args.device,
                             iteration_graph=args.iteration_graph == "on", attention=args.attention)
        result = pipe.generate(args.prompt, args.max_new_tokens, sampling, chat=args.chat)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    else:
        print(result["text"])
        print(f"[{len(result['tokens'])} tokens in {result['seconds']:.2f}s, {result['target_calls']} target calls, "
              f"mean accept length {result['mean_accept_length']:.2f}, drafter {result['drafter']}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
