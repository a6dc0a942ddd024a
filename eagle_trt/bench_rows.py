"""What `python -m eagle_trt.bench` measures (bench.py is its command line and report).

The comparison (a CPU): per workload, `transformers` generate, autoregressive and speculative
decoding on the same ONNX graphs (`run_workload`: the two ONNX Runtime modes alternate, each
prompt's fastest of `repeats` runs counts, runtime/timing.py), after a tree sweep.

The rows (a GPU, or --rows): each prompt through every row in turn (`run`), the order reversed
every other repeat, each row's fastest run counting: `captured-plain` / `captured-speculative`
(one per tree: the PyTorch engine, runtime/static.py, each iteration one CUDA graph on a GPU, the
GPU's busy time from CUDA events; uncaptured on a CPU); `transformers-compiled` (generate() with a
StaticCache, compiled on a GPU as its docs recommend) and `transformers-eager`; and the exported
graphs, plain and speculative, on ONNX Runtime's CUDA provider (`onnxruntime-cuda`, the KV caches
on the GPU; `-host-kv`, in host memory) and its CPU provider (`onnxruntime-cpu`, the reference
the CUDA rows are compared with); a provider that cannot run them is the row's result."""
from __future__ import annotations

import resource
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from .api import onnxruntime_backends, ort_cuda_available
from .config import ConfigError, SamplingConfig, TreeShape
from .devices import torch_dtype
from .evaluate import depth_rates
from .export import export_pipeline
from .runtime.loop import DecodingLoop
from .runtime.onnxruntime_backend import OrtTarget
from .runtime.sessions import PROVIDERS
from .runtime.ort_engines import open_backends
from .runtime.static import StaticEngine
from .runtime.timing import OrtDecoding, decoding_threads

MODES = ("transformers", "autoregressive", "speculative")
DRAFTER_WEIGHTS = {"float32": "drafter_tree", "int8": "drafter_tree_int8"}
ITERATION_WEIGHTS = {"float32": "iteration", "int8": "iteration_int8"}
# the ONNX Runtime rows: provider (PROVIDERS: the providers each takes), where the KV caches live
# (onnxruntime_backend.kv_device_for; None: its default, the GPU on the CUDA provider)
ORT_ROWS = {"onnxruntime-cuda": ("cuda", None), "onnxruntime-cuda-host-kv": ("cuda", "cpu"),
            "onnxruntime-cpu": ("cpu", None)}
CAPTURED = ("captured-plain", "captured-speculative")
ROWS = (*CAPTURED, "transformers-compiled", "transformers-eager", *ORT_ROWS)


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


def sweep_trees(models, shapes: list[TreeShape], folder: Path, target: OrtTarget,
                prompts: list[list[int]], max_new_tokens: int, threads: int | None, weights: str = "float32",
                repeats: int = 2) -> list[dict]:
    """Speculative tokens/s of each tree shape on the same target session
    and prompts (kept apart from the measured ones), fastest first. Only the drafter graph is
    exported per shape. The
    shapes take turns on each prompt (the order reversed every other round) and each prompt's
    fastest of `repeats` runs counts, so a drift of the machine's speed over the sweep does not
    pick the shape that happened to run while it was fast."""
    decoders = []
    for shape in shapes:
        opened = open_backends({"drafter_tree": drafter_graph(models, shape, folder, weights)}, shape,
                               target.max_context, threads=threads, target=target)
        decoders.append(DecodingLoop(opened.engine(), models.eos_ids, models.target.config.vocab_size))
    best: list[list] = [[None] * len(prompts) for _ in shapes]      # fastest run per shape and prompt
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
    for shape, runs, decoder in zip(shapes, best, decoders):
        tokens, seconds = sum(len(r.tokens) for r in runs), sum(r.seconds for r in runs)
        accepts = [a for r in runs for a in r.accept_lengths]
        rows.append({"tree": [shape.depth, shape.top_k, shape.total_tokens],
                     "tokens_per_second": tokens / seconds, "mean_accept_length": sum(accepts) / len(accepts),
                     "mean_nodes_verified": sum(decoder.verified) / max(len(decoder.verified), 1)})
        print(f"  {sweep_label(rows[-1])}: {rows[-1]['tokens_per_second']:.1f} tok/s, accept "
              f"{rows[-1]['mean_accept_length']:.2f}, {rows[-1]['mean_nodes_verified']:.2f} nodes verified",
              file=sys.stderr, flush=True)
    return sorted(rows, key=lambda r: -r["tokens_per_second"])


