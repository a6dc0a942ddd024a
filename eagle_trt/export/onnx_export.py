"""Trace the graphs in graphs.py to ONNX files, atomically, and check them."""
from __future__ import annotations

import gc
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import onnx
import torch

from ..config import TreeShape
from ..models.drafter import EagleDrafter
from ..models.streamed import StreamedTarget
from ..models.target import LlamaTarget, causal_mask
from ..graph_names import DRAFT_STEP_INPUTS, DRAFT_STEP_OUTPUTS, DRAFT_TREE_INPUTS, DRAFT_TREE_OUTPUTS, target_io_names
from .graphs import DrafterStepGraph, DraftTreeGraph, TargetGraph
from .graph_files import install_graph
from .opcheck import check_graph
from .shape_folding import fold_shapes
from .weights import Resolver, WeightWritten, attach_weights, stand_in, weights_as_inputs

DEFAULT_OPSET = 19   # FP8 Q/DQ needs >= 19
DTYPES = {"float32": torch.float32, "float16": torch.float16}
# Example sizes for tracing: distinct and non-zero, so a size that got baked in as a
# constant shows up as a wrong shape when the parity tests run other sizes.
TRACE_BATCH, TRACE_NEW, TRACE_PAST = 2, 3, 5
# What every graph's callers guarantee about its named axes, for fold_shapes: a call has a
# sequence and a new token at least, and an attention mask covers the past and the new rows.
AXIS_FACTS = {"positive": ("batch", "new_tokens"), "relations": {"total_tokens": "past_tokens + new_tokens"}}


@dataclass
class ExportedGraph:
    path: Path
    seconds: float
    ops: list[str]


def _export(make_graph, module: torch.nn.Module, dtype: str, args: tuple, path: Path, inputs: list[str],
            outputs: list[str], dynamic_axes: dict, opset: int,
            static_dims: dict[str, dict[int, int]] | None = None, resolve: Resolver | None = None,
            on_weight: WeightWritten | None = None) -> ExportedGraph:
    """Trace make_graph(stand-in of `module` in `dtype`) into a temporary folder, attach the real
    weights tensor by tensor (weights.py), check, then move into place (with its data file if
    any). static_dims: output sizes fixed by construction that shape inference lost behind a
    dynamic axis (the tree's node count behind the batch axis), written into the output types.
    resolve: where the values of `module`'s meta parameters are (a target read part by part);
    on_weight(done, total, name) after each weight is written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.stem}.", dir=path.parent))
    try:
        tmp_file = tmp / path.name
        traced = make_graph(stand_in(module, DTYPES[dtype]))
        names, weights = weights_as_inputs(traced, len(inputs))
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")   # tracer warnings about python ints are expected and checked by tests
            torch.onnx.export(traced, (*args, *weights), str(tmp_file), input_names=inputs + names,
                              output_names=outputs, dynamic_axes=dynamic_axes, opset_version=opset, dynamo=False,
                              do_constant_folding=True)
        del traced, weights
        gc.collect()      # the traced stand-in sits in reference cycles: free its placeholder buffer now
        graph = onnx.load(str(tmp_file))
        fold_shapes(graph, **AXIS_FACTS)     # the traced views' run-time shape arithmetic, made constant
        for out in graph.graph.output:
            for axis, size in (static_dims or {}).get(out.name, {}).items():
                out.type.tensor_type.shape.dim[axis].dim_value = size
        # ops, types and structure: the weights (graph inputs here) are not needed
        check_graph(graph, str(path))
        onnx.checker.check_model(graph)
        final = tmp / "out" / path.name
        final.parent.mkdir()
        written = attach_weights(graph, make_graph(module), len(inputs), final, resolve, on_weight)
        ops = sorted({n.op_type for n in graph.graph.node})
        del graph
        if len(written) > 1:     # the graph without its external weights, and their references
            onnx.checker.check_model(str(final))
        install_graph(written, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ExportedGraph(path, time.perf_counter() - start, ops)


def _kv_like(num_kv_heads: int, head_dim: int, length: int, dtype, batch: int = 1) -> torch.Tensor:
    return torch.randn(batch, num_kv_heads, length, head_dim).to(dtype)      # [B, Hkv, rows, D]


def export_target(model: LlamaTarget | StreamedTarget, path: Path, dtype: str = "float32",
                  on_weight: WeightWritten | None = None, opset: int = DEFAULT_OPSET) -> ExportedGraph:
    """The target graph; of a StreamedTarget, its weights are copied from the checkpoint files
    one tensor at a time into the graph's data file (the model is never loaded)."""
    resolve = None
    if isinstance(model, StreamedTarget):
        model, resolve = model.model, model.weight_ref
    cfg = model.cfg
    inputs, outputs = target_io_names(cfg.num_hidden_layers)
    B, T, P = TRACE_BATCH, TRACE_NEW, TRACE_PAST
    past = [_kv_like(cfg.num_key_value_heads, cfg.head_dim, P, DTYPES[dtype], B) for _ in range(2 * cfg.num_hidden_layers)]
    args = (torch.zeros(B, T, dtype=torch.int64), torch.arange(P, P + T)[None].repeat(B, 1),
            causal_mask(T, P).repeat(B, 1, 1), torch.arange(T - 1), *past)
    axes = {"input_ids": {0: "batch", 1: "new_tokens"}, "position_ids": {0: "batch", 1: "new_tokens"},
            "attention_mask": {0: "batch", 1: "new_tokens", 2: "total_tokens"}, "logits_index": {0: "logit_tokens"},
            "logits": {0: "batch", 1: "logit_tokens"}, "captured": {0: "batch", 1: "new_tokens"},
            "accept_path": {0: "batch", 1: "logit_tokens"}, "accept_length": {0: "batch"},
            "accept_tokens": {0: "batch", 1: "logit_tokens"}}
    for name in inputs[4:]:
        axes[name] = {0: "batch", 2: "past_tokens"}
    for name in outputs:
        if name.startswith("new_"):
            axes[name] = {0: "batch", 2: "new_tokens"}
    return _export(TargetGraph, model, dtype, args, path, inputs, outputs, axes, opset, resolve=resolve,
                   on_weight=on_weight)


