"""A target graph whose attention is ONNX Runtime's fused `GroupQueryAttention`, for its CPU provider.

The portable target graph writes each layer's attention from plain ops (RoPE, two score
MatMuls, the mask, softmax, two weighted sums and the reshapes between), ~25 nodes a layer.
On a 2-core CPU those small nodes cost ~1-2 us each in place, most of the ~2.9 ms a 12 ms
SmolLM2 step spent beside its weight MatMuls; the 30 fused operators take ~1.1 ms
(docs/benchmarks.md, "Against llama.cpp"). This graph is
the portable one with every layer's attention (from the q / k / v projections to the o
projection's input) replaced by one `com.microsoft.GroupQueryAttention`, as onnxruntime-genai's
CPU models are written:

- RoPE inside the operator (do_rotary, the graph's position_ids, so tree rows get their depth's
  position), from cos / sin tables of max_position_embeddings rows made by the model's own
  RotaryEmbedding (YaRN's attention factor included); NoPE layers rotate nothing.
- The KV caches in place: input past_key_i is the cache's whole block of rows [B, Hkv, S, D]
  and output present_key_i the same memory (the runtime binds both to it), so the operator
  writes each sequence's new rows right after its committed ones and copies nothing. Rows a
  verification rejects are overwritten or moved by the commit (KVCache.commit, in_place).
- The mask from the same attention_mask input as the portable graph ([B, T, S + T]: committed
  rows, then the tree): each sequence's committed length is counted from it, and the tree part is
  moved to the columns where the new rows now are, as the operator's additive attention_bias.

- Each layer's q / k / v projections one MatMul (their weights side by side; the operator takes
  packed QKV) and its gate / up projections one MatMul and a Split: 60 fewer nodes for SmolLM2,
  the same float sums column by column, so the outputs are bit-identical to separate MatMuls
  (a 4-bit graph's MatMulNBits packed alike).

- The attention's 1/sqrt(head_dim) folded into the packed q projection's weights (and bias) and
  the operator's `scale` set to 1, where that factor is a power of two (head_dim 16, 64, 256):
  the same floats, so the outputs are bit-identical, but a one-row call's query-key product
  then takes MLAS' one-row kernel, which reads the keys in place, where a scale other than 1
  sends it to the general GEMM, which first copies every head's keys into a packed panel
  (SmolLM2, 2026-11-29: -0.2 ms of a ~14 ms one-token call).

- Each float weight MatMul a 1x1 `Conv` over [B, K, T, 1] between two Transposes (convs, the
  default for a float graph), which ONNX Runtime's NCHWc optimizer turns into its blocked
  pointwise convolution with the Transposes folded into its reorder nodes. On the 2-core AVX-512
  EPYC its kernel reads the weights faster than MLAS' GEMM at the few rows decoding and
  verification have (SmolLM2's weight products alone, 2026-11-29: 1 row 12.4 -> 11.9 ms, 5 rows
  14.6 -> 13.4 ms, 8 rows 15.2 -> 13.1; as fast from 72 rows on), and each row of a several-row
  call equals the same row computed alone, as the MatMul's does. Its sums run in another order
  than the MatMul's (logits ~1e-3 apart on SmolLM2). Where K or N is not a multiple of 16 (the
  channel block) a MatMul stays.

- With int8_activations (the 4-bit graph): its MatMulNBits compute with int8 activations
  (accuracy_level 4, as llama.cpp's Q4 dot products do: ~2x the float kernel on several rows)
  and no call gives the operator one query row. The operator's weighted sum of values takes
  MLAS' one-row path for one row and its several-row path otherwise, which round differently;
  int8 activations turn such last bits into other tokens (9 of 10 MT-bench prompts unpadded). A
  one-row call is padded with a copy of its row (its KV row written one past, never committed,
  its output dropped), so every row a chain verification computes is bit-identical to the same
  token decoded alone. A tree node off the first chain sits at other columns than alone (its
  siblings masked in between), which regroups its softmax sum: such a graph is lossless for
  chain trees (top_k 1), and says so in its metadata (graph_names.LOSSLESS_TREES, PADS_ONE_ROW).

The runtime feeds it exactly what it feeds the portable graph; only where the new rows go
differs (runtime/onnxruntime_backend.py). The operator's CPU kernel takes several new rows
after a past only at batch 1, so verification and prefill on this graph run one sequence a call
(OrtTarget refuses a batched one); plain steps batch. ONNX Runtime only (a contrib operator),
fp32, head_dim a multiple of 16 (the kernel's). Refused, with the reason: q / k norm (Qwen3) and
sliding-window layers (Mistral), which this rewrite does not map."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from ..config import TargetConfig
from ..graph_names import LOSSLESS_TREES, PADS_ONE_ROW, target_kv_names
from ..models.target import RotaryEmbedding
from .graph_files import DataFile, new_tensor, read_array, rewrite_graph
from .shape_folding import remove_unused

GQA = "GroupQueryAttention"
INT8_ACTIVATIONS = 4      # MatMulNBits accuracy_level: int8 activations
CONV_BLOCK = 16           # NCHWc's channel block on AVX-512 (8 on AVX2): a projection becomes a Conv
                          # where its K and N are multiples


class FusedAttentionError(ValueError):
    pass


def rope_tables(cfg: TargetConfig) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [max_position_embeddings, D/2] for the operator's rotary (non-interleaved:
    x1 cos - x2 sin, x2 cos + x1 sin), from RotaryEmbedding, so each position's values are the
    portable graph's (attention factor included)."""
    rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    with torch.no_grad():
        cos, sin_signed = rope(torch.arange(cfg.max_position_embeddings)[None], torch.float32)
    half = cfg.head_dim // 2
    return cos[0, :, 0, :half].numpy().copy(), (-sin_signed[0, :, 0, :half]).numpy().copy()


