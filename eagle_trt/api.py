"""Python API: load a target and a drafter, tokenize, run the speculative decoder."""
from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from .checkpoints import LoadedTarget, cache_dir, load_drafter, load_target, random_drafter, save_drafter
from .config import ConfigError, SamplingConfig, TreeShape
from .devices import resolve_device, resolve_dtype, torch_dtype
from .models.drafter import EagleDrafter
from .runtime.loop import DecodingLoop
from .runtime.static import StaticEngine

SHIPPED_DRAFTERS = Path(__file__).parent / "drafters"


def default_drafter_path(target_spec: str) -> Path | None:
    """The drafter shipped for the embedded default target, when there is one."""
    path = SHIPPED_DRAFTERS / "smollm2-eagle3.1"
    return path if target_spec == "smollm2" and (path / "config.json").is_file() else None


def load_target_on(spec: str, device: str = "auto", dtype: str | None = None) -> LoadedTarget:
    """load_target in the device's dtype (resolve_dtype), moved to the device; drafters loaded
    for it follow it there."""
    dev = resolve_device(device)
    target = load_target(spec, torch_dtype(resolve_dtype(dtype, dev)))
    target.model.to(dev)
    return target


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    if not text or not text.strip():
        raise ConfigError("the prompt is empty: nothing to condition on")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("--chat was given but the target's tokenizer has no chat template")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        return list(ids)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@dataclass
class Pipeline:
    target: LoadedTarget
    drafter: EagleDrafter
    drafter_source: str
    tokenizer: object
    decoder: DecodingLoop

    def generate(self, prompt: str, max_new_tokens: int, sampling: SamplingConfig | None = None,
                 chat: bool = False) -> dict:
        ids = encode_prompt(self.tokenizer, prompt, chat)
        result = self.decoder.generate(ids, max_new_tokens, sampling)
        out = result.as_dict()
        out["text"] = self.tokenizer.decode(result.tokens, skip_special_tokens=True)
        out["drafter"] = self.drafter_source
        out["drafter_variant"] = self.drafter.cfg.variant
        return out


