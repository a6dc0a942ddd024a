"""Layer-by-layer parity of a quantized graph with the fake-quant reference.

End-to-end logits of a deep quantized model are not a sharp test of the graph's arithmetic:
two engines whose float32 results differ in the last bit (different MatMul kernels, Softmax
or Sigmoid approximations) occasionally land on opposite sides of an FP8 / FP4 rounding
boundary, the flipped value moves the layer's output by up to one quantization step, and the
following quantizers turn that into more flips. On SmolLM2 (30 layers, per-tensor FP8
activation scales) that cascade alone moves the logits by about as much as quantization
itself does. So each quantized MatMul is checked on its own: the graph's output against
QuantLinear applied to the graph's own input of that layer. A wrong scale, axis, block layout,
rounding rule or packing shows up there as a large error; float noise stays ~1e-7."""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper
from onnx.external_data_helper import load_external_data_for_model
from torch import nn

from ..export.graph_files import save_graph
from ..models.streamed import StreamedTarget
from ..parity_sessions import probe_session
from .config import QuantError
from .fakequant import QuantLinear, linear_paths
from .onnx_qdq import module_for_node
from .run import is_nvfp4_graph, reference_evaluator


@dataclass
class LayerParity:
    node: str
    module: str
    rel_l2: float      # ||graph - reference|| / ||reference|| for this MatMul's output
    max_abs: float


def _quantizer(name: str, producer: dict) -> onnx.NodeProto | None:
    """Walk up a MatMul input through DequantizeLinear nodes (and a float16 graph's Cast back
    from float32) to the activation quantizer."""
    node = producer.get(name)
    while node is not None and node.op_type in ("DequantizeLinear", "Cast"):
        node = producer.get(node.input[0])
    if node is not None and node.op_type in ("QuantizeLinear", "TRT_FP4DynamicQuantize"):
        return node
    return None


def _float16_graph(node: onnx.NodeProto, producer: dict) -> bool:
    """Whether the quantized MatMul `node` reads its dequantized input through a Cast to float16."""
    first = producer.get(node.input[0])
    return first is not None and first.op_type == "Cast" and helper.get_attribute_value(first.attribute[0]) == \
        TensorProto.FLOAT16


def quantized_matmuls(model: onnx.ModelProto) -> list[tuple[onnx.NodeProto, onnx.NodeProto]]:
    """(MatMul node, its activation quantizer) for every quantized MatMul; the quantizer's
    first input is the float32 activation, its second the float32 scale."""
    producer = {o: n for n in model.graph.node for o in n.output}
    out = []
    for node in model.graph.node:
        if node.op_type == "MatMul":
            quantizer = _quantizer(node.input[0], producer)
            if quantizer is not None:
                out.append((node, quantizer))
    return out


def _dequantize_weights_where_used(model: onnx.ModelProto) -> None:
    """Make each weight's DequantizeLinear wait for its first MatMul's input. Reading only
    initializers, they would all run first in ONNX Runtime's order and hold every float weight
    at once (a real-size target's float copy); here each weight's scale is multiplied by an
    exact 1 derived from that input's shape, and the nodes are moved to just before the MatMul,
    so each weight is dequantized when it is used. The values are unchanged."""
    nodes = list(model.graph.node)
    producer = {o: n for n in nodes for o in n.output}
    index = {id(n): i for i, n in enumerate(nodes)}
    moved: dict[int, list[onnx.NodeProto]] = {}     # MatMul index -> weight nodes to run before it
    taken = set()
    for i, node in enumerate(nodes):
        if node.op_type != "MatMul":
            continue
        chain, name = [], node.input[1]
        while (n := producer.get(name)) is not None and n.op_type in ("Cast", "DequantizeLinear"):
            chain.append(n)
            name = n.input[0]
        dqs = [n for n in chain if n.op_type == "DequantizeLinear"]
        if not dqs or any(id(n) in taken for n in chain):
            continue                                   # not a weight DQ, or moved for an earlier MatMul
        first = dqs[-1]                                # the one reading the stored weight's scale
        one = f"{first.name}/dep_one"
        x = node.input[0]
        extra = [helper.make_node("Size", [x], [f"{one}_size"], name=f"{one}_Size"),
                 helper.make_node("Cast", [f"{one}_size"], [f"{one}_float"], name=f"{one}_Cast", to=TensorProto.FLOAT),
                 helper.make_node("Div", [f"{one}_float", f"{one}_float"], [one], name=f"{one}_Div"),
                 helper.make_node("Mul", [first.input[1], one], [f"{one}_scale"], name=f"{one}_Mul")]
        first.input[1] = f"{one}_scale"
        taken.update(id(n) for n in chain)
        moved[i] = extra + sorted(chain, key=lambda n: index[id(n)])
    if not moved:
        return
    order = []
    for i, node in enumerate(nodes):
        if id(node) in taken:
            continue
        order += moved.get(i, []) + [node]
    del model.graph.node[:]
    model.graph.node.extend(order)