def check_fusable(cfg: TargetConfig, where: str) -> None:
    arch = cfg.arch
    reasons = []
    if arch.qk_norm:
        reasons.append("q / k RMSNorm before RoPE (Qwen3)")
    if arch.sliding_layers:
        reasons.append(f"sliding-window layers {list(arch.sliding_layers)[:4]}")
    if cfg.head_dim % 16:
        reasons.append(f"head_dim {cfg.head_dim} (the operator's CPU kernel takes multiples of 16)")
    if reasons:
        raise FusedAttentionError(f"{where}: the fused-attention target graph does not map "
                                  f"{'; '.join(reasons)}; use the portable target graph")


def _mask_nodes() -> tuple[list, list]:
    """Nodes, shared by every layer, that turn attention_mask [B, T, S + T] into the operator's
    inputs: seqlens_k [B] (committed + T - 1, int32), total_sequence_length (S, the cache rows)
    and attention_bias [B, 1, T, S] (0 where visible, -inf elsewhere; the tree's columns moved to
    each sequence's new rows)."""
    def c(name, values, dtype=np.int64):
        return numpy_helper.from_array(np.array(values, dtype=dtype), f"fused_attention/{name}")
    consts = [c("zero", [0]), c("two", [2]), c("big", [1 << 40]), c("axis1", [1]), c("axes2", [2]), c("one", 1),
              c("zero_s", 0), c("neg_inf", -np.inf, np.float32), c("zero_f", 0.0, np.float32), c("minus1", [-1]),
              c("nhwc_shape", [0, 0, 1, -1]), c("rows_shape", [0, 0, -1])]     # _pointwise_conv's
    k = "fused_attention/"
    n = helper.make_node
    nodes = [
        n("Shape", ["past_key_0"], [k + "S1"], start=2, end=3),                               # [S]
        n("Slice", ["attention_mask", k + "zero", k + "S1", k + "two"], [k + "committed"]),     # [B, T, S]
        n("Slice", ["attention_mask", k + "S1", k + "big", k + "two"], [k + "tree"]),           # [B, T, T]
        n("Shape", ["attention_mask"], [k + "T1"], start=1, end=2),                            # [T]
        n("Gather", [k + "committed", k + "zero_s"], [k + "row0"], axis=1),                    # [B, S]
        n("Cast", [k + "row0"], [k + "row0_i"], to=TensorProto.INT64),
        n("ReduceSum", [k + "row0_i", k + "minus1"], [k + "lengths"], keepdims=0),             # [B]
        n("Add", [k + "lengths", k + "T1"], [k + "ends"]),
        n("Sub", [k + "ends", k + "one"], [k + "seqlens64"]),
        n("Cast", [k + "seqlens64"], ["fused_attention/seqlens_k"], to=TensorProto.INT32),
        n("Cast", [k + "S1"], ["fused_attention/total_sequence_length"], to=TensorProto.INT32),
        n("Squeeze", [k + "S1"], [k + "S"]),
        n("Range", [k + "zero_s", k + "S", k + "one"], [k + "columns"]),                       # [S]
        n("Unsqueeze", [k + "lengths", k + "axis1"], [k + "lengths_col"]),                     # [B, 1]
        n("Sub", [k + "columns", k + "lengths_col"], [k + "rel"]),                             # [B, S]: column - committed
        n("Sub", [k + "T1", k + "one"], [k + "last"]),
        n("Max", [k + "rel", k + "zero_s"], [k + "rel_low"]),
        n("Min", [k + "rel_low", k + "last"], [k + "index"]),                                  # [B, S] in 0..T-1
        n("Unsqueeze", [k + "index", k + "axis1"], [k + "index_row"]),                         # [B, 1, S]
        n("Shape", [k + "committed"], [k + "BTS"]),
        n("Expand", [k + "index_row", k + "BTS"], [k + "index_all"]),                          # [B, T, S]
        n("GatherElements", [k + "tree", k + "index_all"], [k + "tree_moved"], axis=2),         # [B, T, S]
        n("GreaterOrEqual", [k + "rel", k + "zero_s"], [k + "after"]),
        n("Less", [k + "rel", k + "T1"], [k + "before_end"]),
        n("And", [k + "after", k + "before_end"], [k + "new_column"]),                         # [B, S]
        n("Unsqueeze", [k + "new_column", k + "axis1"], [k + "new_column_row"]),
        n("And", [k + "new_column_row", k + "tree_moved"], [k + "tree_visible"]),
        n("Or", [k + "committed", k + "tree_visible"], [k + "visible"]),     # committed: only columns < length
        n("Where", [k + "visible", k + "zero_f", k + "neg_inf"], [k + "bias3"]),
        n("Unsqueeze", [k + "bias3", k + "axis1"], ["fused_attention/attention_bias"]),       # [B, 1, T, S]
    ]
    return nodes, consts


