"""How much of the host work per iteration is the loop's own Python, and how much is the CPU's
caches being emptied by the graph calls (issue 22).

On this CPU every target call streams the target's weights (SmolLM2: 540 MB in fp32) through
the caches, so the loop's Python and tensors run cold after each call. On a GPU host the
weights stay in GPU memory and the same Python runs warm. This script runs the same decoding
loop (ONNX Runtime, tree (3, 2, 4), the drafter graph and the target graph with acceptance
inside) on a random target with SmolLM2's layer count but a tiny width, so the graph calls
are short and leave the caches alone, then again with each graph call also reading
`--stream-mb` of memory (timed as graph time, like the real calls' weight reads):

    python scripts/host_cache_effect.py [--streams 1] [--layers 30] [--stream-mb 540] [--threads 1]

Both lines print host ms per iteration (wall time minus time inside graph calls). --streams N:
N sequences decoded together, every iteration drafting and verifying the whole tree."""
from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from eagle_trt.checkpoints import random_drafter_for, read_json, resolve_target
from eagle_trt.config import TargetConfig, TreeShape
from eagle_trt.export import export_drafter_tree, export_target
from eagle_trt.models.target import LlamaTarget
from eagle_trt.runtime import onnxruntime_backend
from eagle_trt.runtime.decoder import Request, SpeculativeDecoder
from eagle_trt.runtime.timing import OrtDecoding, decoding_threads, graph_seconds


def decode(ort: OrtDecoding, prompts: list[list[int]], max_new_tokens: int, streams: int) -> tuple[float, int]:
    """(host seconds, iterations) of speculative decoding over the prompts."""
    graph0, start = graph_seconds(ort.target, ort.drafter), time.perf_counter()
    if streams == 1:
        iterations = sum(ort.speculative(p, max_new_tokens).drafter_calls for p in prompts)
    else:
        decoder = SpeculativeDecoder(ort.target, ort.drafter, ort.eos, ort.decoder.vocab_size)
        with decoding_threads():
            decoder.generate_batch([Request(p, max_new_tokens) for p in prompts], streams)
        iterations = len(decoder.verified)
    wall = time.perf_counter() - start
    return wall - (graph_seconds(ort.target, ort.drafter) - graph0), iterations


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=1)
    p.add_argument("--layers", type=int, default=None, help="target layers (default: SmolLM2's)")
    p.add_argument("--stream-mb", type=float, default=None,
                   help="memory each graph call also reads (default: SmolLM2's fp32 weight bytes)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="ONNX Runtime threads per session")
    args = p.parse_args(argv)
    real = TargetConfig.from_hf(read_json(resolve_target("smollm2") / "config.json"))
    cfg = dataclasses.replace(real, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=16, vocab_size=256, num_hidden_layers=args.layers or real.num_hidden_layers,
                              eos_token_ids=(2,))
    with torch.device("meta"):   # SmolLM2's parameter count, nothing allocated
        stream_mb = args.stream_mb if args.stream_mb is not None else 4 * sum(
            w.numel() for w in LlamaTarget(real).parameters()) / 1e6
    torch.manual_seed(0)
    target = LlamaTarget(cfg).eval()
    shape = TreeShape(depth=3, top_k=2, total_tokens=4)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        export_target(target, folder / "target.onnx")
        export_drafter_tree(random_drafter_for(cfg).eval(), shape, folder / "drafter_tree.onnx")
        ort = OrtDecoding.open(folder / "target.onnx", folder / "drafter_tree.onnx", shape,
                               cfg.max_position_embeddings, {2}, cfg.vocab_size, threads=args.threads)
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, cfg.vocab_size, (int(n),), generator=gen).tolist()
                   for n in torch.randint(40, 120, (args.prompts + 1,), generator=gen)]
        ort.warm_up(prompts[0])
        decode(ort, prompts[:1], 16, args.streams)      # the batched shapes bound once
        host, iterations = decode(ort, prompts[1:], args.max_new_tokens, args.streams)
        print(f"{cfg.num_hidden_layers} layers, hidden 64, {args.streams} stream(s): host work {1e3 * host / iterations:.3f} ms "
              f"per iteration ({iterations} iterations), graph calls leaving the caches warm")
        big = np.ones(int(stream_mb * 1e6 / 4), dtype=np.float32)
        plain_run = onnxruntime_backend._Timed._run_graph

        def run_and_stream(self, io):   # the call, then a read of `big`, both timed as graph time
            plain_run(self, io)
            start = time.perf_counter()
            big.sum()
            self.graph_seconds += time.perf_counter() - start
        onnxruntime_backend._Timed._run_graph = run_and_stream
        try:
            host, iterations = decode(ort, prompts[1:], args.max_new_tokens, args.streams)
        finally:
            onnxruntime_backend._Timed._run_graph = plain_run
        print(f"{cfg.num_hidden_layers} layers, hidden 64, {args.streams} stream(s): host work {1e3 * host / iterations:.3f} ms "
              f"per iteration ({iterations} iterations), each graph call also reading {stream_mb:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
