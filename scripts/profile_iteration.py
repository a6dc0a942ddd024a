"""Where the host time of a speculative iteration goes: the ONNX Runtime loop on the exported
graphs, under cProfile, on MT-bench prompts; batch 1, or `--streams N`: N sequences at a time,
continuously batched with the cost model (`bench --concurrency`'s speculative-batched mode,
after the same warm-up on held-out prompts).

    python scripts/profile_iteration.py [--tree 3,2,4] [--prompts 4] [--max-new-tokens 64] [--threads 2]
                                        [--iteration-graph]   (one call an iteration)
    python scripts/profile_iteration.py --streams 8 --prompts 16 [--runs 3]
    python scripts/profile_iteration.py --streams 8 --prompts 16 --iteration-graph --nodes 2 --subtree-calls alternate --runs 6
    python scripts/profile_iteration.py --iteration-graph --temperature 0.7 --top-p 0.9 [--top-k 50]   (sampled)

Prints host ms per iteration (wall time minus time inside graph calls, measured without the
profiler), then the host time of each step of the loop (timers around its methods), then the
functions that take the most host time under cProfile (graph calls excluded). The timers and
the profiler inflate their own tables, not the first number."""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from eagle_trt.api import prepare_models, real_prompt_ids
from eagle_trt.checkpoints import cache_dir
from eagle_trt.config import SamplingConfig, parse_tree
from eagle_trt.export import export_pipeline
from eagle_trt.runtime.backend import DrafterBackend
from eagle_trt.runtime.cost import CostModel
from eagle_trt.runtime.kv_cache import KVCache
from eagle_trt.runtime.loop import DecodingLoop, Request, Sequence
from eagle_trt.runtime.onnxruntime_backend import OrtIteration, OrtTarget
from eagle_trt.runtime.timing import OrtDecoding, decoding_threads, graph_seconds
from eagle_trt.runtime.two_call import IterationEngine, TwoCallEngine


def run(ort: OrtDecoding, prompts: list[list[int]], max_new_tokens: int, batched: DecodingLoop | None = None,
        streams: int = 1, sampling: SamplingConfig | None = None) -> tuple[float, float, int]:
    """(wall seconds, seconds inside graph calls, iterations) of speculative decoding over the
    prompts: one at a time, or `streams` at a time through `batched`; greedy, or sampled with
    `sampling` (prompt i seeded with i)."""
    settings = [replace(sampling, seed=i) if sampling else SamplingConfig() for i in range(len(prompts))]
    graph0 = graph_seconds(*ort.sessions.values())
    start, iterations = time.perf_counter(), 0
    if batched is not None:
        batched.verified.clear()
        with decoding_threads():
            batched.generate_batch([Request(ids, max_new_tokens, how) for ids, how in zip(prompts, settings)], streams)
        iterations = len(batched.verified)
    else:
        for ids, how in zip(prompts, settings):
            iterations += ort.speculative(ids, max_new_tokens, how).drafter_calls
    wall = time.perf_counter() - start
    return wall, graph_seconds(*ort.sessions.values()) - graph0, iterations


# (class, method, label): the loop's steps whose host time (wall minus graph time inside) is
# reported; nested labels are parts of the one above them
PHASES = [(DecodingLoop, "step", "step (one iteration)"),
          (TwoCallEngine, "_draft", "  drafting: batch the new rows, drafter call"),
          (IterationEngine, "_draft", "  drafting in the iteration graph: batch the new rows, the call"),
          (DrafterBackend, "draft", "    drafter backend: stage, bind, outputs, KV commit"),
          (OrtIteration, "run", "    both in one call (iteration graph): stage, bind, outputs, drafter KV commit"),
          (OrtTarget, "verify", "  verification (acceptance in the graph): inputs, bind, outputs"),
          (KVCache, "commit", "  KV commits: accepted rows copied into place (the drafter's inside drafting)"),
          (Sequence, "extend", "  streaming and stop checks"),
          (DecodingLoop, "add", "joins, outside the step: checks, prefill, first token")]