def _one_row_padding() -> list:
    """Nodes, shared by every layer, that give a one-row call a second (dummy) query row: n =
    max(0, 2 - T) copies of the last row's position and bias, seqlens_k n further (its KV row is
    written one past the new ones). Each layer pads its packed QKV the same way (_pad_layer).
    They read _mask_nodes' outputs and constants."""
    k, p, n = "fused_attention/", "fused_attention/pad/", helper.make_node
    return [
        n("Sub", [k + "two", k + "T1"], [p + "short"]),
        n("Max", [p + "short", k + "zero"], [p + "rows"]),                           # [n]: 1 for a one-row call, else 0
        n("Sub", [k + "T1", p + "rows"], [p + "from"]),
        n("Slice", ["position_ids", p + "from", k + "T1", k + "axis1"], [p + "positions_copy"]),
        n("Concat", ["position_ids", p + "positions_copy"], [p + "position_ids"], axis=1),
        n("Slice", [k + "attention_bias", p + "from", k + "T1", k + "axes2"], [p + "bias_copy"]),
        n("Concat", [k + "attention_bias", p + "bias_copy"], [p + "attention_bias"], axis=2),
        n("Cast", [p + "rows"], [p + "rows32"], to=TensorProto.INT32),
        n("Add", [k + "seqlens_k", p + "rows32"], [p + "seqlens_k"]),
    ]


