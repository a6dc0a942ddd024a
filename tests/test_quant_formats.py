"""FP8 / FP4 / NVFP4 numerics pinned against hand-computed values and against onnx's own
helpers and reference ops; QuantConfig and calibration-file errors. No models: fast."""
from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from eagle_trt.quant.calibrate import load_calibration, save_calibration
from eagle_trt.quant.config import QuantConfig, QuantError, QuantPlan
from eagle_trt.quant.formats import (fp4_decode, fp4_encode, fp8_cast, fp8_fake_quant, fp8_scale, fp8_weight,
                                     nvfp4_dequantize, nvfp4_global_scale, nvfp4_quantize, nvfp4_weight, pack_fp4,
                                     unpack_fp4)
from eagle_trt.quant.run import TRT_FP4DynamicQuantize



def _model(nodes, inputs, outputs, inits=(), opset=23, domains=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]
                          + [helper.make_opsetid(d, 1) for d in domains])
    m.ir_version = 11   # FLOAT4E2M1 needs IR 11; ONNX Runtime 1.31 reads up to 13
    onnx.checker.check_model(m)
    return m


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint8)


# ----------------------------------------------------------------------------- FP4 E2M1

def test_fp4_rounding_ties_saturation_and_negative_zero_by_hand():
    x = torch.tensor([0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5, 100.0,
                      -0.0, -0.1, -0.25, -0.3, -5.0, -7.0, 0.2501, 2.99, 4.9])
    # Ties go to the even code: 0.25->0 (code 0), 0.75->1 (2), 1.25->1 (2), 1.75->2 (4), 2.5->2 (4),
    # 3.5->4 (6), 5->4 (6); above 6 saturates to code 7; a negative value rounding to 0 is 0x8.
    expected = [0, 0, 2, 2, 4, 4, 6, 6, 7, 7, 8, 8, 8, 9, 14, 15, 1, 5, 6]
    codes = fp4_encode(x)
    assert codes.tolist() == expected
    values = fp4_decode(codes)
    assert values.tolist() == [0, 0, 1, 1, 2, 2, 4, 4, 6, 6, -0.0, -0.0, -0.0, -0.5, -4, -6, 0.5, 3, 4]
    assert torch.signbit(values[10:13]).all(), "negative zero must survive the round trip"


def test_fp4_encode_matches_ml_dtypes_and_onnx_quantize_linear():
    x = (torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 3).float()
    x[:16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 9, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5, -9])
    ours = fp4_encode(x).numpy()
    assert (ours == _bits(x.numpy().astype(ml_dtypes.float4_e2m1fn))).all()
    # onnx's reference QuantizeLinear to FLOAT4E2M1 (scale 1, zero point 0)
    m = _model([helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"])],
               [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None])],
               [helper.make_tensor_value_info("q", TensorProto.FLOAT4E2M1, [None])],
               [numpy_helper.from_array(np.array(1.0, np.float32), "s"),
                helper.make_tensor("z", TensorProto.FLOAT4E2M1, [], [0.0])])
    (q,) = ReferenceEvaluator(m).run(None, {"x": x.numpy()})
    assert (_bits(q) == ours).all()
    with pytest.raises(ValueError, match="NaN"):
        fp4_encode(torch.tensor([1.0, float("nan")]))


def test_fp4_packing_low_nibble_is_even_index():
    codes = fp4_encode(torch.tensor([0.5, 1.0, 1.5, -6.0, -0.0]))
    assert codes.tolist() == [1, 2, 3, 15, 8]
    raw = pack_fp4(codes)
    assert raw == bytes([0x21, 0xF3, 0x08])        # (1 | 2 << 4), (3 | 15 << 4), (8 | pad 0)
    # onnx packs the same values the same way
    t = helper.make_tensor("w", TensorProto.FLOAT4E2M1, [5], [0.5, 1.0, 1.5, -6.0, -0.0])
    assert bytes(t.int32_data) == raw
    assert numpy_helper.from_array(np.array([0.5, 1.0, 1.5, -6.0, -0.0], np.float32)
                                   .astype(ml_dtypes.float4_e2m1fn)).raw_data == raw
    assert unpack_fp4(raw, 5).tolist() == codes.tolist()
    # and reads our bytes back as the same values
    ours = helper.make_tensor("w", TensorProto.FLOAT4E2M1, [5], raw, raw=True)
    assert numpy_helper.to_array(ours).astype(np.float32).tolist() == [0.5, 1.0, 1.5, -6.0, -0.0]


