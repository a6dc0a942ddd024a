"""Exporting a graph without copying its weights in memory.

Left to itself, the TorchScript exporter folds every nn.Linear weight into a transposed copy
and holds all weights once more while it serializes them: for a 0.83 B target the export
peaked at 2.3x the fp32 weights, the model included. Here it never sees a weight:

- `stand_in` is the module with every parameter replaced by a placeholder of the graph's dtype
  that has the right shape, all of them views into one zero buffer the size of the largest
  (a stride-0 placeholder would be copied whole by each MatMul the trace runs), and every
  Linear multiplying by `weight_t`, its weight's transpose (a view);
- `weights_as_inputs` traces it with every parameter and buffer as a graph input named after it
  (`model.layers.0.mlp.up_proj.weight_t`), not as a parameter: the exporter runs ONNX shape
  inference with the values of the parameters it holds and copied them for it (1.2 GB for the
  0.83 B target, even with export_params=False); inputs it knows by shape only;
- `attach_weights` turns those inputs into initializers, taking each value from the real
  module (cast to the graph's dtype, transposed for `weight_t`) and writing it, one tensor at a
  time, into the graph's one data file when the graph is past the external-data threshold.

A tied lm_head (whose `weight_t` is the transpose of the embedding table the graph also reads)
becomes a Transpose node of that one table: the weights are stored once, and ONNX Runtime and
TensorRT fold the Transpose when they load the graph."""
from __future__ import annotations

import copy
import math
import types
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper
from torch import nn

from ..models.streamed import WeightRef
from .graph_files import MIN_EXTERNAL_TENSOR, DataFile, data_file_name, external_data_threshold, writing

TRANSPOSED = "_t"     # suffix of the parameter a stand-in Linear multiplies by


def _matmul_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    y = x @ self.weight_t
    return y if self.bias is None else y + self.bias


def stand_in(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of `module` (buffers included, in `dtype` where floating) whose parameters are
    placeholders of `dtype`, views into one zero buffer; parameters shared in `module` stay
    shared. Each Linear multiplies by `weight_t` (its weight's transpose), its only parameter."""
    params = list({id(p): p for p in module.parameters()}.values())
    zeros = torch.zeros(max((p.numel() for p in params), default=0), dtype=dtype)
    memo = {id(p): nn.Parameter(zeros[:p.numel()].view(p.shape), requires_grad=False) for p in params}
    copied = copy.deepcopy(module, memo).to(dtype).eval()
    for sub in copied.modules():
        if isinstance(sub, nn.Linear):
            sub.weight_t = nn.Parameter(sub.weight.t(), requires_grad=False)
            sub.weight = sub._parameters.pop("weight").detach()     # kept for its dtype and device, not traced
            sub.forward = types.MethodType(_matmul_forward, sub)
    return copied


def weights_as_inputs(graph: nn.Module, num_inputs: int) -> tuple[list[str], list[torch.Tensor]]:
    """Turn the parameters and buffers of `graph` (a graph module around a stand-in) into
    trailing inputs of its forward, in place: call it with (*inputs, *weights), input names
    inputs + names. The module stays the traced root, so node names keep their module scopes
    (which quantization maps MatMuls by). The exporter drops inputs the graph does not read;
    attach_weights checks each remaining input's name against its weight's shape."""
    tensors: dict[int, tuple[str, torch.Tensor, list]] = {}    # id -> first name, tensor, where it is held
    for prefix, sub in graph.named_modules(remove_duplicate=False):
        for table in (sub._parameters, sub._buffers):
            for attr, t in list(table.items()):
                if t is not None:
                    name = f"{prefix}.{attr}" if prefix else attr
                    tensors.setdefault(id(t), (name, t.detach(), []))[2].append((sub, attr))
                    del table[attr]
    held = [places for _, _, places in tensors.values()]
    forward = graph.forward

    def forward_with_weights(*args):
        for places, value in zip(held, args[num_inputs:]):
            for sub, attr in places:
                setattr(sub, attr, value)
        return forward(*args[:num_inputs])
    graph.forward = forward_with_weights
    return [name for name, _, _ in tensors.values()], [t for _, t, _ in tensors.values()]


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype)).dtype


# Resolves a parameter that holds no values (a meta tensor of a model read part by part) to the
# file tensor behind it.
Resolver = Callable[[torch.Tensor], "WeightRef | None"]
WeightWritten = Callable[[int, int, str], None]     # (weights written, of how many, the last one's name)


def _ref(tensor: torch.Tensor, resolve: Resolver | None, name: str) -> WeightRef:
    if tensor.is_meta:
        ref = resolve(tensor) if resolve is not None else None
        if ref is None:
            raise ValueError(f"the exported graph reads {name!r}, which holds no values (meta) and no file "
                             f"tensor backs it")
        return ref
    return WeightRef(("tensor", id(tensor)), tuple(tensor.shape), lambda: tensor)


