"""The iteration graph: the drafter-tree graph and the target graph composed into one ONNX graph,
so one speculative iteration is one graph call (issue 22).

In the two-graph loop the host sits between the calls: it reads the drafter's tree, builds the
verification inputs (root, tokens, positions, mask) and binds them for the target. Here a few
glue nodes do that inside the graph, and the target's greedy acceptance follows as before:

    drafter tree graph (names prefixed "drafter.")  ->  glue  ->  target graph (names as exported)

iteration:  drafter.captured [B,Tp,A*Ht], drafter.input_ids [B,Tp] i64, drafter.past_key,
            drafter.past_value [B,Hkv,Pd,D], drafter.past_lengths [B] i64, drafter.new_lengths [B] i64
            (the drafter tree graph's inputs: the committed rows it has not encoded, the last
            valid one the root), past_lengths [B] i64 (the target's committed rows),
            verify_nodes [1] i64 (n: how many of each tree's N nodes are verified, its n best;
            more than N verifies N), past_key_{i}, past_value_{i} [B,Hkv,P,D]
        ->  drafter.tree_tokens, drafter.tree_parents, drafter.tree_mask, drafter.tree_depths,
            drafter.tree_scores, drafter.new_key, drafter.new_value (the drafter graph's outputs,
            the whole trees), input_ids [B,1+n] (root, then the tree's first n tokens),
            logits [B,1+n,V], captured [B,1+n,A*H],
            accept_path, accept_length, accept_tokens, new_key_{i}, new_value_{i} (the target's),
            next_captured [B,Tp,A*Ht], next_input_ids [B,Tp] i64 (the hand-off: the next call's
            drafter.captured and drafter.input_ids, with accept_length its drafter.new_lengths)

glue: root = drafter.input_ids[b, new_lengths[b] - 1]; the tree cut to its first n nodes (its
n best, a tree of their own: tree.py), input_ids = [root, tree_tokens[:n]]; position_ids =
past_lengths + tree_depths[:n+1]; attention_mask = [row < past_lengths for each of the P past
rows, tree_mask[:n+1, :n+1]]; logits_index = 0..n (every row). So one call verifies whatever
subtree the cost model picks, not only the whole tree. The two graphs are composed as they are
on disk, so each keeps its own precision (the int8 drafter ONNX Runtime serves, FP8 Q/DQ ...).

hand-off (after the target): next_captured[b, j] = captured[b, accept_path[b, j]] and
next_input_ids[b, j] = accept_tokens[b, j] for j < Tp (this call's drafter rows, which must be at
least the tree's depth + 1 to hold every accepted path), cast to the drafter's input type: the
accepted rows' states and the ids one position later, in path order, with the next call's
drafter input shapes. A runtime binds them as the next call's drafter inputs (two buffers in
turn), so the accepted states never pass through the host; rows past a path's length are
padding (row 0's state and token; zeros past 1 + n)."""
from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import uses_external_data

from ..graph_names import HANDOFF, PREFIX, VERIFY_NODES
from .graph_files import check_graph_files, check_structure, install_graph, save_graph
from .onnx_export import ExportedGraph
from .opcheck import check_graph

ORT_CONTRIB = "com.microsoft"     # ONNX Runtime's contrib operators' domain (MatMulNBits)

TARGET_FED = ("input_ids", "position_ids", "attention_mask", "logits_index")   # made by the glue
GLUE = "iteration_glue/"
ITERATION_FORMAT = 3   # 2: the hand-off outputs; 3: verify_nodes


class IterationGraphError(ValueError):
    pass


def _io(graph: onnx.GraphProto) -> tuple[dict, dict]:
    return {i.name: i for i in graph.input}, {o.name: o for o in graph.output}


