"""python -m eagle_trt.bench: speculative vs autoregressive decoding on the compiled graphs, and
`transformers` generate as the baseline a user would otherwise pick, measured in one run.

    python -m eagle_trt.bench --workloads mtbench,humaneval,long-2k --prompts 20 --out bench/

Per workload, all at temperature 0 (or all sampled: --temperature, --top-p, --top-k) on the same
prompts and the same machine:
- `transformers`: AutoModelForCausalLM.generate (greedy, KV cache) on the same weights, on --device;
- `autoregressive`: one target-graph call per token (ONNX Runtime, same graphs and precision);
- `speculative`: the drafter-tree graph (int8 weights, as the build's Triton repository serves an
  fp32 drafter on ONNX Runtime; the exported fp32 graph with --drafter-weights float32) and the
  target graph's verification, composed into one graph called once per iteration (the iteration
  graph, export/iteration.py; --iteration-graph off calls the two in turn);
- `torch-autoregressive` / `torch-speculative` (with --torch-row): the same loops on the PyTorch
  backend, tree as above.
On a GPU (--device cuda, or auto where there is one) the bench is eagle_trt/device_bench.py:
captured speculative and plain decoding against transformers compiled and eager, and the graphs on
ONNX Runtime's CUDA provider.
The tree is the fastest of a few candidate shapes on held-out MT-bench prompts (--tree auto),
since the best shape depends on how verification cost grows with tokens on the hardware.
Each prompt is decoded --repeats times (default 2) in both ONNX Runtime modes, the modes
alternating, and each mode's fastest run counts (runtime/timing.py: a slow spell of the machine
lands on one run, not on one mode). Reported: tokens/s, mean acceptance length, acceptance per depth, the time split of speculative
decoding (drafter graph, target graph, host work outside graph calls), peak RSS, and whether
the outputs of the three were identical. Prints a table, writes bench.json and two PNG plots.

--concurrency 1,2,4,8 adds `concurrency` to bench.json: batched speculative, batched
autoregressive and per-request speculative serving of many streams (eagle_trt/concurrency.py)."""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from . import concurrency
from .api import prepare_models
from .checkpoints import CheckpointError, cache_dir
from .config import ConfigError, SamplingConfig, TreeShape, parse_tree
from .devices import add_device_options, resolve_device, resolve_dtype, torch_dtype
from .evaluate import depth_rates
from .export import export_pipeline
from .runtime.cost import NodeTrim
from .runtime.loop import DecodingLoop
from .runtime.onnxruntime_backend import OrtTarget
from .runtime.ort_engines import open_backends
from .runtime.static import StaticEngine
from .runtime.timing import OrtDecoding, decoding_threads, ort_threads
from .workloads import build

MODES = ("transformers", "autoregressive", "speculative")
TORCH_MODES = ("torch-autoregressive", "torch-speculative")
# --tree auto tries these: chains and small trees suit hardware where verifying more tokens
# costs noticeably more than one (a CPU), wider trees the memory-bound regime of a GPU.
TREE_CANDIDATES = "2,1,2;3,1,3;3,2,4;4,2,6;4,4,12;5,4,16"


DRAFTER_WEIGHTS = {"float32": "drafter_tree", "int8": "drafter_tree_int8"}
ITERATION_WEIGHTS = {"float32": "iteration", "int8": "iteration_int8"}


def _tree_graph(models, shape: TreeShape, folder: Path, name: str, target_graph: Path | None = None) -> Path:
    sub = folder / "trees" / f"{shape.depth}-{shape.top_k}-{shape.total_tokens}"
    return export_pipeline(models, shape, sub, log=sys.stderr, only=(name,), target_graph=target_graph)[name]


def drafter_graph(models, shape: TreeShape, folder: Path, weights: str = "float32") -> Path:
    """The drafter-tree graph for `shape` with fp32 or int8 weights (export/cpu_int8.py), one
    folder per shape (exported once, then reused)."""
    return _tree_graph(models, shape, folder, DRAFTER_WEIGHTS[weights])


def iteration_graph(models, shape: TreeShape, folder: Path, target_graph: Path, weights: str = "float32") -> Path:
    """That drafter graph and the target graph composed into the iteration graph beside it
    (export/iteration.py), remade when either changes."""
    return _tree_graph(models, shape, folder, ITERATION_WEIGHTS[weights], target_graph)


