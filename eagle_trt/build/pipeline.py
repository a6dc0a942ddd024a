"""`build()`: the stages of `python -m eagle_trt.build`, each cached by a content hash of its
inputs (its config sections, its sources' fingerprints and its upstream artifacts' sha256).

    validate  resolve target / drafter, check they fit, the capture layers, tree and profiles
    export    target graph and drafter-tree graph (ONNX, the graphs every runtime runs)
    quantize  FP8 / NVFP4 Q/DQ graphs from calibration on ShareGPT validation prompts
    parity    graphs vs PyTorch through Polygraphy; parity bundles for TensorRT-side checks
    engines   TensorRT plans (skipped, with the reason, where TensorRT or a GPU is missing)
    triton    a Triton model repository serving the speculative loop
"""
from __future__ import annotations

import dataclasses
import datetime
import gc
import hashlib
import json
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from ..codehash import code_digest
from ..config import CaptureLayers, ConfigError, DrafterConfig, TargetConfig, read_json
from .config import BuildConfig, BuildConfigError, config_to_dict
from .store import (
    Progress,
    Store,
    fingerprint,
    human_bytes,
    progress_callback,
    sha256_json,
    versions,
    write_json_atomic,
)

STAGES = ("validate", "export", "quantize", "parity", "engines", "triton")
DEPENDS = {"validate": (), "export": ("validate",), "quantize": ("validate", "export"),
           "parity": ("validate", "export", "quantize"), "engines": ("export", "quantize"),
           "triton": ("validate", "export", "quantize", "engines")}
# The module that does each stage's work: the hash of its code and of what it imports from the
# package is part of the stage's key (codehash.py), so a stage made by other code is made again.
STAGE_CODE = {"validate": ("eagle_trt.checkpoints", "eagle_trt.tensor_files"),
              "export": ("eagle_trt.export.onnx_export", "eagle_trt.models.streamed"),
              "quantize": ("eagle_trt.build.quantize",), "parity": ("eagle_trt.build.checks",),
              "engines": ("eagle_trt.build.engines",), "triton": ("eagle_trt.build.triton",)}


class BuildError(ConfigError):
    """The build cannot proceed as asked (bad input, missing upstream artifact, TensorRT required)."""


class ParityFailure(RuntimeError):
    """A graph does not match its PyTorch reference within tolerance."""


