"""The Triton model repository: one decoupled Python-backend model running the speculative
loop (model.py from triton_model.py), plus tensorrt_plan models for the target and drafter
engines where the engines stage built them.

    <repo>/<name>/config.pbtxt              backend "python", decoupled, inputs optional where they may be
    <repo>/<name>/1/model.py, eagle.json    the loop and its settings
    <repo>/<name>/1/graphs/*.onnx           graphs for the in-process ONNX Runtime path
    <repo>/<name>/1/tokenizer/              the target's tokenizer
    <repo>/<name>_target/{config.pbtxt,1/model.plan}, <name>_drafter/...   (with engines only)
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..config import TargetConfig
from ..export.cpu_attention import fuse_attention
from ..export.cpu_int8 import quantize_int8
from ..graph_names import kv_heads_and_dim
from .config import BuildConfig
from .engines import input_dims
from .store import Progress

TEMPLATE = Path(__file__).with_name("triton_model.py")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "chat_template.jinja", "added_tokens.json",
                   "generation_config.json")
ONNX_TYPES = {1: "TYPE_FP32", 10: "TYPE_FP16", 7: "TYPE_INT64", 9: "TYPE_BOOL", 6: "TYPE_INT32"}

REQUEST_INPUTS = [  # name, Triton type, dims
    ("text_input", "TYPE_STRING", [1]), ("input_ids", "TYPE_INT64", [-1]), ("max_tokens", "TYPE_INT32", [1]),
    ("temperature", "TYPE_FP32", [1]), ("top_p", "TYPE_FP32", [1]), ("top_k", "TYPE_INT32", [1]),
    ("seed", "TYPE_INT64", [1]), ("stop_token_ids", "TYPE_INT64", [-1])]
RESPONSE_OUTPUTS = [("text_output", "TYPE_STRING", [1]), ("token_ids", "TYPE_INT64", [-1]), ("accepted", "TYPE_INT32", [1]),
                    ("finish_reason", "TYPE_STRING", [1])]


def _tensor(name: str, dtype: str, dims: list[int], optional: bool = False) -> str:
    opt = "\n    optional: true" if optional else ""
    return f'  {{\n    name: "{name}"\n    data_type: {dtype}\n    dims: [ {", ".join(map(str, dims))} ]{opt}\n  }}'


def python_model_config(name: str, instances: int = 1) -> str:
    inputs = ",\n".join(_tensor(n, t, d, optional=True) for n, t, d in REQUEST_INPUTS)
    outputs = ",\n".join(_tensor(n, t, d) for n, t, d in RESPONSE_OUTPUTS)
    return (f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n'
            f"model_transaction_policy {{\n  decoupled: true\n}}\n"
            f"input [\n{inputs}\n]\noutput [\n{outputs}\n]\n"
            f"instance_group [\n  {{\n    count: {instances}\n    kind: KIND_CPU\n  }}\n]\n")


def _graph_io(path: Path) -> tuple[list, list]:
    import onnx
    model = onnx.load(str(path), load_external_data=False)
    inits = {i.name for i in model.graph.initializer}

    def rows(values):
        return [(v.name, ONNX_TYPES[v.type.tensor_type.elem_type],
                 [d.dim_value if d.dim_value else -1 for d in v.type.tensor_type.shape.dim]) for v in values]
    return rows([i for i in model.graph.input if i.name not in inits]), rows(model.graph.output)


def plan_model_config(name: str, graph: Path, profiles: list[int]) -> str:
    """tensorrt_plan model: I/O from the graph the plan was built from; every profile available
    to the instance, so the backend picks the one whose shape ranges fit each request."""
    inputs, outputs = _graph_io(graph)
    ins = ",\n".join(_tensor(*r) for r in inputs)
    outs = ",\n".join(_tensor(*r) for r in outputs)
    profs = ", ".join(f'"{p}"' for p in profiles)
    return (f'name: "{name}"\nplatform: "tensorrt_plan"\nmax_batch_size: 0\n'
            f"input [\n{ins}\n]\noutput [\n{outs}\n]\n"
            f"instance_group [\n  {{\n    count: 1\n    kind: KIND_GPU\n    profile: [ {profs} ]\n  }}\n]\n")


def _link(src: Path, dst: Path) -> None:
    """Hard link where possible (same file system: no second copy of multi-GB weights)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _link_graph(src: Path, folder: Path) -> Path:
    """The graph and every file it reads its weights from, under their own names (external data
    locations are relative to the graph), checked in place: a repository that cannot load a
    graph fails the build here, naming the missing file, instead of at serving time."""
    from ..export.graph_files import check_graph_files, graph_files
    for f in graph_files(src):
        _link(f, folder / f.name)
    check_graph_files(folder / src.name)
    return folder / src.name