def sweep_label(row: dict) -> str:
    return f"tree {tuple(row['tree'])}"


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20   # Linux: KiB


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class Transformers:
    """transformers' own model and generate() on the target folder: the baseline a user has.
    compiled: with a StaticCache (reset per prompt), with which generate compiles its decode step
    on a GPU (torch.compile with CUDA graphs); else eager."""

    def __init__(self, name: str, folder: Path, device: torch.device, dtype: torch.dtype, eos: set[int],
                 compiled: bool = False, max_cache_len: int = 0):
        from transformers import AutoModelForCausalLM, StaticCache
        self.name, self.device, self.eos = name, device, sorted(eos)
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
        self.cache = StaticCache(config=self.model.config, max_cache_len=max_cache_len) if compiled else None

    @torch.inference_mode()
    def generate(self, ids: list[int], max_new_tokens: int, sampling: SamplingConfig | None = None) -> dict:
        """Greedy, or sampled as `sampling` says (its seed seeds torch's global generator, which
        generate() draws from)."""
        how = {"do_sample": False}
        if sampling is not None and not sampling.greedy:
            torch.manual_seed(sampling.seed or 0)
            how = {"do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p,
                   "top_k": sampling.top_k}      # top_k 0: off (generate's own default is 50)
        if self.cache is not None:
            self.cache.reset()
            how["past_key_values"] = self.cache
        synchronize(self.device)
        start = time.perf_counter()
        x = torch.tensor([ids], device=self.device)
        out = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                  eos_token_id=self.eos, pad_token_id=self.eos[0], **how)
        synchronize(self.device)
        seconds = time.perf_counter() - start
        tokens = out[0, len(ids):].tolist()
        cut = next((i for i, t in enumerate(tokens) if t in self.eos), None)
        return {"tokens": tokens if cut is None else tokens[: cut + 1], "seconds": seconds}


def run_workload(name: str, prompts: list[list[int]], hf: Transformers, ort: OrtDecoding, max_new_tokens: int,
                 depth: int, repeats: int = 2, sampling: SamplingConfig | None = None, peers: tuple = ()) -> dict:
    """sampling: every mode samples, prompt i with seed i; outputs then differ between modes (each
    draws its own way from the same distribution), so identical_outputs is None. peers: other
    plain decoders (peers.LlamaCpp) on the same prompts, each prompt's fastest of `repeats` runs,
    right after the graphs' runs of that prompt."""
    rows = {m: {"tokens": 0, "seconds": 0.0} for m in MODES}
    peer_rows = {peer.label: {"tokens": 0, "seconds": 0.0, "identical_to_autoregressive": 0} for peer in peers}
    split = {role: 0.0 for role in ort.sessions}      # seconds inside each session's calls
    calls = {"autoregressive": 0, "drafter": 0, "verify": 0}
    accepts, identical, lossless = [], 0, 0
    for i, ids in enumerate(prompts):
        how = replace(sampling, seed=i) if sampling is not None else None
        hf_run = hf.generate(ids, max_new_tokens, how)
        hf_tokens, hf_s = hf_run["tokens"], hf_run["seconds"]
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
        lossless += sp.tokens == ar.tokens
        peer_rates = ""
        for peer in peers:
            run = min((peer.generate(ids, max_new_tokens, how) for _ in range(repeats)), key=lambda r: r["seconds"])
            row = peer_rows[peer.label]
            row["tokens"], row["seconds"] = row["tokens"] + len(run["tokens"]), row["seconds"] + run["seconds"]
            row["identical_to_autoregressive"] += run["tokens"] == ar.tokens
            peer_rates += f", {peer.label} {len(run['tokens']) / run['seconds']:.1f}"
        print(f"  {name} {i + 1}/{len(prompts)}: accept {sp.mean_accept_length:.2f}; tok/s transformers "
              f"{len(hf_tokens) / hf_s:.1f}, autoregressive {len(ar.tokens) / ar.seconds:.1f}, speculative "
              f"{len(sp.tokens) / sp.seconds:.1f}{peer_rates}", file=sys.stderr, flush=True)
    for r in [*rows.values(), *peer_rows.values()]:
        r["tokens_per_second"] = r["tokens"] / r["seconds"]
    for r in peer_rows.values():
        r["speculative_speedup"] = rows["speculative"]["tokens_per_second"] / r["tokens_per_second"]
        r["autoregressive_ratio"] = rows["autoregressive"]["tokens_per_second"] / r["tokens_per_second"]
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
            "cost": cost, "identical_outputs": identical if sampling is None else None,
            # the graphs' speculative output against their own plain decoding (a 4-bit target's is not transformers')
            "speculative_equals_autoregressive": lossless if sampling is None else None, "peers": peer_rows,
            "peak_rss_gb": peak_rss_gb()}


