"""Exporting a graph without copying its weights in memory.

Left to itself, the TorchScript exporter folds every nn.Linear weight into a transposed copy
and holds all weights once more while it serializes them: for a 0.83 B target the export
peaked at 2.3x the fp32 weights, the model included. Here it never sees a weight:

- `stand_in` is the module with every parameter replaced by a placeholder of the graph's dtype
  that has the right shape and one element of storage (a stride-0 view), and every Linear
  multiplying by `weight_t`, its weight's transpose held as a parameter of its own (a view):
  nothing is left for constant folding to copy;
- traced with `export_params=False`, each parameter the graph reads becomes a graph input
  named after it (`model.layers.0.mlp.up_proj.weight_t`);
- `attach_weights` turns those inputs into initializers, taking each value from the real
  module (cast to the graph's dtype, transposed for `weight_t`) and writing it, one tensor at a
  time, into the graph's one data file when the graph is past the external-data threshold.

A tied lm_head (whose `weight_t` is the transpose of the embedding table the graph also reads)
becomes a Transpose node of that one table: the weights are stored once, and ONNX Runtime and
TensorRT fold the Transpose when they load the graph."""
from __future__ import annotations

import copy
import types
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper
from torch import nn

from .graph_files import MIN_EXTERNAL_TENSOR, data_file_name, external_data_threshold, point_to_data

TRANSPOSED = "_t"     # suffix of the parameter a stand-in Linear multiplies by


def _matmul_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    y = x @ self.weight_t
    return y if self.bias is None else y + self.bias


def stand_in(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of `module` (buffers included, in `dtype` where floating) whose parameters are
    placeholders of `dtype` without storage; parameters shared in `module` stay shared."""
    memo: dict = {}
    for i, p in enumerate(module.parameters(), 1):
        # distinct values: the exporter merges parameters that are equal (checked below)
        memo[id(p)] = nn.Parameter(torch.full((), i, dtype=dtype).expand(p.shape), requires_grad=False)
    if len({float(p) for p in (q.reshape(-1)[0] for q in memo.values())}) < len(memo):
        raise ValueError(f"{type(module).__name__} has {len(memo)} parameters, more than {dtype} placeholders "
                         f"can tell apart")
    copied = copy.deepcopy(module, memo).to(dtype).eval()
    for sub in copied.modules():
        if isinstance(sub, nn.Linear):
            sub.weight_t = nn.Parameter(sub.weight.t(), requires_grad=False)
            sub.forward = types.MethodType(_matmul_forward, sub)
    return copied


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype)).dtype


def _source(real: nn.Module, name: str) -> tuple[torch.Tensor, bool]:
    """The real tensor behind a stand-in's graph input `name`, and whether the graph reads it transposed."""
    owner, _, attr = name.rpartition(".")
    if attr == f"weight{TRANSPOSED}":
        return real.get_submodule(owner).weight, True
    try:
        return real.get_parameter(name), False
    except AttributeError:
        try:
            return real.get_buffer(name), False
        except AttributeError:
            raise ValueError(f"the exported graph reads {name!r}, which is neither a parameter nor a buffer of "
                             f"{type(real).__name__}: the exporter folded a weight into a value of its own") from None


def attach_weights(graph: onnx.ModelProto, real: nn.Module, num_inputs: int, path: Path) -> list[Path]:
    """Make the graph inputs past the first `num_inputs` (the parameters of a stand-in of `real`,
    exported with export_params=False) initializers holding `real`'s values, and write the graph
    to `path`, with its weights in `path.data` past the external-data threshold (as save_graph
    does). Returns the files written, the graph first. `graph` keeps the weights' metadata at
    most, never their values."""
    params = list(graph.graph.input)[num_inputs:]
    sources = {p.name: _source(real, p.name) for p in params}
    held = {id(t): name for name, (t, transposed) in sources.items() if not transposed}

    def dtype_of(p) -> np.dtype:
        return onnx.helper.tensor_dtype_to_np_dtype(p.type.tensor_type.elem_type)

    tied = {p.name: held[id(sources[p.name][0])] for p in params if sources[p.name][1] and id(sources[p.name][0]) in held}
    stored = [p for p in params if p.name not in tied]
    weight_bytes = sum(sources[p.name][0].numel() * dtype_of(p).itemsize for p in stored)
    external = graph.ByteSize() + weight_bytes > external_data_threshold()
    data = Path(path).with_name(data_file_name(path))
    if data.exists():
        data.unlink()
    del graph.graph.input[num_inputs:]
    if tied:     # Transposes reading initializers only: first keeps the node order topological
        nodes = [helper.make_node("Transpose", [table], [name], name=f"{table}_Transpose", perm=[1, 0])
                 for name, table in tied.items()] + list(graph.graph.node)
        del graph.graph.node[:]
        graph.graph.node.extend(nodes)

    def values():      # one tensor at a time: the only copy of a weight ever made
        for p in stored:
            tensor, transposed = sources[p.name]
            value = (tensor.t() if transposed else tensor).detach().to("cpu", _torch_dtype(dtype_of(p)))
            yield p, value.contiguous().numpy()

    path = Path(path)
    if not external:
        # The graph, then each weight as a message of its own: protobuf merges a repeated message
        # field when it parses, so this is the graph with its initializers, serialized a tensor
        # at a time instead of all at once (the in-memory `graph` stays without them).
        with open(path, "wb") as f:
            f.write(graph.SerializeToString())
            for p, value in values():
                init = numpy_helper.from_array(value, p.name)
                f.write(onnx.ModelProto(graph=onnx.GraphProto(initializer=[init])).SerializeToString())
        return [path]
    offset = 0
    with open(data, "wb") as out:
        for p, value in values():
            if value.nbytes >= MIN_EXTERNAL_TENSOR:
                init = onnx.TensorProto(name=p.name, data_type=p.type.tensor_type.elem_type, dims=value.shape)
                out.write(memoryview(value).cast("B"))
                point_to_data(init, data, offset, value.nbytes)
                offset += value.nbytes
            else:
                init = numpy_helper.from_array(value, p.name)
            graph.graph.initializer.append(init)
    onnx.save(graph, str(path))
    return [path, data]


__all__ = ["attach_weights", "stand_in"]
