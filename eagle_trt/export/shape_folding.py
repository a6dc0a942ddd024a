"""Fold the shape arithmetic a traced graph computes at run time into constants, where the
graph's symbolic sizes prove the result.

TorchScript traces `x.view(B, T, H, D)` with B and T read from the tensors at run time:
Shape -> Gather -> Unsqueeze -> Concat -> Reshape, six nodes for one view. SmolLM2's target had
~1,300 such nodes beside ~300 MatMuls; on a CPU each costs ONNX Runtime a dispatch, together
~3 ms of a 15 ms one-token step (docs/benchmarks.md, "Against llama.cpp"). This pass gives every tensor symbolic dims (the graph inputs'
named axes; fresh symbols where an op's result is not known here), evaluates the integer
tensors computed from shapes as symbolic values, and then:
- an integer tensor whose value is a constant becomes an initializer (`half = x.shape[-1] // 2`);
- a Reshape whose target is known becomes a constant target: an entry equal to the input's
  size on the same axis becomes 0 (copy it), at most one other entry -1 (inferred; used only
  where every other entry is provably non-zero, as -1 beside a zero size is an error);
- a symbolic value computed again (every layer reads the past's length from its own cache, a
  named axis they share) is read from the first tensor that holds it;
- the nodes left without consumers go.

The result is plain ONNX (Reshape's 0 and -1 are standard and TensorRT parses them). The pass
is sound by construction: a size it cannot derive gets a fresh symbol, equal to nothing.
`relations` states what the graph's callers guarantee between named axes, such as
total_tokens = past_tokens + new_tokens for an attention mask."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import onnx
import sympy
from onnx import numpy_helper

Dim = sympy.Expr
INT_TYPES = (onnx.TensorProto.INT64, onnx.TensorProto.INT32)
MAX_VALUES = 64     # integer tensors longer than this are data, not shapes

UNARY = {"Abs", "Cast", "CastLike", "Ceil", "Clip", "Cos", "CumSum", "Elu", "Erf", "Exp", "Floor", "Gelu",
         "HardSigmoid", "Identity", "IsInf", "IsNaN", "LeakyRelu", "Log", "LogSoftmax", "Neg", "Not", "Reciprocal",
         "Relu", "Round", "Sigmoid", "Sign", "Sin", "Softmax", "Softplus", "Sqrt", "Tanh", "Trilu",
         "QuantizeLinear", "DequantizeLinear"}
BROADCAST = {"Add", "And", "BitShift", "Div", "Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual", "Max",
             "Min", "Mod", "Mul", "Or", "Pow", "Sub", "Sum", "Where", "Xor"}
VALUE_OPS = {"Add": lambda a, b: a + b, "Sub": lambda a, b: a - b, "Mul": lambda a, b: a * b}


@dataclass
class ShapeFolding:
    """What fold_shapes changed (the tests read it)."""
    nodes_before: int
    nodes_after: int
    reshapes: int = 0        # Reshape targets made constant
    constants: int = 0       # computed integer tensors made initializers
    shared: int = 0          # readers of a symbolic value computed before, given that tensor
    kept: list[str] = field(default_factory=list)   # Reshapes left computed (their names)


class _Symbols:
    def __init__(self, positive: set[str], relations: dict[str, str]):
        self.positive, self.named, self.fresh = positive, {}, 0
        # every name in an expression is an axis (sympy's own N, E, S... would parse as functions)
        self.relations = {}
        for name, expr in relations.items():
            axes = {n: self.named_dim(n) for n in re.findall(r"[A-Za-z_]\w*", expr)}
            self.relations[name] = sympy.sympify(expr, locals=axes)

    def named_dim(self, name: str) -> Dim:
        if name not in self.named:
            self.named[name] = sympy.Symbol(name, integer=True, nonnegative=True,
                                            positive=True if name in self.positive else None)
        return self.named[name]

    def axis(self, name: str) -> Dim:
        return self.relations[name] if name in self.relations else self.named_dim(name)

    def new(self) -> Dim:
        self.fresh += 1
        return sympy.Symbol(f"_d{self.fresh}", integer=True, nonnegative=True)


def _same(a: Dim, b: Dim) -> bool:
    if a == b:
        return True
    difference = sympy.expand(a - b)
    return difference == 0 or (not difference.is_number and sympy.simplify(difference) == 0)


def _int(e) -> int | None:
    return int(e) if isinstance(e, (int, sympy.Integer)) or (isinstance(e, sympy.Expr) and e.is_Integer) else None


class _Shapes:
    """Symbolic dims of every tensor, and the values of the small integer tensors."""

    def __init__(self, model: onnx.ModelProto, symbols: _Symbols):
        self.sym = symbols
        self.dims: dict[str, tuple | None] = {}
        self.values: dict[str, list] = {}       # flat values (rank 0 or 1 integer tensors)
        self.types: dict[str, int] = {}         # their element types
        g = model.graph
        for vi in g.input:
            t = vi.type.tensor_type
            if not t.HasField("shape"):
                self.dims[vi.name] = None
                continue
            self.dims[vi.name] = tuple(sympy.Integer(d.dim_value) if d.HasField("dim_value")
                                       else symbols.axis(d.dim_param) if d.dim_param else symbols.new()
                                       for d in t.shape.dim)
        for init in g.initializer:
            self._constant(init.name, init)

    def _constant(self, name: str, tensor: onnx.TensorProto) -> None:
        self.dims[name] = tuple(sympy.Integer(d) for d in tensor.dims)
        size = int(np.prod(tensor.dims)) if tensor.dims else 1
        if tensor.data_type in INT_TYPES and len(tensor.dims) <= 1 and size <= MAX_VALUES \
                and tensor.data_location != onnx.TensorProto.EXTERNAL:
            self.values[name] = [sympy.Integer(int(v)) for v in numpy_helper.to_array(tensor).reshape(-1)]
            self.types[name] = tensor.data_type

    def _pass_values(self, source: str, out: str, elem_type: int | None = None) -> None:
        if source in self.values:
            self.values[out], self.types[out] = self.values[source], elem_type or self.types[source]

    # ------------------------------------------------------------------ helpers

    def _fresh(self, rank: int | None) -> tuple | None:
        return None if rank is None else tuple(self.sym.new() for _ in range(rank))

    def _broadcast(self, shapes: list[tuple | None]) -> tuple | None:
        if any(s is None for s in shapes):
            return None
        rank = max(len(s) for s in shapes)
        out = []
        for axis in range(rank):
            dims = [s[axis - rank + len(s)] for s in shapes if axis - rank + len(s) >= 0]
            known = [d for d in dims if d != 1]
            if not known:
                out.append(sympy.Integer(1))
            elif all(_same(known[0], d) for d in known[1:]):
                out.append(known[0])
            else:      # a symbol that may be 1 beside another: either could be the result
                out.append(self.sym.new())
        return tuple(out)

    def _axes(self, node, index: int) -> list[int] | None:
        attr = _attr(node, "axes")
        if attr is not None:
            return list(attr)
        if len(node.input) > index and node.input[index]:
            v = self.values.get(node.input[index])
            return None if v is None or any(_int(x) is None for x in v) else [_int(x) for x in v]
        return []

    # ------------------------------------------------------------------ one node

    def visit(self, node: onnx.NodeProto) -> None:
        op, ins = node.op_type, [self.dims.get(i) if i else None for i in node.input]
        out = node.output[0] if node.output else None
        handler = getattr(self, f"_op_{op}", None) if node.domain in ("", "ai.onnx") else None
        if handler is not None:
            handler(node, ins)
        elif op in UNARY:
            self.dims[out] = ins[0]
            if op == "Identity" or (op == "Cast" and _attr(node, "to") in INT_TYPES):
                self._pass_values(node.input[0], out, _attr(node, "to"))
        elif op in BROADCAST:
            self.dims[out] = self._broadcast(ins)
            self._value_arithmetic(node)
        for o in node.output:        # anything not derived: unknown rank
            self.dims.setdefault(o, None)

    def _value_arithmetic(self, node) -> None:
        vals = [self.values.get(i) for i in node.input]
        if any(v is None for v in vals):
            return
        if node.op_type == "Where":     # a traced expand()'s "-1 keeps the size" selection
            n = max(len(v) for v in vals)
            if all(len(v) in (1, n) for v in vals) and all(c in (sympy.true, sympy.false) for c in vals[0]):
                c, a, b = (v * n if len(v) == 1 else v for v in vals)
                self.values[node.output[0]] = [x if k == sympy.true else y for k, x, y in zip(c, a, b)]
                self.types[node.output[0]] = self.types[node.input[1]]
            return
        if len(vals) != 2:
            return
        a, b = vals
        n = max(len(a), len(b))
        if min(len(a), len(b)) != 1 and len(a) != len(b):
            return
        a, b = (a * n if len(a) == 1 else a), (b * n if len(b) == 1 else b)
        op = node.op_type
        out = node.output[0]
        if op in VALUE_OPS:
            self.values[out] = [sympy.expand(VALUE_OPS[op](x, y)) for x, y in zip(a, b)]
        elif op == "Div" and all(x.is_nonnegative and y.is_positive for x, y in zip(a, b)):
            self.values[out] = [sympy.floor(x / y) for x, y in zip(a, b)]    # floor = ONNX's truncation here
        elif op == "Equal":
            equal = [sympy.Eq(x, y) for x, y in zip(a, b)]
            if not all(e in (sympy.true, sympy.false) for e in equal):
                return
            self.values[out], self.types[out] = equal, onnx.TensorProto.BOOL
            return
        else:
            return
        self.types[out] = self.types[node.input[0]]

    def _op_Constant(self, node, ins) -> None:
        value = _attr(node, "value")
        if isinstance(value, onnx.TensorProto):
            self._constant(node.output[0], value)
        elif _attr(node, "value_int") is not None:
            self.dims[node.output[0]] = ()
            self.values[node.output[0]] = [sympy.Integer(_attr(node, "value_int"))]
            self.types[node.output[0]] = onnx.TensorProto.INT64
        elif _attr(node, "value_ints") is not None:
            v = _attr(node, "value_ints")
            self.dims[node.output[0]] = (sympy.Integer(len(v)),)
            self.values[node.output[0]] = [sympy.Integer(x) for x in v]
            self.types[node.output[0]] = onnx.TensorProto.INT64

    def _op_Shape(self, node, ins) -> None:
        if ins[0] is None:
            self.dims[node.output[0]] = None
            return
        rank = len(ins[0])
        start, end = _attr(node, "start") or 0, _attr(node, "end")
        end = rank if end is None else end
        start, end = [max(0, min(rank, x + rank if x < 0 else x)) for x in (start, end)]
        self.values[node.output[0]] = list(ins[0][start:end])
        self.types[node.output[0]] = onnx.TensorProto.INT64
        self.dims[node.output[0]] = (sympy.Integer(max(0, end - start)),)

    def _op_Gather(self, node, ins) -> None:
        data, idx = ins[0], ins[1]
        axis = _attr(node, "axis") or 0
        self.dims[node.output[0]] = None if data is None or idx is None else \
            data[:axis % len(data)] + idx + data[axis % len(data) + 1:]
        values, where = self.values.get(node.input[0]), self.values.get(node.input[1])
        if values is not None and where is not None and axis == 0 and all(_int(w) is not None for w in where):
            picked = [_int(w) + len(values) if _int(w) < 0 else _int(w) for w in where]
            if all(0 <= p < len(values) for p in picked):
                self.values[node.output[0]] = [values[p] for p in picked]
                self.types[node.output[0]] = self.types[node.input[0]]

    def _op_Unsqueeze(self, node, ins) -> None:
        axes = self._axes(node, 1)
        if ins[0] is not None and axes is not None:
            rank = len(ins[0]) + len(axes)
            axes = sorted(a + rank if a < 0 else a for a in axes)
            dims = list(ins[0])
            for a in axes:
                dims.insert(a, sympy.Integer(1))
            self.dims[node.output[0]] = tuple(dims)
        self._pass_values(node.input[0], node.output[0])

    def _op_Squeeze(self, node, ins) -> None:
        axes = self._axes(node, 1)
        if ins[0] is not None and axes is not None:
            rank = len(ins[0])
            axes = {a + rank if a < 0 else a for a in axes} or {i for i, d in enumerate(ins[0]) if d == 1}
            self.dims[node.output[0]] = tuple(d for i, d in enumerate(ins[0]) if i not in axes)
        self._pass_values(node.input[0], node.output[0])

    def _op_Concat(self, node, ins) -> None:
        if any(i is None for i in ins) or not ins:
            return
        axis = _attr(node, "axis")
        axis = axis % len(ins[0])
        total = sympy.expand(sum((i[axis] for i in ins), sympy.Integer(0)))
        self.dims[node.output[0]] = ins[0][:axis] + (total,) + ins[0][axis + 1:]
        vals = [self.values.get(i) for i in node.input]
        if all(v is not None for v in vals) and len(ins[0]) == 1 and len({self.types[i] for i in node.input}) == 1:
            self.values[node.output[0]] = [x for v in vals for x in v]
            self.types[node.output[0]] = self.types[node.input[0]]

    def _op_Transpose(self, node, ins) -> None:
        if ins[0] is not None:
            perm = _attr(node, "perm") or list(range(len(ins[0])))[::-1]
            self.dims[node.output[0]] = tuple(ins[0][p] for p in perm)

    def _op_MatMul(self, node, ins) -> None:
        a, b = ins
        if a is None or b is None or len(a) < 2 or len(b) < 2:
            return
        batch = self._broadcast([a[:-2], b[:-2]])
        self.dims[node.output[0]] = None if batch is None else batch + (a[-2], b[-1])

    def _op_Reshape(self, node, ins) -> None:
        target = self.values.get(node.input[1])
        self._pass_values(node.input[0], node.output[0])
        if target is None:   # the rank, where the target's length is known
            rank = _int(ins[1][0]) if ins[1] is not None and len(ins[1]) == 1 else None
            self.dims[node.output[0]] = self._fresh(rank)
            return
        self.dims[node.output[0]] = self.reshaped(ins[0], target, bool(_attr(node, "allowzero")))

    def reshaped(self, dims: tuple | None, target: list, allowzero: bool) -> tuple | None:
        out = []
        for j, e in enumerate(target):
            if _int(e) == 0 and not allowzero:
                if dims is None or j >= len(dims):
                    return self._fresh(len(target))
                out.append(dims[j])
            elif _int(e) is None and not allowzero and not e.is_positive and \
                    (dims is None or j >= len(dims) or not _same(e, dims[j])):
                out.append(self.sym.new())     # a run-time 0 would copy the input's size instead
            else:
                out.append(e)
        infer = [j for j, e in enumerate(out) if _int(e) == -1]
        if infer:
            others = [e for j, e in enumerate(out) if j != infer[0]]
            if dims is None or len(infer) > 1 or not all(e.is_positive for e in others):
                return tuple(self.sym.new() if j in infer else e for j, e in enumerate(out))
            out[infer[0]] = sympy.simplify(sympy.prod(dims) / sympy.prod(others))
        return tuple(out)

    def _op_Slice(self, node, ins) -> None:
        data = ins[0]
        starts, ends = (self.values.get(node.input[i]) for i in (1, 2))
        axes = self.values.get(node.input[3]) if len(node.input) > 3 and node.input[3] else None
        steps = self.values.get(node.input[4]) if len(node.input) > 4 and node.input[4] else None
        if data is None:
            return
        rank = len(data)
        if starts is None or ends is None or (len(node.input) > 3 and node.input[3] and axes is None) or \
                (len(node.input) > 4 and node.input[4] and steps is None):
            self.dims[node.output[0]] = self._fresh(rank)
            return
        axes = [_int(a) for a in axes] if axes is not None else list(range(len(starts)))
        steps = steps or [sympy.Integer(1)] * len(starts)
        if any(a is None for a in axes) or any(_int(s) != 1 for s in steps):
            self.dims[node.output[0]] = self._fresh(rank)
            return
        dims = list(data)
        for a, s, e in zip(axes, starts, ends):
            a = a + rank if a < 0 else a
            dims[a] = self._slice_length(data[a], s, e)
        self.dims[node.output[0]] = tuple(dims)
        if rank == 1 and node.input[0] in self.values and axes == [0] and \
                all(_int(x) is not None for x in starts + ends):
            values = self.values[node.input[0]]
            self.values[node.output[0]] = values[slice(_int(starts[0]), _int(ends[0]))]
            self.types[node.output[0]] = self.types[node.input[0]]

    def _slice_length(self, size: Dim, start: Dim, end: Dim) -> Dim:
        """end - start clamped to [0, size], where the signs are known; else a fresh symbol."""
        def bound(x):
            if _int(x) is not None and _int(x) < 0:
                x = size + x
            if _int(x) is not None and _int(x) >= 2 ** 62:
                return size
            if not x.is_nonnegative:
                return None
            return sympy.Min(x, size)
        s, e = bound(start), bound(end)
        if s is None or e is None:
            return self.sym.new()
        length = sympy.simplify(sympy.Max(e - s, 0))
        return length if not length.has(sympy.Min, sympy.Max) else self.sym.new()

    def _op_Expand(self, node, ins) -> None:
        shape = self.values.get(node.input[1])
        if ins[0] is not None and shape is not None:
            self.dims[node.output[0]] = self._broadcast([ins[0], tuple(shape)])

    def _op_ConstantOfShape(self, node, ins) -> None:
        shape = self.values.get(node.input[0])
        if shape is None:
            return
        self.dims[node.output[0]] = tuple(shape)
        fill = _attr(node, "value")
        if fill is not None and fill.data_type in INT_TYPES and len(shape) == 1 and _int(shape[0]) is not None \
                and _int(shape[0]) <= MAX_VALUES:     # e.g. the ones a traced repeat() expands by
            value = int(numpy_helper.to_array(fill).reshape(-1)[0])
            self.values[node.output[0]] = [sympy.Integer(value)] * _int(shape[0])
            self.types[node.output[0]] = fill.data_type

    def _reduce(self, node, ins, axes) -> None:
        if ins[0] is None or axes is None:
            return
        rank = len(ins[0])
        axes = {a + rank if a < 0 else a for a in axes} if axes else set(range(rank))
        keep = _attr(node, "keepdims")
        keep = 1 if keep is None else keep
        self.dims[node.output[0]] = tuple(sympy.Integer(1) if i in axes else d for i, d in enumerate(ins[0])
                                          if keep or i not in axes)

    def _op_ReduceMean(self, node, ins) -> None:
        self._reduce(node, ins, self._axes(node, 1))

    _op_ReduceSum = _op_ReduceMax = _op_ReduceMin = _op_ReduceProd = _op_ReduceMean

    def _op_ArgMax(self, node, ins) -> None:
        self._reduce(node, ins, [_attr(node, "axis") or 0])

    _op_ArgMin = _op_ArgMax

    def _op_GatherElements(self, node, ins) -> None:
        self.dims[node.output[0]] = ins[1]

    def _op_ScatterElements(self, node, ins) -> None:
        self.dims[node.output[0]] = ins[0]

    def _op_Tile(self, node, ins) -> None:
        repeats = self.values.get(node.input[1])
        if ins[0] is not None and repeats is not None and len(repeats) == len(ins[0]):
            self.dims[node.output[0]] = tuple(sympy.expand(d * r) for d, r in zip(ins[0], repeats))

    def _op_Split(self, node, ins) -> None:
        if ins[0] is None:
            return
        axis = (_attr(node, "axis") or 0) % len(ins[0])
        sizes = self.values.get(node.input[1]) if len(node.input) > 1 and node.input[1] else None
        if sizes is None and len(node.input) > 1 and node.input[1]:
            return
        if sizes is None:     # equal parts
            n = len(node.output)
            if _int(ins[0][axis]) is None or _int(ins[0][axis]) % n:
                return
            sizes = [sympy.Integer(_int(ins[0][axis]) // n)] * n
        for out, size in zip(node.output, sizes):
            self.dims[out] = ins[0][:axis] + (size,) + ins[0][axis + 1:]

    def _op_TopK(self, node, ins) -> None:
        k = self.values.get(node.input[1])
        if ins[0] is not None and k is not None and len(k) == 1:
            axis = _attr(node, "axis")
            axis = (-1 if axis is None else axis) % len(ins[0])
            for out in node.output:
                self.dims[out] = ins[0][:axis] + (k[0],) + ins[0][axis + 1:]

    def _op_Range(self, node, ins) -> None:
        start, limit, delta = (self.values.get(i) for i in node.input)
        length = None
        if start and limit and delta and _int(delta[0]) == 1:
            length = sympy.expand(limit[0] - start[0])
        self.dims[node.output[0]] = (length,) if length is not None and length.is_nonnegative else self._fresh(1)


def _attr(node: onnx.NodeProto, name: str):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return None


def fold_shapes(model: onnx.ModelProto, positive: tuple[str, ...] = (),
                relations: dict[str, str] | None = None) -> ShapeFolding:
    """Rewrite `model` in place (module docstring). positive: the named axes that are never 0
    (a batch, the new tokens); relations: {axis: expression of other axes} the callers keep."""
    g = model.graph
    report = ShapeFolding(len(g.node), len(g.node))
    shapes = _Shapes(model, _Symbols(set(positive), relations or {}))
    produced = {}
    for node in g.node:
        shapes.visit(node)
        for o in node.output:
            produced[o] = node
    new_inits: dict[tuple, str] = {}

    def constant(values: list, like: str) -> str:
        """An initializer with these integer values and `like`'s rank and type; one per distinct
        value. Named after `like` and numbered: one computed target read by two Reshapes can
        become two different constants."""
        ints, rank0 = [_int(v) for v in values], shapes.dims.get(like) == ()
        key = (tuple(ints), rank0, shapes.types.get(like, onnx.TensorProto.INT64))
        if key not in new_inits:
            arr = np.array(ints[0] if rank0 else ints, dtype=onnx.helper.tensor_dtype_to_np_dtype(key[2]))
            new_inits[key] = f"{like}__folded{len(new_inits)}"
            g.initializer.append(numpy_helper.from_array(arr, new_inits[key]))
        return new_inits[key]

    computed_once: dict[tuple, str] = {}

    def computed(name: str) -> bool:
        return bool(name) and name in produced and produced[name].op_type != "Constant"

    for node in g.node:
        if node.op_type == "Reshape" and computed(node.input[1]):
            new = _static_target(shapes.dims.get(node.input[0]), shapes.values.get(node.input[1]),
                                 bool(_attr(node, "allowzero")))
            if new is None:
                report.kept.append(node.name)
            else:
                node.input[1] = constant([sympy.Integer(v) for v in new], node.input[1])
                report.reshapes += 1
            continue
        for i, name in enumerate(node.input):
            values = shapes.values.get(name) if computed(name) else None
            if values is None:
                continue
            if all(_int(v) is not None for v in values):
                node.input[i] = constant(values, name)
                report.constants += 1
                continue
            # The same symbolic value computed again (each layer reads the past's length from its
            # own cache): the first tensor holding it serves every later reader. It was produced
            # before its first reader, so before this node.
            key = (tuple(values), shapes.dims.get(name) == (), shapes.types.get(name))
            first = computed_once.setdefault(key, name)
            if first != name:
                node.input[i] = first
                report.shared += 1
    remove_unused(g, set(new_inits.values()))
    report.nodes_after = len(g.node)
    return report


def _static_target(dims: tuple | None, target: list | None, allowzero: bool) -> list[int] | None:
    """A constant Reshape target equal to `target` for input dims `dims`, or None."""
    if target is None or dims is None or allowzero:
        return None
    new, infer = [], []
    for j, e in enumerate(target):
        if _int(e) is not None:
            if _int(e) == -1:
                infer.append(j)
            new.append(_int(e))
        elif j < len(dims) and _same(e, dims[j]):
            new.append(0)
        elif e.is_positive:     # (a run-time 0 here would have meant: copy the input's size)
            infer.append(j)
            new.append(-1)
        else:
            return None
    if len(infer) > 1:
        return None
    if infer:     # -1 beside a zero size is an error in ONNX Runtime: every other entry must be non-zero
        sizes = [dims[j] if v == 0 else sympy.Integer(v) for j, v in enumerate(new) if j != infer[0]]
        if not all(s.is_positive for s in sizes):
            return None
    return new


def remove_unused(g: onnx.GraphProto, folded: set[str]) -> None:
    """Drop the nodes (in topological order) whose outputs nothing reads (nor a subgraph), and the
    unread initializers named in `folded`."""
    needed = {o.name for o in g.output}
    keep = []
    for node in reversed(g.node):
        if any(o in needed for o in node.output):
            keep.append(node)
            needed.update(i for i in node.input if i)
            needed.update(_subgraph_reads(node))
    if len(keep) != len(g.node):
        keep.reverse()
        del g.node[:]
        g.node.extend(keep)
    for init in [i for i in g.initializer if i.name in folded and i.name not in needed]:
        g.initializer.remove(init)


def _subgraph_reads(node: onnx.NodeProto) -> set[str]:
    names = set()
    for a in node.attribute:
        for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
            for n in sub.node:
                names.update(n.input)
                names.update(_subgraph_reads(n))
    return names


__all__ = ["ShapeFolding", "fold_shapes", "remove_unused"]
