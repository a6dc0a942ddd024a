"""Two graph calls per speculative iteration against one (the iteration graph), and the
iteration graph with and without its drafter-row padding, in one process on the same sessions:
the modes take turns on each prompt (the order reversed every other round), so a slow spell of
the machine lands on a run, not on a mode (bench's pairs of runs could not separate ~1%).
Plain decoding runs in the same rotation, for the ratio.

    python scripts/iteration_graph_ab.py [--prompts 6] [--max-new-tokens 128] [--threads 2] [--repeats 2]

Prints per mode tokens/s, and per iteration the wall time, the time inside graph calls and the
host work (wall minus graph), and whether every mode's tokens were identical on every prompt."""
from __future__ import annotations

import argparse
import sys

from eagle_trt.api import prepare_models
from eagle_trt.bench import DRAFTER_WEIGHTS, drafter_graph, iteration_graph, parse_tree
from eagle_trt.checkpoints import cache_dir
from eagle_trt.export import export_pipeline
from eagle_trt.runtime.decoder import SpeculativeDecoder, generate_autoregressive
from eagle_trt.runtime.onnxruntime_backend import OrtIteration
from eagle_trt.runtime.timing import OrtDecoding, decoding_threads, graph_seconds
from eagle_trt.workloads import build


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafter", default=None)
    p.add_argument("--tree", default="3,2,4")
    p.add_argument("--prompts", type=int, default=6, help="MT-bench prompts (after one for the warm-up)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2, help="runs of each mode per prompt")
    p.add_argument("--drafter-weights", choices=sorted(DRAFTER_WEIGHTS), default="int8")
    args = p.parse_args(argv)
    shape = parse_tree(args.tree)
    models = prepare_models(args.target, args.drafter, log=sys.stderr)
    folder = cache_dir() / "onnx" / models.target.folder.name       # bench's graphs
    target_graph = export_pipeline(models, shape, folder, log=sys.stderr, only=("target",))["target"]
    ort = OrtDecoding.open(target_graph, drafter_graph(models, shape, folder, args.drafter_weights), shape,
                           models.target.config.max_position_embeddings, models.eos_ids,
                           models.target.config.vocab_size, args.threads)
    graph = iteration_graph(models, shape, folder, target_graph, args.drafter_weights)
    padded = OrtIteration(graph, ort.target, ort.drafter, args.threads)
    unpadded = OrtIteration(graph, ort.target, ort.drafter, args.threads)
    unpadded.min_rows = 1
    decoders = {"two calls": ort.decoder}
    for name, iteration in (("one call", padded), ("one call, rows unpadded", unpadded)):
        decoders[name] = SpeculativeDecoder(ort.target, ort.drafter, models.eos_ids, models.target.config.vocab_size,
                                            iteration=iteration)
    sessions = (ort.target, ort.drafter, padded, unpadded)
    prompts = build(models.tokenizer, "mtbench", args.prompts + 1)
    names = [*decoders, "plain"]
    totals = {n: {"seconds": 0.0, "graph": 0.0, "iterations": 0, "tokens": 0} for n in names}
    identical = True
    with decoding_threads():
        for d in decoders.values():
            d.generate(prompts[0], 8)
        generate_autoregressive(ort.plain, prompts[0], 8, ort.eos)
        turn = 0
        for ids in prompts[1:]:
            outputs = set()
            for _ in range(args.repeats):
                for name in (names if turn % 2 == 0 else names[::-1]):
                    before = graph_seconds(*sessions)
                    run = (generate_autoregressive(ort.plain, ids, args.max_new_tokens, ort.eos) if name == "plain"
                           else decoders[name].generate(ids, args.max_new_tokens))
                    t = totals[name]
                    t["seconds"] += run.seconds
                    t["graph"] += graph_seconds(*sessions) - before
                    t["iterations"] += run.drafter_calls
                    t["tokens"] += len(run.tokens)
                    outputs.add(tuple(run.tokens))
                turn += 1
            identical &= len(outputs) == 1
    plain = totals["plain"]["tokens"] / totals["plain"]["seconds"]
    print(f"{args.prompts} MT-bench prompts x {args.max_new_tokens} tokens, {args.repeats} runs per mode, tree "
          f"({shape.depth}, {shape.top_k}, {shape.total_tokens}), {args.drafter_weights} drafter weights, {args.threads} threads")
    print(f"{'mode':<26}{'tok/s':>8}{'vs plain':>10}{'ms/it':>8}{'graph':>8}{'host':>8}")
    for name in decoders:
        t = totals[name]
        n = t["iterations"]
        print(f"{name:<26}{t['tokens'] / t['seconds']:>8.1f}{t['tokens'] / t['seconds'] / plain:>9.3f}x"
              f"{1e3 * t['seconds'] / n:>8.2f}{1e3 * t['graph'] / n:>8.2f}{1e3 * (t['seconds'] - t['graph']) / n:>8.3f}")
    print(f"{'plain':<26}{plain:>8.1f}")
    print(f"outputs identical in every mode on every prompt: {identical}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
