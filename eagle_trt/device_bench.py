"""python -m eagle_trt.bench --device cuda: speculative decoding on a GPU against the fastest plain
decoding a user has there, measured in one run, on the same prompts, in the same dtype.

Rows (--rows picks; each prompt is decoded by every row in turn):
- `captured plain`: plain decoding on the PyTorch backend, each iteration replayed as one CUDA
  graph (runtime/static.py): the fair plain baseline on a GPU;
- `transformers compiled`: generate() with a StaticCache, with which transformers compiles its
  decode step (torch.compile with CUDA graphs), as its docs recommend;
- `transformers eager`: generate() as it comes;
- `captured speculative D,k,N`: the whole speculative iteration (draft tree, verification, greedy
  acceptance, KV commit, hand-off) replayed as one CUDA graph, one row per --tree shape;
- `onnxruntime cuda plain` / `speculative`: the exported graphs on ONNX Runtime's CUDA execution
  provider (onnxruntime-gpu) where it is installed, fp32, the speculative row through the
  iteration graph (one call an iteration), the KV caches on the GPU; a failure is the row's result;
- `onnxruntime cuda host-kv plain` / `speculative` (`--rows onnxruntime-cuda-host-kv`): the same
  with the KV caches in host memory, copied to the GPU at every call (what a PyTorch without CUDA
  leaves the runtime);
- `onnxruntime cpu plain` / `speculative`: the same graphs on the CPU provider, the reference the
  CUDA rows' outputs are compared with (`same as cpu`).
With --streams N the captured rows also decode all prompts N at a time (continuous batching,
one graph per batch size).

Warm-up (compilation, capture) runs on a held-out prompt and is reported apart. For the captured
rows the GPU's busy time inside the replays is measured with CUDA events; idle is the rest of
the decode steps' wall time. On a CPU the same rows run without capture or compilation: a dry
run of the GPU check (scripts/gpu_check.sh), no measurement of the GPU's."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from .api import onnxruntime_backends, ort_cuda_available, prepare_models
from .checkpoints import CheckpointError, cache_dir
from .config import ConfigError, TreeShape
from .devices import add_device_options, resolve_device, resolve_dtype, torch_dtype
from .runtime.loop import DecodingLoop, Request
from .runtime.sessions import PROVIDERS
from .runtime.static import StaticEngine
from .workloads import build

# the ONNX Runtime rows: provider (PROVIDERS: the providers each takes), where the KV caches live
# (onnxruntime_backend.kv_device_for; None: its default, the GPU on the CUDA provider)
ORT_ROWS = {"onnxruntime-cuda": ("cuda", None), "onnxruntime-cuda-host-kv": ("cuda", "cpu"),
            "onnxruntime-cpu": ("cpu", None)}
ROWS = ("captured-plain", "captured-speculative", "transformers-compiled", "transformers-eager", *ORT_ROWS)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class CapturedRow:
    """A loop on a StaticEngine (speculative or plain), timed per prompt, its GPU time per replay."""

    def __init__(self, name: str, decoder: DecodingLoop, device: torch.device):
        self.name, self.decoder, self.device = name, decoder, device
        engine = decoder.engine
        engine.replayer.events = [] if engine.replayer.capture else None

    def generate(self, ids: list[int], max_new_tokens: int) -> dict:
        dec = self.decoder.engine
        synchronize(self.device)
        dec.step_seconds, dec.replayer.events = 0.0, [] if dec.replayer.capture else None
        start = time.perf_counter()
        res = self.decoder.generate(ids, max_new_tokens)
        synchronize(self.device)
        seconds = time.perf_counter() - start
        return {"tokens": res.tokens, "seconds": seconds, "accept": res.accept_lengths,
                "step_seconds": dec.step_seconds, "gpu_seconds": dec.replayer.gpu_seconds()}

    def batch(self, prompts: list[list[int]], max_new_tokens: int, streams: int) -> dict:
        synchronize(self.device)
        start = time.perf_counter()
        results = self.decoder.generate_batch([Request(ids, max_new_tokens) for ids in prompts], streams)
        synchronize(self.device)
        return {"tokens": [r.tokens for r in results], "seconds": time.perf_counter() - start}


class TransformersRow:
    """transformers' generate(), eager or with a StaticCache (compiled on a GPU, reset per prompt)."""

    def __init__(self, name: str, folder: Path, device: torch.device, dtype: torch.dtype, compiled: bool,
                 max_cache_len: int):
        from transformers import AutoModelForCausalLM, StaticCache
        self.name, self.device = name, device
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
        self.cache = StaticCache(config=self.model.config, max_cache_len=max_cache_len) if compiled else None

    @torch.inference_mode()
    def generate(self, ids: list[int], max_new_tokens: int, eos: set[int]) -> dict:
        synchronize(self.device)
        start = time.perf_counter()
        x = torch.tensor([ids], device=self.device)
        extra = {}
        if self.cache is not None:
            self.cache.reset()
            extra["past_key_values"] = self.cache
        out = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                                  eos_token_id=sorted(eos), pad_token_id=sorted(eos)[0], **extra)
        tokens = out[0, len(ids):].tolist()
        synchronize(self.device)
        seconds = time.perf_counter() - start
        cut = next((i for i, t in enumerate(tokens) if t in eos), None)
        return {"tokens": tokens if cut is None else tokens[:cut + 1], "seconds": seconds}


