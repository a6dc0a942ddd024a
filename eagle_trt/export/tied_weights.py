"""Tied weights stored once in an exported graph.

With tied embeddings (SmolLM2, Qwen2.5-0.5B, Llama-3.2-1B, ...) the lm_head is the embedding
table. The graph reads it twice: Gather takes rows of the [vocab, hidden] table, and the
lm_head MatMul needs it as [hidden, vocab], which the exporter's constant folding writes as a
second, transposed copy (0.38 GB twice for a 2048 x 49152 table in fp32). `share_tied_weights`
finds such a copy and feeds the MatMul from a Transpose of the one table instead. ONNX Runtime
and TensorRT fold that Transpose when they load the graph: the file shrinks, the math does not
change (the copy is bit-identical, checked before it is dropped)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

MIN_SHARED_ELEMENTS = 1024     # as MIN_EXTERNAL_TENSOR: smaller tables stay as they are


def share_tied_weights(model: onnx.ModelProto, base_dir: str | Path | None = None) -> list[str]:
    """Rewrite `model` in place; returns the names of the dropped copies. base_dir: where the
    weights of a model loaded without its external data are (only the candidates are read).

    A MatMul weight W [in, out] is dropped when a table E [out, in] of the same type that some
    other node reads (a Gather: the embedding) holds exactly W transposed; every MatMul reading
    W then reads Transpose(E)."""
    graph = model.graph
    readers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in graph.node:
        for slot, name in enumerate(node.input):
            readers.setdefault(name, []).append((node, slot))
    protected = {o.name for o in graph.output} | {i.name for i in graph.input}

    def big_2d(init) -> bool:
        return len(init.dims) == 2 and init.dims[0] * init.dims[1] >= MIN_SHARED_ELEMENTS and init.name not in protected

    def matmul_weight_only(name: str) -> bool:
        return bool(readers.get(name)) and all(n.op_type == "MatMul" and slot == 1 for n, slot in readers[name])

    weights = [w for w in graph.initializer if big_2d(w) and matmul_weight_only(w.name)]
    wanted = {((w.dims[0], w.dims[1]), w.data_type) for w in weights}
    tables = {}     # (dims of the transposed table, type) -> tables E, only where a weight could match
    for init in graph.initializer:
        key = ((init.dims[1], init.dims[0]), init.data_type) if len(init.dims) == 2 else None
        if key in wanted and big_2d(init) and readers.get(init.name) and not matmul_weight_only(init.name):
            tables.setdefault(key, []).append(init)
    if not tables:
        return []
    dropped, transposes = [], []
    for w in weights:
        candidates = tables.get(((w.dims[0], w.dims[1]), w.data_type), [])
        if not candidates:
            continue
        base = str(base_dir) if base_dir is not None else ""
        array = numpy_helper.to_array(w, base)
        table = next((e for e in candidates if np.array_equal(numpy_helper.to_array(e, base).T, array)), None)
        if table is None:
            continue
        out = f"{table.name}_transposed"
        if not any(t.output[0] == out for t in transposes):
            transposes.append(helper.make_node("Transpose", [table.name], [out], name=f"{table.name}_Transpose",
                                               perm=[1, 0]))
        for node, slot in readers[w.name]:
            node.input[slot] = out
        dropped.append(w.name)
    if dropped:
        kept = [i for i in graph.initializer if i.name not in set(dropped)]
        del graph.initializer[:]
        graph.initializer.extend(kept)
        nodes = transposes + list(graph.node)   # initializer-only inputs: first keeps the order topological
        del graph.node[:]
        graph.node.extend(nodes)
    return dropped


__all__ = ["MIN_SHARED_ELEMENTS", "share_tied_weights"]