def _static_dim(value: onnx.ValueInfoProto, axis: int, source: str) -> int:
    dim = value.type.tensor_type.shape.dim[axis]
    if not dim.HasField("dim_value"):
        raise IterationGraphError(f"{source}: output {value.name!r} axis {axis} is not a fixed size; the tree's "
                                  f"node count must be (re-export the drafter graph with this eagle_trt)")
    return dim.dim_value


def _glue_nodes(nodes: int) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """The verification inputs from the drafter's tree, the committed lengths and the number of
    draft nodes to verify (docstring)."""
    g, d = GLUE, PREFIX
    consts = [numpy_helper.from_array(np.array(v, dtype=np.int64), g + name) for name, v in
              (("one", 1), ("one_1d", [1]), ("zero", 0), ("zero_1d", [0]), ("zeros_2", [0, 0]), ("axis1", [1]),
               ("axes12", [1, 2]), ("two", 2), ("max_nodes", [nodes]))]
    n = helper.make_node
    return [
        # n = min(verify_nodes, N) draft nodes: the tree's first n are its n best and a tree of their own
        n("Min", [VERIFY_NODES, g + "max_nodes"], [g + "n"]),
        n("Add", [g + "n", g + "one_1d"], [g + "n_rows"]),
        n("Slice", [d + "tree_tokens", g + "zero_1d", g + "n", g + "axis1"], [g + "tokens"]),
        n("Slice", [d + "tree_depths", g + "zero_1d", g + "n_rows", g + "axis1"], [g + "depths"]),
        n("Concat", [g + "n_rows", g + "n_rows"], [g + "n_rows_2"], axis=0),
        n("Slice", [d + "tree_mask", g + "zeros_2", g + "n_rows_2", g + "axes12"], [g + "tree_mask"]),
        n("Sub", [d + "new_lengths", g + "one"], [g + "last"]),
        n("Unsqueeze", [g + "last", g + "axis1"], [g + "last_col"]),
        n("GatherElements", [d + "input_ids", g + "last_col"], [g + "root"], axis=1),
        n("Concat", [g + "root", g + "tokens"], ["input_ids"], axis=1),
        n("Unsqueeze", ["past_lengths", g + "axis1"], [g + "lengths_col"]),
        n("Add", [g + "depths", g + "lengths_col"], ["position_ids"]),
        n("Shape", ["past_key_0"], [g + "past_shape"]),
        n("Gather", [g + "past_shape", g + "two"], [g + "past_rows"], axis=0),
        n("Range", [g + "zero", g + "past_rows", g + "one"], [g + "row_numbers"]),
        n("Unsqueeze", ["past_lengths", g + "axes12"], [g + "lengths_b11"]),
        n("Less", [g + "row_numbers", g + "lengths_b11"], [g + "committed_b1p"]),
        n("Concat", [g + "one_1d", g + "n_rows", g + "one_1d"], [g + "rows"], axis=0),
        n("Expand", [g + "committed_b1p", g + "rows"], [g + "committed"]),
        n("Concat", [g + "committed", g + "tree_mask"], ["attention_mask"], axis=2),
        n("Squeeze", [g + "n_rows"], [g + "n_rows_scalar"]),
        n("Range", [g + "zero", g + "n_rows_scalar", g + "one"], ["logits_index"]),
    ], consts