def sweep_trees(models, candidates: list[tuple[TreeShape, bool]], folder: Path, target: OrtTarget,
                prompts: list[list[int]], max_new_tokens: int, threads: int | None, weights: str = "float32",
                repeats: int = 2) -> list[dict]:
    """Speculative tokens/s of each (tree shape, node trim) candidate on the same target session
    and prompts (kept apart from the measured ones), fastest first. Only the drafter graph is
    exported per shape. The
    shapes take turns on each prompt (the order reversed every other round) and each prompt's
    fastest of `repeats` runs counts, so a drift of the machine's speed over the sweep does not
    pick the shape that happened to run while it was fast."""
    decoders, opened = [], {}
    for shape, trim in candidates:
        if shape not in opened:
            opened[shape] = open_backends({"drafter_tree": drafter_graph(models, shape, folder, weights)}, shape,
                                          target.max_context, threads=threads, target=target)
        decoders.append(DecodingLoop(opened[shape].engine(trim=NodeTrim() if trim else None), models.eos_ids,
                                     models.target.config.vocab_size))
    best: list[list] = [[None] * len(prompts) for _ in candidates]      # fastest run per shape and prompt
    with decoding_threads():
        for d in decoders:
            d.generate(prompts[0], 8)
        turn = 0
        for _ in range(max(repeats, 1)):
            for p, ids in enumerate(prompts):
                order = list(range(len(decoders)))
                for c in (order if turn % 2 == 0 else order[::-1]):
                    run = decoders[c].generate(ids, max_new_tokens)
                    if best[c][p] is None or run.seconds < best[c][p].seconds:
                        best[c][p] = run
                turn += 1
    rows = []
    for (shape, trim), runs, decoder in zip(candidates, best, decoders):
        tokens, seconds = sum(len(r.tokens) for r in runs), sum(r.seconds for r in runs)
        accepts = [a for r in runs for a in r.accept_lengths]
        rows.append({"tree": [shape.depth, shape.top_k, shape.total_tokens], "node_trim": trim,
                     "tokens_per_second": tokens / seconds, "mean_accept_length": sum(accepts) / len(accepts),
                     "mean_nodes_verified": sum(decoder.verified) / max(len(decoder.verified), 1)})
        print(f"  {sweep_label(rows[-1])}: {rows[-1]['tokens_per_second']:.1f} tok/s, accept "
              f"{rows[-1]['mean_accept_length']:.2f}, {rows[-1]['mean_nodes_verified']:.2f} nodes verified",
              file=sys.stderr, flush=True)
    return sorted(rows, key=lambda r: -r["tokens_per_second"])


def sweep_label(row: dict) -> str:
    return f"tree {tuple(row['tree'])}" + (", trimmed" if row["node_trim"] else "")


def _decoding(sampling: SamplingConfig | None) -> str:
    if sampling is None:
        return "temperature 0"
    return (f"sampled: temperature {sampling.temperature:g}, top-p {sampling.top_p:g}, top-k {sampling.top_k or 'off'}"
            f" (outputs differ between modes)")


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20   # Linux: KiB


class HFBaseline:
    """transformers' own model and generate() on the target folder: the baseline to beat."""

    def __init__(self, folder: Path, device=torch.device("cpu"), dtype=torch.float32):
        from transformers import AutoModelForCausalLM
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
        self.device = device

    @torch.inference_mode()
    def generate(self, ids: list[int], max_new_tokens: int, eos: set[int],
                 sampling: SamplingConfig | None = None) -> tuple[list[int], float]:
        """Greedy, or sampled as `sampling` says (its seed seeds torch's global generator, which
        generate() draws from)."""
        how = {"do_sample": False}
        if sampling is not None and not sampling.greedy:
            torch.manual_seed(sampling.seed or 0)
            how = {"do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p,
                   "top_k": sampling.top_k}      # top_k 0: off (generate's own default is 50)
        start = time.perf_counter()
        x = torch.tensor([ids], device=self.device)
        out = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                  eos_token_id=sorted(eos), pad_token_id=sorted(eos)[0], **how)
        seconds = time.perf_counter() - start
        tokens = out[0, len(ids):].tolist()
        cut = next((i for i, t in enumerate(tokens) if t in eos), None)
        return (tokens if cut is None else tokens[: cut + 1]), seconds


