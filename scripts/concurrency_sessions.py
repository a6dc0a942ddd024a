"""Where the speculative decoder's gap to plain batched decoding at 8 streams comes from (session
48): the same 16 MT-bench requests decoded, in turn, by plain batched decoding on the baseline's
own session (workers spinning between calls, runtime/timing.py), by plain batched decoding on
the speculative loop's target session (workers spinning only inside a call), and by the
speculative decoder with its cost model (bench --concurrency's speculative-batched mode).

    python scripts/concurrency_sessions.py [--streams 8] [--runs 3] [--threads 2]
"""
from __future__ import annotations

import argparse
import sys

import torch

from eagle_trt import concurrency
from eagle_trt.api import prepare_models
from eagle_trt.bench import drafter_graph, iteration_graph
from eagle_trt.checkpoints import cache_dir
from eagle_trt.config import TreeShape
from eagle_trt.export import export_pipeline
from eagle_trt.runtime.onnxruntime_backend import OrtTarget
from eagle_trt.runtime.timing import OrtDecoding, decoding_threads, ort_threads
from eagle_trt.workloads import build


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    models = prepare_models("smollm2", None, log=sys.stderr)
    shape, folder, threads = TreeShape(3, 2, 4), cache_dir() / "onnx" / models.target.folder.name, ort_threads(args.threads)
    graph = export_pipeline(models, shape, folder, log=sys.stderr, only=("target",))["target"]
    context, eos, vocab = models.target.config.max_position_embeddings, models.eos_ids, models.target.config.vocab_size
    target = OrtTarget(graph, context, threads)
    ort = OrtDecoding.open(graph, drafter_graph(models, shape, folder, "int8"), shape, context, eos, vocab, threads,
                           target=target, iteration_graph=iteration_graph(models, shape, folder, graph, "int8"))
    arms = {"plain, baseline session": ("autoregressive-batched", ort.plain),
            "plain, speculative's session": ("autoregressive-batched", target),
            "speculative, cost model": ("speculative-batched", None)}
    with decoding_threads():
        held = build(models.tokenizer, "mtbench", args.prompts + 8)
        prompts, warm = held[:args.prompts], [held[args.prompts + i % 8] for i in range(2 * args.streams)]
        for r in range(args.runs):
            for name, (mode, plain) in arms.items():
                results, nodes, seconds, host = concurrency.run_level(
                    mode, args.streams, target, ort.drafter, eos, vocab, prompts, args.max_new_tokens, warm, plain,
                    ort.iteration)
                print(f"run {r + 1}: {name:30s} {sum(len(x.tokens) for x in results) / seconds:6.1f} tok/s, "
                      f"host {host:.2f} ms an iteration, draft nodes {nodes:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