def _handoff_nodes(width: int, cast_to: int | None) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """The accepted rows' states and ids in path order, as the next call's drafter inputs
    (docstring): the paths padded with zeros (row 0, a valid id) to at least this call's drafter
    rows, since a call verifying fewer nodes than the tree's depth has shorter paths, and cut to
    them; one GatherElements."""
    g, d = GLUE, PREFIX
    consts = [numpy_helper.from_array(np.array(v, dtype=np.int64), g + name) for name, v in
              (("starts", [0]), ("row_axis", [1]), ("rows_at", [1]), ("rows_end", [2]), ("axis2", [2]),
               ("width", [1, 1, width]))]
    n = helper.make_node
    next_captured, next_ids = HANDOFF
    gathered = g + next_captured if cast_to is not None else next_captured
    nodes = [
        n("Shape", [d + "captured"], [g + "drafter_shape"]),
        n("Slice", [g + "drafter_shape", g + "rows_at", g + "rows_end"], [g + "drafter_rows"]),
        n("Concat", [g + "rows_at", g + "drafter_rows"], [g + "pad_shape"], axis=0),
        n("Slice", ["accept_path", g + "starts", g + "rows_at", g + "row_axis"], [g + "first_col"]),
        n("Sub", [g + "first_col", g + "first_col"], [g + "zero_col"]),
        n("Expand", [g + "zero_col", g + "pad_shape"], [g + "pad"]),
    ]
    for name, out in (("accept_path", g + "next_path"), ("accept_tokens", next_ids)):
        nodes += [n("Concat", [name, g + "pad"], [g + name + "_padded"], axis=1),
                  n("Slice", [g + name + "_padded", g + "starts", g + "drafter_rows", g + "row_axis"], [out])]
    nodes += [
        n("Unsqueeze", [g + "next_path", g + "axis2"], [g + "next_path_col"]),
        n("Expand", [g + "next_path_col", g + "width"], [g + "next_index"]),
        n("GatherElements", ["captured", g + "next_index"], [gathered], axis=1),
    ]
    if cast_to is not None:      # a target capturing in another precision than the drafter takes
        nodes.append(n("Cast", [gathered], [next_captured], to=cast_to))
    return nodes, consts


def _prefix_dims(graph: onnx.GraphProto) -> None:
    """The drafter's named axes prefixed too, but for the batch: a name is one size across a
    graph, and the drafter's new rows are not the target's."""
    for value in (*graph.input, *graph.output, *graph.value_info):
        for dim in value.type.tensor_type.shape.dim:
            if dim.HasField("dim_param") and dim.dim_param != "batch":
                dim.dim_param = PREFIX + dim.dim_param


def _copy(value: onnx.ValueInfoProto) -> onnx.ValueInfoProto:
    out = onnx.ValueInfoProto()
    out.CopyFrom(value)
    return out