class StageSkipped(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass
class StageResult:
    name: str
    status: str                 # ran | cached | skipped | failed | not built
    reason: str = ""
    seconds: float = 0.0
    key: str = ""
    artifacts: dict[str, dict] = field(default_factory=dict)
    info: dict = field(default_factory=dict)


@dataclass
class Manifest:
    path: Path
    output: Path
    stages: dict[str, StageResult]
    data: dict

    def artifact(self, rel: str) -> Path:
        return self.output / rel


class Build:
    def __init__(self, cfg: BuildConfig, output: Path, force: bool, require_tensorrt: bool, log: TextIO | None):
        self.cfg, self.store, self.force, self.require_tensorrt = cfg, Store(output), force, require_tensorrt
        self.log = log
        self.results: dict[str, StageResult] = {}
        self._models = None

    def say(self, text: str) -> None:
        if self.log is not None:
            print(text, file=self.log, flush=True)

    # ------------------------------------------------------------------ stage machinery

    def upstream(self, name: str) -> dict:
        """What a stage's key depends on from its upstream stages: their artifacts' hashes."""
        return {dep: {rel: meta["sha256"] for rel, meta in self.results[dep].artifacts.items()}
                for dep in DEPENDS[name]}

    def run(self, name: str, selected: bool, key_data: dict, fn: Callable[[Path], dict],
            skip_reason: str | None = None) -> StageResult:
        key = sha256_json({"stage": name, "code": code_digest(*STAGE_CODE[name]), **key_data})
        rec = self.store.record(name)
        if rec is not None and rec.key == key and not (self.force and selected):
            problem = self.store.valid(rec)
            if problem is None:
                return self._done(StageResult(name, "cached", "inputs unchanged", 0.0, key, rec.artifacts, rec.info))
            self.say(f"  {name}: cache invalid ({problem}); rebuilding")
        if skip_reason is not None:
            self.store.drop(name)   # what is there was built from other inputs or elsewhere
            return self._done(StageResult(name, "skipped", skip_reason, key=key))
        if not selected:
            blocked = [d for d in DEPENDS[name] if self.results[d].status == "not built"]
            if blocked:   # the root cause is upstream: report that one
                root = self.results[blocked[0]].info
                return self._done(StageResult(name, "not built", f"not in --stages; {root['why']}", key=key, info=root))
            why = "out of date" if rec is not None else "not built"
            if rec is not None and rec.key == key:
                why = self.store.valid(rec) or why
            return self._done(StageResult(name, "not built", f"not in --stages; {why}", key=key,
                                          info={"stage": name, "why": why}))
        self.say(f"[{STAGES.index(name) + 1}/{len(STAGES)}] {name}")
        start = time.perf_counter()
        tmp = self.store.new_tmp(name)
        try:
            info = fn(tmp) or {}
        except StageSkipped as skip:
            shutil.rmtree(tmp, ignore_errors=True)
            self.store.drop(name)
            return self._done(StageResult(name, "skipped", skip.reason, time.perf_counter() - start, key))
        except BaseException as exc:
            shutil.rmtree(tmp, ignore_errors=True)     # nothing half-written stays behind
            from ..export.graph_files import DISK_FULL_ERRNOS, DiskFull
            if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
                raise BuildError(f"{self.store.root}: the {name} stage stopped: {exc}; free space on that file system "
                                 f"and run the build again (completed stages are kept)") from None
            if isinstance(exc, DiskFull):
                raise DiskFull(f"the {name} stage stopped: {exc}") from None
            raise
        rec = self.store.commit(name, tmp, key, info, time.perf_counter() - start)
        return self._done(StageResult(name, "ran", "", rec.seconds, key, rec.artifacts, rec.info))

    def _done(self, result: StageResult) -> StageResult:
        self.results[result.name] = result
        note = f" ({result.reason})" if result.reason else ""
        self.say(f"  {result.name}: {result.status}{note}" + (f" in {result.seconds:.1f}s" if result.status == "ran" else ""))
        return result

    def need(self, stage: str, selected: bool, *deps: str) -> None:
        """A selected stage cannot run on missing or stale upstream artifacts: name the root cause."""
        for dep in deps if selected else ():
            r = self.results[dep]
            if r.status == "not built":
                root, why = r.info["stage"], r.info["why"]
                raise BuildError(f"{self.store.root}: stage '{stage}' needs the {root} stage's artifacts ({why}); "
                                 f"add {root} to --stages or drop --stages")

    def path(self, stage: str, rel: str) -> Path:
        return self.store.stage_dir(stage) / rel

    # ------------------------------------------------------------------ models (loaded lazily)

    @property
    def resolved(self) -> dict:
        return json.loads(self.path("validate", "resolved.json").read_text())

    @property
    def device(self):
        """The resolved config `device` (a torch.device); 'cuda' without a GPU is a config error."""
        from ..devices import resolve_device
        try:
            return resolve_device(self.cfg.device)
        except ConfigError as exc:
            raise BuildConfigError(f"{self.cfg.source}: device: {exc}") from None

    def models_on(self, device, drafter: bool = True):
        """The models on `device`: the drafter moved there (in place), the target read there part
        by part as it is needed. drafter=False: the target alone where a stage needs no drafter
        (its drafter is not loaded: a 70B-wide one is 5 GB in float16)."""
        import torch
        m = self.models if drafter or self._models is not None else self._load_models(drafter=False)
        m.target.device = torch.device(device)
        if m.drafter is not None:
            m.drafter.to(device)
        return m

    @property
    def models(self):
        """The target as a StreamedTarget (its weights stay in the checkpoint's files and are read a
        part at a time: an 8B target is never in memory, models/streamed.py) and the drafter,
        loaded, with its own copy of the target's embedding when it shares it."""
        if self._models is None:
            self._models = self._load_models(drafter=True)
        return self._models

    def _load_models(self, drafter: bool):
        import torch

        from ..api import Models
        from ..checkpoints import load_drafter
        from ..models.streamed import StreamedTarget
        start = time.perf_counter()
        r = self.resolved
        dtypes = {self.cfg.precision.target.dtype, self.cfg.precision.drafter.dtype}
        target = StreamedTarget(r["target"]["folder"], torch.float32 if "float32" in dtypes else torch.float16)
        capture = CaptureLayers(tuple(r["capture"]["streams"]), "layer_input")
        target.set_capture(capture)
        loaded = load_drafter(r["drafter"]["folder"], target) if drafter else None
        if loaded is not None:
            loaded.cfg.capture = capture
        self.say(f"  target {target.describe()}; drafter {r['drafter']['label']} "
                 + (f"loaded in {time.perf_counter() - start:.1f}s" if drafter else "not needed here"))
        return Models(target, loaded, r["drafter"]["label"], target.tokenizer())

    def release_models(self) -> None:
        """Drop the drafter (the target holds no weights); a later stage that needs them loads them again."""
        self._models = None
        gc.collect()

    # ------------------------------------------------------------------ stages

    def validate(self, selected: bool) -> StageResult:
        from ..api import default_drafter_path
        from ..checkpoints import check_drafter_files, check_drafter_fits, resolve_target
        cfg = self.cfg
        folder = resolve_target(cfg.target.source)
        # every weights file read as far as its header: a missing or truncated shard, or a tensor
        # that does not fit the config, is named now rather than minutes into a later stage
        from ..models.streamed import StreamedTarget
        tcfg = StreamedTarget(folder, device="cpu").config
        drafter = None if cfg.drafter.source == "default" else Path(cfg.drafter.source)
        if drafter is None:
            drafter = default_drafter_path(cfg.target.source)
        elif not (drafter / "config.json").is_file():
            raise BuildConfigError(f"{cfg.source}: drafter.source: {drafter}: no drafter checkpoint "
                                   f"(config.json) there")
        key = {"target": cfg.section("target"), "drafter": cfg.section("drafter"), "tree": cfg.section("tree"),
               "engines": cfg.section("engines"), "target_files": fingerprint(folder),
               "drafter_files": fingerprint(drafter) if drafter
               else f"random {cfg.drafter.random_variant} {cfg.precision.drafter.dtype}"}

        def run(tmp: Path) -> dict:
            nonlocal drafter
            label = str(drafter)
            if drafter is None:   # no trained drafter for this target: an untrained one, reproducibly
                import torch

                from ..checkpoints import random_drafter_for, save_drafter
                # in the drafter graph's float type: a 70B-wide drafter is 9 GB in float32
                d = random_drafter_for(tcfg, cfg.drafter.random_variant, draft_vocab_size=min(8192, tcfg.vocab_size),
                                       dtype=getattr(torch, cfg.precision.drafter.dtype))
                drafter = save_drafter(d, tmp / "drafter")     # the target's weights are not loaded for it
                label = f"random {cfg.drafter.random_variant} (untrained)"
            dcfg = DrafterConfig.from_hf(read_json(drafter / "config.json"), str(drafter / "config.json"))
            check_drafter_fits(dcfg, tcfg)
            check_drafter_files(drafter, dcfg)     # its tensors' shapes, from the headers
            capture = self._capture(dcfg, tcfg)
            try:
                cfg.tree.shape.validate(dcfg.draft_vocab_size)
            except ConfigError as exc:
                raise BuildConfigError(f"{cfg.source}: tree: {exc} of {drafter}") from None
            for pname, p in dataclasses.asdict(cfg.engines.profiles).items():
                longest = p["max_tokens"] + p["max_past"]
                if longest > tcfg.max_position_embeddings:
                    raise BuildConfigError(f"{cfg.source}: engines.profiles.{pname}: max_tokens + max_past = {longest} "
                                           f"exceeds the target's context of {tcfg.max_position_embeddings} tokens "
                                           f"({tcfg.source}: max_position_embeddings)")
            in_output = drafter.is_relative_to(tmp)
            # the checkpoints' content fingerprints are part of what later stages' keys read: a
            # target or drafter rewritten in place makes its graphs again, not just this stage
            data = {"target": {"spec": cfg.target.source, "folder": str(folder.resolve()),
                               "num_layers": tcfg.num_hidden_layers, "hidden_size": tcfg.hidden_size,
                               "vocab_size": tcfg.vocab_size, "max_context": tcfg.max_position_embeddings,
                               "eos_ids": list(tcfg.eos_token_ids), "files": key["target_files"]},
                    "drafter": {"folder": str(self.path("validate", "drafter").resolve()) if in_output
                                else str(drafter.resolve()), "label": label, "variant": dcfg.variant,
                                "draft_vocab_size": dcfg.draft_vocab_size, "files": key["drafter_files"]},
                    "capture": capture, "tree": cfg.section("tree")}
            (tmp / "resolved.json").write_text(json.dumps(data, indent=2))
            self.say(f"  target {folder} ({tcfg.num_hidden_layers} layers); drafter {label} ({dcfg.variant}); "
                     f"captured {capture['convention']} ids {capture['layer_ids']} ({capture['source']})")
            return data
        self.say(f"  PyTorch side of calibration and parity on {self.device} (config device: {cfg.device})")
        # Validation is cheap and must hold for this very config, so it runs whatever --stages says.
        return self.run("validate", True, key, run)

    def _capture(self, dcfg: DrafterConfig, tcfg: TargetConfig) -> dict:
        """The captured tensors, in the config's numbering; ids stated in both the config and
        the checkpoint must name the same tensors."""
        want = self.cfg.target.capture
        shift = 0 if want.convention == "layer_input" else 1
        ckpt = dcfg.capture
        if want.layer_ids is not None:
            mine = CaptureLayers(want.layer_ids, want.convention)
            try:
                mine.validate(tcfg.num_hidden_layers, f"{self.cfg.source}: target.capture.layer_ids")
            except ConfigError as exc:
                raise BuildConfigError(str(exc)) from None
            if ckpt is not None and ckpt.streams() != mine.streams():
                raise BuildConfigError(
                    f"{self.cfg.source}: target.capture.layer_ids: {list(want.layer_ids)} ({want.convention}) names "
                    f"residual streams {list(mine.streams())}, but {dcfg.source} was trained on "
                    f"{list(ckpt.layer_ids)} ({ckpt.convention}) = streams {list(ckpt.streams())}")
            streams, source = mine.streams(), "config"
        elif ckpt is not None:
            streams, source = ckpt.streams(), f"checkpoint ({ckpt.convention} {list(ckpt.layer_ids)})"
        else:
            streams, source = CaptureLayers.eagle_default(tcfg.num_hidden_layers).streams(), "EAGLE default"
        return {"convention": want.convention, "layer_ids": [s - shift for s in streams], "streams": list(streams),
                "source": source}

    def export(self, selected: bool) -> StageResult:
        from ..export import GRAPH_FORMAT, export_drafter_step, export_drafter_tree, export_target
        from ..export.onnx_export import DTYPES
        cfg = self.cfg
        key = {"upstream": self.upstream("export"), "tree": cfg.section("tree"),
               "dtypes": [cfg.precision.target.dtype, cfg.precision.drafter.dtype],
               "step_graphs": cfg.outputs.step_graphs, "format": GRAPH_FORMAT}

        def run(tmp: Path) -> dict:
            m, shape = self.models_on("cpu"), cfg.tree.shape      # traced on the CPU: the graph is the same
            tdt, ddt = cfg.precision.target.dtype, cfg.precision.drafter.dtype
            weights_written = progress_callback("export", self.log, "target.onnx weights")
            jobs = [("target", lambda p: export_target(m.target.with_dtype(DTYPES[tdt]), p, tdt, weights_written)),
                    ("drafter_tree", lambda p: export_drafter_tree(m.drafter, shape, p, ddt))]
            if cfg.outputs.step_graphs:
                jobs += [("drafter_step_first", lambda p: export_drafter_step(m.drafter, p, True, ddt)),
                         ("drafter_step", lambda p: export_drafter_step(m.drafter, p, False, ddt))]
            progress, info = Progress("export", len(jobs), self.log), {}
            for name, job in jobs:
                result = job(tmp / f"{name}.onnx")
                info[name] = {"file": f"{name}.onnx", "dtype": tdt if name == "target" else ddt,
                              "seconds": round(result.seconds, 2), "ops": result.ops}
                progress.step(f"{name}.onnx")
            return info
        self.need("export", selected, "validate")
        return self.run("export", selected, key, run)

    def quantize(self, selected: bool) -> StageResult:
        cfg = self.cfg
        fmts = {n: getattr(cfg.precision, n).format for n in ("target", "drafter")}
        qdq = any(getattr(cfg.precision, n).quantized for n in fmts)       # Q/DQ graphs: calibrated
        skip = None if qdq or cfg.precision.target.weight_only else \
            f"precision is target {fmts['target']}, drafter {fmts['drafter']}: nothing to quantize"
        key = {"upstream": self.upstream("quantize"), "precision": cfg.section("precision"),
               "calibration": cfg.section("calibration"), "tree": cfg.section("tree"), "device": self.device.type}

        def run(tmp: Path) -> dict:
            from .quantize import quantize_graphs
            graphs = {g: self.path("export", f"{g}.onnx") for g in ("target", "drafter_tree")}
            models = self.models_on(self.device, drafter=cfg.precision.drafter.quantized) if qdq \
                else None     # int4 alone: no calibration
            return quantize_graphs(models, graphs, cfg, tmp, self.log, release=self.release_models)
        if skip is None:
            self.need("quantize", selected, "export")
        return self.run("quantize", selected, key, run, skip)

    def graphs_for(self, purpose: str) -> dict[str, Path]:
        """The graph each model runs as: the quantized one where there is one. For ONNX Runtime
        ('onnxruntime'), NVFP4 graphs fall back to the float graph (ORT has no FP4 kernels)."""
        out = {}
        for model, graph in (("target", "target"), ("drafter", "drafter_tree")):
            p = getattr(self.cfg.precision, model)
            q = self.results["quantize"]
            usable = (p.quantized or p.weight_only) and q.status in ("ran", "cached") \
                and not (purpose == "onnxruntime" and p.format == "nvfp4")
            out[graph] = self.path("quantize", f"{graph}.{p.format}.onnx") if usable else self.path("export", f"{graph}.onnx")
        return out

    @property
    def ort_drafter_int8(self) -> bool:
        """Whether ONNX Runtime serves the drafter with int8 weights (serving.drafter_weights;
        auto: where it would run an fp32 float graph)."""
        weights = self.cfg.serving.drafter_weights
        return weights == "int8" or (weights == "auto" and self.cfg.precision.drafter.ort_float32)

    @property
    def ort_iteration_graph(self) -> bool:
        """Whether ONNX Runtime serves the iteration graph (serving.iteration_graph; auto: on,
        FP8 graphs included since the Triton model runs them with their own session settings:
        runtime/sessions.py FP8_SESSION)."""
        return self.cfg.serving.iteration_graph in ("on", "auto")

    @property
    def ort_fused_attention(self) -> TargetConfig | None:
        """The target's config where ONNX Runtime serves the fused-attention target graph
        (serving.attention; export/cpu_attention.py), else None. auto: an fp32 target (or int4
        with a chain tree) served one stream at a time whose family the rewrite maps; fused: the
        same, a family it does not map an error naming why."""
        from ..export.cpu_attention import FusedAttentionError, check_fusable
        cfg = self.cfg
        attention = cfg.serving.attention
        if attention == "portable" or not cfg.fused_attention_servable:
            return None
        path = Path(self.resolved["target"]["folder"]) / "config.json"
        tcfg = TargetConfig.from_hf(read_json(path), str(path))
        try:
            check_fusable(tcfg, str(path))
        except FusedAttentionError as exc:
            if attention == "fused":
                raise BuildError(f"serving.attention: fused: {exc}") from exc
            return None
        return tcfg

    @property
    def parity_checks_iteration(self) -> bool:
        """Whether the parity stage checks the served iteration graph against PyTorch: where it is
        composed of float graphs (quantized graphs are checked on their own, against fake-quant
        references; their composition is the same mechanical step)."""
        return self.ort_iteration_graph and not any(getattr(self.cfg.precision, m).quantized
                                                    for m in ("target", "drafter"))

    def parity(self, selected: bool) -> StageResult:
        from ..export.iteration import ITERATION_FORMAT
        cfg = self.cfg
        key = {"upstream": self.upstream("parity"), "parity": cfg.section("parity"), "tree": cfg.section("tree"),
               "precision": cfg.section("precision"), "device": self.device.type,
               "iteration_graph": self.parity_checks_iteration and ITERATION_FORMAT,
               "fused_attention": self.ort_fused_attention is not None}
        skip = None if cfg.parity.enabled else "parity.enabled is false in the config"

        def run(tmp: Path) -> dict:
            from .checks import run_parity_stage
            report = run_parity_stage(self, tmp)
            if not report["passed"]:
                failed = self.store.root / "parity.failed"
                shutil.rmtree(failed, ignore_errors=True)
                shutil.copytree(tmp, failed)
                raise ParityFailure(f"parity failed: {', '.join(report['failed'])}; report: {failed / 'report.json'}")
            return {k: v for k, v in report.items() if k != "graphs"}
        if skip is None:
            self.need("parity", selected, "export", "quantize")
        return self.run("parity", selected, key, run, skip)

    def engines(self, selected: bool) -> StageResult:
        from .engines import build_engines, tensorrt_status
        cfg = self.cfg
        if cfg.precision.target.weight_only:     # ONNX Runtime's MatMulNBits: no TensorRT form
            trt, why = None, "precision.target.format int4 is ONNX Runtime's 4-bit form (MatMulNBits); TensorRT engines " \
                             "take fp32, fp16, fp8 or nvfp4"
        else:
            trt, why = tensorrt_status() if cfg.engines.enabled else (None, "engines.enabled is false in the config")
        if trt is None and self.require_tensorrt:
            raise BuildError(f"--require-tensorrt: cannot build engines: {why}")
        graphs = self.graphs_for("tensorrt") if trt is not None else {}
        key = {"upstream": self.upstream("engines"), "engines": cfg.section("engines"), "tree": cfg.section("tree"),
               "graphs": {g: str(p.relative_to(self.store.root)) for g, p in graphs.items()},
               "tensorrt": getattr(trt, "__version__", None)}
        if trt is not None:
            self.need("engines", selected, "export", "quantize")
        return self.run("engines", selected, key, lambda tmp: build_engines(trt, graphs, cfg, tmp, self.log), why)

    def triton(self, selected: bool) -> StageResult:
        from ..export.iteration import ITERATION_FORMAT
        from .triton import TEMPLATE, write_repository
        cfg = self.cfg
        engines = self.results["engines"].status in ("ran", "cached")
        graphs = self.graphs_for("onnxruntime")
        onnxruntime = not engines and cfg.serving.runtime == "onnxruntime"
        int8 = onnxruntime and self.ort_drafter_int8
        iteration = onnxruntime and self.ort_iteration_graph
        fused = self.ort_fused_attention if onnxruntime else None
        key = {"upstream": self.upstream("triton"), "serving": cfg.section("serving"), "tree": cfg.section("tree"),
               "graphs": {g: str(p.relative_to(self.store.root)) for g, p in graphs.items()}, "drafter_int8": int8,
               "fused_attention": fused is not None,
               "iteration_graph": iteration and ITERATION_FORMAT,    # a new iteration format: composed again
               "template": hashlib.sha256(TEMPLATE.read_bytes()).hexdigest()}
        skip = None if cfg.outputs.triton else "outputs.triton is false in the config"
        if skip is None:
            self.need("triton", selected, "validate", "export", "quantize")

        def run(tmp: Path) -> dict:
            plans = {n: self.path("engines", f"{n}.plan") for n in ("target", "drafter_tree")} if engines else None
            precision = {g: next((f for f in ("fp8", "int4") if f".{f}." in p.name), "float") for g, p in graphs.items()}
            return write_repository(tmp, cfg, self.resolved, graphs, precision, plans, self.log, drafter_int8=int8,
                                    iteration_graph=iteration, fused_attention=fused)
        return self.run("triton", selected, key, run, skip)


# ---------------------------------------------------------------------------- entry point

def _config_record(cfg: BuildConfig) -> dict:
    data = config_to_dict(cfg)
    return {"source": cfg.source, "sha256": sha256_json(data), "data": data}


def build(config: BuildConfig, output: str | Path | None = None, stages: list[str] | None = None,
          force: bool = False, require_tensorrt: bool = False, log: TextIO | None = sys.stderr) -> Manifest:
    """Run the stages (all, or those in `stages`; validate always runs) into `output`
    (default: the config's outputs.dir, else artifacts/<name>) and write manifest.json."""
    unknown = sorted(set(stages or ()) - set(STAGES))
    if unknown:
        raise BuildError(f"unknown stage(s) {unknown}; stages are {', '.join(STAGES)}")
    out = config.output_dir(output)
    b = Build(config, out, force, require_tensorrt, log)
    removed = b.store.clean_temporaries()
    if removed:
        b.say(f"removed leftovers of an interrupted build: {', '.join(sorted(removed))}")
    wanted = set(stages or STAGES)
    error = None
    start = time.perf_counter()
    try:
        for name in STAGES:
            getattr(b, name)(name in wanted)
    except BaseException as exc:
        error = exc
        raise
    finally:
        try:
            manifest = _write_manifest(b, time.perf_counter() - start, error)
        except OSError as exc:     # a full disk: the stage's own error is the one to report
            if error is None:
                raise
            b.say(f"  (manifest.json not written: {exc})")
    if log is not None:
        print(summary_table(manifest), file=log)
    return manifest


def _write_manifest(b: Build, seconds: float, error: BaseException | None) -> Manifest:
    results = dict(b.results)
    for name in STAGES:
        if name not in results:
            results[name] = StageResult(name, "failed" if error and name == _current(b) else "not run",
                                        (f"{type(error).__name__}: {error}" if error and name == _current(b) else ""))
    artifacts = []
    for r in results.values():
        for rel, meta in r.artifacts.items():
            artifacts.append({"path": f"{r.name}/{rel}", "stage": r.name, **meta})
    data = {"name": b.cfg.name, "status": "failed" if error else "ok",
            "error": None if error is None else f"{type(error).__name__}: {error}",
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "output": str(b.store.root.resolve()), "seconds": round(seconds, 2),
            "config": _config_record(b.cfg), "versions": versions(),
            "stages": [{"name": r.name, "status": r.status, "reason": r.reason, "seconds": round(r.seconds, 2),
                        "key": r.key, "info": r.info} for r in (results[n] for n in STAGES)],
            "artifacts": artifacts}
    path = write_json_atomic(b.store.root / "manifest.json", data) if b.store.root.is_dir() else b.store.root
    return Manifest(path, b.store.root, results, data)


def _current(b: Build) -> str | None:
    return next((n for n in STAGES if n not in b.results), None)


def summary_table(m: Manifest) -> str:
    rows = [("stage", "status", "time", "files", "size", "note")]
    for s in m.data["stages"]:
        files = [a for a in m.data["artifacts"] if a["stage"] == s["name"]]
        rows.append((s["name"], s["status"], f"{s['seconds']:.1f}s" if s["status"] == "ran" else "-",
                     str(len(files)) if files else "-", human_bytes(sum(a["bytes"] for a in files)) if files else "-",
                     s["reason"]))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:5], widths)) + "  " + r[5] for r in rows]
    lines.append(f"output: {m.output}  manifest: {m.output / 'manifest.json'}  ({m.data['seconds']:.1f}s)")
    return "\n".join(lines)


__all__ = ["STAGES", "Build", "BuildError", "Manifest", "ParityFailure", "StageResult", "build", "summary_table"]