def layer_parity(graph: str, reference: nn.Module | StreamedTarget, feeds: dict[str, np.ndarray], threads: int = 1
                 ) -> list[LayerParity]:
    """Run the quantized graph once (ONNX Runtime for FP8, unoptimized, its weights fed as memory
    maps: parity_sessions.probe_session; onnx.reference for NVFP4), exposing every quantized
    MatMul's float input and output, and compare each output with the reference model's
    QuantLinear of the same module applied to that input (a fake-quant StreamedTarget's, one
    part at a time)."""
    model = onnx.load(str(graph), load_external_data=False)    # the weights stay in the graph's data file
    layers = _quantized_paths(reference)
    pairs = quantized_matmuls(model)
    if not pairs:
        raise QuantError(f"{graph}: no quantized MatMul found")
    producer = {o: n for n in model.graph.node for o in n.output}
    # The quantizers' float32 inputs and the MatMuls' outputs (in the graph's float type). Asking
    # for the quantizer's own input matters in a float16 graph: ONNX Runtime's CPU otherwise
    # elides the float32 -> float16 -> float32 casts around ops it runs in float32 and quantizes
    # unrounded values, which the graph (and TensorRT) would round to float16 first.
    out_elem = TensorProto.FLOAT16 if _float16_graph(pairs[0][0], producer) else TensorProto.FLOAT
    elems = {q.input[0]: TensorProto.FLOAT for _, q in pairs} | {node.output[0]: out_elem for node, _ in pairs}
    names = sorted(elems)
    existing = {o.name for o in model.graph.output}
    for name in names:
        if name not in existing:
            model.graph.output.append(helper.make_tensor_value_info(name, elems[name], None))
    if is_nvfp4_graph(model):
        load_external_data_for_model(model, str(Path(graph).parent))
        values = dict(zip(names, reference_evaluator(model).run(names, feeds)))
    else:   # from a file beside the graph's weights file (hard-linked, else copied one by one; not loaded)
        _dequantize_weights_where_used(model)
        with tempfile.TemporaryDirectory(prefix="layer-parity-") as tmp:
            probe = save_graph(model, Path(tmp) / "probe.onnx", source_dir=Path(graph).parent, share_data=True)[0]
            values = dict(zip(names, probe_session(probe, threads).run(names, feeds)))
    by_path: dict[str, list] = {}       # module path -> its (MatMul, quantizer) pairs
    for node, quantizer in pairs:
        path = module_for_node(node.name, layers)
        if path is None:
            raise QuantError(f"{graph}: quantized node '{node.name}' has no QuantLinear in the reference model")
        by_path.setdefault(path, []).append((node, quantizer))
    report = {}
    for path, layer in _quant_linears(reference, set(by_path)):
        for node, quantizer in by_path[path]:
            x = torch.from_numpy(values[quantizer.input[0]]).to(layer.input_scale.device)   # float32, as quantized
            with torch.no_grad():   # on the reference's device; the graph adds the bias after its MatMul
                expected = layer(x, bias=False).cpu()
            got = torch.from_numpy(values[node.output[0]])
            diff = (got - expected).float()
            denom = float(expected.norm()) or 1.0
            report[node.name] = LayerParity(node.name, path, float(diff.norm()) / denom, float(diff.abs().max()))
    return [report[node.name] for node, _ in pairs]


def _quantized_paths(reference) -> list[str]:
    """The module paths of the reference's QuantLinears (of a StreamedTarget fake-quant reference:
    those it makes as it reads each part)."""
    if isinstance(reference, StreamedTarget):
        cfg = reference.fake_quant.cfg
        return [p for p, linear in linear_paths(reference.model).items() if cfg.skip_reason(p, linear.in_features) is None]
    return [path for path, m in reference.named_modules() if isinstance(m, QuantLinear)]


def _quant_linears(reference, paths: set[str]):
    """(path, QuantLinear) for each path; a StreamedTarget's part by part, each while its part is read."""
    if not isinstance(reference, StreamedTarget):
        layers = dict(reference.named_modules())
        yield from ((p, layers[p]) for p in sorted(paths))
        return
    for part in reference.parts():
        wanted = sorted(p for p in paths if any(p == q or p.startswith(q + ".") for q in part))
        if wanted:
            with reference.loaded(*part) as model:
                yield from ((p, model.get_submodule(p)) for p in wanted)


__all__ = ["LayerParity", "layer_parity", "quantized_matmuls"]