def torch_runtime(version: Path, cfg: BuildConfig, resolved: dict) -> dict:
    """serving.runtime torch: the target and drafter checkpoints linked into the repository
    (target/, drafter/: their config, weights and tokenizer files) and the settings the model
    runs them with; max_context is what the static caches hold (StaticEngine.staged_rows)."""
    from ..runtime.static import StaticEngine
    for role in ("target", "drafter"):
        src = Path(resolved[role]["folder"])
        files = [f for f in sorted(src.iterdir()) if f.is_file() and f.suffix in (".json", ".safetensors", ".model",
                                                                                  ".txt", ".gguf")]
        if not any(f.suffix in (".safetensors", ".gguf") for f in files):
            raise FileNotFoundError(f"{src}: no weights (.safetensors) to serve the {role} with (serving.runtime: torch)")
        for f in files:
            _link(f, version / role / f.name)
    staged = StaticEngine.staged_rows(cfg.tree.shape)
    if cfg.serving.capacity <= staged:
        raise ValueError(f"serving.capacity {cfg.serving.capacity} leaves no room for a sequence: an iteration stages "
                         f"{staged} rows")
    return {"torch_device": cfg.serving.torch_device, "torch_dtype": cfg.serving.torch_dtype,
            "capacity": cfg.serving.capacity, "capture": resolved["capture"],
            "max_context": min(resolved["target"]["max_context"], cfg.serving.capacity - staged)}


def _kv(graph: Path, layers_key: str) -> dict:
    import onnx
    dims = input_dims(graph)
    model = onnx.load(str(graph), load_external_data=False)
    elem = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}[layers_key]
    shape = dims[layers_key]
    heads, head_dim = kv_heads_and_dim(shape, str(graph))
    return {"heads": heads, "head_dim": head_dim, "dtype": {1: "float32", 10: "float16"}[elem],
            "layers": sum(1 for n in dims if n.startswith("past_key_")) or 1}