class OrtRow:
    """The exported fp32 graphs on ONNX Runtime with `providers`; speculative decoding through
    the iteration graph (drafting and verification in one call), as `bench` runs it."""

    def __init__(self, name: str, models, shape: TreeShape | None, folder: Path, eos: set[int],
                 providers: list[str], kv_device: str | None = None):
        self.name = name
        engine = onnxruntime_backends(models, shape, folder, log=sys.stderr, providers=providers,
                                      kv_device=kv_device).engine()
        self.decoder = DecodingLoop(engine, eos, models.target.config.vocab_size)

    def generate(self, ids: list[int], max_new_tokens: int) -> dict:
        start = time.perf_counter()
        res = self.decoder.generate(ids, max_new_tokens)
        return {"tokens": res.tokens, "seconds": time.perf_counter() - start, "accept": res.accept_lengths}


def make_rows(args, models, f32_models, shapes: list[TreeShape], device, dtype: str, capacity: int) -> list:
    """The rows --rows asks for, in the order they run on each prompt."""
    eos, vocab = models.eos_ids, models.target.config.vocab_size
    rows, want = [], set(args.rows.split(","))
    unknown = want - set(ROWS)
    if unknown:
        raise ConfigError(f"--rows: unknown {sorted(unknown)}; known: {', '.join(ROWS)}")
    capture = "off" if device.type != "cuda" else "auto"
    static = dict(max_batch=max(args.streams, 1), capacity=capacity, capture=capture, compile=args.compile)
    if "captured-plain" in want:
        rows.append(CapturedRow("captured plain", DecodingLoop(StaticEngine(models.target.model, **static), eos, vocab),
                                device))
    for shape in shapes if "captured-speculative" in want else []:
        label = f"captured speculative {shape.depth},{shape.top_k},{shape.total_tokens}"
        engine = StaticEngine(models.target.model, models.drafter, shape, **static)
        rows.append(CapturedRow(label, DecodingLoop(engine, eos, vocab), device))
    for name, compiled in (("transformers-compiled", True), ("transformers-eager", False)):
        if name in want:
            rows.append(TransformersRow(name.replace("-", " "), models.target.folder, device, torch_dtype(dtype),
                                        compiled, capacity))
    folder = args.onnx_dir or cache_dir() / "onnx" / models.target.folder.name
    for row, (provider, kv_device) in ORT_ROWS.items():
        if row not in want:
            continue
        why = ort_cuda_available() if provider == "cuda" else None
        kind = row.removeprefix("onnxruntime-").replace("-", " ", 1)
        for label, shape in ((f"onnxruntime {kind} plain", None), (f"onnxruntime {kind} speculative", shapes[0])):
            try:
                if why is not None:
                    raise RuntimeError(why)
                rows.append(OrtRow(label, f32_models, shape, folder, eos, PROVIDERS[provider], kv_device))
            except Exception as exc:  # noqa: BLE001 - a provider that cannot run the graphs is a result
                rows.append(FailedRow(label, f"{type(exc).__name__}: {exc}"))
    return rows


class FailedRow:
    """A row that could not run: its error is its result."""

    def __init__(self, name: str, error: str):
        self.name, self.error = name, error


def run(rows: list, prompts: list[list[int]], warm: list[int], max_new_tokens: int, eos: set[int]) -> dict:
    """Every prompt through every row in turn; returns per-row totals."""
    report = {}
    for row in rows:
        entry = report[row.name] = {"tokens": 0, "seconds": 0.0, "outputs": [], "accept": [], "error": None,
                                    "step_seconds": 0.0, "gpu_seconds": 0.0, "warmup_seconds": 0.0}
        if isinstance(row, FailedRow):
            entry["error"] = row.error
            continue
        start = time.perf_counter()
        try:
            _generate(row, warm, max_new_tokens, eos)       # compilation and capture of batch 1
            _generate(row, warm, max_new_tokens, eos)
        except Exception as exc:  # noqa: BLE001
            entry["error"] = f"{type(exc).__name__}: {exc}"
        entry["warmup_seconds"] = time.perf_counter() - start
    for i, ids in enumerate(prompts):
        line = []
        for row in rows:
            entry = report[row.name]
            if entry["error"] is not None:
                continue
            try:
                out = _generate(row, ids, max_new_tokens, eos)
            except Exception as exc:  # noqa: BLE001 - reported, the other rows go on
                entry["error"] = f"prompt {i}: {type(exc).__name__}: {exc}"
                continue
            entry["tokens"] += len(out["tokens"])
            entry["seconds"] += out["seconds"]
            entry["outputs"].append(out["tokens"])
            entry["accept"] += out.get("accept", [])
            entry["step_seconds"] += out.get("step_seconds", 0.0)
            entry["gpu_seconds"] += out.get("gpu_seconds", 0.0)
            line.append(f"{row.name} {len(out['tokens']) / out['seconds']:.1f}")
        print(f"  prompt {i + 1}/{len(prompts)}: tok/s " + ", ".join(line), file=sys.stderr, flush=True)
    return report