def _pad_layer(qkv: str, op_out: str, out: str, scope: str) -> tuple[list, str, list]:
    """(nodes before the operator, its padded QKV input, nodes after it): QKV [B, T, W] with the
    padding rows (copies of its last row); the operator's padded output `op_out` cut back to T
    rows as `out`."""
    k, n = "fused_attention/", helper.make_node
    padded = f"{scope}pad/qkv"
    before = [n("Slice", [qkv, k + "pad/from", k + "T1", k + "axis1"], [f"{scope}pad/qkv_copy"], name=f"{scope}pad/Slice"),
              n("Concat", [qkv, f"{scope}pad/qkv_copy"], [padded], name=f"{scope}pad/Concat", axis=1)]
    after = [n("Slice", [op_out, k + "zero", k + "T1", k + "axis1"], [out], name=f"{scope}pad/Slice_output")]
    return before, padded, after


def _pointwise_conv(x: str, weight: str, out: str, name: str) -> list:
    """x [B, T, K] times `weight` [N, K, 1, 1] as `out` [B, T, N]: x as an NHWC image T high and 1
    wide, one 1x1 Conv; ONNX Runtime's NCHWc optimizer folds both Transposes into its reorders."""
    k, n = "fused_attention/", helper.make_node
    return [n("Reshape", [x, k + "nhwc_shape"], [f"{name}/nhwc"], name=f"{name}/Reshape"),
            n("Transpose", [f"{name}/nhwc"], [f"{name}/nchw"], name=f"{name}/Transpose", perm=[0, 3, 1, 2]),
            n("Conv", [f"{name}/nchw", weight], [f"{name}/conv"], name=f"{name}/Conv"),
            n("Transpose", [f"{name}/conv"], [f"{name}/conv_nhwc"], name=f"{name}/Transpose_1", perm=[0, 2, 3, 1]),
            n("Reshape", [f"{name}/conv_nhwc", k + "rows_shape"], [out], name=f"{name}/Reshape_1")]


def _exact_query_scale(head_dim: int) -> float | None:
    """1/sqrt(head_dim) where it is a power of two (multiplying by it changes no float's digits),
    else None."""
    scale = float(np.float32(1.0) / np.sqrt(np.float32(head_dim)))
    return scale if np.frexp(scale)[0] == 0.5 else None


def _conv_shape(k: int, n: int) -> bool:
    return k % CONV_BLOCK == 0 and n % CONV_BLOCK == 0


def use_int8_activations(model: onnx.ModelProto) -> int:
    """Every MatMulNBits of `model` computing with int8 activations (accuracy_level 4); returns how many."""
    count = 0
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            for a in [a for a in node.attribute if a.name == "accuracy_level"]:
                node.attribute.remove(a)
            node.attribute.append(helper.make_attribute("accuracy_level", INT8_ACTIVATIONS))
            count += 1
    return count


def _last_output(nodes, prefix: str, where: str) -> str:
    named = [n for n in nodes if n.name.startswith(prefix)]
    if not named:
        raise FusedAttentionError(f"{where}: no node named {prefix}*: not a target graph of eagle_trt's export")
    return named[-1].output[0]