class LoopRow:
    """A decoding loop (runtime/loop.py) timed per prompt; on the PyTorch engine also its
    iterations' wall time and the GPU's busy time inside their replays (CUDA events)."""

    def __init__(self, name: str, decoder: DecodingLoop, device: torch.device = torch.device("cpu")):
        self.name, self.decoder, self.device = name, decoder, device
        self.replayer = getattr(decoder.engine, "replayer", None)

    def generate(self, ids: list[int], max_new_tokens: int, sampling: SamplingConfig | None = None) -> dict:
        engine, replayer = self.decoder.engine, self.replayer
        if replayer is not None:
            engine.step_seconds, replayer.events = 0.0, [] if replayer.capture else None
        synchronize(self.device)
        start = time.perf_counter()
        res = self.decoder.generate(ids, max_new_tokens, sampling)
        synchronize(self.device)
        out = {"tokens": res.tokens, "seconds": time.perf_counter() - start, "accept": res.accept_lengths}
        if replayer is not None:
            out.update(step_seconds=engine.step_seconds, gpu_seconds=replayer.gpu_seconds())
        return out


class FailedRow:
    """A row that could not run: its error is its result."""

    def __init__(self, name: str, error: str):
        self.name, self.error = name, error


def make_rows(names: list[str], models, f32, shapes: list[TreeShape], dtype: str, folder: Path, *, capacity: int,
              max_batch: int = 1, compile: bool = False, drafter_weights: str = "float32",
              iteration_graph: bool = True) -> list:
    """The rows `names` asks for, in the order they run on each prompt; the ONNX Runtime rows on
    `f32` (fp32 CPU models, the graphs' source) and the first tree shape."""
    unknown = set(names) - set(ROWS)
    if unknown:
        raise ConfigError(f"--rows: unknown {sorted(unknown)}; known: {', '.join(ROWS)}")
    eos, vocab, device = models.eos_ids, models.target.config.vocab_size, models.target.model.embed_tokens.weight.device
    static = dict(max_batch=max_batch, capacity=capacity, compile=compile)
    rows = [LoopRow("captured plain", DecodingLoop(StaticEngine(models.target.model, **static), eos, vocab), device)
            ] if "captured-plain" in names else []
    for shape in shapes if "captured-speculative" in names else []:
        engine = StaticEngine(models.target.model, models.drafter, shape, **static)
        rows.append(LoopRow(f"captured speculative {shape.depth},{shape.top_k},{shape.total_tokens}",
                            DecodingLoop(engine, eos, vocab), device))
    for name, compiled in (("transformers-compiled", True), ("transformers-eager", False)):
        if name in names:
            rows.append(Transformers(name.replace("-", " "), models.target.folder, device, torch_dtype(dtype), eos,
                                     compiled, capacity))
    for row, (provider, kv_device) in ORT_ROWS.items():
        if row not in names:
            continue
        why = ort_cuda_available() if provider == "cuda" else None
        kind = row.removeprefix("onnxruntime-").replace("-", " ", 1)
        for label, shape in ((f"onnxruntime {kind} plain", None), (f"onnxruntime {kind} speculative", shapes[0])):
            try:
                if why is not None:
                    raise RuntimeError(why)
                backends = onnxruntime_backends(f32, shape, folder, log=sys.stderr, providers=PROVIDERS[provider],
                                                kv_device=kv_device, iteration_graph=iteration_graph,
                                                drafter_graph=DRAFTER_WEIGHTS[drafter_weights])
                rows.append(LoopRow(label, DecodingLoop(backends.engine(), eos, vocab)))
            except Exception as exc:  # noqa: BLE001 - a provider that cannot run the graphs is a result
                rows.append(FailedRow(label, f"{type(exc).__name__}: {exc}"))
    return rows