def compose_iteration(target_path: str | Path, drafter_path: str | Path, path: str | Path,
                      tensorrt: bool = True) -> ExportedGraph:
    """Write the iteration graph of a target graph and a drafter tree graph to `path`
    (atomically; checked against TensorRT's parser op set unless `tensorrt` is False: the int8
    drafter graphs are ONNX Runtime's alone). The target's weights are read from its own weights
    file, hard-linked beside the iteration graph (copied tensor by tensor where a link cannot be
    made: never all in memory); so are the drafter's, from its own folder."""
    start = time.perf_counter()
    target_path, drafter_path, path = Path(target_path), Path(drafter_path), Path(path)
    for p in (target_path, drafter_path):
        if not p.is_file():
            raise FileNotFoundError(f"{p}: ONNX graph not found")
    target = onnx.load(str(target_path), load_external_data=False)
    drafter = onnx.load(str(drafter_path), load_external_data=False)
    t_in, t_out = _io(target.graph)
    d_in, d_out = _io(drafter.graph)
    for name in (*TARGET_FED, "past_key_0", "logits", "captured", "accept_path"):
        if name not in t_in and name not in t_out:
            raise IterationGraphError(f"{target_path}: not an eagle_trt target graph with in-graph acceptance (no "
                                      f"{name!r}); re-export it (python -m eagle_trt.build --force export)")
    for name in ("captured", "input_ids", "new_lengths", "tree_tokens", "tree_mask", "tree_depths"):
        if name not in d_in and name not in d_out:
            raise IterationGraphError(f"{drafter_path}: not an eagle_trt drafter tree graph (no {name!r})")
    for name in ("past_lengths", VERIFY_NODES):
        if name in t_in:
            raise IterationGraphError(f"{target_path}: has an input named {name!r}, which the glue defines")
    widths = [int(v.type.tensor_type.shape.dim[-1].dim_value) for v in (t_out["captured"], d_in["captured"])]
    if widths[0] != widths[1]:
        raise IterationGraphError(f"{drafter_path}: takes captured states {widths[1]} wide, but {target_path} "
                                  f"captures {widths[0]}: the drafter was not made for this target")
    opsets = {}
    for source, model in ((target_path, target), (drafter_path, drafter)):
        for o in model.opset_import:
            if opsets.setdefault(o.domain, o.version) != o.version:
                raise IterationGraphError(f"{source}: opset {o.domain or 'ai.onnx'} {o.version} differs from the "
                                          f"other graph's {opsets[o.domain]}; export both with one eagle_trt")
    nodes = _static_dim(d_out["tree_tokens"], 1, str(drafter_path))
    onnx.compose.add_prefix(drafter, PREFIX, inplace=True)
    # the drafter's external weights are read from its own folder (never all in memory)
    drafter_sources = {t.name: drafter_path.parent for t in drafter.graph.initializer if uses_external_data(t)}
    _prefix_dims(drafter.graph)
    glue, consts = _glue_nodes(nodes)
    t_type, d_type = (v.type.tensor_type.elem_type for v in (t_out["captured"], d_in["captured"]))
    handoff, handoff_consts = _handoff_nodes(widths[0], d_type if d_type != t_type else None)
    rows = d_in["captured"].type.tensor_type.shape.dim[1]
    rows = rows.dim_value if rows.HasField("dim_value") else rows.dim_param    # prefixed by _prefix_dims
    inputs = [*drafter.graph.input, helper.make_tensor_value_info("past_lengths", TensorProto.INT64, ["batch"]),
              helper.make_tensor_value_info(VERIFY_NODES, TensorProto.INT64, [1]),
              *(i for i in target.graph.input if i.name not in TARGET_FED)]
    outputs = [*drafter.graph.output, helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "new_tokens"]),
               *target.graph.output, helper.make_tensor_value_info(HANDOFF[0], d_type, ["batch", rows, widths[0]]),
               helper.make_tensor_value_info(HANDOFF[1], TensorProto.INT64, ["batch", rows])]
    # The drafter's model becomes the iteration graph in place: its initializers (its weights, where
    # they are held) are never copied; the target's point into its weights file.
    model, graph = drafter, drafter.graph
    ir_version = max(target.ir_version, drafter.ir_version)
    inputs, outputs = ([_copy(v) for v in values] for values in (inputs, outputs))
    for field in ("input", "output", "value_info"):
        graph.ClearField(field)
    graph.input.extend(inputs)
    graph.output.extend(outputs)
    graph.node.extend([*glue, *target.graph.node, *handoff])
    graph.initializer.extend([*consts, *handoff_consts, *target.graph.initializer])
    graph.name = "eagle_trt_iteration"
    for field in ("opset_import", "metadata_props", "producer_version", "domain", "model_version", "functions"):
        model.ClearField(field)
    model.opset_import.extend(helper.make_opsetid(d, v) for d, v in opsets.items())
    model.ir_version, model.producer_name, model.doc_string = ir_version, "eagle_trt", __doc__.split("\n\n")[0]
    del target, drafter
    if tensorrt and not any(o.domain == ORT_CONTRIB for o in model.opset_import):
        check_graph(model, str(path))     # (a graph of ONNX Runtime's contrib ops, the 4-bit target, is its alone)
    check_structure(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.stem}.", dir=path.parent))
    try:
        # the target's weights stay in its own weights file, hard-linked beside the iteration graph
        written = save_graph(model, tmp / path.name, source_dir=target_path.parent, share_data=True,
                             sources=drafter_sources)
        ops = sorted({n.op_type for n in model.graph.node})
        del model
        check_graph_files(written[0])     # every weights file it reads there, long enough
        install_graph(written, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ExportedGraph(path, time.perf_counter() - start, ops)