class _Packer:
    """Projections that read the same input made one MatMul: their weights side by side (and their
    biases), so each output column is the same sum as before: float MatMuls, or 4-bit MatMulNBits
    alike. Anything else is left as it is. convs: float projections written as pointwise Convs
    (`convs`, also for the ones not packed)."""

    def __init__(self, g: onnx.GraphProto, source_dir: Path | None, data: DataFile | None, convs: bool = False):
        self.weights = {t.name: t for t in g.initializer}
        self.source_dir, self.data, self.new, self.convs = source_dir, data, [], convs

    def _parts(self, nodes, prefix: str):
        """(MatMul, bias Add or None) of the projection `prefix`, or None if it is not one."""
        named = [n for n in nodes if n.name.startswith(prefix)]
        if not named or named[0].op_type not in ("MatMul", "MatMulNBits") or len(named) > 2 or \
                any(i not in self.weights for i in named[0].input[1:]):
            return None
        if len(named) == 2 and not (named[1].op_type == "Add" and named[0].output[0] in named[1].input
                                    and any(i in self.weights for i in named[1].input)):
            return None
        return named[0], (named[1] if len(named) == 2 else None)

    def _array(self, name: str) -> np.ndarray:
        return read_array(self.weights[name], self.source_dir or ".")

    def pack(self, nodes, prefixes: list[str], packed: str,
             first_scale: float = 1.0) -> tuple[list, str, list[int], list] | None:
        """(new nodes, their output, each projection's width, the nodes they replace) or None
        where the projections do not pack. first_scale: a factor folded into the first
        projection's weights and bias (float weights only)."""
        parts = [self._parts(nodes, p) for p in prefixes]
        if any(p is None for p in parts) or len({m.input[0] for m, _ in parts}) != 1 or \
                len({b is None for _, b in parts}) != 1:
            return None
        matmuls = [m for m, _ in parts]
        if matmuls[0].op_type == "MatMulNBits":
            if first_scale != 1.0:
                raise FusedAttentionError(f"{packed}: a factor is folded into float weights only")
            made = self._matmul_nbits(matmuls, packed)
        else:
            made = self._matmul(matmuls, packed, first_scale)
        if made is None:
            return None
        made, widths = made
        out = made[-1].output[0]
        if parts[0][1] is not None:
            biases = [self._array(next(i for i in b.input if i in self.weights)) for _, b in parts]
            bias = np.concatenate([biases[0] * np.float32(first_scale), *biases[1:]])
            self.new.append(numpy_helper.from_array(bias.astype(np.float32), f"{packed}.bias"))
            made.append(helper.make_node("Add", [out, f"{packed}.bias"], [f"{packed}/Add_output_0"], name=f"{packed}/Add"))
            out = made[-1].output[0]
        return made, out, widths, [n for part in parts for n in part if n is not None]

    def _matmul(self, matmuls, packed: str, first_scale: float = 1.0):
        """float weights [K, N_i] side by side (the first times first_scale): one MatMul [K, sum N_i]."""
        tensors = [self.weights[m.input[1]] for m in matmuls]
        if any(t.data_type != TensorProto.FLOAT or len(t.dims) != 2 for t in tensors):
            return None
        weights = [self._array(t.name) for t in tensors]
        weights[0] = weights[0] * np.float32(first_scale)
        w = np.concatenate(weights, axis=1)
        widths = [int(x.shape[1]) for x in weights]
        if self.convs and _conv_shape(*w.shape):
            return self._conv(matmuls[0].input[0], w, packed, f"{packed}/MatMul_output_0"), widths
        self.new.append(new_tensor(f"{packed}.weight_t", TensorProto.FLOAT, list(w.shape), w.tobytes(), self.data))
        node = helper.make_node("MatMul", [matmuls[0].input[0], f"{packed}.weight_t"], [f"{packed}/MatMul_output_0"],
                                name=f"{packed}/MatMul")
        return [node], widths

    def _conv(self, x: str, w: np.ndarray, name: str, out: str) -> list:
        """_pointwise_conv's nodes for weights w [K, N], written as [N, K, 1, 1]."""
        conv_w = np.ascontiguousarray(w.T)[:, :, None, None]
        self.new.append(new_tensor(f"{name}.conv_weight", TensorProto.FLOAT, list(conv_w.shape), conv_w.tobytes(),
                                   self.data))
        return _pointwise_conv(x, f"{name}.conv_weight", out, name)

    def as_convs(self, nodes: list) -> list:
        """`nodes` with every other float weight MatMul of the model's projections (named /model/...
        by the exporter: each reads [B, T, K] rows) a pointwise Conv: its weights an initializer
        [K, N], or a tied head's transposed embedding [N, K]."""
        transposed = {n.output[0]: n.input[0] for n in nodes if n.op_type == "Transpose" and n.input[0] in self.weights
                      and len(self.weights[n.input[0]].dims) == 2
                      and [helper.get_attribute_value(a) for a in n.attribute if a.name == "perm"] in ([], [[1, 0]])}
        out = []
        for node in nodes:
            w = node.input[1] if node.op_type == "MatMul" and node.name.startswith("/model/") else None
            tensor = self.weights.get(w if w in self.weights else transposed.get(w))
            if tensor is None or tensor.data_type != TensorProto.FLOAT or len(tensor.dims) != 2 or \
                    not _conv_shape(*(tensor.dims if w in self.weights else tensor.dims[::-1])):
                out.append(node)
                continue
            name = node.name.rsplit("/", 1)[0] if "/" in node.name else node.output[0]
            if w in self.weights:
                out += self._conv(node.input[0], self._array(w), name, node.output[0])
                continue
            # the tied head reads the embedding [N, K] itself, as [N, K, 1, 1] (ONNX Runtime folds the Reshape)
            shape = f"{name}/conv_weight_shape"
            self.new.append(numpy_helper.from_array(np.array([*tensor.dims, 1, 1], np.int64), shape))
            out.append(helper.make_node("Reshape", [tensor.name, shape], [f"{name}.conv_weight"], name=f"{name}/weight_Reshape"))
            out += _pointwise_conv(node.input[0], f"{name}.conv_weight", node.output[0], name)
        return out

    def _matmul_nbits(self, matmuls, packed: str):
        """4-bit MatMulNBits of the same K, bits and blocks: their blocks, scales and zero points
        (each N-major) stacked along N, one MatMulNBits."""
        attrs = [{a.name: helper.get_attribute_value(a) for a in m.attribute} for m in matmuls]
        same = [{k: v for k, v in a.items() if k != "N"} for a in attrs]
        # weights, scales and zero points only: g_idx (along K) or a bias input would not stack so
        if any(a != same[0] for a in same) or len({len(m.input) for m in matmuls}) != 1 or len(matmuls[0].input) > 4:
            return None
        inputs = [matmuls[0].input[0]]
        for j, suffix in enumerate(("Q4", "scales", "zero_points")[:len(matmuls[0].input) - 1], 1):
            tensors = [self.weights[m.input[j]] for m in matmuls]
            stacked = np.concatenate([self._array(t.name) for t in tensors], axis=0)
            name = f"{packed}.weight_t_{suffix}"
            self.new.append(new_tensor(name, tensors[0].data_type, list(stacked.shape), stacked.tobytes(), self.data))
            inputs.append(name)
        node = helper.make_node("MatMulNBits", inputs, [f"{packed}/MatMul_output_0"], name=f"{packed}/MatMulNBits",
                                domain=matmuls[0].domain, **dict(same[0], N=sum(int(a["N"]) for a in attrs)))
        return [node], [int(a["N"]) for a in attrs]

    def split(self, made: list, out: str, widths: list[int], outputs: list[str], name: str) -> list:
        """`made` and a Split of its output `out` into the projections' own outputs."""
        sizes = f"{name}/sizes"
        self.new.append(numpy_helper.from_array(np.array(widths, np.int64), sizes))
        return made + [helper.make_node("Split", [out, sizes], outputs, name=f"{name}/Split", axis=-1)]


