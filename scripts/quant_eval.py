"""What do FP8 / NVFP4 cost in acceptance and perplexity? Acceptance length and target perplexity
under FP8 / NVFP4 quantization of the target, the drafter, or both, on real prompts.

    python scripts/quant_eval.py [--target smollm2] [--drafter PATH] [--prompts 10] [--json]

Acceptance length: greedy (temperature 0) speculative decoding of the first N MT-bench
questions, tree depth 5 / top-k 4 / 16 nodes by default; tokens per target call, bonus
included. Perplexity: the target's, on held-out ShareGPT conversations (validation split,
assistant tokens only, disjoint from the calibration prompts), not on generated text.

Engines: float32 and FP8 components run their exported graphs on ONNX Runtime (FP8: the Q/DQ
graph, see eagle_trt/quant/run.py); NVFP4 components run the PyTorch fake-quant reference,
which the tests hold to the NVFP4 graph on onnx.reference MatMul by MatMul (onnx.reference is
far too slow for decoding). The table names the engine of each row. Calibration: max amax on
ShareGPT validation-split first turns, the drafter fed the target's real features.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2", help="target checkpoint (HF folder, GGUF, or 'smollm2')")
    p.add_argument("--drafter", default=None, help="drafter checkpoint folder (default: a random EAGLE 3.1 drafter)")
    p.add_argument("--prompts", type=int, default=10, help="MT-bench prompts for acceptance length")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--tree-top-k", type=int, default=4)
    p.add_argument("--total-tokens", type=int, default=16)
    p.add_argument("--calib-prompts", type=int, default=16, help="ShareGPT validation prompts for calibration")
    p.add_argument("--ppl-samples", type=int, default=8, help="held-out ShareGPT conversations for perplexity")
    p.add_argument("--formats", default="fp8,nvfp4", help="comma-separated quantization formats to evaluate")
    p.add_argument("--skip", default="lm_head", help="comma-separated glob patterns of target layers kept float")
    p.add_argument("--drafter-skip", default="lm_head", help="the same for the drafter (e.g. 'lm_head,fc')")
    p.add_argument("--work-dir", default=None, help="where graphs and calibration go (default: a temporary folder)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    return p


ENGINES = {"fp32": "onnxruntime float32 graph", "fp8": "onnxruntime FP8 Q/DQ graph (ORT_ENABLE_BASIC)",
           "nvfp4": "torch NVFP4 fake-quant reference"}


def perplexity(target, samples) -> float:
    """exp(mean NLL) over the assistant tokens of `samples`, through a TargetBackend."""
    from eagle_trt.models.target import causal_mask
    nll, count = 0.0, 0
    for s in samples:
        ids = torch.tensor(s.ids)
        target.reset()
        target.add_sequence(len(ids))
        logits = target.forward(ids[None], torch.arange(len(ids))[None], causal_mask(len(ids), 0)).logits
        logits = logits[0]
        logp = torch.log_softmax(logits[:-1].float(), dim=-1).gather(1, ids[1:, None])[:, 0]
        mask = torch.tensor(s.loss_mask[1:], dtype=torch.bool)
        nll -= float(logp[mask].sum())
        count += int(mask.sum())
    return math.exp(nll / max(count, 1))


def main(argv: list[str] | None = None) -> int:
    from eagle_trt.checkpoints import CheckpointError
    from eagle_trt.config import ConfigError
    from eagle_trt.data import DataError
    try:
        return run(build_parser().parse_args(argv))
    except (ConfigError, CheckpointError, DataError, FileNotFoundError) as exc:   # QuantError is a ConfigError
        print(f"error: {exc}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    from eagle_trt.api import prepare_models, real_prompt_ids
    from eagle_trt.config import TreeShape
    from eagle_trt.export import export_drafter_tree, export_target
    from eagle_trt.quant import (QuantConfig, calibrate_drafter, calibrate_target,
                                 calibration_prompts, linear_paths, quantize_onnx, quantized_copy, save_calibration)
    from eagle_trt.runtime.backend import TorchDrafter, TorchTarget
    from eagle_trt.runtime.loop import DecodingLoop
    from eagle_trt.runtime.ort_engines import open_backends
    from eagle_trt.runtime.two_call import TwoCallEngine
    from eagle_trt.train.data import DataConfig, load_samples

    log = sys.stderr
    formats = [f.strip().lower() for f in args.formats.split(",") if f.strip()]
    bad = [f for f in formats if f not in ("fp8", "nvfp4")]
    if bad:
        print(f"error: --formats takes fp8 and/or nvfp4, got {bad}", file=sys.stderr)
        return 2
    shape = TreeShape(args.depth, args.tree_top_k, args.total_tokens).validate()
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="quant_eval_"))
    work.mkdir(parents=True, exist_ok=True)
    models = prepare_models(args.target, args.drafter, log=log)
    target_model, drafter_model = models.target.model, models.drafter
    shape.validate(drafter_model.cfg.draft_vocab_size)
    max_ctx = models.target.config.max_position_embeddings

    t0 = time.perf_counter()
    calib = calibration_prompts(models.tokenizer, args.calib_prompts)
    calib_ids = [ids for _, ids in calib]
    amax = {"target": calibrate_target(target_model, calib_ids),
            "drafter": calibrate_drafter(drafter_model, target_model, calib_ids, shape)}
    for name, values in amax.items():
        save_calibration(work / f"{name}.amax.json", values)
    print(f"calibrated on {len(calib)} ShareGPT validation prompts in {time.perf_counter() - t0:.1f}s", file=log)

    # Held-out perplexity text: validation-split conversations not used for calibration.
    used = {sid for sid, _ in calib}
    samples, _ = load_samples(models.tokenizer, DataConfig(split="val", max_samples=args.ppl_samples + len(used),
                                                           max_len=256))
    samples = [s for s in samples if s.sample_id not in used][: args.ppl_samples]

    t0 = time.perf_counter()
    graphs = {"target": export_target(target_model, work / "target.onnx").path,
              "drafter": export_drafter_tree(drafter_model, shape, work / "drafter.onnx").path}
    skips = {"target": tuple(p for p in args.skip.split(",") if p),
             "drafter": tuple(p for p in args.drafter_skip.split(",") if p)}
    sources = {"target": target_model, "drafter": drafter_model}
    if "fp8" in formats:
        for name in ("target", "drafter"):
            cfg = QuantConfig("fp8", skip=skips[name])
            path = work / f"{name}.fp8.onnx"
            summary = quantize_onnx(graphs[name], path, cfg, amax[name], linear_paths(sources[name]))
            graphs[name, "fp8"] = path
            print(f"{name} FP8 graph: {len(summary.modules)} Linear layers quantized, {len(summary.skipped)} "
                  f"MatMuls kept float", file=log)
    print(f"graphs exported and quantized in {time.perf_counter() - t0:.1f}s", file=log)

    def target_backend(fmt):
        if fmt in ("fp32", "fp8"):
            graph = graphs["target"] if fmt == "fp32" else graphs["target", "fp8"]
            return open_backends({"target": graph}, None, max_ctx, threads=args.threads, precision={"target": fmt}).target
        return TorchTarget(quantized_copy(target_model, QuantConfig(fmt, skip=skips["target"]), amax["target"])[0])

    def drafter_backend(fmt):
        if fmt in ("fp32", "fp8"):
            graph = graphs["drafter"] if fmt == "fp32" else graphs["drafter", "fp8"]
            return open_backends({"drafter_tree": graph}, shape, max_ctx, threads=args.threads,
                                 precision={"drafter_tree": fmt}).drafter
        return TorchDrafter(quantized_copy(drafter_model, QuantConfig(fmt, skip=skips["drafter"]), amax["drafter"])[0],
                            shape)

    combos = [("fp32", "fp32")]
    for f in formats:
        combos += [(f, "fp32"), ("fp32", f), (f, f)]
    prompts = real_prompt_ids(models, args.prompts)
    ppl: dict[str, float] = {}
    targets: dict[str, object] = {}
    rows = []
    for t_fmt, d_fmt in combos:
        start = time.perf_counter()
        if t_fmt not in targets:
            targets[t_fmt] = target_backend(t_fmt)
        target = targets[t_fmt]
        if t_fmt not in ppl:
            ppl[t_fmt] = perplexity(target, samples)
        decoder = DecodingLoop(TwoCallEngine(target, drafter_backend(d_fmt)), models.eos_ids,
                               models.target.config.vocab_size)
        tokens = calls = 0
        for ids in prompts:
            res = decoder.generate(ids, args.max_new_tokens)
            tokens += sum(res.accept_lengths)
            calls += len(res.accept_lengths)
        rows.append({"target": t_fmt, "drafter": d_fmt, "accept_length": tokens / max(calls, 1),
                     "target_perplexity": ppl[t_fmt], "target_engine": ENGINES[t_fmt], "drafter_engine": ENGINES[d_fmt],
                     "seconds": time.perf_counter() - start})
        print(f"target {t_fmt:5s} drafter {d_fmt:5s}: accept {rows[-1]['accept_length']:.3f}, "
              f"ppl {ppl[t_fmt]:.3f} ({rows[-1]['seconds']:.0f}s)", file=log)

    result = {"target": str(models.target.folder), "drafter": models.drafter_source,
              "drafter_variant": drafter_model.cfg.variant, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "tree": [shape.depth, shape.top_k, shape.total_tokens], "temperature": 0.0,
              "perplexity_text": f"{len(samples)} held-out ShareGPT validation conversations (assistant tokens, "
                                 f"<= 256 tokens each), disjoint from the {len(calib)} calibration prompts",
              "skip": {k: list(v) for k, v in skips.items()}, "rows": rows}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"target {result['target']}, drafter {result['drafter']} ({result['drafter_variant']}); "
          f"{len(prompts)} MT-bench prompts x {args.max_new_tokens} tokens, greedy, tree {tuple(result['tree'])}")
    print(f"perplexity: {result['perplexity_text']}")
    header = f"{'target':7s} {'drafter':7s} {'accept len':>10s} {'target ppl':>10s}  engines (target / drafter)"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['target']:7s} {r['drafter']:7s} {r['accept_length']:10.3f} {r['target_perplexity']:10.3f}  "
              f"{r['target_engine']} / {r['drafter_engine']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
