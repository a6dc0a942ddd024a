"""Throughput and latency under concurrent streams (`python -m eagle_trt.bench --concurrency 1,2,4,8`).

At each level c, every prompt is a request, all submitted at once, with at most c decoded at a
time (a finished stream's slot goes to the next request). Three ways to serve them:
- `speculative-batched`: one continuously batched speculative decoding loop (runtime/loop.py) with
  the cost model choosing how many draft tokens each iteration verifies;
- `autoregressive-batched`: the same loop without a drafter (one token per sequence per call);
- `speculative-per-request`: c threads, each running its own batch-1 speculative decoder on the
  shared sessions (how the Triton model served requests before continuous batching).
On a GPU (or with bench --rows) the modes are bench's captured rows instead (`measure_loops`:
the PyTorch engine, plain and speculative, each batched at every level).
Per level and mode: total tokens/s (all streams together, wall clock; the median of `repeats`
interleaved runs, since identical runs differ by ~5% on a shared CPU), per-request time per
output token after the first (p50 / p99 over requests), time to first token (p50 / p99, queueing
included), draft nodes verified per sequence and iteration (what the cost model chose; 0 =
plain decoding), host milliseconds per iteration in the batched modes (wall time outside graph
calls, per decoder iteration), and whether every stream's tokens equal its own batch-1 run (greedy)."""
from __future__ import annotations

import copy
import statistics
import sys
import threading
import time
from pathlib import Path

from .runtime.cost import CostModel
from .runtime.loop import DecodingLoop, GenerationResult, Request
from .runtime.timing import graph_seconds
from .runtime.two_call import IterationEngine, TwoCallEngine

