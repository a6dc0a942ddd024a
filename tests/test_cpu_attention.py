"""The fused-attention target graph (export/cpu_attention.py: each layer's attention one ONNX
Runtime GroupQueryAttention, the KV caches written in place): one operator per layer and none of
the portable attention's nodes; greedy decoding on it equals the PyTorch reference's, plainly,
speculatively with two calls and with the iteration graph, one sequence and continuously batched;
the in-place commit moves accepted rows down over rejected ones; what it does not map is refused.
(On the real SmolLM2: test_onnx_smollm2.py.)"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from conftest import LIMITS, TINY_SHAPE, on_graph, two_call

from eagle_trt.export.cpu_attention import FusedAttentionError, fuse_attention, rope_tables
from eagle_trt.export.iteration import compose_iteration
from eagle_trt.runtime.backend import TorchTarget
from eagle_trt.runtime.kv_cache import KVCache
from eagle_trt.runtime.loop import Request
from eagle_trt.runtime.onnxruntime_backend import OrtDrafter, OrtIteration, OrtTarget


@pytest.fixture(scope="module")
def fused(tiny_graphs, tmp_path_factory):
    """(fused target graph, its iteration graph with the tiny drafter tree graph)."""
    target, _, graphs, _ = tiny_graphs
    folder = tmp_path_factory.mktemp("fused")
    path = folder / "target_fused.onnx"
    counts = fuse_attention(graphs["target"], path, target.config)
    assert counts["fused_layers"] == target.config.num_hidden_layers
    return path, compose_iteration(path, graphs["drafter_tree"], folder / "iteration.onnx", tensorrt=False).path


def _backends(tiny_graphs, fused_path):
    target, _, graphs, _ = tiny_graphs
    return (OrtTarget(fused_path, target.config.max_position_embeddings),
            OrtDrafter(graphs["drafter_tree"], TINY_SHAPE))


def test_each_layer_attention_is_one_operator(tiny_graphs, fused):
    target, _, graphs, _ = tiny_graphs
    model = onnx.load(str(fused[0]))
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("GroupQueryAttention") == target.config.num_hidden_layers
    assert "Softmax" not in ops                      # the portable attention is gone
    wrapping = 4 * ops.count("Conv")                 # a pointwise Conv's Reshapes and Transposes
    assert len(ops) - wrapping < 0.6 * len(onnx.load(str(graphs["target"])).graph.node)
    outputs = {o.name for o in model.graph.output}
    assert "present_key_0" in outputs and "new_key_0" not in outputs


def _x86_with_avx2() -> bool:
    """MLAS has NCHWc kernels on x86 from AVX2 on (8-channel blocks; AVX-512: 16)."""
    try:
        return " avx2 " in Path("/proc/cpuinfo").read_text().replace("\n", " ")
    except OSError:
        return False


def test_float_projections_are_pointwise_convs_onnx_runtime_blocks(tiny_graphs, fused, tmp_path):
    """Every weight MatMul of the float graph (packed q / k / v, o, packed gate / up, down, the
    tied head) is a 1x1 Conv whose weights are the MatMul's transposed: none is left a MatMul, and
    where MLAS has NCHWc kernels ONNX Runtime's optimizer runs each as its blocked Conv with the
    Transposes folded into its reorders (what makes them faster); convs=False keeps MatMuls."""
    import onnxruntime as ort
    target, _, graphs, _ = tiny_graphs
    cfg = target.config
    model = onnx.load(str(fused[0]))
    ops = [n.op_type for n in model.graph.node]
    assert "MatMul" not in ops
    assert ops.count("Conv") == 4 * cfg.num_hidden_layers + 1
    weights = {t.name: t for t in model.graph.initializer}
    qkv = next(n for n in model.graph.node if n.name == "/model/layers.0/self_attn/qkv_proj/Conv")
    q_width = cfg.num_attention_heads * cfg.head_dim
    portable = {t.name: t for t in onnx.load(str(graphs["target"])).graph.initializer}
    q_t = next(t for name, t in portable.items() if name.startswith("model.layers.0.self_attn.q_proj"))
    scale = cfg.head_dim ** -0.5           # a power of two here: folded into q, the operator's scale 1
    assert scale == 0.25
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(weights[qkv.input[1]])[:q_width, :, 0, 0],
                                  onnx.numpy_helper.to_array(q_t).T * np.float32(scale))
    scales = [a.f for n in model.graph.node if n.op_type == "GroupQueryAttention" for a in n.attribute
              if a.name == "scale"]
    assert scales == [1.0] * cfg.num_hidden_layers
    if _x86_with_avx2():
        so = ort.SessionOptions()
        so.optimized_model_filepath = str(tmp_path / "optimized.onnx")
        ort.InferenceSession(str(fused[0]), so, providers=["CPUExecutionProvider"])
        optimized = onnx.load(str(tmp_path / "optimized.onnx"), load_external_data=False)
        blocked = [n for n in optimized.graph.node if n.domain == "com.microsoft.nchwc" and n.op_type == "Conv"]
        assert len(blocked) == ops.count("Conv")
        assert not any(n.op_type == "Transpose" and n.input[0] in {o for b in blocked for o in b.output}
                       for n in optimized.graph.node), "a Transpose after a blocked Conv was not folded"
    matmul_graph = tmp_path / "matmuls.onnx"
    assert fuse_attention(graphs["target"], matmul_graph, cfg, convs=False)["conv_projections"] == 0
    assert "Conv" not in {n.op_type for n in onnx.load(str(matmul_graph)).graph.node}


def test_a_tied_head_becomes_a_conv_over_the_embedding_itself(tmp_path):
    """The tied head's MatMul reads the embedding through a Transpose: its Conv reads the
    embedding [V, H] as [V, H, 1, 1] (a Reshape ONNX Runtime folds), no second copy of it in the
    graph; a MatMul of other widths than whole channel blocks stays; the logits equal the MatMul's
    within fp32 rounding, one row and five."""
    from onnx import TensorProto, helper, numpy_helper

    from eagle_trt.export.cpu_attention import _Packer
    from eagle_trt.runtime.sessions import make_session
    gen = np.random.default_rng(0)
    embed, odd = gen.standard_normal((64, 32), dtype=np.float32), gen.standard_normal((32, 20), dtype=np.float32)
    nodes = [helper.make_node("Transpose", ["embed"], ["embed_t"], name="tie"),
             helper.make_node("MatMul", ["x", "embed_t"], ["logits"], name="/model/lm_head/MatMul"),
             helper.make_node("MatMul", ["x", "odd"], ["odd_out"], name="/model/odd/MatMul")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "t", 32])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("logits", "odd_out")],
                              [numpy_helper.from_array(embed, "embed"), numpy_helper.from_array(odd, "odd"),
                               numpy_helper.from_array(np.array([0, 0, 1, -1], np.int64), "fused_attention/nhwc_shape"),
                               numpy_helper.from_array(np.array([0, 0, -1], np.int64), "fused_attention/rows_shape")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)
    packer = _Packer(model.graph, None, None, convs=True)
    converted = packer.as_convs(list(model.graph.node))
    assert [n.op_type for n in converted].count("Conv") == 1 and [n.op_type for n in converted].count("MatMul") == 1
    reshape = next(n for n in converted if n.name.endswith("weight_Reshape"))
    assert reshape.input[0] == "embed"
    conv_model = onnx.ModelProto()
    conv_model.CopyFrom(model)
    del conv_model.graph.node[:]
    conv_model.graph.node.extend(converted)
    conv_model.graph.initializer.extend(packer.new)
    for name, m in (("matmul", model), ("conv", conv_model)):
        onnx.save(m, str(tmp_path / f"{name}.onnx"))
    a, b = make_session(tmp_path / "matmul.onnx", 1), make_session(tmp_path / "conv.onnx", 1)
    for rows in (1, 5):
        x = gen.standard_normal((1, rows, 32), dtype=np.float32)
        for want, got in zip(a.run(None, {"x": x}), b.run(None, {"x": x})):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_rope_tables_are_the_models_cos_and_sin(tiny_target):
    cfg = tiny_target.config
    cos, sin = rope_tables(cfg)
    assert cos.shape == sin.shape == (cfg.max_position_embeddings, cfg.head_dim // 2)
    angles = torch.arange(cfg.max_position_embeddings).float()[:, None] * tiny_target.model.rope.inv_freq
    np.testing.assert_allclose(cos, angles.cos().numpy(), atol=1e-6)
    np.testing.assert_allclose(sin, angles.sin().numpy(), atol=1e-6)


@pytest.mark.parametrize("engine", ["plain", "two calls", "iteration graph"])
def test_greedy_decoding_on_the_fused_graph_equals_the_pytorch_reference(tiny_graphs, fused, engine):
    target_model, _, _, prompts = tiny_graphs
    target, drafter = _backends(tiny_graphs, fused[0])
    reference = two_call(TorchTarget(target_model.model))
    if engine == "iteration graph":
        iteration = OrtIteration(fused[1], target, drafter)
        decoder = on_graph(iteration)
    else:
        decoder = two_call(target, drafter if engine == "two calls" else None)
    accepted = []
    for p, n in zip(prompts[:6], LIMITS):
        out = decoder.generate(p, n)
        assert out.tokens == reference.generate(p, n).tokens
        accepted += out.accept_lengths
    if engine != "plain":
        assert max(accepted) >= 2, "no draft was ever accepted: the in-place commit went untested"
    if engine == "iteration graph":
        assert iteration.graph_calls > 0


def test_a_batch_of_several_rows_each_is_refused_with_the_reason(tiny_graphs, fused):
    """ONNX Runtime's GroupQueryAttention CPU kernel takes several new rows after a past only at
    batch 1; plain decoding steps (one row each) do batch."""
    _, _, _, prompts = tiny_graphs
    target, drafter = _backends(tiny_graphs, fused[0])
    requests = [Request(p, n) for p, n in zip(prompts[:4], LIMITS)]
    for decoder in (two_call(target, drafter), on_graph(OrtIteration(fused[1], target, drafter))):
        with pytest.raises(ValueError, match="one sequence a call"):
            decoder.generate_batch(requests, max_batch=3)
    solo = [two_call(target).generate(p, n).tokens for p, n in zip(prompts, LIMITS)]
    plain = two_call(target).generate_batch([Request(p, n) for p, n in zip(prompts, LIMITS)], max_batch=3)
    assert [r.tokens for r in plain] == solo


def test_in_place_commit_moves_accepted_rows_down():
    cache = KVCache(num_layers=2, kv_heads=1, head_dim=2, capacity=16)
    cache.in_place = True
    cache.add()
    cache.stage(range(1), 3)
    cache.kv_np[:, :, 0, :, 0:3] = np.arange(3, dtype=np.float32)[:, None] + 1     # a prefill's rows, in place
    cache.commit([[0, 1, 2]])
    assert cache.lengths == [3]
    cache.stage(range(1), 6)
    rows = np.arange(6, dtype=np.float32)[:, None] + 10                             # a tree's 6 rows at 3..8
    cache.kv_np[:, :, 0, :, 3:9] = rows
    cache.commit([[0, 2, 3, 5]])                                                    # root, then a path
    assert cache.lengths == [7]
    np.testing.assert_array_equal(cache.kv_np[0, 1, 0, 0, :7, 0], [1, 2, 3, 10, 12, 13, 15])
    np.testing.assert_array_equal(cache.kv_np[1, 0, 0, 0, :7, 1], [1, 2, 3, 10, 12, 13, 15])


def test_what_the_rewrite_does_not_map_is_refused(tiny_graphs, tmp_path):
    target, _, graphs, _ = tiny_graphs
    cfg = target.config
    for arch, named in ((dataclasses.replace(cfg.arch, qk_norm=True), "q / k RMSNorm"),
                        (dataclasses.replace(cfg.arch, sliding_window=8, sliding_layers=(1,)), "sliding-window")):
        with pytest.raises(FusedAttentionError, match=named):
            fuse_attention(graphs["target"], tmp_path / "t.onnx", dataclasses.replace(cfg, arch=arch))
        assert not (tmp_path / "t.onnx").exists()        # nothing half-written
    with pytest.raises(FusedAttentionError, match="not a portable target graph"):
        fuse_attention(graphs["drafter_tree"], tmp_path / "t.onnx", cfg)


def test_an_iteration_graph_of_the_other_target_graph_is_refused(tiny_graphs, fused, tiny_iteration_graph):
    target, drafter = _backends(tiny_graphs, fused[0])
    with pytest.raises(ValueError, match="composed from a portable target graph"):
        OrtIteration(tiny_iteration_graph, target, drafter)


def test_fused_graph_outputs_equal_the_portable_graphs_on_parity_feeds(tiny_graphs, fused):
    """Parity's target feeds (a random past with a hole in the new rows' mask, prefills, real tree
    verifications), made the fused graph's (fused_feeds: T more cache rows): logits, captured
    states and the greedy acceptance equal the portable graph's within the fp32 floor."""
    from eagle_trt.export.cpu_attention import fused_feeds
    from eagle_trt.parity import target_case
    from eagle_trt.runtime.sessions import make_session
    target, drafter, graphs, prompts = tiny_graphs
    case = target_case(target.model, graphs["target"], "float32", prompts[1:3], TINY_SHAPE, drafter)
    portable, fused_graph = make_session(graphs["target"], 1), make_session(fused[0], 1)
    names = ["logits", "captured", "accept_path", "accept_length", "accept_tokens"]
    single = [f for f in case.feeds if f["input_ids"].shape[0] == 1]
    assert len(single) >= 4 and any(f["input_ids"].shape[1] > 1 and f["past_key_0"].shape[2] for f in single)
    for feed in single:
        want = portable.run(names, feed)
        got = fused_graph.run(names, fused_feeds(feed))
        for name, a, b in zip(names, want, got):
            if a.dtype == np.int64:
                np.testing.assert_array_equal(a, b, err_msg=name)
            else:
                np.testing.assert_allclose(a, b, atol=2e-4, rtol=1e-4, err_msg=name)


