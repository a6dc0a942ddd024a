"""The parity stage: every exported graph against its PyTorch model (eagle_trt.parity, through
Polygraphy's ONNX Runtime runner), parity bundles for TensorRT-side checks, and for quantized
graphs a layer-by-layer check against the fake-quant reference (eagle_trt.quant) plus bundles
whose reference outputs come from that fake-quant model.

    polygraphy run onnx/target.onnx --trt --load-inputs parity/bundles/target.inputs.json \\
        --load-outputs parity/bundles/target.reference.json --atol 1e-3 --rtol 1e-3
"""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import torch

from ..models.streamed import StreamedTarget
from .store import Progress

# Worst relative L2 error of any quantized MatMul against QuantLinear on the same input: a wrong
# scale, axis or packing gives >1e-2; float-order noise stays near 1e-6 (fp32) / 1e-3 (fp16).
QUANT_LAYER_TOL = {"float32": 1e-4, "float16": 5e-3}
TORCH = {"float32": torch.float32, "float16": torch.float16}


def _in_dtype(module, dtype: str):
    """The model in `dtype`: a StreamedTarget reads its parts in it (nothing to copy); a loaded
    module is copied when its dtype differs."""
    want = TORCH[dtype]
    if isinstance(module, StreamedTarget):
        return module.with_dtype(want)
    param = next(module.parameters())
    return module if param.dtype == want else copy.deepcopy(module).to(want)


def run_parity_stage(b, out: Path) -> dict:
    """b: the Build (config, models, stage paths). Writes report.json and bundles/ into out."""
    from ..api import real_prompt_ids
    from ..parity import (
        check_case,
        drafter_cases,
        format_report,
        iteration_case,
        report_json,
        target_case,
        target_outputs,
    )
    cfg, models = b.cfg, b.models_on(b.device)     # the PyTorch references on the config's device
    shape = cfg.tree.shape
    tdt, ddt = cfg.precision.target.dtype, cfg.precision.drafter.dtype
    graphs = {g: b.path("export", f"{g}.onnx") for g in ("target", "drafter_tree")}
    if cfg.outputs.step_graphs:
        graphs.update({g: b.path("export", f"{g}.onnx") for g in ("drafter_step_first", "drafter_step")})
    quantized = [m for m in ("target", "drafter") if getattr(cfg.precision, m).quantized]
    # the iteration graph ONNX Runtime serves (serving.iteration_graph), composed of the float
    # graphs as the TensorRT-checkable one is; composed here for its check and bundle, then dropped
    iteration = b.parity_checks_iteration
    fp16 = tdt == "float16"
    int4 = cfg.precision.target.weight_only
    # the fused-attention target graph ONNX Runtime serves (serving.attention), made here for its check
    fused = b.ort_fused_attention
    progress = Progress("parity", len(graphs) + 1 + fp16 + 2 * len(quantized) + 2 * iteration + int4
                        + (fused is not None) * (1 if int4 else 2), b.log)

    prompts = real_prompt_ids(models, cfg.parity.prompts)
    target = _in_dtype(models.target, tdt)
    drafter = _in_dtype(models.drafter, ddt)
    tcase = target_case(target, graphs["target"], tdt, prompts, shape, _in_dtype(models.drafter, tdt),
                        on_part=_parts_progress(b, target, "target reference"))
    progress.step("target reference")
    if fp16:    # the float32 model on the same feeds: the yardstick of float16 rounding (parity.GraphCase.exact)
        exact = _in_dtype(models.target, "float32")
        tcase.exact = target_outputs(exact, [_float32(f) for f in tcase.feeds],
                                     _parts_progress(b, exact, "float32 reference", passes=1))
        progress.step("float32 reference")
    real = [(c["captured"], p[1:] + [int(c["logits"][0, -1].argmax())]) for c, p in zip(tcase.reference[1::2], prompts)]
    cases = [tcase] + drafter_cases(drafter, shape, {g: p for g, p in graphs.items() if g != "target"}, ddt, real)
    if iteration:
        from ..export.iteration import compose_iteration
        composed = compose_iteration(graphs["target"], graphs["drafter_tree"], out / "iteration" / "iteration.onnx")
        progress.step(f"iteration graph composed in {composed.seconds:.1f}s")
        cases.append(iteration_case(target, drafter, shape, composed.path, "float16" if "float16" in (tdt, ddt) else tdt,
                                    [(c, ids) for c, (_, ids) in zip(tcase.reference[1::2], real)],
                                    on_part=_parts_progress(b, target, "iteration reference", passes=1),
                                    prefix_feed=tcase.feeds[0]))
    if fused is not None and not int4:
        cases.append(_fused_case(graphs["target"], out / "fused" / "target.fused.onnx", fused, tcase))
        progress.step("fused-attention target graph made")
    # Every float reference is computed (the target's part by part: models/streamed.py); the
    # fake-quant references are the float models made quantized: the target read part by part with
    # its Linears swapped as each part is read, a drafter in place. The drafter goes before ONNX
    # Runtime maps the graphs' weights.
    try:
        references = {m: _fake_quant_reference(b, m, target if m == "target" else drafter) for m in quantized}
    finally:
        del models, target, drafter
        b.release_models()
    entries = {m: _quantized_parity(b, m, references.pop(m), tcase if m == "target" else cases[1], out / "bundles",
                                    progress) for m in quantized}
    if int4:
        entries["target"] = _int4_distance(b.path("quantize", "target.int4.onnx"), tcase, progress)
    if int4 and fused is not None:      # the served one: fused, int8 activations (its own rounding)
        from ..export.cpu_attention import fuse_attention
        path = out / "fused" / "target.int4.fused.onnx"
        fuse_attention(b.path("quantize", "target.int4.onnx"), path, fused, int8_activations=True)
        entries["target_fused"] = _int4_distance(path, tcase, progress, fused=True)
    reports = []
    for case in cases:
        with np.errstate(divide="ignore", invalid="ignore"):   # Polygraphy's relative error on exact zeros
            reports.append(check_case(case, out / "bundles"))
        progress.step(f"{case.name}: {'ok' if reports[-1].passed else 'FAIL'}")
    for made in ("iteration", "fused"):     # checked; the triton stage makes the served ones
        shutil.rmtree(out / made, ignore_errors=True)
    data = report_json(reports)
    if b.log is not None:
        print(format_report(reports), file=b.log)
    failed = [r.name for r in reports if not r.passed]

    data["quantized"] = entries
    for entry in entries.values():
        if not entry["passed"]:
            what = "logits" if entry["format"] == "int4" else "layer"
            failed.append(f"{entry['graph']} ({what} rel L2 {entry['worst_rel_l2']:.2e} > {entry['tolerance']:.0e})")
    data["passed"] = not failed
    data["failed"] = failed
    data["bundles"] = sorted(p.name for p in (out / "bundles").iterdir())
    (out / "report.json").write_text(json.dumps(data, indent=2, default=float))
    data["worst"] = {f"{g['name']}.{o['output']}": o["max_abs"] for g in data["graphs"] for o in g["outputs"]
                     if o["output"] in ("logits", "tree_scores", "tree_tokens")}
    return data