@dataclass
class Models:
    """A target with its tokenizer and a drafter that fits it, capture layers set from the drafter."""
    target: LoadedTarget
    drafter: EagleDrafter | None      # None: the build's stages that need the target alone
    drafter_source: str
    tokenizer: object

    @property
    def eos_ids(self) -> set[int]:
        eos = set(self.target.config.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos.add(self.tokenizer.eos_token_id)
        return eos


def prepare_models(target_spec: str, drafter_path: str | None, dtype: str | None = "float32",
                   log: TextIO | None = None, device: str = "cpu") -> Models:
    """dtype None: the device's default (resolve_dtype); the models end up on `device`."""
    t0 = time.perf_counter()
    target = load_target_on(target_spec, device, dtype)
    w = target.model.embed_tokens.weight
    if drafter_path is None:
        drafter_path = default_drafter_path(str(target_spec))
    if drafter_path is None:
        # No trained drafter for this target: write a random EAGLE 3.1 one and load it back
        # through the ordinary checkpoint path, so the demo exercises the real loader; the
        # temporary checkpoint is gone once loaded.
        source = "random EAGLE 3.1 (untrained)"
        with tempfile.TemporaryDirectory(prefix="eagle_trt_random_drafter_") as tmp:
            folder = save_drafter(random_drafter(target, "eagle3.1",
                                                 draft_vocab_size=min(8192, target.config.vocab_size)),
                                  Path(tmp) / "drafter")
            drafter = load_drafter(folder, target)   # the target's device and dtype
    else:
        source = str(drafter_path)
        drafter = load_drafter(drafter_path, target)
    target.model.set_capture(drafter.cfg.capture_for(target.config))
    tokenizer = target.tokenizer()
    if log is not None:
        print(f"loaded target {target.folder} and drafter {source} ({drafter.cfg.variant}), {w.dtype} on {w.device}, "
              f"in {time.perf_counter() - t0:.1f}s", file=log)
    return Models(target, drafter, source, tokenizer)


def real_prompt_ids(models: Models, count: int, chat: bool = True) -> list[list[int]]:
    """The first `count` MT-bench questions, tokenized (with the chat template when there is one)."""
    from .data import mtbench_prompts
    use_chat = chat and bool(getattr(models.tokenizer, "chat_template", None))
    return [encode_prompt(models.tokenizer, text, use_chat) for text in mtbench_prompts()[:count]]


BACKENDS = ("torch", "onnxruntime")


def load_pipeline(target_spec: str, drafter_path: str | None, shape: TreeShape, dtype: str | None = "float32",
                  log: TextIO | None = None, backend: str = "torch", onnx_dir: str | Path | None = None,
                  device: str = "cpu", iteration_graph: bool = True, max_batch: int = 1,
                  attention: str = "portable") -> Pipeline:
    """backend 'torch' runs the PyTorch models on `device` (the fixed-shape engine,
    runtime/static.py: CUDA graphs on a GPU); 'onnxruntime' exports the target and the
    drafter-tree graphs into onnx_dir (default: a cache folder) and runs those on ONNX Runtime,
    on the CPU or (device 'cuda', with onnxruntime-gpu installed) its CUDA provider, with
    iteration_graph (the default, as the build serves) also the two composed into one graph
    called once an iteration (export/iteration.py); the drafter graph still encodes prompts.
    max_batch: the sequences the torch engine lays its caches out for. attention 'fused': the
    onnxruntime backend's target graph with ONNX Runtime's fused attention (export/cpu_attention.py;
    the CPU provider, float32)."""
    if backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {BACKENDS}, got {backend!r}")
    providers = None
    if backend == "onnxruntime":
        if device == "cuda":
            why = ort_cuda_available()
            if why is not None:
                raise ConfigError(f"--backend onnxruntime --device cuda: {why}; or use --backend torch for CUDA")
            from .runtime.sessions import PROVIDERS
            providers = PROVIDERS["cuda"]
        device = "cpu"          # the models are traced on the CPU; the sessions run on `providers`
    models = prepare_models(target_spec, drafter_path, dtype, log, device)
    dtype = str(models.target.model.embed_tokens.weight.dtype).removeprefix("torch.")
    if backend == "torch":
        engine = StaticEngine(models.target.model, models.drafter, shape, max_batch=max_batch)
    else:
        if dtype not in ("float32", "float16"):
            raise ConfigError(f"the onnxruntime backend runs float32 or float16 graphs, not {dtype}")
        folder = Path(onnx_dir) if onnx_dir else cache_dir() / "onnx" / models.target.folder.name
        engine = onnxruntime_backends(models, shape, folder, dtype, log, iteration_graph, providers,
                                      attention=attention).engine()
    decoder = DecodingLoop(engine, models.eos_ids, vocab_size=models.target.config.vocab_size)
    return Pipeline(models.target, models.drafter, models.drafter_source, models.tokenizer, decoder)


def ort_cuda_available() -> str | None:
    """None where onnxruntime has the CUDA execution provider, else why not."""
    import onnxruntime as ort
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return f"onnxruntime {ort.__version__} has no CUDAExecutionProvider (install onnxruntime-gpu)"
    return None


def onnxruntime_backends(models: Models, shape: TreeShape | None, folder: Path, dtype: str = "float32",
                         log: TextIO | None = None, iteration_graph: bool = True, providers: list[str] | None = None,
                         kv_device: str | None = None, drafter_graph: str = "drafter_tree",
                         attention: str = "portable", **session):
    """ONNX Runtime backends (runtime/ort_engines.OrtBackends: `.engine()` decodes on them) on
    `models`' graphs in `folder` (exported there where not current), on ONNX Runtime's
    `providers` (default: the CPU's). shape None: the target alone (plain decoding);
    iteration_graph False: no iteration graph. kv_device: where the KV caches live
    (onnxruntime_backend.kv_device_for; None: on the GPU where the sessions run on CUDA and
    PyTorch has it). drafter_graph: 'drafter_tree', or 'drafter_tree_int8' (its int8 weights,
    export/cpu_int8.py; the iteration graph composed of it). attention: 'portable', or 'fused' (the
    target graph with ONNX Runtime's fused attention, export/cpu_attention.py: the CPU provider,
    float32, one sequence a call where a call has several rows). session: open_backends' options."""
    from .export import export_pipeline
    from .runtime.ort_engines import open_backends
    if attention not in ("portable", "fused"):
        raise ConfigError(f"attention must be 'portable' or 'fused', got {attention!r}")
    if attention == "fused" and (dtype != "float32" or providers not in (None, ["CPUExecutionProvider"])):
        raise ConfigError(f"the fused-attention target graph runs on ONNX Runtime's CPU provider in float32, "
                          f"not {dtype} on {providers}")
    target = "target_fused" if attention == "fused" else "target"
    iteration = {"drafter_tree": "iteration", "drafter_tree_int8": "iteration_int8"}[drafter_graph]
    names = (target,) if shape is None else (target, drafter_graph) + ((iteration,) if iteration_graph else ())
    graphs = export_pipeline(models, shape or TreeShape(3, 2, 4), folder, dtype, log=log, only=names,
                             target_graph=folder / f"{target}.onnx")     # the iteration graph composed with it
    graphs = {"target": graphs[target], "drafter_tree": graphs.get(drafter_graph), "iteration": graphs.get(iteration)}
    return open_backends({k: v for k, v in graphs.items() if v is not None}, shape,
                         models.target.config.max_position_embeddings, providers=providers, kv_device=kv_device,
                         **session)
