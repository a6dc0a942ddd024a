"""Rewrite an exported graph into TensorRT's explicit-quantization (Q/DQ) form.

Linear layers are MatMul nodes whose second input is a [in, out] weight initializer (reached
directly, or through Identity nodes where the exporter shares one initializer between the
unrolled copies of a drafter module). Per quantized MatMul:

FP8:    x -> QuantizeLinear(s_x, zp FLOAT8E4M3FN) -> DequantizeLinear(s_x) -> MatMul
        W_fp8 [in, out] -> DequantizeLinear(s_w, axis=1 when per output channel) -> MatMul
NVFP4:  x -> trt::TRT_FP4DynamicQuantize(g_x; axis=-1, block_size=16, scale_type=FP8E4M3FN)
             -> (x_fp4, sx_fp8);  DQ(sx_fp8, g_x) -> DQ(x_fp4, ., axis=-1, block_size=16) -> MatMul
        W_fp4 [in, out] FLOAT4E2M1, W_sb8 [in/16, out] FP8:
             DQ(W_sb8, g_w) -> DQ(W_fp4, ., axis=0, block_size=16) -> MatMul

Weights are quantized with the same functions as the torch reference (formats.py), so the
graph and QuantLinear hold identical quantized values. A weight shared by several MatMuls is
converted once. NVFP4 needs opset 23 (FLOAT4E2M1, blocked DequantizeLinear); the default
domain import is raised to 23, which changes no op the exporter emits.

Node names map to module paths through their scope: `/model/layers.3/self_attn/q_proj/MatMul`
names module `layers.3.self_attn.q_proj`; unrolled copies carry suffixes (`q_proj_1`), and a
module whose forward is never called directly (the drafter's `midlayer`) is missing from the
scope, so a scope is matched as an ordered subsequence of a known module path."""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from ..export.graph_files import DataFile, new_tensor, read_array, rewrite_graph
from ..export.opcheck import check_graph
from .config import QuantConfig, QuantError
from .fakequant import check_amax
from .formats import NVFP4_BLOCK, fp8_scale, fp8_weight, nvfp4_global_scale, nvfp4_weight, pack_fp4

NVFP4_OPSET = 23
NVFP4_IR_VERSION = 11          # FLOAT4E2M1 arrived with IR version 11
TRT_DOMAIN = "trt"
# The graph's float type. Quantization arithmetic is float32 in either: a float16 graph's
# quantizers read float32 casts of its activations and their dequantized outputs are cast back
# (as ModelOpt keeps NVFP4 scales in float32 behind a Cast), so the scales keep float32's range
# (a weight's FP8 scale can fall below float16's normal range) and the quotients are the
# float32 fake-quant reference's.
FLOAT_TYPES = {TensorProto.FLOAT: torch.float32, TensorProto.FLOAT16: torch.float16}
_COPY_SUFFIX = re.compile(r"_\d+$")


@dataclass
class QDQSummary:
    format: str
    quantized: dict[str, str] = field(default_factory=dict)   # MatMul node name -> module path
    skipped: dict[str, str] = field(default_factory=dict)     # MatMul node name -> reason
    weights_converted: int = 0                                 # initializers (shared ones once)
    opset: int = 0
    # Modules that were listed and not skipped by pattern, yet no MatMul of the graph is theirs
    # (expected for a single-step drafter graph without fc; a bug for a target graph).
    unmatched: list[str] = field(default_factory=list)

    @property
    def modules(self) -> list[str]:
        return sorted(set(self.quantized.values()))

    def as_dict(self) -> dict:
        return {"format": self.format, "opset": self.opset, "weights_converted": self.weights_converted,
                "quantized": self.quantized, "skipped": self.skipped, "unmatched": self.unmatched}


# ----------------------------------------------------------------------------- node -> module

def _scope_segments(node_name: str) -> list[list[str]]:
    """'/model/layers.3/self_attn/q_proj_1/MatMul' -> [['model'], ['layers', '3'], ['self_attn'], ['q_proj_1']]."""
    parts = [p for p in node_name.split("/") if p][:-1]
    return [p.split(".") for p in parts]


def _segment_at(seg: list[str], comps: list[str], end: int) -> bool:
    """Does `seg` match comps[end - len(seg):end], allowing an unrolled-copy suffix on its last part?"""
    start = end - len(seg)
    if start < 0:
        return False
    window = comps[start:end]
    if window[:-1] != seg[:-1]:
        return False
    return window[-1] == seg[-1] or window[-1] == _COPY_SUFFIX.sub("", seg[-1])


