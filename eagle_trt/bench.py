"""python -m eagle_trt.bench: speculative decoding against the plain decoding a user would
otherwise run, measured in one run on the same prompts, with the same flags on a CPU and a GPU.

    python -m eagle_trt.bench --workloads mtbench,humaneval,long-2k --prompts 20 --out bench/

On a CPU (the default there) it compares, per workload, all at temperature 0 (or all sampled:
--temperature, --top-p, --top-k, prompt i seeded with i):
- `transformers`: AutoModelForCausalLM.generate (KV cache, eager) on the same weights, on --device;
- `autoregressive`: one target-graph call per token (ONNX Runtime, same graphs and precision);
- `speculative`: the drafter-tree graph (int8 weights, as the build's Triton repository serves an
  fp32 drafter on ONNX Runtime; the exported fp32 graph with --drafter-weights float32) and the
  target graph's verification, composed into one graph called once per iteration (the iteration
  graph, export/iteration.py; --iteration-graph off calls the two in turn).
The tree is the fastest of a few candidate shapes on held-out MT-bench prompts (--tree auto),
since the best shape depends on how verification cost grows with tokens on the hardware.
Each prompt is decoded --repeats times (default 2) in both ONNX Runtime modes, the modes
alternating, and each mode's fastest run counts (runtime/timing.py: a slow spell of the machine
lands on one run, not on one mode). Reported: tokens/s, mean acceptance length, acceptance per depth, the time split of speculative
decoding (drafter graph, target graph, host work outside graph calls), peak RSS, and whether
the outputs of the three were identical.

On a GPU (--device cuda, or auto where there is one), or with --rows on a CPU (the GPU check's
dry run: the same rows, uncaptured), it measures rows instead (eagle_trt/bench_rows.py):
captured speculative decoding, one row per --tree shape, against captured plain decoding (the fair
plain baseline there), `transformers` compiled (StaticCache) and eager, and the graphs on ONNX
Runtime's CUDA and CPU providers; each prompt through every row in turn, --repeats times, each
row's fastest run counting; warm-up (compilation, capture) apart; the GPU's idle share of the
captured decode steps from CUDA events. The PyTorch engine on a CPU: `--rows captured-plain,
captured-speculative`.

--concurrency 1,2,4,8 adds `concurrency` to bench.json: on a CPU batched speculative, batched
autoregressive and per-request speculative serving of many streams on the graphs, on a GPU the
captured rows continuously batched (eagle_trt/concurrency.py). Prints tables, writes bench.json
(and PNG plots)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from . import concurrency
from .api import prepare_models
from .bench_rows import (DRAFTER_WEIGHTS, ORT_ROWS, ROWS, LoopRow, Transformers, drafter_graph,
                         iteration_graph, make_rows, peak_rss_gb, run, run_workload, summarize, sweep_label,
                         sweep_trees)
from .checkpoints import CheckpointError, cache_dir
from .config import ConfigError, SamplingConfig, TreeShape, parse_tree
from .devices import add_device_options, resolve_device, resolve_dtype, torch_dtype
from .export import export_pipeline
from .peers import PeerUnavailable
from .runtime import huge_pages
from .runtime.ort_engines import open_backends
from .runtime.static import StaticEngine
from .runtime.timing import OrtDecoding, decoding_threads, ort_threads
from .workloads import build

# --tree auto tries these: chains and small trees suit hardware where verifying more tokens
# costs noticeably more than one (a CPU), wider trees the memory-bound regime of a GPU.
TREE_CANDIDATES = "2,1,2;3,1,3;3,2,4;4,2,6;4,4,12;5,4,16"
# --tree auto on a target graph lossless for chains only (the fused 4-bit graph's int8 activations)
CHAIN_CANDIDATES = "2,1,2;3,1,3;4,1,4;5,1,5"


def _decoding(sampling: SamplingConfig | None) -> str:
    if sampling is None:
        return "temperature 0"
    return (f"sampled: temperature {sampling.temperature:g}, top-p {sampling.top_p:g}, top-k {sampling.top_k or 'off'}"
            f" (outputs differ between modes)")


def format_table(results: list[dict]) -> str:
    head = (f"{'workload':<10}{'ctx':>6}{'HF tok/s':>10}{'AR tok/s':>10}{'spec tok/s':>11}{'accept':>8}"
            f"{'vs AR':>7}{'vs HF':>7}{'drafter':>9}{'target':>8}{'1 call':>8}{'host':>7}{'same':>7}{'spec=AR':>8}")
    lines = [head, "-" * len(head)]
    for r in results:
        m, s = r["modes"], r["time_split"]
        lines.append(f"{r['workload']:<10}{r['prompt_tokens']:>6.0f}{m['transformers']['tokens_per_second']:>10.1f}"
                     f"{m['autoregressive']['tokens_per_second']:>10.1f}{m['speculative']['tokens_per_second']:>11.1f}"
                     f"{r['mean_accept_length']:>8.2f}{r['speedup_vs_autoregressive']:>6.2f}x"
                     f"{r['speedup_vs_transformers']:>6.2f}x{s['drafter_graph']:>9.1%}{s['target_graph']:>8.1%}"
                     f"{s.get('iteration_graph', 0.0):>8.1%}"
                     f"{s['host']:>7.1%}{_same(r['identical_outputs'], r['prompts'])}"
                     f"{_same(r.get('speculative_equals_autoregressive'), r['prompts']):>8}")
    head = (f"{'workload':<10}{'AR step':>9}{'draft':>8}{'verify':>8}{'1 call':>8}{'host':>7}{'iteration':>11}"
            f"{'break-even':>12}{'for 1.8x':>10}{'measured':>10}")
    lines += ["", "where the time goes (ms per call; '1 call': drafting and verification in the iteration graph, "
              "per iteration; accept lengths an iteration must reach):", head, "-" * len(head)]
    for r in results:
        c = r["cost"]
        lines.append(f"{r['workload']:<10}{c['autoregressive_step_ms']:>9.1f}{c['draft_call_ms']:>8.1f}"
                     f"{c['verify_call_ms']:>8.1f}{c['iteration_call_ms']:>8.1f}{c['host_ms_per_iteration']:>7.2f}"
                     f"{c['iteration_ms']:>11.1f}"
                     f"{c['break_even_accept_length']:>12.2f}{c['accept_length_for_1.8x']:>10.2f}"
                     f"{r['mean_accept_length']:>10.2f}")
    peers = [(r["workload"], label, row) for r in results for label, row in r.get("peers", {}).items()]
    if peers:
        lines += ["", "peers: plain decoding elsewhere on the same prompt ids and threads ('same': outputs identical "
                  "to the graphs' autoregressive decoding):"]
        lines += [f"{w:<10}{label:<18}{row['tokens_per_second']:>8.1f} tok/s   speculative {row['speculative_speedup']:.2f}x "
                  f"it, the graphs' plain decoding {row['autoregressive_ratio']:.2f}x it   same "
                  f"{row['identical_to_autoregressive']}/{next(r['prompts'] for r in results if r['workload'] == w)}"
                  for w, label, row in peers]
    return "\n".join(lines)


def _same(identical: int | None, prompts: int) -> str:
    """The 'same' column: identical outputs of prompts, or '-' where the modes sampled."""
    return f"{identical:>4}/{prompts:<2}" if identical is not None else f"{'-':>4}{'':<3}"


def plot(report: dict, out: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    results = report["results"]
    names = [r["workload"] for r in results]
    fig, ax = plt.subplots(figsize=(1.6 * len(names) + 3, 4))
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [r["speedup_vs_autoregressive"] for r in results], 0.4, label="vs autoregressive (same graphs)")
    ax.bar([i + 0.2 for i in x], [r["speedup_vs_transformers"] for r in results], 0.4, label="vs transformers generate")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(list(x), names)
    ax.set_ylabel("speculative speed-up")
    ax.set_title(f"{report['drafter_variant']} drafter, tree {tuple(report['tree'])}, {report['backend']}")
    ax.legend()
    fig.tight_layout()
    paths = [out / "speedup.png", out / "acceptance_per_depth.png"]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        ax.plot(range(1, len(r["accepted_at_least"]) + 1), r["accepted_at_least"], marker="o", label=r["workload"])
    ax.set_xlabel("draft depth d")
    ax.set_ylabel("share of verifications accepting >= d drafts")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)
    return paths


def format_rows(rows: list[dict], prompts: int) -> str:
    head = f"{'row':<38}{'tok/s':>9}{'vs best plain':>15}{'accept':>8}{'GPU idle':>10}{'same':>7}{'warm-up s':>11}"
    lines = [head, "-" * len(head)]
    for r in rows:
        if r["error"] is not None and r["tokens_per_second"] is None:
            lines.append(f"{r['row']:<38}  failed: {r['error'][:200]}")
            continue

        def fmt(value, spec: str, width: int, suffix: str = "") -> str:
            return (format(value, spec) + suffix if value is not None else "-").rjust(width)
        same = f"{r['identical_to_captured_plain']}/{prompts}" if r["identical_to_captured_plain"] is not None else "-"
        lines.append(f"{r['row']:<38}{fmt(r['tokens_per_second'], '.1f', 9)}{fmt(r['vs_fastest_plain'], '.2f', 15, 'x')}"
                     f"{fmt(r['mean_accept_length'], '.2f', 8)}{fmt(r['gpu_idle'], '.1%', 10)}{same:>7}"
                     f"{r['warmup_seconds']:>11.1f}")
        if "identical_to_cpu_provider" in r:
            lines[-1] += f"   same as cpu: {r['identical_to_cpu_provider']}/{prompts}"
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eagle_trt.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafter", default=None, help="drafter folder (default: the shipped one for smollm2)")
    p.add_argument("--onnx-dir", type=Path, default=None, help="graphs folder (exported there if missing)")
    p.add_argument("--build", type=Path, default=None, help="a python -m eagle_trt.build output folder: measure the "
                   "graphs its Triton repository serves (its tree, drafter weights and iteration graph), with its "
                   "target and drafter (what make demo reports) instead of exporting graphs")
    p.add_argument("--workloads", default="mtbench,humaneval,long-2k")
    p.add_argument("--prompts", type=int, default=20, help="prompts per workload (long context: at most 3)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--tree", default="auto", help="depth,top_k,total_tokens of the draft tree, several ';'-separated, "
                   "or 'auto' (--tree-candidates). Several: on a CPU the fastest on --sweep-prompts MT-bench prompts "
                   "not among the measured ones is measured; the rows measure each (a captured speculative row each; "
                   "the ONNX Runtime rows take the first)")
    p.add_argument("--tree-candidates", default=TREE_CANDIDATES, help="';'-separated shapes for --tree auto (by "
                   f"default {TREE_CANDIDATES}; on a target graph lossless for chains only, the fused 4-bit one, "
                   f"{CHAIN_CANDIDATES})")
    p.add_argument("--sweep-prompts", type=int, default=None, help="held-out prompts of the tree sweep (default 3; "
                   "the rows have no sweep)")
    p.add_argument("--repeats", type=int, default=2, help="runs per prompt of each mode (ONNX Runtime modes on a CPU, "
                   "rows on a GPU), alternating; the fastest counts")
    p.add_argument("--threads", type=int, default=0, help="torch and ONNX Runtime threads (0: all cores)")
    p.add_argument("--drafter-weights", choices=sorted(DRAFTER_WEIGHTS), default="int8",
                   help="the ONNX Runtime drafter graph's weights: int8 (the default, and what the build's Triton "
                        "repository serves: per-channel int8 MatMul weights, a quarter of the bytes a memory-bound "
                        "drafter call streams; the output stays the target's) or float32 (the exported graph)")
    p.add_argument("--target-weights", choices=("float32", "int4"), default="float32",
                   help="the ONNX Runtime target graph's weights: float32 (the exported graph) or int4 (4-bit "
                        "MatMulNBits blocks of 32, made by ONNX Runtime's quantizer: export/cpu_int4.py; plain and "
                        "speculative rows both run it, and 'same' compares them with each other, not transformers)")
    p.add_argument("--attention", choices=("portable", "fused"), default="portable",
                   help="the ONNX Runtime target graph's attention: portable (plain ONNX ops, what TensorRT parses) "
                        "or fused (each layer's attention one GroupQueryAttention, ONNX Runtime's CPU contrib "
                        "operator, the KV caches written in place: export/cpu_attention.py; the float32 or int4 "
                        "target; one stream)")
    add_device_options(p)
    p.add_argument("--iteration-graph", choices=("on", "off"), default="on",
                   help="ONNX Runtime speculative decoding with drafting and verification in one graph call (the "
                        "target and drafter graphs composed: export/iteration.py; the default), or the two graphs "
                        "called in turn (off). The tree sweep runs the two graphs")
    p.add_argument("--rows", default=None, help=f"comma-separated, of {', '.join(ROWS)} (default on a GPU: all); "
                   "given on a CPU, these rows instead of the CPU comparison (the GPU check's dry run)")
    p.add_argument("--capacity", type=int, default=0, help="rows per sequence of the PyTorch engine's static caches "
                   "and transformers' StaticCache (0: the longest prompt + --max-new-tokens + the rows an iteration "
                   "stages, rounded up to 256)")
    p.add_argument("--compile", action="store_true", help="the PyTorch engine's iterations torch.compile'd (inductor; "
                   "before capture on a GPU); compilation counts as warm-up")
    p.add_argument("--concurrency", default="", help="comma-separated stream counts (e.g. 1,2,4,8): batched and "
                   "per-request serving of --concurrency-prompts MT-bench prompts at each level (on a GPU the "
                   "captured rows batched; see eagle_trt/concurrency.py); with --workloads '' only this")
    p.add_argument("--concurrency-prompts", type=int, default=16)
    p.add_argument("--concurrency-repeats", type=int, default=3,
                   help="runs per level and mode, modes interleaved; tok/s is the median (runs differ by ~5%%)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="> 0: every mode samples (with --top-p, --top-k; prompt i seeded with i) instead of greedy "
                        "decoding; the modes' outputs then differ, each drawn from the same distribution")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0: off")
    p.add_argument("--peers", default="", help="llama.cpp: on a CPU, also llama.cpp's plain decoding of the same "
                   "weights (f32, and the GGUF the target came from) on the same prompts and threads (eagle_trt/peers.py; "
                   "install it with bash scripts/install_llama_cpp.sh)")
    p.add_argument("--out", type=Path, required=True, help="folder for bench.json and the plots")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        sampling = SamplingConfig(args.temperature, args.top_p, args.top_k).validate()
        sampling = None if sampling.greedy else sampling
        shapes = [parse_tree(t) for t in (args.tree_candidates if args.tree == "auto" else args.tree).split(";")
                  if t.strip()]
        names = [w.strip() for w in args.workloads.split(",") if w.strip()]
        levels = [int(c) for c in args.concurrency.split(",") if c.strip()] if args.concurrency else []
        if any(c < 1 for c in levels):
            raise ConfigError(f"--concurrency {args.concurrency}: stream counts must be >= 1")
        for flag in ("repeats", "concurrency_repeats"):
            if getattr(args, flag) < 1:
                raise ConfigError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be >= 1")
        if not names and not levels:
            raise ConfigError("nothing to measure: give --workloads or --concurrency")
        if args.attention == "fused" and args.build is not None:
            raise ConfigError("--attention fused: --build measures the graphs the build serves (serving.attention "
                              "chooses there); drop one")
        if args.attention == "fused" and args.concurrency:
            raise ConfigError("--attention fused: the fused-attention target graph verifies one sequence a call "
                              "(ONNX Runtime's GroupQueryAttention CPU kernel); measure --concurrency on the portable one")
        if args.peers not in ("", "llama.cpp"):
            raise ConfigError(f"--peers {args.peers!r}: the peer known is llama.cpp")
        if sampling is not None and levels:
            raise ConfigError(f"--concurrency measures greedy decoding (its rows compare outputs with one stream's): "
                              f"drop --temperature {args.temperature} or run it without --concurrency")
        built = served_build(args) if args.build is not None else None
        if built is not None and levels and built["attention"] == "fused":
            raise ConfigError(f"--concurrency: {args.build} serves the fused-attention target graph (serving.attention), "
                              f"which verifies one sequence a call; measure batches on a build that serves the portable one")
        if built is not None:
            shapes = [built["shape"]]
        if args.threads:
            torch.set_num_threads(args.threads)
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
        on_rows = device.type == "cuda" or args.rows is not None
        rows = [r.strip() for r in (args.rows or ",".join(ROWS)).split(",") if r.strip()]
        if args.peers:
            if on_rows:
                raise ConfigError("--peers llama.cpp: the peer rows are a CPU comparison (drop --rows / --device cuda)")
            from .peers import require_llama_cpp
            require_llama_cpp()
        if on_rows and args.sweep_prompts is not None:
            raise ConfigError("--sweep-prompts: the rows (a GPU, or --rows) have no tree sweep: every --tree shape "
                              "is a captured speculative row measured on the prompts themselves")
        cpu32 = (device.type, dtype) == ("cpu", "float32")      # the graphs come from fp32 CPU models
        f32 = prepare_models(args.target, args.drafter, "float32", sys.stderr, "cpu") \
            if cpu32 or not on_rows or any(r in ORT_ROWS for r in rows) else None
        models = f32 if cpu32 or not on_rows else \
            prepare_models(args.target, args.drafter, dtype, sys.stderr, device.type)     # the PyTorch engine's
        prompts = {w: build(models.tokenizer, w, min(args.prompts, 3) if w.startswith("long-") else args.prompts)
                   for w in names}
        sweep = build(models.tokenizer, "mtbench", args.prompts + (args.sweep_prompts or 3))[args.prompts:]
        held_out = build(models.tokenizer, "mtbench", args.concurrency_prompts + 8) if levels else []
        longest = max(map(len, sum(prompts.values(), []) + sweep + held_out)) + args.max_new_tokens
        stage = max(StaticEngine.staged_rows(s) for s in shapes)
        capacity = args.capacity or -(-(longest + stage) // 256) * 256
        folder = args.onnx_dir or cache_dir() / "onnx" / models.target.folder.name
        static = dict(max_batch=max(levels + [1]), capacity=capacity, compile=args.compile)
        if on_rows:
            measured = make_rows(rows, models, f32, shapes, dtype, folder, **static, drafter_weights=args.drafter_weights,
                                 iteration_graph=args.iteration_graph == "on")
    except (ConfigError, CheckpointError, FileNotFoundError, PeerUnavailable) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    held = (held_out[:args.concurrency_prompts], held_out[args.concurrency_prompts:])
    try:        # (a setting only the graphs can refuse: a branching tree on a target lossless for chains)
        if on_rows:
            report = _rows(args, models, measured, shapes, [p for w in names for p in prompts[w]], sweep[0], held,
                           levels, sampling, dtype, capacity)
        else:
            report = _compare(args, f32, folder, prompts, sweep, held, levels, sampling, shapes, device, dtype, built)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = args.out / "bench.json.tmp"
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, args.out / "bench.json")
    paths = plot(report, args.out) if report.get("results") else []
    if report["concurrency"]:
        tree = f"tree {tuple(report['tree'])}, " if "tree" in report else ""
        paths.append(concurrency.plot(report["concurrency"], args.out, f"{models.drafter.cfg.variant} drafter, {tree}"
                                      f"{report['backend']}"))
    for path in paths + [args.out / "bench.json"]:
        print(f"wrote {path}")
    return 0


def _rows(args, models, rows: list, shapes: list[TreeShape], prompts: list[list[int]], warm: list[int], held: tuple,
          levels: list[int], sampling: SamplingConfig | None, dtype: str, capacity: int) -> dict:
    """The rows (bench_rows.py) on the prompts of every workload, then the captured rows batched."""
    device = models.target.model.embed_tokens.weight.device
    name = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU ({os.cpu_count()} cores)"
    print(f"{len(prompts)} prompts x {args.max_new_tokens} tokens, {_decoding(sampling)}, {dtype} on {name}; "
          f"capacity {capacity}", file=sys.stderr)
    summary = summarize(run(rows, prompts, warm, args.max_new_tokens, args.repeats, sampling), sampling is not None)
    loops = {r.name: r.decoder for r, s in zip(rows, summary)
             if isinstance(r, LoopRow) and r.replayer is not None and s["error"] is None}
    concurrent = concurrency.measure_loops(loops, held[0], args.max_new_tokens, levels, held[1],
                                           repeats=args.concurrency_repeats) if levels else []
    print(f"\n{len(prompts)} prompts x {args.max_new_tokens} new tokens, {_decoding(sampling)}, {dtype} on {name}, "
          f"fastest of {args.repeats}; 'same' = outputs identical to captured plain decoding")
    print(format_rows(summary, len(prompts)))
    if concurrent:
        print(f"\ncaptured rows, continuously batched ({len(held[0])} MT-bench requests per level):")
        print(concurrency.format_table(concurrent))
    return {"device": name, "dtype": dtype, "torch": torch.__version__, "backend": f"PyTorch engine, {name}",
            "prompts": len(prompts), "workloads": args.workloads.split(","), "max_new_tokens": args.max_new_tokens,
            "capacity": capacity, "repeats": args.repeats, "sampling": asdict(sampling) if sampling else None,
            "trees": [[s.depth, s.top_k, s.total_tokens] for s in shapes], "rows": summary, "concurrency": concurrent}


def served_build(args) -> dict:
    """--build DIR: the graphs DIR's Triton repository serves on ONNX Runtime, its tree,
    precision and target graph's attention, and its target and drafter folders (set as --target /
    --drafter)."""
    from .build.triton import served_graphs
    out = Path(args.build)
    resolved_path, repository = out / "validate" / "resolved.json", out / "triton"
    settings_files = sorted(repository.glob("*/1/eagle.json"))
    if not resolved_path.is_file() or len(settings_files) != 1:
        raise ConfigError(f"--build {out}: not a python -m eagle_trt.build output with one Triton model "
                          f"(validate/resolved.json and triton/<model>/1/eagle.json)")
    settings = json.loads(settings_files[0].read_text())
    graphs = served_graphs(repository, settings_files[0].parent.parent.name)
    if graphs is None:
        raise ConfigError(f"--build {out}: its repository serves TensorRT engines, not ONNX graphs")
    resolved = json.loads(resolved_path.read_text())
    spec = resolved["target"]["spec"]          # "smollm2" keeps bench's peers (its shipped Q4_1 file)
    args.target = spec if spec == "smollm2" else resolved["target"]["folder"]
    args.drafter = resolved["drafter"]["folder"]
    if args.iteration_graph == "off":
        graphs.pop("iteration", None)
    attention = "fused" if graphs["target"].name.endswith(".fused.onnx") else "portable"   # serving.attention's
    return {"graphs": graphs, "shape": TreeShape(*settings["tree"]), "precision": settings["precision"],
            "attention": attention}


def _compare(args, f32, folder: Path, prompts: dict, sweep: list[list[int]], held: tuple, levels: list[int],
             sampling: SamplingConfig | None, shapes: list[TreeShape], device, dtype: str,
             built: dict | None = None) -> dict:
    """The CPU comparison (bench_rows.run_workload) per workload, after the tree sweep; then
    --concurrency on the same graphs. built: served_build's (the graphs of a build's repository)."""
    threads = ort_threads(args.threads or None)      # explicit, as every timed session (runtime/timing.py)
    precision = built["precision"] if built else None
    if built:
        target_graph = built["graphs"]["target"]
    else:
        target_name = {"float32": "target", "int4": "target_int4"}[args.target_weights] + \
            ("_fused" if args.attention == "fused" else "")
        target_graph = export_pipeline(f32, shapes[0], folder, log=sys.stderr, only=(target_name,))[target_name]
    target = open_backends({"target": target_graph}, None, f32.target.config.max_position_embeddings,
                           threads=threads, precision=precision).target
    if target.lossless_trees == "chains" and args.tree == "auto" and args.tree_candidates == TREE_CANDIDATES:
        # (a tree given is refused with the reason, by open_backends)
        shapes = [parse_tree(t) for t in CHAIN_CANDIDATES.split(";")]
    tree_sweep = []
    if len(shapes) > 1:
        print(f"tree sweep on {len(sweep)} held-out MT-bench prompts, shapes taking turns, fastest of "
              f"{args.repeats} per prompt:", file=sys.stderr)
        tree_sweep = sweep_trees(f32, shapes, folder, target, sweep, min(args.max_new_tokens, 64), threads,
                                 args.drafter_weights, args.repeats)
    shape = TreeShape(*tree_sweep[0]["tree"]) if tree_sweep else shapes[0]
    eos, vocab = f32.eos_ids, f32.target.config.vocab_size
    if built:
        served = built["graphs"]
    else:
        served = {"target": target_graph, "drafter_tree": drafter_graph(f32, shape, folder, args.drafter_weights)}
        if args.iteration_graph == "on":
            served["iteration"] = iteration_graph(f32, shape, folder, target_graph, args.drafter_weights)
    ort = OrtDecoding.open(served, shape, f32.target.config.max_position_embeddings, eos, vocab, threads,
                           target=target, precision=precision)
    hf = Transformers("transformers", f32.target.folder, device, torch_dtype(dtype), eos) if prompts else None
    warm = sweep[0]                                  # first-call allocations stay out of the numbers
    ort.warm_up(warm)
    if hf is not None:
        hf.generate(warm, 8)
    peers = ()
    if args.peers:
        from .checkpoints import smollm2_gguf
        from .peers import llama_cpp_peers
        source = smollm2_gguf() if args.target == "smollm2" else Path(args.target) if args.target.endswith(".gguf") \
            else None
        longest = max(map(len, sum(prompts.values(), []) + [warm])) + args.max_new_tokens
        peers = llama_cpp_peers(f32.target.folder, source, threads, -(-longest // 256) * 256, eos)
        for peer in peers:
            peer.generate(warm, 8)
    results = [run_workload(w, ids, hf, ort, args.max_new_tokens, shape.depth, args.repeats, sampling, peers)
               for w, ids in prompts.items()]
    concurrent = []
    if levels:
        print(f"concurrency {levels} on {args.concurrency_prompts} MT-bench prompts:", file=sys.stderr)
        with decoding_threads():
            concurrent = concurrency.measure(target, ort.backends.drafter, eos, vocab, held[0], args.max_new_tokens,
                                             levels, warm=held[1], repeats=args.concurrency_repeats,
                                             plain_target=ort.plain, iteration=ort.backends.iteration)
    report = {"target": str(f32.target.folder), "drafter": f32.drafter_source,
              "drafter_variant": f32.drafter.cfg.variant, "backend": "onnxruntime (CPU, fp32)",
              "drafter_weights": built["precision"].get("drafter_tree") if built else args.drafter_weights,
              "target_weights": built["precision"].get("target") if built else args.target_weights,
              "attention": built["attention"] if built else args.attention,
              "build": str(args.build) if built else None,
              "iteration_graph": ort.backends.iteration is not None,
              "transformers_device": f"{device.type} {dtype}",
              "tree": [shape.depth, shape.top_k, shape.total_tokens],
              "max_new_tokens": args.max_new_tokens, "sampling": asdict(sampling) if sampling else None,
              "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "tree_sweep": tree_sweep,
              "results": results, "concurrency": concurrent, "huge_pages": huge_pages.summary()}
    fused = ", fused attention" if report["attention"] == "fused" else ""
    print(f"\n{report['target_weights']} target{fused}, {report['drafter_variant']} drafter ({report['drafter_weights']} weights"
          f"{', one call an iteration' if ort.backends.iteration is not None else ''}), tree {tuple(report['tree'])}, "
          f"{args.max_new_tokens} new tokens, "
          f"{_decoding(sampling)}, {report['threads']} threads; 'same' = prompts where all three outputs are identical")
    if results:
        print(format_table(results))
    if concurrent:
        print(f"\nconcurrent streams ({args.concurrency_prompts} MT-bench requests per level; ms/tok = per-request time "
              f"per output token after the first; TTFT includes queueing):")
        print(concurrency.format_table(concurrent))
    if tree_sweep:
        print("tree sweep (held-out MT-bench prompts, speculative tok/s): " + ", ".join(
            f"{sweep_label(r)} {r['tokens_per_second']:.1f} (accept {r['mean_accept_length']:.2f})" for r in tree_sweep))
    print(f"peak RSS {peak_rss_gb():.2f} GB; {report['huge_pages']}")
    return report


if __name__ == "__main__":
    sys.exit(main())