def _generate(row, ids, max_new_tokens, eos) -> dict:
    return row.generate(ids, max_new_tokens, eos) if isinstance(row, TransformersRow) else \
        row.generate(ids, max_new_tokens)


def summarize(report: dict, plain: str = "captured plain") -> list[dict]:
    """Per row: tok/s, acceptance, idle share, identical outputs against the captured plain row."""
    base = report.get(plain, {}).get("outputs")
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
        if name.startswith("onnxruntime cuda"):   # the must-show: fp32 on both providers, token for token
            cpu = report.get("onnxruntime cpu " + name.rsplit(" ", 1)[1], {}).get("outputs")   # plain / speculative
            if cpu and e["outputs"]:
                rows[-1]["identical_to_cpu_provider"] = sum(a == b for a, b in zip(e["outputs"], cpu))
    return rows


def format_table(rows: list[dict], prompts: int) -> str:
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
    p = argparse.ArgumentParser(prog="python -m eagle_trt.bench --device cuda", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafter", default=None, help="drafter folder (default: the shipped one for smollm2)")
    p.add_argument("--workloads", default="mtbench")
    p.add_argument("--prompts", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--tree", default="3,2,4;5,8,60", help="';'-separated depth,top_k,total_tokens: a captured "
                   "speculative row each")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    p.add_argument("--streams", type=int, default=0, help="> 0: the captured rows also decode all prompts this "
                   "many at a time")
    p.add_argument("--capacity", type=int, default=0, help="rows per sequence of the static caches (0: the longest "
                   "prompt + --max-new-tokens + the rows an iteration stages, rounded up to 256)")
    p.add_argument("--compile", action="store_true", help="the captured rows' iterations torch.compile'd "
                   "(inductor) before capture; compilation counts as warm-up")
    p.add_argument("--onnx-dir", type=Path, default=None, help="graphs folder for the ONNX Runtime rows")
    p.add_argument("--threads", type=int, default=0)
    add_device_options(p)
    p.add_argument("--out", type=Path, required=True, help="folder for device_bench.json")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        from .config import parse_tree
        shapes = [parse_tree(t) for t in args.tree.split(";") if t.strip()]
        if args.threads:
            torch.set_num_threads(args.threads)
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
        models = prepare_models(args.target, args.drafter, dtype, sys.stderr, args.device)
        f32 = models if dtype == "float32" and device.type == "cpu" else None
        if any(row in args.rows.split(",") for row in ORT_ROWS) and f32 is None:   # graphs come from fp32 CPU models
            f32 = prepare_models(args.target, args.drafter, "float32", sys.stderr, "cpu")
        names = [w.strip() for w in args.workloads.split(",") if w.strip()]
        prompts = [ids for w in names for ids in build(models.tokenizer, w, args.prompts)]
        warm = build(models.tokenizer, "mtbench", args.prompts + 1)[-1]
        longest = max(map(len, prompts + [warm])) + args.max_new_tokens
        stage = max(s.total_tokens + s.depth for s in shapes) + 2
        capacity = args.capacity or -(-(longest + stage) // 256) * 256
        rows = make_rows(args, models, f32, shapes, device, dtype, capacity)
    except (ConfigError, CheckpointError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU ({os.cpu_count()} cores)"
    print(f"{len(prompts)} prompts x {args.max_new_tokens} tokens, greedy, {dtype} on {name}; capacity {capacity}",
          file=sys.stderr)
    report = run(rows, prompts, warm, args.max_new_tokens, models.eos_ids)
    summary = summarize(report)
    streams = []
    if args.streams:
        for row in rows:
            if isinstance(row, CapturedRow) and report[row.name]["error"] is None:
                row.batch(prompts[:args.streams], args.max_new_tokens, args.streams)      # capture each batch size
                out = row.batch(prompts, args.max_new_tokens, args.streams)
                streams.append({"row": row.name, "streams": args.streams,
                                "tokens_per_second": sum(map(len, out["tokens"])) / out["seconds"],
                                "identical_to_one_stream": sum(a == b for a, b in
                                                               zip(out["tokens"], report[row.name]["outputs"]))})
    result = {"device": name, "dtype": dtype, "torch": torch.__version__, "prompts": len(prompts),
              "workloads": names, "max_new_tokens": args.max_new_tokens, "capacity": capacity,
              "trees": [[s.depth, s.top_k, s.total_tokens] for s in shapes], "rows": summary, "streams": streams}
    print(f"\n{len(prompts)} prompts x {args.max_new_tokens} new tokens, {dtype} on {name}; 'same' = outputs "
          f"identical to captured plain decoding")
    print(format_table(summary, len(prompts)))
    for s in streams:
        print(f"{s['row']}, {s['streams']} streams: {s['tokens_per_second']:.1f} tok/s, "
              f"{s['identical_to_one_stream']}/{len(prompts)} identical to one stream")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "device_bench.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out / 'device_bench.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