# ----------------------------------------------------------------------------- FP8 E4M3FN

def test_fp8_saturation_and_round_to_nearest_even_by_hand():
    x = torch.tensor([448.0, 449.0, 464.0, 1e6, -1e6, 2.0 ** -9, 2.0 ** -10, 1.5 * 2.0 ** -10,
                      1.0625, 1.1875, 1.1, -0.0])
    # 464 is halfway to a 480 that E4M3FN does not have: saturates; 2^-10 is halfway between 0 and
    # the smallest subnormal 2^-9: even -> 0; 1.0625 halfway 1 / 1.125 -> 1; 1.1875 -> 1.25.
    expected = [448, 448, 448, 448, -448, 2.0 ** -9, 0.0, 2.0 ** -9, 1.0, 1.25, 1.125, -0.0]
    got = fp8_cast(x).float()
    assert got.tolist() == expected
    assert torch.signbit(got[-1])


def test_fp8_quantize_matches_onnx_reference_and_onnxruntime_bitwise():
    gen = np.random.default_rng(0)
    x = (gen.standard_normal(50000) * np.exp(gen.uniform(-14, 8, 50000))).astype(np.float32)
    scale = np.float32(0.37)
    m = _model([helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], saturate=1)],
               [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None])],
               [helper.make_tensor_value_info("q", TensorProto.FLOAT8E4M3FN, [None])],
               [numpy_helper.from_array(np.array(scale), "s"),
                helper.make_tensor("z", TensorProto.FLOAT8E4M3FN, [], [0.0])], opset=19)
    ours = fp8_cast(torch.from_numpy(x) / torch.tensor(scale)).view(torch.uint8).numpy()
    (ref,) = ReferenceEvaluator(m).run(None, {"x": x})
    assert (_bits(ref) == ours).all()
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    so.intra_op_num_threads = 1
    (got,) = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    assert (_bits(got) == ours).all()
    # fake quant = float(q) * scale, as DequantizeLinear computes it
    fq = fp8_fake_quant(torch.from_numpy(x), torch.tensor(scale)).numpy()
    assert (fq == ref.astype(np.float32) * scale).all()


def test_fp8_weight_scales_per_tensor_and_per_channel():
    w = torch.tensor([[1.0, -448.0 * 2], [0.0, 0.0], [3.0, 0.5]])
    q, s = fp8_weight(w, per_channel=True)
    assert s.tolist() == pytest.approx([2.0, 1.0, 3.0 / 448])    # amax / 448, 1.0 for an all-zero row
    assert (q.float()[1] == 0).all()
    assert q.float()[0].tolist() == [0.5, -448.0]
    q, s = fp8_weight(w, per_channel=False)
    assert s.shape == () and float(s) == 2.0
    assert float(fp8_scale(0.0)) == 1.0


# ----------------------------------------------------------------------------- NVFP4

def test_nvfp4_block_scales_by_hand():
    g = nvfp4_global_scale(2688.0)               # 2688 / (6 * 448) = 1
    assert float(g) == 1.0
    x = torch.zeros(5, 16)
    x[0, :4] = torch.tensor([2688.0, -1344.0, 672.0, 0.0])        # block amax 2688: sb8 = 448
    # x[1] all zero: scale 0, values 0, no NaN
    x[2, :5] = torch.tensor([30.0, 12.5, 17.5, -1.25, 25.0])     # sb8 = 5 (exact in FP8)
    x[3, :2] = torch.tensor([6.6, 1.6875])                       # 1.1 rounds to FP8 1.125
    x[4, :2] = torch.tensor([6.3, -6.3])                         # 1.05 rounds to 1.0: 6.3 saturates to 6
    codes, sb8 = nvfp4_quantize(x, g, axis=-1)
    assert sb8.float()[:, 0].tolist() == [448.0, 0.0, 5.0, 1.125, 1.0]
    assert codes[0, :4].tolist() == [7, 13, 3, 0]                 # 6, -3, 1.5, 0
    assert codes[1].tolist() == [0] * 16
    assert codes[2, :5].tolist() == [7, 4, 6, 8, 6]               # 6, 2.5->2, 3.5->4, -0.25->-0, 5->4
    assert codes[3, :2].tolist() == [7, 3]                        # 5.87->6, 1.5
    assert codes[4, :2].tolist() == [7, 15]
    deq = nvfp4_dequantize(codes, sb8, g)
    assert not torch.isnan(deq).any()
    assert deq[0, :4].tolist() == [2688.0, -1344.0, 672.0, 0.0]
    assert deq[2, :5].tolist() == [30.0, 10.0, 20.0, -0.0, 20.0]
    assert deq[3, :2].tolist() == [6.75, 1.6875]
    assert deq[4, :2].tolist() == [6.0, -6.0]