def _source(real: nn.Module, name: str, resolve: Resolver | None = None) -> tuple[WeightRef, bool]:
    """The real tensor behind a stand-in's graph input `name`, and whether the graph reads it transposed."""
    owner, _, attr = name.rpartition(".")
    if attr == f"weight{TRANSPOSED}":
        return _ref(real.get_submodule(owner).weight, resolve, name), True
    try:
        return _ref(real.get_parameter(name), resolve, name), False
    except AttributeError:
        try:
            return _ref(real.get_buffer(name), resolve, name), False
        except AttributeError:
            raise ValueError(f"the exported graph reads {name!r}, which is neither a parameter nor a buffer of "
                             f"{type(real).__name__}: the exporter folded a weight into a value of its own") from None


def _length_delimited(field: int, size: int) -> bytes:
    """A protobuf length-delimited field's tag and length."""
    out, value = bytearray(), (field << 3) | 2
    for v in (value, size):
        while v >= 0x80:
            out.append(v & 0x7F | 0x80)
            v >>= 7
        out.append(v)
    return bytes(out)


def _write_initializer(f, header: onnx.TensorProto, raw: memoryview) -> None:
    """Write ModelProto{graph: GraphProto{initializer: [header + raw_data]}} with `raw` copied
    straight into the file (field numbers from onnx.proto: ModelProto.graph 7,
    GraphProto.initializer 5, TensorProto.raw_data 9)."""
    head = header.SerializeToString()
    tensor = len(head) + len(_length_delimited(9, raw.nbytes)) + raw.nbytes
    graph = len(_length_delimited(5, tensor)) + tensor
    f.write(_length_delimited(7, graph) + _length_delimited(5, tensor) + head + _length_delimited(9, raw.nbytes))
    f.write(raw)


def attach_weights(graph: onnx.ModelProto, real: nn.Module, num_inputs: int, path: Path,
                   resolve: Resolver | None = None, on_weight: WeightWritten | None = None) -> list[Path]:
    """Make the graph inputs past the first `num_inputs` (the parameters and buffers of a stand-in
    of `real`, traced through weights_as_inputs) initializers holding `real`'s values, and write the graph
    to `path`, with its weights in `path.data` past the external-data threshold (as save_graph
    does). Returns the files written, the graph first. `graph` keeps the weights' metadata at
    most, never their values. resolve: where the values of `real`'s meta parameters are (a
    model read part by part): each is read from its file when written."""
    folded = [i.name for i in graph.graph.initializer if numpy_helper.to_array(i).nbytes >= MIN_EXTERNAL_TENSOR]
    if folded:
        raise ValueError(f"the exported graph holds constants {folded[:3]} that are not weight inputs: the "
                         f"exporter folded a weight into a value of its own")
    params = list(graph.graph.input)[num_inputs:]
    sources = {p.name: _source(real, p.name, resolve) for p in params}
    for p in params:
        ref, transposed = sources[p.name]
        want = tuple(ref.shape[::-1] if transposed else ref.shape)
        have = tuple(d.dim_value for d in p.type.tensor_type.shape.dim)
        if have != want:
            raise ValueError(f"graph input {p.name!r} has shape {have}, the weight of that name {want}")
    held = {ref.key: name for name, (ref, transposed) in sources.items() if not transposed}

    def dtype_of(p) -> np.dtype:
        return onnx.helper.tensor_dtype_to_np_dtype(p.type.tensor_type.elem_type)

    tied = {p.name: held[sources[p.name][0].key] for p in params if sources[p.name][1] and sources[p.name][0].key in held}
    stored = [p for p in params if p.name not in tied]
    weight_bytes = sum(math.prod(sources[p.name][0].shape) * dtype_of(p).itemsize for p in stored)
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
        for i, p in enumerate(stored):
            ref, transposed = sources[p.name]
            tensor = ref.read()
            value = (tensor.t() if transposed else tensor).detach().to("cpu", _torch_dtype(dtype_of(p)))
            del tensor
            yield p, value.contiguous().numpy()
            if on_weight is not None:
                on_weight(i + 1, len(stored), p.name)

    path = Path(path)
    if not external:
        # The graph, then each weight as a message of its own: protobuf merges a repeated message
        # field when it parses, so this is the graph with its initializers, serialized a tensor
        # at a time, each weight's bytes going from its array to the file (no protobuf copy of
        # them); the in-memory `graph` stays without them.
        with writing(path), open(path, "wb") as f:
            f.write(graph.SerializeToString())
            for p, value in values():
                header = onnx.TensorProto(name=p.name, data_type=p.type.tensor_type.elem_type, dims=value.shape)
                _write_initializer(f, header, memoryview(value).cast("B"))
        return [path]
    with DataFile(data) as out:
        for p, value in values():
            if value.nbytes >= MIN_EXTERNAL_TENSOR:
                init = out.append(onnx.TensorProto(name=p.name, data_type=p.type.tensor_type.elem_type,
                                                   dims=value.shape), [memoryview(value).cast("B")])
            else:
                init = numpy_helper.from_array(value, p.name)
            graph.graph.initializer.append(init)
    with writing(path):
        onnx.save(graph, str(path))
    return [path, data]


__all__ = ["Resolver", "WeightRef", "WeightWritten", "attach_weights", "stand_in", "weights_as_inputs"]