def _fused_case(graph: Path, path: Path, tcfg, tcase):
    """The fused-attention target graph (export/cpu_attention.py) made from the target graph and
    checked on the target case's one-sequence feeds (its operator verifies one sequence a call),
    made its own (cpu_attention.fused_feeds: T more cache rows), against the same references
    (its caches are written in place, not output: the KV rows are checked by the decoding they
    feed, tests/test_cpu_attention.py)."""
    from ..export.cpu_attention import fuse_attention, fused_feeds
    from ..parity import GraphCase
    fuse_attention(graph, path, tcfg)
    one = [i for i, f in enumerate(tcase.feeds) if f["input_ids"].shape[0] == 1]
    return GraphCase("target.fused", path, tcase.dtype, [fused_feeds(tcase.feeds[i]) for i in one],
                     [tcase.labels[i] for i in one],
                     [{k: v for k, v in tcase.reference[i].items() if not k.startswith(("new_key_", "new_value_"))}
                      for i in one])


def _float32(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v.astype(np.float32) if v.dtype == np.float16 else v for k, v in feed.items()}


def _parts_progress(b, target, label: str, passes: int = 2):
    """A progress callback for the reference passes over a StreamedTarget's parts (at most a line
    every 10 s, with an ETA); None for a loaded model."""
    if not isinstance(target, StreamedTarget):
        return None
    bar = Progress("parity", passes * len(target.parts()), b.log, label, every=10.0)
    return bar.step