def _drafter_example(drafter: EagleDrafter, dtype, batch: int = 1) -> tuple:
    c = drafter.cfg
    T, P = TRACE_NEW, TRACE_PAST
    captured = torch.randn(batch, T, c.num_aux_hidden_states * c.target_hidden_size).to(dtype)
    ids = torch.randint(0, c.vocab_size, (batch, T))
    return captured, ids, _kv_like(c.num_key_value_heads, c.head_dim, P, dtype, batch), \
        _kv_like(c.num_key_value_heads, c.head_dim, P, dtype, batch)


def export_drafter_tree(drafter: EagleDrafter, shape: TreeShape, path: Path, dtype: str = "float32",
                        opset: int = DEFAULT_OPSET) -> ExportedGraph:
    shape.validate(drafter.cfg.draft_vocab_size)
    axes = {"captured": {0: "batch", 1: "new_tokens"}, "input_ids": {0: "batch", 1: "new_tokens"},
            "past_key": {0: "batch", 2: "past_tokens"}, "past_value": {0: "batch", 2: "past_tokens"},
            "past_lengths": {0: "batch"}, "new_lengths": {0: "batch"},
            "new_key": {0: "batch", 2: "new_tokens"}, "new_value": {0: "batch", 2: "new_tokens"}}
    for name in DRAFT_TREE_OUTPUTS[:5]:
        axes[name] = {0: "batch"}
    # Traced with two sequences of different lengths, so no length is baked in as a constant.
    example = _drafter_example(drafter, DTYPES[dtype], TRACE_BATCH) + \
        (torch.tensor([TRACE_PAST, TRACE_PAST - 2]), torch.tensor([TRACE_NEW, TRACE_NEW - 1]))
    N = shape.total_tokens
    nodes = {"tree_tokens": {1: N}, "tree_parents": {1: N + 1}, "tree_mask": {1: N + 1, 2: N + 1},
             "tree_depths": {1: N + 1}, "tree_scores": {1: N}}
    return _export(lambda d: DraftTreeGraph(d, shape), drafter, dtype, example, path, DRAFT_TREE_INPUTS,
                   DRAFT_TREE_OUTPUTS, axes, opset, nodes)


def export_drafter_step(drafter: EagleDrafter, path: Path, first: bool, dtype: str = "float32",
                        opset: int = DEFAULT_OPSET) -> ExportedGraph:
    c = drafter.cfg
    captured, ids, pk, pv = _drafter_example(drafter, DTYPES[dtype])
    hidden = captured if first else torch.randn(1, TRACE_NEW, c.hidden_size).to(DTYPES[dtype])
    args = (hidden, ids, torch.arange(TRACE_PAST, TRACE_PAST + TRACE_NEW)[None], causal_mask(TRACE_NEW, TRACE_PAST),
            pk, pv)
    axes = {"hidden": {1: "new_tokens"}, "input_ids": {1: "new_tokens"}, "position_ids": {1: "new_tokens"},
            "attention_mask": {1: "new_tokens", 2: "total_tokens"}, "past_key": {2: "past_tokens"},
            "past_value": {2: "past_tokens"}, "logits": {1: "new_tokens"}, "feedback": {1: "new_tokens"},
            "new_key": {2: "new_tokens"}, "new_value": {2: "new_tokens"}}
    return _export(lambda d: DrafterStepGraph(d, first), drafter, dtype, args, path, DRAFT_STEP_INPUTS,
                   DRAFT_STEP_OUTPUTS, axes, opset)
