"""Tokens per second on the ONNX Runtime backend: plain autoregressive decoding vs speculative
decoding, measured in one run on the same machine, on MT-bench prompts at temperature 0,
plus the share of wall time spent outside graph calls (host work).

    python scripts/bench_ort.py [--prompts 20] [--max-new-tokens 128] [--drafter PATH] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from eagle_trt.api import prepare_models, real_prompt_ids
from eagle_trt.checkpoints import cache_dir
from eagle_trt.config import TreeShape
from eagle_trt.export import export_pipeline
from eagle_trt.runtime.decoder import SpeculativeDecoder, generate_autoregressive
from eagle_trt.runtime.onnxruntime_backend import OrtDrafter, OrtTarget


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafter", default=None)
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--tree-top-k", type=int, default=8)
    p.add_argument("--total-tokens", type=int, default=60)
    p.add_argument("--onnx-dir", default=None)
    p.add_argument("--json", default=None, help="also write the numbers here")
    args = p.parse_args()
    torch.set_num_threads(2)

    shape = TreeShape(args.depth, args.tree_top_k, args.total_tokens).validate()
    models = prepare_models(args.target, args.drafter, log=sys.stderr)
    folder = args.onnx_dir or cache_dir() / "onnx" / models.target.folder.name
    graphs = export_pipeline(models, shape, folder, log=sys.stderr)
    ctx = models.target.config.max_position_embeddings
    target, drafter = OrtTarget(graphs["target"], ctx), OrtDrafter(graphs["drafter_tree"], shape)
    decoder = SpeculativeDecoder(target, drafter, models.eos_ids, models.target.config.vocab_size)
    prompts = real_prompt_ids(models, args.prompts)

    decoder.generate(prompts[0], 8)   # warm-up: first-run allocations stay out of the numbers
    generate_autoregressive(target, prompts[0], 8, models.eos_ids)

    rows = {"autoregressive": {"tokens": 0, "seconds": 0.0, "graph_seconds": 0.0, "calls": 0},
            "speculative": {"tokens": 0, "seconds": 0.0, "graph_seconds": 0.0, "calls": 0, "accept": [],
                            "drafter_seconds": 0.0, "target_seconds": 0.0}}
    identical = 0
    for i, ids in enumerate(prompts):
        g0 = target.graph_seconds
        ar = generate_autoregressive(target, ids, args.max_new_tokens, models.eos_ids)
        r = rows["autoregressive"]
        r["tokens"] += len(ar.tokens); r["seconds"] += ar.seconds; r["calls"] += ar.target_calls
        r["graph_seconds"] += target.graph_seconds - g0

        g0 = target.graph_seconds + drafter.graph_seconds
        t0, d0 = target.graph_seconds, drafter.graph_seconds
        sp = decoder.generate(ids, args.max_new_tokens)
        r = rows["speculative"]
        r["drafter_seconds"] += drafter.graph_seconds - d0
        r["target_seconds"] += target.graph_seconds - t0
        r["tokens"] += len(sp.tokens); r["seconds"] += sp.seconds; r["calls"] += sp.target_calls + sp.drafter_calls
        r["graph_seconds"] += target.graph_seconds + drafter.graph_seconds - g0
        r["accept"] += sp.accept_lengths
        identical += sp.tokens == ar.tokens
        print(f"prompt {i:2d}: {len(sp.tokens):3d} tokens, accept {sp.mean_accept_length:.2f}, "
              f"spec {len(sp.tokens) / sp.seconds:6.1f} tok/s, ar {len(ar.tokens) / ar.seconds:6.1f} tok/s",
              file=sys.stderr, flush=True)

    result = {"target": str(models.target.folder), "drafter": models.drafter_source,
              "drafter_variant": models.drafter.cfg.variant,
              "tree": [shape.depth, shape.top_k, shape.total_tokens], "prompts": len(prompts),
              "max_new_tokens": args.max_new_tokens, "identical_outputs": identical,
              "machine_threads": torch.get_num_threads()}
    print(f"\n{'mode':<16}{'tok/s':>9}{'tokens':>8}{'seconds':>9}{'graph calls':>12}{'host share':>11}")
    for mode, r in rows.items():
        tps = r["tokens"] / r["seconds"]
        host = 1 - r["graph_seconds"] / r["seconds"]
        result[mode] = {"tokens_per_second": tps, "tokens": r["tokens"], "seconds": r["seconds"],
                        "graph_calls": r["calls"], "host_share": host}
        print(f"{mode:<16}{tps:>9.1f}{r['tokens']:>8}{r['seconds']:>9.1f}{r['calls']:>12}{host:>10.1%}")
    sp = rows["speculative"]
    result["speculative"]["drafter_graph_seconds"] = sp["drafter_seconds"]
    result["speculative"]["target_graph_seconds"] = sp["target_seconds"]
    print(f"speculative time split: drafter graph {sp['drafter_seconds'] / sp['seconds']:.1%}, "
          f"target graph {sp['target_seconds'] / sp['seconds']:.1%}, host {1 - sp['graph_seconds'] / sp['seconds']:.1%}")
    accept = rows["speculative"]["accept"]
    result["mean_accept_length"] = sum(accept) / len(accept)
    result["speedup"] = result["speculative"]["tokens_per_second"] / result["autoregressive"]["tokens_per_second"]
    print(f"\nmean accept length {result['mean_accept_length']:.2f}; speculative / autoregressive "
          f"{result['speedup']:.2f}x; outputs identical on {identical}/{len(prompts)} prompts")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
