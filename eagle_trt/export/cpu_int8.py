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

The exporter writes the unrolled tree's later levels as Identity nodes over the same weight
initializers; ONNX Runtime's quantizer only recognises a MatMul whose weight is an initializer,
so those aliases are folded first (every level then reads the one int8 copy)."""
from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import onnx

from .graph_files import install_graph, save_graph


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


class _DropPreprocessingHint(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "pre-processing before quantization" not in record.getMessage()


def quantize_int8(src: str | Path, dst: str | Path) -> dict:
    """Write `src` with int8 per-channel weights for every weight MatMul to `dst` (atomically:
    a failed run leaves no `dst`). Returns counts for the log."""
    from onnxruntime.quantization import QuantType, quantize_dynamic
    src, dst = Path(src), Path(dst)
    model = onnx.load(str(src))
    folded = fold_weight_aliases(model)
    with tempfile.TemporaryDirectory(prefix=".int8-", dir=dst.parent) as tmp:
        folded_path, out = Path(tmp) / "folded.onnx", Path(tmp) / dst.name
        external = len(save_graph(model, folded_path)) > 1     # past 2 GB: weights in a data file
        del model
        # its root-logger hint to run ORT's pre-processing (shape inference, for models traced
        # without shapes) does not apply to an exported graph and would print on every build
        root, hint = logging.getLogger(), _DropPreprocessingHint()
        root.addFilter(hint)
        try:
            quantize_dynamic(folded_path, out, weight_type=QuantType.QInt8, per_channel=True,
                             op_types_to_quantize=["MatMul"], use_external_data_format=external)
        finally:
            root.removeFilter(hint)
        quantized = onnx.load(str(out))
        matmuls = sum(n.op_type == "MatMulInteger" for n in quantized.graph.node)
        install_graph(save_graph(quantized, out), dst)
    return {"folded_aliases": folded, "int8_matmuls": matmuls}