def test_packed_projections_are_bit_identical_to_separate_ones(tiny_graphs, fused, tmp_path):
    """Each layer's q / k / v one MatMul read as packed QKV by the operator, its gate / up one
    MatMul and a Split: the same sums column by column, so every output equals the graph with
    separate projections exactly, prefills and tree verifications alike. The packed graph also
    has 1/sqrt(head_dim) folded into q (the operator's scale 1), the separate one not: a power
    of two changes no digit."""
    from eagle_trt.export.cpu_attention import fused_feeds
    from eagle_trt.parity import target_case
    from eagle_trt.runtime.sessions import make_session
    target, drafter, graphs, prompts = tiny_graphs
    layers = target.config.num_hidden_layers
    separate = tmp_path / "separate.onnx"
    assert fuse_attention(graphs["target"], separate, target.config, pack=False)["packed_layers"] == 0
    packed_model, separate_model = onnx.load(str(fused[0])), onnx.load(str(separate))
    operators = [n for n in packed_model.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(operators) == layers and all(n.input[1] == n.input[2] == "" for n in operators)
    assert all(any(a.name == "scale" for a in n.attribute) for n in operators)
    assert not any(a.name == "scale" for n in separate_model.graph.node if n.op_type == "GroupQueryAttention"
                   for a in n.attribute)

    def matmuls(m):       # the projections: MatMuls, or pointwise Convs (the default in a float graph)
        return sum(n.op_type in ("MatMul", "Conv") for n in m.graph.node)
    assert matmuls(separate_model) - matmuls(packed_model) == 3 * layers
    case = target_case(target.model, graphs["target"], "float32", prompts[1:3], TINY_SHAPE, drafter)
    a, b = make_session(separate, 1), make_session(fused[0], 1)
    names = ["logits", "captured", "accept_tokens"]
    single = [fused_feeds(f) for f in case.feeds if f["input_ids"].shape[0] == 1]
    assert any(f["input_ids"].shape[1] > 1 for f in single)
    for feed in single:
        for name, x, y in zip(names, a.run(names, feed), b.run(names, feed)):
            np.testing.assert_array_equal(x, y, err_msg=name)


@pytest.fixture(scope="module")
def fused_build(tmp_path_factory):
    """The default build of a tiny fp32 target served one stream at a time (serving.attention auto)."""
    from test_build_support import tiny_config, write_tiny_target

    from eagle_trt.build import build, config_from_dict
    folder = tmp_path_factory.mktemp("build_fused")
    data = tiny_config(write_tiny_target(folder / "target"), serving={"max_concurrent": 1})
    build(config_from_dict(data, "tiny.yaml"), folder / "out", log=None)
    return folder / "out"


def test_a_one_stream_build_serves_the_fused_graph_checked_by_parity(fused_build):
    import json

    from eagle_trt.build.triton import served_graphs
    from eagle_trt.config import TreeShape
    from eagle_trt.runtime.loop import DecodingLoop
    from eagle_trt.runtime.ort_engines import open_backends
    from eagle_trt.runtime.two_call import TwoCallEngine
    report = json.loads((fused_build / "parity" / "report.json").read_text())
    checked = {g["name"]: g for g in report["graphs"]}
    assert report["passed"] and "target.fused" in checked
    assert {o["output"] for o in checked["target.fused"]["outputs"]} >= {"logits", "captured", "accept_tokens"}
    settings = json.loads((fused_build / "triton/eagle_trt/1/eagle.json").read_text())
    assert settings["graphs"]["target"] == "graphs/target.fused.onnx" and "iteration" in settings["graphs"]
    graphs = served_graphs(fused_build / "triton", "eagle_trt")
    opened = open_backends(graphs, TreeShape(*settings["tree"]), settings["max_context"], threads=1)
    portable = OrtTarget(fused_build / "export" / "target.onnx", settings["max_context"], threads=1)
    assert opened.target.in_place and opened.iteration is not None
    for seed in range(3):
        prompt = torch.randint(3, settings["vocab_size"], (5 + 8 * seed,),
                               generator=torch.Generator().manual_seed(seed)).tolist()
        want = DecodingLoop(TwoCallEngine(portable), (), settings["vocab_size"]).generate(prompt, 24).tokens
        assert DecodingLoop(opened.engine(), (), settings["vocab_size"]).generate(prompt, 24).tokens == want
    assert opened.iteration.graph_calls > 0


@pytest.mark.parametrize("precision, serving", [({}, {"attention": "fused"}),            # max_concurrent 8
                                                ({"target": {"format": "fp8"}}, {"attention": "fused", "max_concurrent": 1})])
def test_fused_serving_where_it_cannot_run_is_refused(tmp_path, precision, serving):
    from test_build_support import tiny_config

    from eagle_trt.build import BuildConfigError, config_from_dict
    with pytest.raises(BuildConfigError, match="serving.attention: fused serves one stream of an fp32 or int4 target"):
        config_from_dict(tiny_config(tmp_path / "t", precision=precision, serving=serving), "tiny.yaml")