def test_nvfp4_block_scale_saturates_at_448():
    # A calibrated global amax below the runtime block amax: the FP8 block scale saturates.
    codes, sb8 = nvfp4_quantize(torch.tensor([[6000.0] + [1.0] * 15]), torch.tensor(1.0))
    assert float(sb8.float()[0, 0]) == 448.0
    assert codes[0, 0] == 7 and codes[0, 1] == 0                  # 13.4 -> 6; 1 / 448 -> 0


def test_nvfp4_weight_two_level_dequantize_on_onnx_reference():
    w = torch.randn(24, 48, generator=torch.Generator().manual_seed(1))   # [out, in]
    w[3, 16:32] = 0.0                                                      # an all-zero block
    codes, sb8, g = nvfp4_weight(w)
    assert sb8.shape == (24, 3) and float(sb8.float()[3, 1]) == 0.0
    ours = nvfp4_dequantize(codes, sb8, g, axis=1)
    # The graph layout: [in, out], blocks along axis 0.
    inits = [helper.make_tensor("w4", TensorProto.FLOAT4E2M1, [48, 24], pack_fp4(codes.T.contiguous()), raw=True),
             helper.make_tensor("sb8", TensorProto.FLOAT8E4M3FN, [3, 24],
                                sb8.T.contiguous().view(torch.uint8).numpy().tobytes(), raw=True),
             numpy_helper.from_array(g.numpy(), "g")]
    nodes = [helper.make_node("DequantizeLinear", ["sb8", "g"], ["bs"]),
             helper.make_node("DequantizeLinear", ["w4", "bs"], ["w"], axis=0, block_size=16)]
    m = _model(nodes, [], [helper.make_tensor_value_info("w", TensorProto.FLOAT, [48, 24])], inits)
    (got,) = ReferenceEvaluator(m).run(None, {})
    assert np.array_equal(got, ours.T.numpy())
    assert not np.isnan(got).any()
    # blocked QuantizeLinear to FLOAT4E2M1 with our block scales gives our codes back
    d = (sb8.float() * g).T.contiguous().numpy()                      # [3, 24]
    d = np.where(d > 0, d, 1.0).astype(np.float32)                    # QuantizeLinear needs scale > 0
    q = _model([helper.make_node("QuantizeLinear", ["x", "d", "z"], ["q"], axis=0, block_size=16)],
               [helper.make_tensor_value_info("x", TensorProto.FLOAT, [48, 24])],
               [helper.make_tensor_value_info("q", TensorProto.FLOAT4E2M1, [48, 24])],
               [numpy_helper.from_array(d, "d"), helper.make_tensor("z", TensorProto.FLOAT4E2M1, [3, 24], [0.0] * 72)])
    (qv,) = ReferenceEvaluator(q).run(None, {"x": w.T.contiguous().numpy()})
    assert np.array_equal(_bits(qv), codes.T.numpy())