def fuse(model: onnx.ModelProto, cfg: TargetConfig, where: str = "target graph", source_dir: Path | None = None,
         data: DataFile | None = None, pack: bool = True, int8_activations: bool = False,
         convs: bool | None = None) -> dict:
    """Rewrite `model` (the portable target graph, its weights not loaded) in place. source_dir:
    where its weights lie (the packed projections read them), data: the new graph's weights file
    (rewrite_graph's). pack=False keeps every projection its own MatMul. int8_activations: a
    4-bit graph's MatMulNBits compute with int8 activations, and one-row calls are padded.
    convs: float weight MatMuls as pointwise Convs (None: where the graph has no MatMulNBits;
    the module docstring)."""
    check_fusable(cfg, where)
    g = model.graph
    inputs = {i.name: i for i in g.input}
    if "past_key_0" not in inputs or not any(o.name == "new_key_0" for o in g.output):
        raise FusedAttentionError(f"{where}: not a portable target graph (no past_key_0 / new_key_0)")
    if inputs["past_key_0"].type.tensor_type.elem_type != TensorProto.FLOAT:
        raise FusedAttentionError(f"{where}: the fused-attention graph is made from a float32 target graph")
    nodes = list(g.node)
    four_bit = any(n.op_type == "MatMulNBits" for n in nodes)
    if int8_activations and not four_bit:
        raise FusedAttentionError(f"{where}: int8 activations are for a 4-bit (MatMulNBits) target graph")
    if convs is None:
        convs = not four_bit
    mask_nodes, consts = _mask_nodes()
    if int8_activations:
        mask_nodes += _one_row_padding()
    # the operator's seqlens_k, position_ids and attention_bias: padded ones where one-row calls are
    seqlens, positions, bias = (("fused_attention/pad/seqlens_k", "fused_attention/pad/position_ids",
                                 "fused_attention/pad/attention_bias") if int8_activations else
                                ("fused_attention/seqlens_k", "position_ids", "fused_attention/attention_bias"))
    cos, sin = rope_tables(cfg)
    consts += [numpy_helper.from_array(cos, "fused_attention/cos_cache"),
               numpy_helper.from_array(sin, "fused_attention/sin_cache")]
    query_scale = _exact_query_scale(cfg.head_dim) if not four_bit else None
    fused = {}      # id of a node -> the nodes that go right before it (an operator, packed projections)
    packer = _Packer(g, source_dir, data, convs)
    packed_layers, dropped = 0, set()
    kv_names = target_kv_names(cfg.num_hidden_layers, in_place=True)
    for layer, (past_k, past_v, present_k, present_v) in enumerate(kv_names):
        scope = f"/model/layers.{layer}/self_attn/"
        q, k, v = (_last_output(nodes, f"{scope}{p}_proj/", where) for p in "qkv")
        qkv = packer.pack(nodes, [f"{scope}{p}_proj/" for p in "qkv"], f"{scope}qkv_proj",
                          query_scale or 1.0) if pack else None
        folded = {"scale": 1.0} if qkv is not None and query_scale else {}     # the module docstring
        before = []
        if qkv is not None:            # the operator takes packed QKV: key and value left empty
            before, (q, k, v) = qkv[0], (qkv[1], "", "")     # the separate ones go unread
            packed_layers += 1
        mlp = f"/model/layers.{layer}/mlp/"
        gate_up = packer.pack(nodes, [f"{mlp}gate_proj/", f"{mlp}up_proj/"], f"{mlp}gate_up_proj") if pack else None
        if gate_up is not None:        # the Split writes the separate ones' outputs: they go
            made, out, widths, replaced = gate_up
            ends = [_last_output(nodes, f"{mlp}{p}_proj/", where) for p in ("gate", "up")]
            fused[id(replaced[0])] = packer.split(made, out, widths, ends, f"{mlp}gate_up_proj")
            dropped.update(id(n) for n in replaced)
        o_proj = [n for n in nodes if n.name.startswith(f"{scope}o_proj/")
                  and n.op_type in ("MatMul", "Gemm", "MatMulNBits")]     # MatMulNBits: the 4-bit target
        if not o_proj:
            raise FusedAttentionError(f"{where}: layer {layer} has no o_proj MatMul")
        out = op_out = f"{scope}{GQA}_output_0"
        after = []
        if int8_activations:
            if qkv is None:
                raise FusedAttentionError(f"{where}: layer {layer}'s q / k / v projections do not pack; padded "
                                          f"one-row calls need packed QKV")
            op_out = f"{out}_padded"
            pad_before, q, after = _pad_layer(q, op_out, out, scope)
            before = before + pad_before
        fused[id(o_proj[0])] = before + [helper.make_node(
            GQA, [q, k, v, past_k, past_v, seqlens, "fused_attention/total_sequence_length",
                  "fused_attention/cos_cache", "fused_attention/sin_cache", positions, bias],
            [op_out, present_k, present_v], name=f"{scope}{GQA}", domain="com.microsoft",
            num_heads=cfg.num_attention_heads, kv_num_heads=cfg.num_key_value_heads,
            do_rotary=int(layer not in cfg.arch.nope_layers), **folded)] + after
        o_proj[0].input[0] = out
    kv_shape = ["batch", cfg.num_key_value_heads, "cache_rows", cfg.head_dim]
    outputs = [o for o in g.output if not o.name.startswith(("new_key_", "new_value_"))]
    outputs += [helper.make_tensor_value_info(name, TensorProto.FLOAT, kv_shape)
                for names in kv_names for name in names[2:]]
    for i in g.input:              # the past inputs are the caches' whole blocks of rows
        if i.name.startswith("past_"):
            for d, size in zip(i.type.tensor_type.shape.dim, kv_shape):
                if isinstance(size, str):
                    d.dim_param = size
    # in topological order: the mask's nodes read graph inputs only, each layer's operator (after
    # its packed projection) goes right before the o_proj that reads it, the packed gate / up in
    # the gate's place; then the portable attention's and the separate projections' nodes go, unread
    order = mask_nodes + [m for n in nodes for m in (*fused.get(id(n), ()), *(() if id(n) in dropped else (n,)))]
    del g.node[:]
    g.node.extend(order)
    del g.output[:]
    g.output.extend(outputs)
    remove_unused(g, {t.name for t in g.initializer})
    if convs:                      # the MatMuls still read (no weight written for a dropped one)
        order = packer.as_convs(list(g.node))
        del g.node[:]
        g.node.extend(order)
    g.initializer.extend(consts + packer.new)
    remove_unused(g, {t.name for t in g.initializer})
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    counts = {"fused_layers": len(kv_names), "packed_layers": packed_layers,
              "conv_projections": sum(n.op_type == "Conv" for n in g.node), "nodes": len(g.node)}
    if int8_activations:
        counts["int8_activation_matmuls"] = use_int8_activations(model)
        set_metadata(model, {PADS_ONE_ROW: "1", LOSSLESS_TREES: "chains"})
    return counts