MODES = ("speculative-batched", "autoregressive-batched", "speculative-per-request")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def per_request_threads(target, drafter, eos, vocab_size, prompts, max_new_tokens, streams) -> list[GenerationResult]:
    """`streams` threads, each with its own batch-1 decoder (own caches, shared graph sessions)."""
    results: list[GenerationResult | None] = [None] * len(prompts)
    todo = list(range(len(prompts)))
    lock = threading.Lock()
    start = time.perf_counter()

    def worker():
        decoder = DecodingLoop(TwoCallEngine(copy.copy(target), copy.copy(drafter)), eos, vocab_size)
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop(0)
            waited = time.perf_counter() - start
            r = decoder.generate(prompts[i], max_new_tokens)
            r.token_times = [t + waited for t in r.token_times]   # from submission, like the batched modes
            results[i] = r
    threads = [threading.Thread(target=worker) for _ in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def run_level(mode: str, streams: int, target, drafter, eos, vocab_size, prompts, max_new_tokens,
              warm: list[list[int]], plain_target=None, iteration=None
              ) -> tuple[list[GenerationResult], float | None, float, float | None]:
    """The results, the mean draft nodes verified per iteration (None: per-request mode), the
    seconds of the timed run and the host milliseconds per iteration (wall time outside graph
    calls; None in per-request mode, whose threads overlap). A batched decoder first decodes `warm` (held-out prompts,
    as many tokens as the measured requests up to 32, same batch size), as a server that has been running would
    have: the cost model's warm-up verifications and its first timings stay out of the measurement. plain_target: the
    session plain decoding runs on (its fastest setting, runtime/timing.py); default `target`.
    iteration: the batched speculative decoder's iteration graph over `target` and `drafter`
    (OrtIteration), as the Triton model runs it."""
    if mode == "speculative-per-request":
        start = time.perf_counter()
        results = per_request_threads(target, drafter, eos, vocab_size, prompts, max_new_tokens, streams)
        return results, None, time.perf_counter() - start, None
    shape = drafter.shape
    if mode == "speculative-batched":
        cost = CostModel(shape.total_tokens, shape.top_k * (shape.depth - 1))
        engine = IterationEngine(iteration, cost) if iteration is not None else TwoCallEngine(target, drafter, cost)
    else:
        engine = TwoCallEngine(plain_target or target)
    return batched(DecodingLoop(engine, eos, vocab_size), streams, prompts, max_new_tokens, warm)


def batched(decoder: DecodingLoop, streams: int, prompts, max_new_tokens, warm: list[list[int]]
            ) -> tuple[list[GenerationResult], float, float, float | None]:
    """The prompts through `decoder`, `streams` at a time, after `warm` (see run_level); host
    milliseconds per iteration where its engine's backends count their graph seconds."""
    backends = decoder.engine.backends
    decoder.generate_batch([Request(p, min(32, max_new_tokens)) for p in warm], max_batch=streams)
    decoder.verified.clear()
    graph0, start = graph_seconds(*backends) if backends else None, time.perf_counter()
    results = decoder.generate_batch([Request(p, max_new_tokens) for p in prompts], max_batch=streams)
    seconds = time.perf_counter() - start
    host = None if graph0 is None else 1e3 * (seconds - graph_seconds(*backends) + graph0) / len(decoder.verified)
    return results, statistics.fmean(decoder.verified), seconds, host


def measure(target, drafter, eos, vocab_size, prompts: list[list[int]], max_new_tokens: int, levels: list[int],
            warm: list[list[int]], log=None, repeats: int = 1, plain_target=None, iteration=None) -> list[dict]:
    """repeats > 1: every (level, mode) runs that many times, the modes' order rotating per
    repeat so drift in the machine's speed falls on each alike; tokens/s is the median run's,
    latencies are pooled over the runs. iteration: see run_level."""
    solo_decoder = DecodingLoop(TwoCallEngine(target, drafter), eos, vocab_size)
    solo = [solo_decoder.generate(p, max_new_tokens).tokens for p in prompts]

    def mode(name):
        return lambda streams, warm_: run_level(name, streams, target, drafter, eos, vocab_size, prompts,
                                                max_new_tokens, warm_, plain_target, iteration)
    return measure_modes({m: (mode(m), solo) for m in MODES}, levels, warm, log, repeats, drafter.shape.total_tokens)


def measure_loops(decoders: dict[str, DecodingLoop], prompts: list[list[int]], max_new_tokens: int,
                  levels: list[int], warm: list[list[int]], log=None, repeats: int = 1) -> list[dict]:
    """The same for decoding loops made elsewhere (bench's captured rows), each batched at every
    level and compared with its own batch-1 outputs."""
    return measure_modes({name: (lambda streams, warm_, d=d: batched(d, streams, prompts, max_new_tokens, warm_),
                                 [d.generate(p, max_new_tokens).tokens for p in prompts])
                          for name, d in decoders.items()}, levels, warm, log, repeats, 0)


def measure_modes(modes: dict, levels: list[int], warm: list[list[int]], log, repeats: int, nodes_per_tree: int
                  ) -> list[dict]:
    """modes: name -> (run(streams, warm prompts) as run_level returns, its batch-1 outputs)."""
    log = log or sys.stderr   # looked up per call: a default bound at import time may be a closed stream
    names, rows = list(modes), []
    for streams in levels:
        runs: dict[str, list] = {mode: [] for mode in names}
        for r in range(repeats):
            for mode in names[r % len(names):] + names[:r % len(names)]:
                results, nodes, seconds, host = modes[mode][0](streams, [warm[i % len(warm)] for i in range(2 * streams)])
                runs[mode].append((results, nodes, seconds, host))
                print(f"  {streams} stream(s), {mode}, run {r + 1}/{repeats}: "
                      f"{sum(len(x.tokens) for x in results) / seconds:.1f} tok/s"
                      + ("" if host is None else f", host {host:.2f} ms an iteration"), file=log, flush=True)
        for mode in names:
            rows.append(_row(streams, mode, runs[mode], modes[mode][1], nodes_per_tree))
            row = rows[-1]
            print(f"  {streams} stream(s), {mode}: {row['tokens_per_second']:.1f} tok/s (median of {repeats}), accept "
                  f"{row['mean_accept_length']:.2f}, p50 {row['p50_token_latency_ms']:.0f} ms/token, identical "
                  f"{row['identical_to_solo']}", file=log, flush=True)
    base = next((r["tokens_per_second"] for r in rows if r["streams"] == levels[0] and r["mode"] == names[0]), None)
    for r in rows:
        r["vs_one_stream"] = r["tokens_per_second"] / base if base else None
    return rows


def _row(streams: int, mode: str, runs: list, solo: list[list[int]], nodes_per_tree: int) -> dict:
    results = [x for rs, *_ in runs for x in rs]
    rates = [sum(len(x.tokens) for x in rs) / seconds for rs, _, seconds, _ in runs]
    hosts = [h for *_, h in runs if h is not None]
    per_token = [1e3 * (x.token_times[-1] - x.token_times[0]) / (len(x.tokens) - 1) for x in results if len(x.tokens) > 1]
    first = [1e3 * x.token_times[0] for x in results if x.token_times]
    nodes = [n for _, n, _, _ in runs if n is not None]
    return {"streams": streams, "mode": mode, "requests": len(solo), "tokens": sum(len(x.tokens) for x in runs[0][0]),
            "seconds": round(statistics.median(s for _, _, s, _ in runs), 3),
            "host_ms_per_iteration": statistics.median(hosts) if hosts else None, "host_ms_per_iteration_runs": hosts,
            "tokens_per_second": statistics.median(rates), "tokens_per_second_runs": list(rates),
            "p50_token_latency_ms": percentile(per_token, 50), "p99_token_latency_ms": percentile(per_token, 99),
            "p50_first_token_ms": percentile(first, 50), "p99_first_token_ms": percentile(first, 99),
            "mean_accept_length": statistics.fmean(a for x in results for a in x.accept_lengths or [1]),
            "mean_draft_nodes_verified": statistics.fmean(nodes) if nodes else nodes_per_tree,
            "identical_to_solo": all(x.tokens == s for rs, *_ in runs for x, s in zip(rs, solo))}


def format_table(rows: list[dict]) -> str:
    head = (f"{'streams':>7}  {'mode':<28}{'tok/s':>8}{'runs':>13}{'vs 1':>7}{'accept':>8}{'nodes':>7}{'host ms':>9}"
            f"{'p50 ms/tok':>12}{'p99 ms/tok':>12}{'p50 TTFT':>10}{'p99 TTFT':>10}{'same':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        spread = f"{min(r['tokens_per_second_runs']):.0f}-{max(r['tokens_per_second_runs']):.0f}"
        lines.append(f"{r['streams']:>7}  {r['mode']:<28}{r['tokens_per_second']:>8.1f}{spread:>13}{r['vs_one_stream']:>6.2f}x"
                     f"{r['mean_accept_length']:>8.2f}{r['mean_draft_nodes_verified']:>7.2f}"
                     f"{'-' if r['host_ms_per_iteration'] is None else format(r['host_ms_per_iteration'], '.2f'):>9}"
                     f"{r['p50_token_latency_ms']:>12.1f}{r['p99_token_latency_ms']:>12.1f}"
                     f"{r['p50_first_token_ms']:>10.0f}{r['p99_first_token_ms']:>10.0f}"
                     f"{'yes' if r['identical_to_solo'] else 'NO':>6}")
    return "\n".join(lines)


def plot(rows: list[dict], out: Path, title: str) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        pts = [(r["streams"], r["tokens_per_second"]) for r in rows if r["mode"] == mode]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("total tokens/s")
    ax.set_xscale("log", base=2)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = out / "concurrency.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