def _scope_matches(segments: list[list[str]], path: str) -> bool:
    """The last scope segment must end the path; earlier segments must appear in order before it
    (modules never called directly are absent from the scope). The first segment may be the
    export wrapper's attribute ('model', 'drafter'), which is not part of the module path."""
    comps = path.split(".")
    if not segments or not _segment_at(segments[-1], comps, len(comps)):
        return False
    end = len(comps) - len(segments[-1])
    for i, seg in enumerate(reversed(segments[:-1])):
        first = i == len(segments) - 2
        pos = next((e for e in range(end, len(seg) - 1, -1) if _segment_at(seg, comps, e)), None)
        if pos is None:
            if first:
                continue          # the wrapper attribute
            return False
        end = pos - len(seg)
    return True


def module_for_node(node_name: str, paths: Iterable[str]) -> str | None:
    """The unique module path the MatMul's scope names, or None when none matches."""
    segments = _scope_segments(node_name)
    matches = [p for p in paths if _scope_matches(segments, p)]
    if len(matches) > 1:
        raise QuantError(f"node '{node_name}': scope matches several modules {sorted(matches)}")
    return matches[0] if matches else None


def _guess_path(node_name: str) -> str:
    """Best-effort module path from the scope alone (wrapper dropped, copy suffixes removed)."""
    segs = _scope_segments(node_name)[1:] or _scope_segments(node_name)
    return ".".join(".".join(s[:-1] + [_COPY_SUFFIX.sub("", s[-1])]) for s in segs)


# ----------------------------------------------------------------------------- graph surgery