def test_fp4_dynamic_quantize_custom_op_matches_torch():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 5, 64, generator=gen) * torch.logspace(-3, 2, 64)
    x[0, 1, 16:32] = 0.0
    x[1, 2, :16] = 50_000.0                     # above the calibrated range: block scale saturates
    g = nvfp4_global_scale(40.0)
    node = helper.make_node("TRT_FP4DynamicQuantize", ["x", "g"], ["q", "s"], domain="trt", axis=-1,
                            block_size=16, scale_type=TensorProto.FLOAT8E4M3FN)
    m = _model([node], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5, 64])],
               [helper.make_tensor_value_info("q", TensorProto.FLOAT4E2M1, [2, 5, 64]),
                helper.make_tensor_value_info("s", TensorProto.FLOAT8E4M3FN, [2, 5, 4])],
               [numpy_helper.from_array(g.numpy(), "g")], domains=("trt",))
    q, s = ReferenceEvaluator(m, new_ops=[TRT_FP4DynamicQuantize]).run(None, {"x": x.numpy()})
    codes, sb8 = nvfp4_quantize(x, g)
    assert q.shape == (2, 5, 64) and s.shape == (2, 5, 4)
    assert np.array_equal(_bits(q), codes.numpy())
    assert np.array_equal(_bits(s), sb8.view(torch.uint8).numpy())


# ----------------------------------------------------------------------------- config and files

def test_quant_config_from_dict_and_skip_patterns():
    cfg = QuantConfig.from_dict({"format": "FP8", "per_channel": False, "skip": ["lm_head", "fc", "layers.0.*"]})
    assert cfg.format == "fp8" and not cfg.per_channel
    assert cfg.skip_reason("fc", 64) == "skip pattern 'fc'"
    assert cfg.skip_reason("layers.0.mlp.up_proj", 64) == "skip pattern 'layers.0.*'"
    assert cfg.skip_reason("layers.10.mlp.up_proj", 64) is None
    assert QuantConfig.from_dict("nvfp4").skip_reason("midlayer.mlp.down_proj", 40) == \
        "in_features 40 is not a multiple of the NVFP4 block (16)"
    plan = QuantPlan.from_dict({"target": "fp8", "drafter": {"format": "none"}})
    assert plan.target.format == "fp8" and not plan.drafter.enabled
    assert QuantPlan.from_dict(plan.to_dict()) == plan


@pytest.mark.parametrize("data, match", [
    ({"format": "int8"}, "'int8'"),
    ({"fromat": "fp8"}, "'fromat'"),
    ({"format": "fp8", "per_channel": "yes"}, "per_channel"),
    ({"format": "fp8", "skip": [""]}, "skip"),
    ({"format": 8}, "'format'"),
])
def test_bad_quant_config_names_the_key(data, match):
    with pytest.raises(QuantError, match=match):
        QuantConfig.from_dict(data, source="build.yaml: quant.target")
    with pytest.raises(QuantError, match="build.yaml"):
        QuantConfig.from_dict(data, source="build.yaml: quant.target")


def test_bad_quant_plan_names_the_model():
    with pytest.raises(QuantError, match="'draftr'"):
        QuantPlan.from_dict({"target": "fp8", "draftr": "fp8"})
    with pytest.raises(QuantError, match="drafter.*'fp16'"):
        QuantPlan.from_dict({"drafter": "fp16"})


def test_calibration_file_round_trip_and_errors(tmp_path):
    path = save_calibration(tmp_path / "cal.json", {"layers.0.mlp.up_proj": 3.5, "fc": 0.0})
    assert load_calibration(path) == {"fc": 0.0, "layers.0.mlp.up_proj": 3.5}
    assert [p.name for p in tmp_path.iterdir()] == ["cal.json"]       # no temporary left behind
    with pytest.raises(QuantError, match="missing.json: calibration file not found"):
        load_calibration(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text('{"fc": -1}')
    with pytest.raises(QuantError, match="bad.json: amax of module 'fc'"):
        load_calibration(tmp_path / "bad.json")
    (tmp_path / "trunc.json").write_text('{"fc": 1')
    with pytest.raises(QuantError, match="trunc.json: not valid JSON"):
        load_calibration(tmp_path / "trunc.json")
    with pytest.raises(QuantError, match="module 'fc'"):
        save_calibration(tmp_path / "nan.json", {"fc": float("nan")})
    assert not (tmp_path / "nan.json").exists()
    assert json.loads((tmp_path / "cal.json").read_text())["fc"] == 0.0
