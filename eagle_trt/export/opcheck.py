"""Static check that a graph uses only what TensorRT's ONNX parser accepts.

The op list follows onnx-tensorrt's operator support matrix (TensorRT 10.x, docs/operators.md),
default ONNX domain. Besides op types we check tensor element types (no float64 / strings /
sequences / optionals in the graph), custom domains (only TensorRT's own `trt` ops), the opset
range, and TopK's k (TensorRT's TopK layer takes k <= 3840)."""
from __future__ import annotations

from pathlib import Path

import onnx
from onnx import TensorProto

TRT_ONNX_OPS = frozenset("""
Abs Acos Acosh Add AffineGrid And ArgMax ArgMin Asin Asinh Atan Atanh Attention AveragePool BatchNormalization
BitShift BitwiseAnd BitwiseNot BitwiseOr BitwiseXor BlackmanWindow Cast CastLike Ceil Celu CenterCropPad Clip
Compress Concat Constant ConstantOfShape Conv ConvTranspose Cos Cosh CumSum DFT DeformConv DepthToSpace
DequantizeLinear Div Dropout DynamicQuantizeLinear Einsum Elu Equal Erf Exp Expand EyeLike Flatten Floor Gather
GatherElements GatherND Gelu Gemm GlobalAveragePool GlobalLpPool GlobalMaxPool Greater GreaterOrEqual GridSample
GroupNormalization GRU HammingWindow HannWindow Hardmax HardSigmoid HardSwish Identity If ImageScaler
InstanceNormalization IsInf IsNaN LayerNormalization LeakyRelu Less LessOrEqual Log LogSoftmax Loop LpNormalization
LpPool LRN LSTM MatMul Max MaxPool MaxUnpool Mean MeanVarianceNormalization Min Mish Mod Mul Neg NonMaxSuppression
NonZero Not OneHot Or Pad ParametricSoftplus Pow PRelu QuantizeLinear RandomNormal RandomNormalLike RandomUniform
RandomUniformLike Range Reciprocal ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax ReduceMean ReduceMin
ReduceProd ReduceSum ReduceSumSquare Relu Reshape Resize ReverseSequence RMSNormalization RNN RoiAlign
RotaryEmbedding Round ScaledTanh Scan Scatter ScatterElements ScatterND Selu Shape Shrink Sigmoid Sign Sin Sinh Size
Slice Softmax Softplus Softsign SpaceToDepth Split Sqrt Squeeze Sub Sum Tan Tanh ThresholdedRelu Tile TopK Transpose
Trilu Unsqueeze Upsample Where Xor
""".split())

# TensorRT plugins / ops ModelOpt emits for NVFP4, under the "trt" domain.
TRT_CUSTOM_OPS = frozenset({("trt", "TRT_FP4DynamicQuantize")})

TRT_TYPES = frozenset({TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.INT32,
                       TensorProto.INT64, TensorProto.INT8, TensorProto.UINT8, TensorProto.BOOL,
                       TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT4E2M1, TensorProto.INT4})
MIN_OPSET, MAX_OPSET = 9, 23
TRT_TOPK_MAX_K = 3840


class UnsupportedGraph(ValueError):
    pass


def _type_name(elem: int) -> str:
    return TensorProto.DataType.Name(elem)


def find_problems(model: onnx.ModelProto, label: str = "graph") -> list[str]:
    problems: list[str] = []
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset is None or not MIN_OPSET <= opset <= MAX_OPSET:
        problems.append(f"{label}: default-domain opset {opset} outside TensorRT's supported {MIN_OPSET}..{MAX_OPSET}")
    constants = {init.name: init for init in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    constants[node.output[0]] = attr.t
    for node in model.graph.node:
        where = f"{label}: node '{node.name or node.output[0]}' ({node.domain + '::' if node.domain else ''}{node.op_type})"
        if node.domain in ("", "ai.onnx"):
            if node.op_type not in TRT_ONNX_OPS:
                problems.append(f"{where} is not supported by TensorRT's ONNX parser")
        elif (node.domain, node.op_type) not in TRT_CUSTOM_OPS:
            problems.append(f"{where} is in custom domain '{node.domain}' that TensorRT does not implement")
        if node.op_type == "TopK" and len(node.input) > 1 and node.input[1] in constants:
            k = int(onnx.numpy_helper.to_array(constants[node.input[1]]).reshape(-1)[0])
            if k > TRT_TOPK_MAX_K:
                problems.append(f"{where} has k = {k}; TensorRT's TopK takes k <= {TRT_TOPK_MAX_K}")
        if node.op_type == "TopK" and len(node.input) > 1 and node.input[1] not in constants:
            problems.append(f"{where} has a computed k; TensorRT needs a build-time constant k")
        if node.op_type == "Cast":
            to = next((a.i for a in node.attribute if a.name == "to"), None)
            if to is not None and to not in TRT_TYPES:
                problems.append(f"{where} casts to {_type_name(to)}, which TensorRT does not support")
    for init in model.graph.initializer:
        if init.data_type not in TRT_TYPES:
            problems.append(f"{label}: initializer '{init.name}' has type {_type_name(init.data_type)}")
    for value in list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info):
        kind = value.type.WhichOneof("value")
        if kind != "tensor_type":
            problems.append(f"{label}: value '{value.name}' is a {kind}, not a tensor")
        elif value.type.tensor_type.elem_type not in TRT_TYPES:
            problems.append(f"{label}: value '{value.name}' has type {_type_name(value.type.tensor_type.elem_type)}")
    return problems


def check_graph(model: str | Path | onnx.ModelProto, label: str | None = None) -> None:
    """Raise UnsupportedGraph listing every problem, or return silently."""
    if not isinstance(model, onnx.ModelProto):
        label = label or str(model)
        model = onnx.load(str(model), load_external_data=False)
    problems = find_problems(model, label or model.graph.name)
    if problems:
        raise UnsupportedGraph(f"{len(problems)} TensorRT incompatibilities:\n  " + "\n  ".join(problems))