def _fake_quant_reference(b, model: str, module):
    """`module` (the float model of 'target' or 'drafter', in its precision's dtype) made the
    fake-quant reference: its quantized Linears hold FP8 / FP4 weights, not float ones (a
    StreamedTarget's as each part is read; a loaded module's in place)."""
    from ..quant import LinearQuantizer, QuantConfig, load_calibration, quantize_model
    p = getattr(b.cfg.precision, model)
    source = b.path("quantize", f"{model}.amax.json")
    cfg = QuantConfig(format=p.format, per_channel=p.per_channel, skip=tuple(p.skip))
    if isinstance(module, StreamedTarget):
        module = module.with_dtype(module.dtype)
        module.fake_quant = LinearQuantizer(cfg, load_calibration(source), str(source))
        return module
    quantize_model(module, cfg, load_calibration(source), source=str(source))
    return module.eval()


# A 4-bit target's logits are not the float model's (4-bit weights move SmolLM2's by ~0.13 rel L2):
# parity reports the distance, and fails only a graph whose logits are unrelated to the model's
# (two unrelated logit vectors lie ~1.4 apart).
INT4_LOGITS_TOL = 1.0


def _int4_distance(graph: Path, float_case, progress: Progress, fused: bool = False) -> dict:
    """The int4 target graph (export/cpu_int4.py) on the target case's feeds against the float
    model's logits: relative L2 (the worst feed) and how often the greedy token agrees. fused: the
    fused-attention graph made from it, on the one-sequence feeds made its own (fused_feeds)."""
    from ..export.cpu_attention import fused_feeds
    from ..runtime.sessions import make_session
    session = make_session(graph, threads=1, huge_pages=False)     # a check, not a decoding session
    worst, agree, rows = 0.0, 0, 0
    for feed, reference in zip(float_case.feeds, float_case.reference):
        if fused and feed["input_ids"].shape[0] != 1:
            continue
        got = session.run(["logits"], fused_feeds(feed) if fused else feed)[0].astype(np.float32)
        want = reference["logits"].astype(np.float32)
        worst = max(worst, float(np.linalg.norm(got - want) / (np.linalg.norm(want) or 1.0)))
        agree += int((got.argmax(-1) == want.argmax(-1)).sum())
        rows += want.shape[0] * want.shape[1]
    progress.step(f"{graph.name}: logits rel L2 {worst:.2e} from the float model, greedy token agrees on "
                  f"{agree}/{rows} rows")
    return {"graph": graph.name, "format": "int4", "worst_rel_l2": worst, "argmax_agreement": agree / rows,
            "tolerance": INT4_LOGITS_TOL, "passed": worst <= INT4_LOGITS_TOL}


def _quantized_parity(b, model: str, reference, float_case, bundle_dir: Path, progress: Progress) -> dict:
    """Each quantized MatMul vs QuantLinear on the graph's own input (quant.check.layer_parity),
    and a bundle of the float case's feeds with the fake-quant model's outputs as reference."""
    from polygraphy.comparator import IterationResult, RunResults

    from ..export.graphs import DraftTreeGraph
    from ..parity import GraphCase, _run, target_outputs, write_bundle
    from ..quant import layer_parity
    p = getattr(b.cfg.precision, model)
    graph_name = "target" if model == "target" else "drafter_tree"
    graph = b.path("quantize", f"{graph_name}.{p.format}.onnx")
    real = [i for i, label in enumerate(float_case.labels) if label.startswith("real")]
    feed = float_case.feeds[real[0] if real else 0]   # a real prompt where there is one
    layers = layer_parity(str(graph), reference, feed)
    worst = max(layers, key=lambda r: r.rel_l2)
    progress.step(f"{graph.name}: {len(layers)} quantized MatMuls, worst rel L2 {worst.rel_l2:.2e}")

    names = list(float_case.reference[0])
    if model == "target":
        outputs = target_outputs(reference, float_case.feeds, _parts_progress(b, reference, "fake-quant reference", 1))
    else:
        outputs = [_run(DraftTreeGraph(reference, b.cfg.tree.shape).eval(), f, names) for f in float_case.feeds]
    case = GraphCase(f"{graph_name}.{p.format}", graph, p.dtype, float_case.feeds, float_case.labels, outputs)
    write_bundle(case, RunResults([("pytorch-fakequant", [IterationResult(outputs=r, runner_name="pytorch-fakequant")
                                                          for r in case.reference])]), bundle_dir)
    progress.step(f"{case.name} bundle")
    tol = QUANT_LAYER_TOL[p.dtype]
    return {"graph": graph.name, "format": p.format, "layers": len(layers), "worst_rel_l2": worst.rel_l2,
            "worst_module": worst.module, "tolerance": tol, "passed": worst.rel_l2 <= tol}