def run(rows: list, prompts: list[list[int]], warm: list[int], max_new_tokens: int, repeats: int = 1,
        sampling: SamplingConfig | None = None) -> dict:
    """Every prompt through every row in turn, `repeats` times (the order reversed every other
    time), each row's fastest run counting; sampled: prompt i with seed i. Per-row totals."""
    report = {}
    for row in rows:
        entry = report[row.name] = {"tokens": 0, "seconds": 0.0, "outputs": [], "accept": [], "error": None,
                                    "step_seconds": 0.0, "gpu_seconds": 0.0, "warmup_seconds": 0.0}
        if isinstance(row, FailedRow):
            entry["error"] = row.error
            continue
        start = time.perf_counter()
        try:
            for _ in range(2):        # compilation and capture of batch 1
                row.generate(warm, max_new_tokens, replace(sampling, seed=0) if sampling else None)
        except Exception as exc:  # noqa: BLE001
            entry["error"] = f"{type(exc).__name__}: {exc}"
        entry["warmup_seconds"] = time.perf_counter() - start
    for i, ids in enumerate(prompts):
        how, best = replace(sampling, seed=i) if sampling else None, {}
        for r in range(repeats):
            for row in rows if r % 2 == 0 else rows[::-1]:
                if report[row.name]["error"] is not None:
                    continue
                try:
                    out = row.generate(ids, max_new_tokens, how)
                except Exception as exc:  # noqa: BLE001 - reported, the other rows go on
                    report[row.name]["error"] = f"prompt {i}: {type(exc).__name__}: {exc}"
                    continue
                if row.name not in best or out["seconds"] < best[row.name]["seconds"]:
                    best[row.name] = out
        line = []
        for name, out in best.items():
            entry = report[name]
            if entry["error"] is None:
                entry["tokens"] += len(out["tokens"])
                entry["seconds"] += out["seconds"]
                entry["outputs"].append(out["tokens"])
                entry["accept"] += out.get("accept", [])
                entry["step_seconds"] += out.get("step_seconds", 0.0)
                entry["gpu_seconds"] += out.get("gpu_seconds", 0.0)
                line.append(f"{name} {len(out['tokens']) / out['seconds']:.1f}")
        print(f"  prompt {i + 1}/{len(prompts)}: tok/s " + ", ".join(line), file=sys.stderr, flush=True)
    return report


def summarize(report: dict, sampled: bool = False, plain: str = "captured plain") -> list[dict]:
    """Per row: tok/s, acceptance, idle share, identical outputs against the captured plain row
    (None where the rows sampled: each draws its own way)."""
    base = None if sampled else report.get(plain, {}).get("outputs")
    best_plain = max((e["tokens"] / e["seconds"] for n, e in report.items()
                      if e["error"] is None and e["seconds"] and "speculative" not in n), default=None)
    rows = []
    for name, e in report.items():
        rate = e["tokens"] / e["seconds"] if e["seconds"] else None
        rows.append({"row": name, "tokens_per_second": rate, "warmup_seconds": round(e["warmup_seconds"], 2),
                     "mean_accept_length": sum(e["accept"]) / len(e["accept"]) if e["accept"] else None,
                     "gpu_idle": 1 - e["gpu_seconds"] / e["step_seconds"] if e["gpu_seconds"] else None,
                     "identical_to_captured_plain": (sum(a == b for a, b in zip(e["outputs"], base))
                                                     if base is not None and e["outputs"] else None),
                     "vs_fastest_plain": rate / best_plain if rate and best_plain else None,
                     "error": e["error"]})
        if name.startswith("onnxruntime cuda") and not sampled:   # the must-show: fp32 on both providers, token for token
            cpu = report.get("onnxruntime cpu " + name.rsplit(" ", 1)[1], {}).get("outputs")   # plain / speculative
            if cpu and e["outputs"]:
                rows[-1]["identical_to_cpu_provider"] = sum(a == b for a, b in zip(e["outputs"], cpu))
    return rows