def set_metadata(model: onnx.ModelProto, values: dict[str, str]) -> None:
    kept = [e for e in model.metadata_props if e.key not in values]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    for key, value in values.items():
        model.metadata_props.add(key=key, value=value)


def fuse_attention(src: str | Path, dst: str | Path, cfg: TargetConfig, pack: bool = True,
                   int8_activations: bool = False, convs: bool | None = None) -> dict:
    """Write the fused-attention copy of the portable target graph `src` to `dst` (atomically:
    a failed run leaves no `dst`), its weights in a file beside it whatever their size: ONNX
    Runtime keeps a graph's embedded weights in memory beside the NCHWc Convs' reordered ones
    (SmolLM2: 1.29 GB resident after loading, against 0.76 GB with the weights outside). Returns
    counts for the log."""
    return rewrite_graph(src, dst, lambda model, data: fuse(model, cfg, str(src), Path(src).parent, data, pack,
                                                            int8_activations, convs), external=True)


def fused_feeds(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A portable target graph's feed (past [B, Hkv, P, D], mask [B, T, P + T]) made the fused
    graph's: each past with T more rows (at least 2: a graph that pads a one-row call writes a
    second) for the operator to write the new ones into (zeros, masked), the mask's committed
    part widened to match. The logits, captured states and acceptance are then the portable
    graph's (parity compares them)."""
    T = feed["input_ids"].shape[1]
    rows = max(T, 2)
    out = dict(feed)
    for name, past in feed.items():
        if name.startswith("past_"):
            B, H, _, D = past.shape
            out[name] = np.concatenate([past, np.zeros((B, H, rows, D), past.dtype)], axis=2)
    mask = feed["attention_mask"]
    P = mask.shape[2] - T
    out["attention_mask"] = np.concatenate([mask[:, :, :P], np.zeros((*mask.shape[:2], rows), mask.dtype),
                                            mask[:, :, P:]], axis=2)
    return out
