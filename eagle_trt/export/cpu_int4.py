"""A 4-bit weight-only target graph for ONNX Runtime on the CPU (`MatMulNBits`).

A small target on a CPU is memory-bound like its drafter: each verification reads every weight
once, 540 MB a call for SmolLM2-135M in fp32. llama.cpp's users run such a model from a 4-bit
file (the Q4_1 GGUF SmolLM2 ships as: 32 weights per block, a scale and a minimum). This graph
is the same idea in ONNX Runtime's own form, made by its own quantizer
(`onnxruntime.quantization.matmul_nbits_quantizer`, block-wise asymmetric RTN, the default
algorithm, float32 compute): every weight MatMul becomes a `com.microsoft.MatMulNBits` with 4-bit weights in
blocks of 32 along the input axis, a float scale and a 4-bit zero point per block. The tied
lm_head (the exporter reads the embedding table through a Transpose) gets its own transposed
copy first so that it is quantized too; the embedding's Gather keeps the float table.

Speculative decoding on this graph is lossless against this graph's own greedy decoding for any
tree (the acceptance rule is in the graph); it is not the fp32 model's output, and parity reports how far
its logits lie from the float model's. ONNX Runtime only: TensorRT builds take FP8 / NVFP4.
The quantizer holds the whole graph, which suits the small targets a CPU serves."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .cpu_int8 import fold_weight_aliases
from .graph_files import load_weights, rewrite_graph

BLOCK = 32            # weights per block along the input axis, as Q4_1's
# MatMulNBits' compute type: 0 (unset: float32, as the activations), lossless for any tree. Level 4
# (int8 activations, ~2x faster on several rows) is what the fused-attention 4-bit graph uses
# (export/cpu_attention.py, int8_activations): in this portable graph, attention's one-row
# products round differently from several-row ones, and int8 activations make that other tokens
# (SmolLM2's logits for 5 tokens in one call lay 0.94 from their 5 one-row calls).
ACCURACY_LEVEL = 0


def untie_transposed_weights(model: onnx.ModelProto) -> int:
    """Each MatMul whose weight is a 2-D Transpose of an initializer (a tied lm_head) reads a
    transposed copy instead, an initializer the quantizer can convert; returns how many."""
    inits = {t.name: t for t in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    made = {}
    for node in model.graph.node:
        if node.op_type != "MatMul" or node.input[1] in inits:
            continue
        t = producer.get(node.input[1])
        if t is None or t.op_type != "Transpose" or t.input[0] not in inits or len(inits[t.input[0]].dims) != 2:
            continue
        perm = [list(helper.get_attribute_value(a)) for a in t.attribute if a.name == "perm"]
        if perm and perm[0] != [1, 0]:
            continue
        name = f"{t.input[0]}_transposed"
        if name not in made:
            made[name] = numpy_helper.from_array(np.ascontiguousarray(numpy_helper.to_array(inits[t.input[0]]).T), name)
        node.input[1] = name
    model.graph.initializer.extend(made.values())
    return len(made)


def quantize_int4(src: str | Path, dst: str | Path, block_size: int = BLOCK,
                  accuracy_level: int = ACCURACY_LEVEL) -> dict:
    """Write `src` (an fp32 target graph) with 4-bit MatMulNBits weights to `dst` (atomically:
    a failed run leaves no `dst`). Returns counts for the log."""
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer
    src = Path(src)

    def rewrite(model: onnx.ModelProto, _data) -> dict:
        load_weights(model, src.parent)         # the quantizer holds the graph whole
        halves = [t.name for t in model.graph.initializer if len(t.dims) == 2 and t.data_type == onnx.TensorProto.FLOAT16]
        if halves:
            raise ValueError(f"{src}: the 4-bit target is made from an fp32 graph; this one has float16 weights "
                             f"(e.g. {halves[0]!r})")
        untied = untie_transposed_weights(model)
        fold_weight_aliases(model)
        config = DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=False, accuracy_level=accuracy_level,
                                              op_types_to_quantize=("MatMul",))
        quantizer = MatMulNBitsQuantizer(model, algo_config=config)
        chatty = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
        level = chatty.level
        chatty.setLevel(logging.WARNING)      # it logs a line per node at INFO
        try:
            quantizer.process()
        finally:
            chatty.setLevel(level)
        if quantizer.model.model is not model:
            model.CopyFrom(quantizer.model.model)
        return {"int4_matmuls": sum(n.op_type == "MatMulNBits" for n in model.graph.node), "untied": untied,
                "block_size": block_size}
    return rewrite_graph(src, dst, rewrite)
