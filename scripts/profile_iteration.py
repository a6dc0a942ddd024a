"""Where the host time of a speculative iteration goes: the ONNX Runtime loop on the exported
graphs, batch 1, under cProfile, on MT-bench prompts.

    python scripts/profile_iteration.py [--tree 3,2,4] [--prompts 4] [--max-new-tokens 64] [--threads 2]

Prints host ms per iteration (wall time minus time inside graph calls, measured without the
profiler) and the functions that take the most host time with it on (graph calls excluded).
The profiler's own overhead inflates the second table, not the first number."""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

from eagle_trt.api import prepare_models, real_prompt_ids
from eagle_trt.bench import parse_tree
from eagle_trt.checkpoints import cache_dir
from eagle_trt.export import export_pipeline
from eagle_trt.runtime.timing import OrtDecoding, graph_seconds


def run(ort: OrtDecoding, prompts: list[list[int]], max_new_tokens: int) -> tuple[float, float, int]:
    """(wall seconds, seconds inside graph calls, iterations) of speculative decoding over the prompts."""
    graph0 = graph_seconds(ort.target, ort.drafter)
    start, iterations = time.perf_counter(), 0
    for ids in prompts:
        iterations += ort.speculative(ids, max_new_tokens).drafter_calls
    wall = time.perf_counter() - start
    return wall, graph_seconds(ort.target, ort.drafter) - graph0, iterations


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafter", default=None)
    p.add_argument("--tree", default="3,2,4", help="depth,top_k,total_tokens")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="ONNX Runtime threads per session")
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args(argv)
    shape = parse_tree(args.tree)
    models = prepare_models(args.target, args.drafter, log=sys.stderr)
    folder = cache_dir() / "profile" / models.target.folder.name / f"{shape.depth}-{shape.top_k}-{shape.total_tokens}"
    graphs = export_pipeline(models, shape, folder, log=sys.stderr, only=("target", "drafter_tree", "accept_greedy"))
    prompts = real_prompt_ids(models, args.prompts + 1)
    ort = OrtDecoding.open(graphs["target"], graphs["drafter_tree"], shape,
                           models.target.config.max_position_embeddings, models.eos_ids,
                           models.target.config.vocab_size, threads=args.threads,
                           accept_graph=graphs["accept_greedy"])
    ort.warm_up(prompts[0])
    wall, graph, iterations = run(ort, prompts[1:], args.max_new_tokens)
    print(f"tree ({shape.depth}, {shape.top_k}, {shape.total_tokens}): {iterations} iterations, {1e3 * wall / iterations:.2f} ms each, of which "
          f"graph calls {1e3 * graph / iterations:.2f} ms and host work {1e3 * (wall - graph) / iterations:.2f} ms")
    profiler = cProfile.Profile()
    profiler.enable()
    run(ort, prompts[1:], args.max_new_tokens)
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out).sort_stats("tottime")
    stats.print_stats(args.top + 2)
    lines = [ln for ln in out.getvalue().splitlines() if "run_with_iobinding" not in ln]
    print("\nhost time by function, under the profiler (ms per iteration = tottime * 1000 / iterations):")
    print("\n".join(lines[lines.index(next(ln for ln in lines if ln.strip().startswith("ncalls"))):]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