def run_workload(name: str, prompts: list[list[int]], hf: HFBaseline, ort: OrtDecoding, max_new_tokens: int,
                 depth: int, torch_decoders: tuple[DecodingLoop, DecodingLoop] | None = None, repeats: int = 2,
                 sampling: SamplingConfig | None = None) -> dict:
    """sampling: every mode samples, prompt i with seed i; outputs then differ between modes (each
    draws its own way from the same distribution), so identical_outputs is None."""
    eos = ort.eos
    rows = {m: {"tokens": 0, "seconds": 0.0} for m in MODES + (TORCH_MODES if torch_decoders else ())}
    torch_identical = 0
    split = {role: 0.0 for role in ort.sessions}      # seconds inside each session's calls
    calls = {"autoregressive": 0, "drafter": 0, "verify": 0}
    accepts, identical = [], 0
    for i, ids in enumerate(prompts):
        how = replace(sampling, seed=i) if sampling is not None else None
        hf_tokens, hf_s = hf.generate(ids, max_new_tokens, eos, how)
        rows["transformers"]["tokens"] += len(hf_tokens)
        rows["transformers"]["seconds"] += hf_s
        sp, ar, graph_s = ort.compare(ids, max_new_tokens, repeats, how)
        rows["autoregressive"]["tokens"] += len(ar.tokens)
        rows["autoregressive"]["seconds"] += ar.seconds
        calls["autoregressive"] += ar.target_calls
        for role, seconds in graph_s.items():
            split[role] += seconds
        calls["drafter"] += sp.drafter_calls
        calls["verify"] += sp.target_calls
        rows["speculative"]["tokens"] += len(sp.tokens)
        rows["speculative"]["seconds"] += sp.seconds
        accepts += sp.accept_lengths
        identical += sp.tokens == ar.tokens == hf_tokens
        if torch_decoders is not None:   # the PyTorch engine on --device: lossless against its own plain loop
            t_ar, t_sp = (d.generate(ids, max_new_tokens, how) for d in torch_decoders)
            for mode, run in zip(TORCH_MODES, (t_ar, t_sp)):
                rows[mode]["tokens"] += len(run.tokens)
                rows[mode]["seconds"] += run.seconds
            torch_identical += t_sp.tokens == t_ar.tokens
        print(f"  {name} {i + 1}/{len(prompts)}: accept {sp.mean_accept_length:.2f}; tok/s transformers "
              f"{len(hf_tokens) / hf_s:.1f}, autoregressive {len(ar.tokens) / ar.seconds:.1f}, speculative "
              f"{len(sp.tokens) / sp.seconds:.1f}", file=sys.stderr, flush=True)
    for r in rows.values():
        r["tokens_per_second"] = r["tokens"] / r["seconds"]
    spec_s = rows["speculative"]["seconds"]
    absolute, conditional = depth_rates(accepts, depth)
    # Where the time goes, per call (prefill folded in, as in the tokens/s): one speculative
    # iteration costs (draft + verify + host) and must emit that many autoregressive steps' worth
    # of tokens to break even. With an iteration graph, drafting and verification are one call
    # an iteration (iteration_call_ms); the drafter graph then only catches up on prompts.
    ar_ms = 1e3 * rows["autoregressive"]["seconds"] / calls["autoregressive"]
    draft_ms = 1e3 * split["drafter_graph"] / calls["drafter"]
    verify_ms = 1e3 * split["target_graph"] / calls["verify"]
    one_call_ms = 1e3 * split.get("iteration_graph", 0.0) / calls["drafter"]
    host_ms = 1e3 * (spec_s - sum(split.values())) / calls["drafter"]
    iteration_ms = draft_ms + verify_ms + one_call_ms + host_ms
    cost = {"autoregressive_step_ms": ar_ms, "draft_call_ms": draft_ms, "verify_call_ms": verify_ms,
            "iteration_call_ms": one_call_ms, "host_ms_per_iteration": host_ms, "iteration_ms": iteration_ms,
            "break_even_accept_length": iteration_ms / ar_ms, "accept_length_for_1.8x": 1.8 * iteration_ms / ar_ms}
    return {"workload": name, "prompts": len(prompts), "prompt_tokens": sum(map(len, prompts)) / len(prompts),
            "modes": rows, "mean_accept_length": sum(accepts) / max(len(accepts), 1),
            "accepted_at_least": absolute, "conditional": conditional,
            "speedup_vs_autoregressive": rows["speculative"]["tokens_per_second"] / rows["autoregressive"]["tokens_per_second"],
            "speedup_vs_transformers": rows["speculative"]["tokens_per_second"] / rows["transformers"]["tokens_per_second"],
            "time_split": dict({k: v / spec_s for k, v in split.items()}, host=1 - sum(split.values()) / spec_s),
            "cost": cost, "identical_outputs": identical if sampling is None else None, "peak_rss_gb": peak_rss_gb(),
            **({"torch_speedup": rows["torch-speculative"]["tokens_per_second"]
                / rows["torch-autoregressive"]["tokens_per_second"],
                "torch_identical_outputs": torch_identical if sampling is None else None}
               if torch_decoders else {})}