def write_repository(out: Path, cfg: BuildConfig, resolved: dict, graphs: dict[str, Path], precision: dict[str, str],
                     plans: dict[str, Path] | None, log=None, drafter_int8: bool = False,
                     iteration_graph: bool = False, fused_attention: TargetConfig | None = None) -> dict:
    """The repository in `out`; `drafter_int8` (ONNX Runtime only) serves the drafter graph with
    int8 weights made here from graphs['drafter_tree'] (serving.drafter_weights);
    `fused_attention` (ONNX Runtime only: the target's config) serves the target graph with ONNX
    Runtime's fused attention, made here from graphs['target'] (serving.attention; a 4-bit one's
    with int8 activations, lossless for the chain tree the config then has);
    `iteration_graph` (ONNX Runtime only) adds the served target and drafter graphs composed
    into one (serving.iteration_graph, export/iteration.py)."""
    name = cfg.serving.model_name
    version = out / name / "1"
    iteration_graph = iteration_graph and not plans
    fused_attention = None if plans else fused_attention
    progress = Progress("triton", 4 + drafter_int8 + iteration_graph + (fused_attention is not None), log)
    version.mkdir(parents=True)
    shutil.copy2(TEMPLATE, version / "model.py")
    (out / name / "config.pbtxt").write_text(python_model_config(name))
    progress.step("python model")

    tok = version / "tokenizer"
    tok.mkdir()
    src = Path(resolved["target"]["folder"])
    copied = [f for f in TOKENIZER_FILES if (src / f).is_file()]
    for f in copied:
        shutil.copy2(src / f, tok / f)
    if "tokenizer.json" not in copied and "tokenizer.model" not in copied:
        raise FileNotFoundError(f"{src}: no tokenizer files (tokenizer.json / tokenizer.model) to serve with")
    progress.step(f"tokenizer ({len(copied)} files)")

    settings = {"backend": "tensorrt" if plans else "onnxruntime", "tree": [cfg.tree.depth, cfg.tree.top_k, cfg.tree.total_tokens],
                "max_context": resolved["target"]["max_context"], "vocab_size": resolved["target"]["vocab_size"],
                "eos_ids": sorted(set(resolved["target"]["eos_ids"])), "chat": cfg.serving.chat,
                "max_tokens": cfg.serving.max_tokens, "max_concurrent": cfg.serving.max_concurrent,
                "prefill_chunk": cfg.serving.prefill_chunk, "cost_model": cfg.serving.cost_model,
                "threads": cfg.serving.threads, "graphs": {}, "precision": precision,
                "target_kv": _kv(graphs["target"], "past_key_0"), "drafter_kv": _kv(graphs["drafter_tree"], "past_key")}
    if not plans and cfg.serving.runtime == "torch":
        settings.update(backend="torch", precision={}, **torch_runtime(version, cfg, resolved))
    elif plans:
        settings.update(target_model=f"{name}_target", drafter_model=f"{name}_drafter")
        for graph, model, profiles in (("target", f"{name}_target", [0, 1]), ("drafter_tree", f"{name}_drafter", [0])):
            (out / model / "1").mkdir(parents=True)
            _link(plans[graph], out / model / "1" / "model.plan")
            (out / model / "config.pbtxt").write_text(plan_model_config(model, graphs[graph], profiles))
    if settings["backend"] == "onnxruntime":
        for graph, path in graphs.items():
            if graph == "target" and fused_attention is not None:
                path = version / "graphs" / f"{path.stem}.fused.onnx"
                path.parent.mkdir(exist_ok=True)
                int4 = precision.get(graph) == "int4"
                counts = fuse_attention(graphs[graph], path, fused_attention, int8_activations=int4)
                progress.step(f"fused-attention target graph ({counts['fused_layers']} GroupQueryAttention layers"
                              + (", int8 activations: chain trees" if int4 else "") + ")")
            elif graph == "drafter_tree" and drafter_int8:
                path = version / "graphs" / f"{path.stem}.int8.onnx"
                path.parent.mkdir(exist_ok=True)
                counts = quantize_int8(graphs[graph], path)
                precision = dict(precision, drafter_tree="int8")
                progress.step(f"int8 drafter weights ({counts['int8_matmuls']} MatMuls)")
            else:
                _link_graph(path, version / "graphs")
            settings["graphs"][graph] = f"graphs/{path.name}"
        settings["precision"] = precision
        if iteration_graph:
            from ..export.iteration import compose_iteration
            served = {g: version / f for g, f in settings["graphs"].items()}
            path = version / "graphs" / "iteration.onnx"
            compose_iteration(served["target"], served["drafter_tree"], path, tensorrt=not drafter_int8)
            settings["graphs"]["iteration"] = f"graphs/{path.name}"
            progress.step("iteration graph (the drafter and target graphs in one)")
    progress.step({"tensorrt": "tensorrt_plan models", "onnxruntime": "onnx graphs",
                   "torch": "checkpoints for the torch runtime"}[settings["backend"]])
    import json
    (version / "eagle.json").write_text(json.dumps(settings, indent=2))
    progress.step("eagle.json")
    served = {g: Path(f).name for g, f in settings["graphs"].items()} or {g: p.name for g, p in graphs.items()}
    return {"model": name, "backend": settings["backend"], "graphs": served, "precision": settings["precision"],
            "models": sorted(p.name for p in out.iterdir())}


def served_graphs(repository: Path, name: str) -> dict[str, Path] | None:
    """The ONNX graphs a repository's in-process ONNX Runtime path runs (eagle.json), by graph
    name: what an offline run must use to be compared with the served stream. None where the
    repository serves TensorRT engines."""
    import json
    version = Path(repository) / name / "1"
    settings = json.loads((version / "eagle.json").read_text())
    return {g: version / f for g, f in settings["graphs"].items()} if settings["backend"] == "onnxruntime" else None


__all__ = ["TEMPLATE", "plan_model_config", "python_model_config", "served_graphs", "write_repository"]
