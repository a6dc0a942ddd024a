"""Int8 weights for the drafter graph that ONNX Runtime runs on the CPU.

At batch 1 a drafter call is memory-bound like verification: the tree graph reads the drafter's
layer and its lm_head once per tree level, about 100 MB of fp32 weights per call for SmolLM2's
drafter, so the call costs what streaming them costs. ONNX Runtime's dynamic quantization
stores every weight MatMul's matrix as int8 with a scale per output channel (activations are
quantized per call), a quarter of the bytes. Only drafting changes: verification and the
acceptance rule are the target's, so speculative output stays token-identical to the target's
whatever the drafter proposes. The graph uses ONNX Runtime's integer ops (MatMulInteger,
DynamicQuantizeLinear); TensorRT builds take the FP8 / NVFP4 Q/DQ graphs instead (quant/onnx_qdq.py).
It lives with the exporters, which make it on request (export_pipeline's `drafter_tree_int8`).

ONNX Runtime's quantizer (`quantize_dynamic`) holds the whole model, twice: a 70B-wide drafter
graph (9 GB of fp32 weights) would not fit a 24 GB machine. So this file does what it does one
weight at a time: it reads one MatMul's matrix from the graph's weights file, quantizes it with
the quantizer's arithmetic (`int8_per_channel`) and appends it to the new graph's weights file;
the same nodes, names and tensors as the quantizer's (tests/test_cpu_int8.py checks them, and
the outputs, bit for bit against `quantize_dynamic`).

The exporter writes the unrolled tree's later levels as Identity nodes over the same weight
initializers; those aliases are folded first (every level then reads the one int8 copy)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from .graph_files import DataFile, new_tensor, read_array, rewrite_graph

QMIN, QMAX = -127, 127       # the quantizer's symmetric int8 range for weights
CLIP = (-128, 127)           # what its quantize_nparray clips to (the full int8 range)


def fold_weight_aliases(model: onnx.ModelProto) -> int:
    """Point every reader of an Identity over an initializer at the initializer itself and drop
    the Identity (graph outputs excepted); returns how many were folded."""
    initializers = {t.name for t in model.graph.initializer}
    outputs = {o.name for o in model.graph.output}
    alias = {n.output[0]: n.input[0] for n in model.graph.node
             if n.op_type == "Identity" and n.input[0] in initializers and n.output[0] not in outputs}
    kept = []
    for node in model.graph.node:
        if node.op_type == "Identity" and node.output[0] in alias:
            continue
        for i, name in enumerate(node.input):
            node.input[i] = alias.get(name, name)
        kept.append(node)
    del model.graph.node[:]
    model.graph.node.extend(kept)
    return len(alias)


def int8_per_channel(w: np.ndarray, columns: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    """A float32 [in, out] MatMul weight as int8 with one float32 scale per output column, in
    onnxruntime.quantization's arithmetic (quant_utils.compute_scale_zp, symmetric, and
    quantize_nparray): the range widened to hold 0 and made symmetric, the scale 2 * absmax / 254
    in float64 then float32 (1.0 under float32's smallest normal), q = round(w / scale) clipped to
    [-128, 127], zero points 0. Done `columns` at a time to bound the temporaries."""
    q = np.empty(w.shape, dtype=np.int8)
    scales = np.empty(w.shape[1], dtype=np.float32)
    for start in range(0, w.shape[1], columns):
        block = w[:, start:start + columns]
        rmin = np.minimum(block.min(axis=0), np.float32(0))
        rmax = np.maximum(block.max(axis=0), np.float32(0))
        absmax = np.maximum(np.abs(rmin), np.abs(rmax))
        scale = (absmax.astype(np.float64) - (-absmax).astype(np.float64)) / np.float64(QMAX - QMIN)
        scale = np.where(scale < np.finfo(np.float32).tiny, 1.0, scale).astype(np.float32)
        scaled = np.round(block / scale)
        np.clip(scaled, *CLIP, out=scaled)
        q[:, start:start + columns] = scaled.astype(np.int8)
        scales[start:start + columns] = scale
    return q, scales


class _Int8Rewriter:
    """The quantizer's rewrite of one MatMul whose weight is a 2-D float32 initializer: its input
    quantized by a DynamicQuantizeLinear (one per input tensor), MatMulInteger on the int8
    weight, the int32 product cast to float and multiplied by both scales."""

    def __init__(self, model: onnx.ModelProto, source_dir: Path, data: DataFile | None):
        self.model, self.source_dir, self.data = model, source_dir, data
        self.inits = {t.name: t for t in model.graph.initializer}
        self.new_inits: list[TensorProto] = []
        self.activations: set[str] = set()
        self.weights: set[str] = set()
        self.matmuls = 0

    def quantizable(self, node: onnx.NodeProto) -> bool:
        w = self.inits.get(node.input[1]) if node.op_type == "MatMul" else None
        return (w is not None and w.data_type == TensorProto.FLOAT and len(w.dims) == 2
                and node.input[0] not in self.inits)

    def weight(self, name: str) -> None:
        if name in self.weights:
            return
        self.weights.add(name)
        init = self.inits[name]
        q, scales = int8_per_channel(read_array(init, self.source_dir))
        self.new_inits.append(new_tensor(f"{name}_quantized", TensorProto.INT8, list(q.shape), q.tobytes(), self.data))
        # as the quantizer makes them: float_data / int32_data fields, not raw bytes
        self.new_inits.append(helper.make_tensor(f"{name}_scale", TensorProto.FLOAT, [q.shape[1]], scales.tolist()))
        self.new_inits.append(helper.make_tensor(f"{name}_zero_point", TensorProto.INT8, [q.shape[1]],
                                                 [0] * q.shape[1]))

    def rewrite(self, node: onnx.NodeProto) -> list[onnx.NodeProto]:
        x, w, y = node.input[0], node.input[1], node.output[0]
        nodes = []
        if x not in self.activations:
            self.activations.add(x)
            nodes.append(helper.make_node("DynamicQuantizeLinear", [x],
                                          [f"{x}_quantized", f"{x}_scale", f"{x}_zero_point"],
                                          f"{x}_QuantizeLinear"))
        self.weight(w)
        name = f"{node.name}_quant" if node.name else ""
        scales = name + "_scales_mul" if name else f"{x}_scale_{w}_scale_mul"
        product = f"{y}_output_quantized"
        nodes += [
            helper.make_node("Mul", [f"{x}_scale", f"{w}_scale"], [scales + ":0"], scales),
            helper.make_node("MatMulInteger", [f"{x}_quantized", f"{w}_quantized", f"{x}_zero_point",
                                               f"{w}_zero_point"], [product], name),
            helper.make_node("Cast", [product], [f"{product}_cast_output"], f"{product}_cast", to=TensorProto.FLOAT),
            helper.make_node("Mul", [f"{product}_cast_output", scales + ":0"], [y],
                             f"{name}_output_scale_mul" if name else ""),
        ]
        self.matmuls += 1
        return nodes

    def finish(self, nodes: list[onnx.NodeProto]) -> None:
        graph = self.model.graph
        del graph.node[:]
        graph.node.extend(nodes)
        used = {i for n in nodes for i in n.input} | {o.name for o in graph.output}
        kept = [t for t in graph.initializer if t.name in used or t.name not in self.weights]
        del graph.initializer[:]
        graph.initializer.extend(kept + self.new_inits)


def quantize_int8(src: str | Path, dst: str | Path) -> dict:
    """Write `src` with int8 per-channel weights for every weight MatMul to `dst`, one weight in
    memory at a time (atomically: a failed run leaves no `dst`). Returns counts for the log."""
    src = Path(src)

    def rewrite(model: onnx.ModelProto, data: DataFile | None) -> dict:
        folded = fold_weight_aliases(model)
        rewriter = _Int8Rewriter(model, src.parent, data)
        nodes = []
        for node in model.graph.node:
            nodes += rewriter.rewrite(node) if rewriter.quantizable(node) else [node]
        rewriter.finish(nodes)
        return {"folded_aliases": folded, "int8_matmuls": rewriter.matmuls}
    return rewrite_graph(src, dst, rewrite)