def format_table(results: list[dict]) -> str:
    head = (f"{'workload':<10}{'ctx':>6}{'HF tok/s':>10}{'AR tok/s':>10}{'spec tok/s':>11}{'accept':>8}"
            f"{'vs AR':>7}{'vs HF':>7}{'drafter':>9}{'target':>8}{'1 call':>8}{'host':>7}{'same':>7}")
    lines = [head, "-" * len(head)]
    for r in results:
        m, s = r["modes"], r["time_split"]
        lines.append(f"{r['workload']:<10}{r['prompt_tokens']:>6.0f}{m['transformers']['tokens_per_second']:>10.1f}"
                     f"{m['autoregressive']['tokens_per_second']:>10.1f}{m['speculative']['tokens_per_second']:>11.1f}"
                     f"{r['mean_accept_length']:>8.2f}{r['speedup_vs_autoregressive']:>6.2f}x"
                     f"{r['speedup_vs_transformers']:>6.2f}x{s['drafter_graph']:>9.1%}{s['target_graph']:>8.1%}"
                     f"{s.get('iteration_graph', 0.0):>8.1%}"
                     f"{s['host']:>7.1%}{_same(r['identical_outputs'], r['prompts'])}")
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
    if "torch_speedup" in results[0]:
        head = f"{'workload':<10}{'torch AR tok/s':>16}{'torch spec tok/s':>18}{'speed-up':>10}{'same':>7}"
        lines += ["", "PyTorch engine (runtime/static.py; see torch_device in bench.json):", head, "-" * len(head)]
        for r in results:
            m = r["modes"]
            lines.append(f"{r['workload']:<10}{m['torch-autoregressive']['tokens_per_second']:>16.1f}"
                         f"{m['torch-speculative']['tokens_per_second']:>18.1f}{r['torch_speedup']:>9.2f}x"
                         f"{_same(r['torch_identical_outputs'], r['prompts'])}")
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