@contextmanager
def phase_timers(ort: OrtDecoding):
    """Wrap the PHASES methods to add up their host time; yields label -> seconds."""
    spent = {label: 0.0 for _, _, label in PHASES}
    saved = [(cls, name, cls.__dict__[name]) for cls, name, _ in PHASES]

    def timed(method, label):
        def call(*args, **kwargs):
            start, graph = time.perf_counter(), graph_seconds(*ort.sessions.values())
            try:
                return method(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter() - start - (graph_seconds(*ort.sessions.values()) - graph)
        return call
    for cls, name, label in PHASES:
        setattr(cls, name, timed(cls.__dict__[name], label))
    try:
        yield spent
    finally:
        for cls, name, method in saved:
            setattr(cls, name, method)


def fixed_nodes(n: int) -> type[CostModel]:
    """A cost model that verifies n nodes every iteration, once warm (--nodes)."""
    class Fixed(CostModel):
        def choose(self, batch: int, backlog: int = 0, remaining: int | None = None) -> int:
            return self.nodes if self.warming_up else n
    return Fixed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafter", default=None)
    p.add_argument("--tree", default="3,2,4", help="depth,top_k,total_tokens")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="ONNX Runtime threads per session")
    p.add_argument("--streams", type=int, default=1, help="sequences decoded at a time (> 1: batched, with the cost model)")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--cumulative", action="store_true", help="the profiler's table by time including callees")
    p.add_argument("--iteration-graph", action="store_true", help="drafting and verification in one graph call "
                   "(export/iteration.py) for every iteration that drafts, as the Triton model runs it")
    p.add_argument("--no-handoff", action="store_true", help="with --iteration-graph: copy the drafter's inputs "
                   "in on the host every call instead of taking the last call's hand-off in place (an A/B)")
    p.add_argument("--nodes", type=int, default=None, help="with --streams: verify this many of each tree's best "
                   "nodes every iteration instead of the cost model's choice (0: plain decoding)")
    p.add_argument("--subtree-calls", choices=["one", "two", "alternate"], default="one",
                   help="with --iteration-graph: verify subtrees in the iteration graph's one call (verify_nodes), "
                   "in two calls as graphs before format 3 did, or alternate the two run by run (an A/B)")
    p.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled decoding (with --top-p, --top-k)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--runs", type=int, default=1, help="measured runs before the tables, each reported: the first "
                   "after the warm-up can pay for growing the KV storages (fresh memory faults in page by page)")
    args = p.parse_args(argv)
    sampling = None if args.temperature == 0 else SamplingConfig(args.temperature, args.top_p, args.top_k).validate()
    shape = parse_tree(args.tree)
    models = prepare_models(args.target, args.drafter, log=sys.stderr)
    folder = cache_dir() / "profile" / models.target.folder.name / f"{shape.depth}-{shape.top_k}-{shape.total_tokens}"
    graphs = export_pipeline(models, shape, folder, log=sys.stderr,
                             only=("target", "drafter_tree") + (("iteration",) if args.iteration_graph else ()))
    held_out = 2 * args.streams if args.streams > 1 else 1
    prompts = real_prompt_ids(models, args.prompts + held_out)
    ort = OrtDecoding.open(graphs, shape, models.target.config.max_position_embeddings, models.eos_ids,
                           models.target.config.vocab_size, threads=args.threads)
    if ort.backends.iteration is not None:
        ort.backends.iteration.handoff = ort.backends.iteration.has_handoff and not args.no_handoff
        one_call = ort.backends.iteration.any_nodes

        def subtree_calls(k: int) -> str:   # run k's way of verifying subtrees
            way = args.subtree_calls if args.subtree_calls != "alternate" else ("one", "two")[k % 2]
            ort.backends.iteration.any_nodes = one_call and way == "one"
            return f", subtrees in {way} call{'s' if way == 'two' else ''}"
    ort.warm_up(prompts[0])
    batched = None
    if args.streams > 1:   # warmed up as bench --concurrency does: the cost model's first timings stay out
        model = (CostModel if args.nodes is None else fixed_nodes(args.nodes))(shape.total_tokens,
                                                                              shape.top_k * (shape.depth - 1))
        engine = IterationEngine(ort.backends.iteration, model) if ort.backends.iteration else TwoCallEngine(ort.backends.target, ort.backends.drafter, model)
        batched = DecodingLoop(engine, models.eos_ids, models.target.config.vocab_size)
        run(ort, prompts[:held_out], min(32, args.max_new_tokens), batched, args.streams, sampling)
    measured = prompts[held_out:]
    sessions = ort.sessions
    made = [(b.made, b.rebound) for b in (s.bindings for s in sessions.values())]
    counted, calls = 0, ort.backends.iteration and (ort.backends.iteration.graph_calls, ort.backends.iteration.handoffs)
    for k in range(args.runs):
        way = subtree_calls(k) if ort.backends.iteration is not None else ""
        wall, graph, iterations = run(ort, measured, args.max_new_tokens, batched, args.streams, sampling)
        if batched is not None:
            print(f"{args.streams} streams, draft nodes verified per sequence and iteration "
                  f"{sum(batched.verified) / len(batched.verified):.2f} "
                  f"({'the cost model' if args.nodes is None else '--nodes'}'s choice{way})")
        print(f"{f'run {k + 1}: ' if args.runs > 1 else ''}tree ({shape.depth}, {shape.top_k}, {shape.total_tokens}): "
              f"{iterations} iterations, {1e3 * wall / iterations:.2f} ms each, of which graph calls "
              f"{1e3 * graph / iterations:.2f} ms and host work {1e3 * (wall - graph) / iterations:.2f} ms", flush=True)
        counted += iterations
    if ort.backends.iteration is not None:
        print(f"iteration graph calls taking the last call's hand-off in place: {ort.backends.iteration.handoffs - calls[1]} "
              f"of {ort.backends.iteration.graph_calls - calls[0]}")
    made = [(b.made - m, b.rebound - r) for b, (m, r) in zip((s.bindings for s in sessions.values()), made)]
    print("ONNX Runtime bindings per iteration (made new / past bound again): " + ", ".join(
        f"{role.removesuffix('_graph')} {m / counted:.2f} / {r / counted:.2f}" for role, (m, r) in zip(sessions, made)))
    with phase_timers(ort) as spent:
        run(ort, measured, args.max_new_tokens, batched, args.streams, sampling)
    print("\nhost time by step of the loop (ms per iteration; the timers add a little of their own):")
    for label, seconds in spent.items():
        print(f"  {label:62s} {1e3 * seconds / iterations:6.3f}")
    profiler = cProfile.Profile()
    profiler.enable()
    run(ort, measured, args.max_new_tokens, batched, args.streams, sampling)
    profiler.disable()
    rows = sorted(((ct if args.cumulative else tt, calls, f"{Path(file).name}:{line}({name})")
                   for (file, line, name), (_, calls, tt, ct, _) in pstats.Stats(profiler).stats.items()
                   if "run_with_iobinding" not in name), reverse=True)        # graph calls excluded
    print("\nhost time by function, under the profiler (" + ("callees included, graph calls too" if args.cumulative
          else "its own time, callees excluded") + "; torch ops called\nthrough operators and indexing count in the caller):")
    print(f"  {'us/iteration':>12s} {'calls/iteration':>15s}  function")
    for tt, calls, name in rows[:args.top]:
        print(f"  {1e6 * tt / iterations:12.1f} {calls / iterations:15.2f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