class _Rewriter:
    def __init__(self, model: onnx.ModelProto, cfg: QuantConfig, base_dir: str | Path | None = None,
                 data: DataFile | None = None):
        self.model, self.cfg, self.data = model, cfg, data   # data: new weights written there as made
        self.base_dir = str(base_dir) if base_dir is not None else ""   # external weights are read one by one
        self.graph = model.graph
        self.inits = {i.name: i for i in self.graph.initializer}
        self.producer = {o: n for n in self.graph.node for o in n.output}
        self.new_inits: list[TensorProto] = []
        self.weight_nodes: list[onnx.NodeProto] = []       # weight DQs, placed first
        self.before: dict[int, list[onnx.NodeProto]] = {}   # MatMul's node index -> activation nodes before it
        self.weights: dict[tuple[str, bool], str] = {}      # (initializer, transposed) -> dequantized output
        self.acts: dict[tuple[str, float], str] = {}        # (activation, amax) -> dequantized output

    def weight_source(self, name: str) -> tuple[str, bool] | None:
        """Follow Identity nodes back to an initializer; (its name, whether a 2-D Transpose lies on
        the way: a tied lm_head reads the [vocab, hidden] embedding table, export/weights.py)."""
        transposed = False
        while name not in self.inits:
            node = self.producer.get(name)
            if node is None:
                return None
            if node.op_type == "Transpose" and list(helper.get_attribute_value(node.attribute[0])) == [1, 0]:
                transposed = not transposed
            elif node.op_type != "Identity":
                return None
            name = node.input[0]
        return name, transposed

    def _init(self, name: str, array: np.ndarray | None = None, *, elem: int | None = None,
              dims: list[int] | None = None, raw: bytes | None = None) -> str:
        if raw is not None:
            self.new_inits.append(new_tensor(name, elem, dims, raw, self.data))
        else:
            self.new_inits.append(numpy_helper.from_array(array, name))
        return name

    @staticmethod
    def _scale(t: torch.Tensor) -> np.ndarray:
        """Scales are float32 whatever the graph's dtype: the Q/DQ pairs run in float32 (`_cast`)."""
        return t.to(torch.float32).numpy()

    def weight(self, init_name: str, transposed: bool = False) -> str:
        key = (init_name, transposed)
        if key in self.weights:
            return self.weights[key]
        init = self.inits[init_name]
        graph_dtype = FLOAT_TYPES[init.data_type]
        array = read_array(init, self.base_dir)       # also from a weights file with several hard links
        w = torch.from_numpy(array if array.flags.writeable else array.copy()).float()
        w = w if transposed else w.T                                        # [out, in], as nn.Linear
        dims = [w.shape[1], w.shape[0]]                                      # the MatMul's [in, out]
        base = init_name.replace(":", "_") + ("_transposed" if transposed else "")
        out = f"{base}_dq"
        if self.cfg.format == "fp8":
            q, scale = fp8_weight(w, self.cfg.per_channel)
            qname = self._init(f"{base}_fp8", elem=TensorProto.FLOAT8E4M3FN, dims=dims,
                               raw=q.T.contiguous().view(torch.uint8).numpy().tobytes())
            sname = self._init(f"{base}_scale", self._scale(scale))
            attrs = {"axis": 1} if self.cfg.per_channel else {}
            self.weight_nodes.append(helper.make_node("DequantizeLinear", [qname, sname], [out],
                                                      name=f"{base}_DequantizeLinear", **attrs))
        else:
            codes, sb8, g = nvfp4_weight(w)
            qname = self._init(f"{base}_fp4", elem=TensorProto.FLOAT4E2M1, dims=dims,
                               raw=pack_fp4(codes.T.contiguous()))
            bname = self._init(f"{base}_block_scale_fp8", elem=TensorProto.FLOAT8E4M3FN,
                               dims=[dims[0] // NVFP4_BLOCK, dims[1]],
                               raw=sb8.T.contiguous().view(torch.uint8).numpy().tobytes())
            gname = self._init(f"{base}_global_scale", self._scale(g))
            self.weight_nodes += [
                helper.make_node("DequantizeLinear", [bname, gname], [f"{base}_block_scale"],
                                 name=f"{base}_DequantizeLinear"),
                helper.make_node("DequantizeLinear", [qname, f"{base}_block_scale"], [out],
                                 name=f"{base}_DequantizeLinear_1", axis=0, block_size=NVFP4_BLOCK)]
        out = self._cast(self.weight_nodes, out, graph_dtype)
        self.weights[key] = out
        return out

    @staticmethod
    def _cast(nodes: list, name: str, graph_dtype: torch.dtype) -> str:
        """A float32 dequantized output `name` in the graph's dtype (a Cast appended to `nodes`
        in a float16 graph)."""
        if graph_dtype == torch.float32:
            return name
        nodes.append(helper.make_node("Cast", [name], [f"{name}_fp16"], name=f"{name}_CastFloat16",
                                      to=TensorProto.FLOAT16))
        return f"{name}_fp16"

    def activation(self, index: int, node: onnx.NodeProto, amax: float, graph_dtype: torch.dtype) -> str:
        """Quantize the MatMul's input (a `graph_dtype` tensor; quantized in float32); one quantizer
        serves every MatMul reading the same tensor with the same amax (q / k / v, gate / up)."""
        x = node.input[0]
        key = (x, amax)
        if key in self.acts:
            return self.acts[key]
        base = f"{node.name.rsplit('/', 1)[0]}/input_quantizer"
        out = f"{base}/dq_output"
        nodes = self.before.setdefault(index, [])
        if graph_dtype != torch.float32:
            nodes.append(helper.make_node("Cast", [x], [f"{base}/x_float32"], name=f"{base}/CastFloat32",
                                          to=TensorProto.FLOAT))
            x = f"{base}/x_float32"
        if self.cfg.format == "fp8":
            sname = self._init(f"{base}/scale", self._scale(fp8_scale(amax)))
            zname = self._init(f"{base}/zero_point", elem=TensorProto.FLOAT8E4M3FN, dims=[], raw=b"\x00")
            nodes += [helper.make_node("QuantizeLinear", [x, sname, zname], [f"{base}/q_output"],
                                       name=f"{base}/QuantizeLinear", saturate=1),
                      helper.make_node("DequantizeLinear", [f"{base}/q_output", sname], [out],
                                       name=f"{base}/DequantizeLinear")]
        else:
            gname = self._init(f"{base}/global_scale", self._scale(nvfp4_global_scale(amax)))
            nodes += [helper.make_node("TRT_FP4DynamicQuantize", [x, gname], [f"{base}/x_fp4", f"{base}/sx_fp8"],
                                       name=f"{base}/TRT_FP4DynamicQuantize", domain=TRT_DOMAIN,
                                       axis=-1, block_size=NVFP4_BLOCK, scale_type=TensorProto.FLOAT8E4M3FN),
                      helper.make_node("DequantizeLinear", [f"{base}/sx_fp8", gname], [f"{base}/block_scale"],
                                       name=f"{base}/DequantizeLinear"),
                      helper.make_node("DequantizeLinear", [f"{base}/x_fp4", f"{base}/block_scale"], [out],
                                       name=f"{base}/DequantizeLinear_1", axis=-1, block_size=NVFP4_BLOCK)]
        out = self._cast(nodes, out, graph_dtype)
        self.acts[key] = out
        return out

    def finish(self) -> None:
        """New node order: weight DQs, then the original nodes with activation Q/DQ in front of
        their MatMul; Identity nodes and float initializers nothing reads any more are dropped."""
        nodes = list(self.weight_nodes)
        for i, n in enumerate(self.graph.node):
            nodes += self.before.get(i, [])
            nodes.append(n)
        graph_outputs = {o.name for o in self.graph.output}
        while True:   # drop dead Identity chains left behind by rewired shared weights
            used = {i for n in nodes for i in n.input} | graph_outputs
            dead = [n for n in nodes if n.op_type in ("Identity", "Transpose") and n.output[0] not in used]
            if not dead:
                break
            nodes = [n for n in nodes if all(n is not d for d in dead)]
        used = {i for n in nodes for i in n.input} | graph_outputs
        converted = {name for name, _ in self.weights}
        kept = [i for i in self.graph.initializer if i.name in used or i.name not in converted]
        del self.graph.node[:]
        self.graph.node.extend(nodes)
        del self.graph.initializer[:]
        self.graph.initializer.extend(kept + self.new_inits)


def _set_opsets(model: onnx.ModelProto, fmt: str) -> int:
    default = next((o for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if default is None:
        raise QuantError("graph has no default-domain opset import")
    need = NVFP4_OPSET if fmt == "nvfp4" else 19
    default.version = max(default.version, need)
    if fmt == "nvfp4":
        if not any(o.domain == TRT_DOMAIN for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(TRT_DOMAIN, 1))
        model.ir_version = max(model.ir_version, NVFP4_IR_VERSION)
    return default.version


def quantize_graph(model: onnx.ModelProto, cfg: QuantConfig, amax: dict[str, float],
                   modules: Iterable[str] | None = None, source: str = "calibration",
                   base_dir: str | Path | None = None, data: DataFile | None = None,
                   on_matmul: Callable[[int, int], None] | None = None) -> QDQSummary:
    """Rewrite `model` in place. `modules` lists the torch Linear module paths (defaults to the
    calibration's keys); `source` names the calibration in errors; base_dir: where the weights
    of a model loaded without its external data are; data: the weights file the quantized
    weights are written into as they are made (else they are held in the graph); on_matmul(done,
    total) after each MatMul is rewritten (progress)."""
    if not cfg.enabled:
        raise QuantError(f"{cfg.source}: quantization format is 'none'; nothing to rewrite")
    known = set(amax) | set(modules or ())
    rw = _Rewriter(model, cfg, base_dir, data)
    summary = QDQSummary(cfg.format)
    plan, seen = [], set()
    for index, node in enumerate(model.graph.node):
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
            continue
        found = rw.weight_source(node.input[1])
        if found is None or len(rw.inits[found[0]].dims) != 2:
            continue                                   # activation x activation (attention)
        init_name, transposed = found
        init = rw.inits[init_name]
        if init.data_type not in FLOAT_TYPES:
            raise QuantError(f"node '{node.name}': weight '{init_name}' has type "
                             f"{TensorProto.DataType.Name(init.data_type)}; only float32 and float16 graphs are "
                             f"quantized (precision base: fp32 or fp16)")
        path = module_for_node(node.name, known) or _guess_path(node.name)
        seen.add(path)
        reason = cfg.skip_reason(path, int(init.dims[1] if transposed else init.dims[0]))
        if reason is not None:
            summary.skipped[node.name] = f"{path}: {reason}"
            continue
        plan.append((index, node, path, init_name, transposed))
    if not plan:
        raise QuantError(f"{cfg.source}: no Linear MatMul in the graph is left to quantize "
                         f"({len(summary.skipped)} skipped)")
    check_amax(amax, sorted({p for _, _, p, _, _ in plan}), source)
    for done, (index, node, path, init_name, transposed) in enumerate(plan, 1):
        graph_dtype = FLOAT_TYPES[rw.inits[init_name].data_type]
        node.input[1] = rw.weight(init_name, transposed)
        node.input[0] = rw.activation(index, node, float(amax[path]), graph_dtype)
        summary.quantized[node.name] = path
        if on_matmul is not None:
            on_matmul(done, len(plan))
    rw.finish()
    summary.weights_converted = len(rw.weights)
    summary.opset = _set_opsets(model, cfg.format)
    summary.unmatched = sorted(p for p in set(modules or ()) - seen if not any(fnmatchcase(p, q) for q in cfg.skip))
    return summary


def quantize_onnx(src: str | Path, dst: str | Path, cfg: QuantConfig, amax: dict[str, float],
                  modules: Iterable[str] | None = None, source: str = "calibration",
                  on_matmul: Callable[[int, int], None] | None = None) -> QDQSummary:
    """Read the float graph at `src`, write its Q/DQ form to `dst` (temporary folder, checks,
    then rename: a present `dst` is always complete), and say what was quantized."""
    src, dst = Path(src), Path(dst)
    if not src.is_file():
        raise QuantError(f"{src}: ONNX graph not found")

    def check(written: Path) -> None:
        try:
            onnx.checker.check_model(str(written))
        except onnx.checker.ValidationError as exc:
            raise QuantError(f"{dst}: the quantized graph fails onnx.checker ({exc})") from None
        check_graph(str(written), label=str(dst))
    # External weights stay on disk: each is read when it is converted, and its quantized form
    # written to the new graph's weights file there and then; the rest is copied at the save.
    return rewrite_graph(src, dst, lambda model, data: quantize_graph(model, cfg, amax, modules, source, src.parent,
                                                                        data, on_matmul), check)


__all__ = ["QDQSummary", "module_for_node", "quantize_graph", "quantize_onnx"]