def main(argv=None) -> int:
    pre = argparse.ArgumentParser(add_help=False)
    add_device_options(pre)
    known, _ = pre.parse_known_args(argv)
    try:
        on_gpu = resolve_device(known.device).type == "cuda"
    except ConfigError:
        on_gpu = False      # reported by the full parse below
    if on_gpu:   # a GPU: captured decoding against the best plain decoding there (device_bench.py)
        from . import device_bench
        return device_bench.main(argv)
    p = argparse.ArgumentParser(prog="python -m eagle_trt.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafter", default=None, help="drafter folder (default: the shipped one for smollm2)")
    p.add_argument("--onnx-dir", type=Path, default=None, help="graphs folder (exported there if missing)")
    p.add_argument("--workloads", default="mtbench,humaneval,long-2k")
    p.add_argument("--prompts", type=int, default=20, help="prompts per workload (long context: at most 3)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--tree", default="auto", help="depth,top_k,total_tokens of the draft tree, or 'auto': the "
                   "fastest of --tree-candidates on --sweep-prompts MT-bench prompts not among the measured ones")
    p.add_argument("--tree-candidates", default=TREE_CANDIDATES, help="';'-separated shapes for --tree auto")
    p.add_argument("--sweep-prompts", type=int, default=3)
    p.add_argument("--node-trim", choices=("on", "off", "both"), default="off",
                   help="on: verify per iteration only the tree nodes whose draft probability pays for their rows "
                        "(runtime/cost.py NodeTrim; no gain measured on a 2-core CPU with SmolLM2, see "
                        "docs/benchmarks.md); off: every node of the tree; both: sweep every shape both ways")
    p.add_argument("--repeats", type=int, default=2, help="runs per prompt of each ONNX Runtime mode, alternating; "
                   "the fastest counts")
    p.add_argument("--threads", type=int, default=0, help="torch and ONNX Runtime threads (0: all cores)")
    p.add_argument("--drafter-weights", choices=sorted(DRAFTER_WEIGHTS), default="int8",
                   help="the ONNX Runtime drafter graph's weights: int8 (the default, and what the build's Triton "
                        "repository serves: per-channel int8 MatMul weights, a quarter of the bytes a memory-bound "
                        "drafter call streams; the output stays the target's) or float32 (the exported graph)")
    add_device_options(p)
    p.add_argument("--iteration-graph", choices=("on", "off"), default="on",
                   help="speculative decoding with drafting and verification in one graph call (the target and "
                        "drafter graphs composed: export/iteration.py; the default), or the two graphs called in "
                        "turn (off; always so with node trim, which picks the nodes between the calls). The tree "
                        "sweep runs the two graphs")
    p.add_argument("--torch-row", action="store_true",
                   help="also time the PyTorch backend (the dynamic loop) on the CPU")
    p.add_argument("--concurrency", default="", help="comma-separated stream counts (e.g. 1,2,4,8): batched and "
                   "per-request serving of --concurrency-prompts MT-bench prompts at each level (see "
                   "eagle_trt/concurrency.py); with --workloads '' only this")
    p.add_argument("--concurrency-prompts", type=int, default=16)
    p.add_argument("--concurrency-repeats", type=int, default=3,
                   help="runs per level and mode, modes interleaved; tok/s is the median (runs differ by ~5%%)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="> 0: every mode samples (with --top-p, --top-k; prompt i seeded with i) instead of greedy "
                        "decoding; the modes' outputs then differ, each drawn from the same distribution")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0: off")
    p.add_argument("--out", type=Path, required=True, help="folder for bench.json and the plots")
    args = p.parse_args(argv)
    try:
        sampling = SamplingConfig(args.temperature, args.top_p, args.top_k).validate()
        sampling = None if sampling.greedy else sampling
        shapes = [parse_tree(t) for t in (args.tree_candidates if args.tree == "auto" else args.tree).split(";")]
        trims = {"on": [True], "off": [False], "both": [True, False]}[args.node_trim]
        candidates = [(shape, trim) for shape in shapes for trim in trims]
        if args.threads:
            torch.set_num_threads(args.threads)
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
        models = prepare_models(args.target, args.drafter, log=sys.stderr)   # fp32 on the CPU: the graphs' source
        torch_models = None
        if args.torch_row:
            same = device.type == "cpu" and dtype == "float32"
            torch_models = models if same else prepare_models(args.target, args.drafter, dtype, sys.stderr, args.device)
        names = [w.strip() for w in args.workloads.split(",") if w.strip()]
        levels = [int(c) for c in args.concurrency.split(",") if c.strip()] if args.concurrency else []
        if any(c < 1 for c in levels):
            raise ConfigError(f"--concurrency {args.concurrency}: stream counts must be >= 1")
        if args.repeats < 1:
            raise ConfigError(f"--repeats {args.repeats}: must be >= 1")
        if args.concurrency_repeats < 1:
            raise ConfigError(f"--concurrency-repeats {args.concurrency_repeats}: must be >= 1")
        if not names and not levels:
            raise ConfigError("nothing to measure: give --workloads or --concurrency")
        if sampling is not None and levels:
            raise ConfigError(f"--concurrency measures greedy decoding (its rows compare outputs with one stream's): "
                              f"drop --temperature {args.temperature} or run it without --concurrency")
        prompts = {w: build(models.tokenizer, w, min(args.prompts, 3) if w.startswith("long-") else args.prompts)
                   for w in names}
        sweep = build(models.tokenizer, "mtbench", args.prompts + args.sweep_prompts)[args.prompts:]
    except (ConfigError, CheckpointError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    folder = args.onnx_dir or cache_dir() / "onnx" / models.target.folder.name
    threads = ort_threads(args.threads or None)      # explicit, as every timed session (runtime/timing.py)
    graphs = export_pipeline(models, shapes[0], folder, log=sys.stderr, only=("target",))
    target_graph = graphs["target"]
    target = open_backends({"target": target_graph}, None, models.target.config.max_position_embeddings,
                           threads=threads).target
    tree_sweep = []
    if len(candidates) > 1:
        print(f"tree sweep on {len(sweep)} held-out MT-bench prompts, shapes taking turns, fastest of "
              f"{args.repeats} per prompt:", file=sys.stderr)
        tree_sweep = sweep_trees(models, candidates, folder, target, sweep, min(args.max_new_tokens, 64), threads,
                                 args.drafter_weights, args.repeats)
    shape, trim = (TreeShape(*tree_sweep[0]["tree"]), tree_sweep[0]["node_trim"]) if tree_sweep else candidates[0]
    eos = models.eos_ids
    one_call = args.iteration_graph == "on" and not trim
    served = {"target": target_graph, "drafter_tree": drafter_graph(models, shape, folder, args.drafter_weights)}
    if one_call:
        served["iteration"] = iteration_graph(models, shape, folder, target_graph, args.drafter_weights)
    ort = OrtDecoding.open(served, shape, models.target.config.max_position_embeddings, eos,
                           models.target.config.vocab_size, threads, target=target, trim=trim)
    hf = HFBaseline(models.target.folder, device, torch_dtype(dtype)) if names else None
    warm = sweep[0]                                  # first-call allocations stay out of the numbers
    ort.warm_up(warm)
    torch_decoders = None
    if torch_models is not None:
        vocab = models.target.config.vocab_size
        torch_decoders = (DecodingLoop(StaticEngine(torch_models.target.model), eos, vocab),
                          DecodingLoop(StaticEngine(torch_models.target.model, torch_models.drafter, shape), eos, vocab))
        for d in torch_decoders:
            d.generate(warm, 8)
    if hf is not None:
        hf.generate(warm, 8, eos)
    results = [run_workload(w, prompts[w], hf, ort, args.max_new_tokens, shape.depth, torch_decoders, args.repeats,
                            sampling) for w in names]
    concurrent = []
    if levels:
        print(f"concurrency {levels} on {args.concurrency_prompts} MT-bench prompts:", file=sys.stderr)
        with decoding_threads():
            held_out = build(models.tokenizer, "mtbench", args.concurrency_prompts + 8)
            concurrent = concurrency.measure(target, ort.drafter, eos, models.target.config.vocab_size,
                                             held_out[:args.concurrency_prompts], args.max_new_tokens, levels,
                                             warm=held_out[args.concurrency_prompts:],
                                             repeats=args.concurrency_repeats, plain_target=ort.plain,
                                             iteration=ort.iteration)
    report = {"target": str(models.target.folder), "drafter": models.drafter_source,
              "drafter_variant": models.drafter.cfg.variant, "backend": "onnxruntime (CPU, fp32)",
              "drafter_weights": args.drafter_weights, "iteration_graph": ort.iteration is not None,
              "transformers_device": f"{device.type} {dtype}",
              "torch_device": f"{device.type} {dtype}" if torch_decoders else None,
              "tree": [shape.depth, shape.top_k, shape.total_tokens], "node_trim": trim,
              "max_new_tokens": args.max_new_tokens, "sampling": asdict(sampling) if sampling else None,
              "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "tree_sweep": tree_sweep,
              "results": results, "concurrency": concurrent}
    print(f"\n{report['drafter_variant']} drafter ({args.drafter_weights} weights"
          f"{', one call an iteration' if ort.iteration is not None else ''}), tree {tuple(report['tree'])}"
          f"{', nodes trimmed' if trim else ''}, "
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
    print(f"peak RSS {peak_rss_gb():.2f} GB")
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = args.out / "bench.json.tmp"
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, args.out / "bench.json")
    paths = plot(report, args.out) if results else []
    if concurrent:
        paths.append(concurrency.plot(concurrent, args.out, f"{report['drafter_variant']} drafter, tree "
                                      f"{tuple(report['tree'])}, {report['backend']}"))
    for path in paths:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
