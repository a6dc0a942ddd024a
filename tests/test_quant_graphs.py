"""Q/DQ graphs of the tiny target and drafter against the PyTorch fake-quant reference: FP8 on
ONNX Runtime (ORT_ENABLE_BASIC), NVFP4 on onnx.reference; graph structure as TensorRT reads
it; speculative decoding on quantized graphs; bad inputs."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from eagle_trt.config import TreeShape
from eagle_trt.export import check_graph, export_drafter_step, export_drafter_tree, export_target
from eagle_trt.models.target import causal_mask
from eagle_trt.export.iteration import compose_iteration
from eagle_trt.quant import (QuantConfig, QuantError, calibrate_drafter, calibrate_target, layer_parity, linear_paths,
                             module_for_node, quantize_model, quantize_onnx, quantized_copy, run_graph)
from eagle_trt.runtime.backend import TorchDrafter, TorchTarget
from eagle_trt.runtime.cost import CostModel
from eagle_trt.runtime.loop import Request
from eagle_trt.runtime.ort_engines import open_backends

from conftest import PlantedDrafter, capturing, on_graph, oracle_drafter, rel_l2, two_call

SHAPE = TreeShape(depth=4, top_k=3, total_tokens=10)
FORMATS = ("fp8", "nvfp4")


def _ids(n: int, seed: int, vocab: int = 96) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def setup(tiny_target, tmp_path_factory):
    """Float graphs, calibration (random token prompts: the tiny model has no tokenizer) and the
    quantized graphs of both formats."""
    folder = tmp_path_factory.mktemp("quant_tiny")
    drafter = oracle_drafter(tiny_target, "eagle3.1", draft_vocab_size=48)
    target = capturing(tiny_target, drafter)
    prompts = [_ids(12 + 5 * i, seed=100 + i) for i in range(6)]
    calls = {"target": 0, "drafter": 0}
    counter = lambda name: lambda: calls.__setitem__(name, calls[name] + 1)   # noqa: E731 - progress callbacks
    amax = {"target": calibrate_target(target.model, prompts, counter("target")),
            "drafter": calibrate_drafter(drafter, target.model, prompts, SHAPE, counter("drafter"))}
    graphs = {"target": export_target(target.model, folder / "target.onnx").path,
              "drafter": export_drafter_tree(drafter, SHAPE, folder / "drafter.onnx").path}
    models = {"target": target.model, "drafter": drafter}
    out = {"folder": folder, "amax": amax, "graphs": graphs, "models": models, "summary": {}, "calls": calls,
           "target": target}
    for fmt in FORMATS:
        for name in ("target", "drafter"):
            path = folder / f"{name}.{fmt}.onnx"
            out["summary"][name, fmt] = quantize_onnx(graphs[name], path, QuantConfig(fmt), amax[name],
                                                      linear_paths(models[name]))
            out["graphs"][name, fmt] = path
    return out


@pytest.fixture(scope="module")
def oracle_target(setup):
    """The tiny target capturing the oracle drafter's layers, as setup's graphs were exported."""
    return setup["target"]


def target_feeds(cfg, ids: list[int], past: int, seed: int = 0):
    """A call with `past` random committed KV rows, to exercise the past inputs too."""
    T = len(ids)
    gen = torch.Generator().manual_seed(seed)
    kv = [torch.randn(1, cfg.num_key_value_heads, past, cfg.head_dim, generator=gen) for _ in range(2 * cfg.num_hidden_layers)]
    feeds = {"input_ids": np.array([ids]), "position_ids": np.arange(past, past + T)[None],
             "attention_mask": causal_mask(T, past).numpy(), "logits_index": np.arange(T)}
    for i in range(cfg.num_hidden_layers):
        feeds[f"past_key_{i}"], feeds[f"past_value_{i}"] = kv[2 * i].numpy(), kv[2 * i + 1].numpy()
    return feeds, kv


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_target_graph_matches_fake_quant_reference(setup, oracle_target, fmt):
    model, cfg = oracle_target.model, oracle_target.config
    reference, summary = quantized_copy(model, QuantConfig(fmt), setup["amax"]["target"])
    assert sorted(summary.quantized) == setup["summary"]["target", fmt].modules
    ids = _ids(6, seed=7)
    feeds, kv = target_feeds(cfg, ids, past=5)
    with torch.no_grad():
        args = (torch.tensor([ids]), torch.arange(5, 11)[None], causal_mask(6, 5), kv[0::2], kv[1::2])
        ref, flt = reference(*args), model(*args)
    got = run_graph(setup["graphs"]["target", fmt], feeds)     # ORT (BASIC) for FP8, onnx.reference for NVFP4
    err = rel_l2(got["logits"], ref.logits)
    print(f"tiny target {fmt}: graph vs reference rel L2 {err:.2e}, quantization error {rel_l2(ref.logits, flt.logits):.2e}")
    assert err <= 1e-3
    assert rel_l2(got["captured"], ref.captured) <= 1e-3
    assert rel_l2(got["new_key_3"], ref.new_k[3]) <= 1e-3
    assert rel_l2(ref.logits, flt.logits) > 1e-2, "quantization changed nothing: the comparison would be vacuous"


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_quantized_matmul_matches_its_quant_linear(setup, oracle_target, fmt):
    reference, _ = quantized_copy(oracle_target.model, QuantConfig(fmt), setup["amax"]["target"])
    feeds, _ = target_feeds(oracle_target.config, _ids(9, seed=3), past=4)
    report = layer_parity(str(setup["graphs"]["target", fmt]), reference, feeds)
    assert len(report) == len(setup["summary"]["target", fmt].quantized) == 6 * 7
    assert setup["summary"]["target", fmt].unmatched == []
    worst = max(r.rel_l2 for r in report)
    assert worst <= 1e-5, [r for r in report if r.rel_l2 > 1e-5]


def test_layer_parity_feeds_an_fp8_graphs_weights_file_as_memory_maps(setup, oracle_target, tmp_path, monkeypatch):
    """The layer check's probe of an FP8 graph whose weights lie in a data file: the FP8 and
    float weights are fed as memory maps of that file (ONNX Runtime would read every layer into
    its heap), with the same report as the graph with its weights inside."""
    import onnxruntime as ort

    from eagle_trt.parity_sessions import probe_session
    monkeypatch.setenv("EAGLE_TRT_EXTERNAL_DATA_BYTES", "0")
    path = export_target(oracle_target.model, tmp_path / "t.onnx").path
    dst = tmp_path / "t.fp8.onnx"
    quantize_onnx(path, dst, QuantConfig("fp8"), setup["amax"]["target"], linear_paths(oracle_target.model))
    assert dst.with_name("t.fp8.onnx.data").is_file()
    fed = probe_session(dst)
    assert sum(isinstance(w, ort.OrtValue) for w in fed.weights.values()) == 6 * 7     # the FP8 weights, mapped
    reference, _ = quantized_copy(oracle_target.model, QuantConfig("fp8"), setup["amax"]["target"])
    feeds, _ = target_feeds(oracle_target.config, _ids(9, seed=3), past=4)
    mapped = layer_parity(str(dst), reference, feeds)
    inside = layer_parity(str(setup["graphs"]["target", "fp8"]), reference, feeds)
    assert [(r.module, r.rel_l2) for r in mapped] == [(r.module, r.rel_l2) for r in inside]
    assert max(r.rel_l2 for r in mapped) <= 1e-5


def test_quantize_model_in_place_lets_each_float_weight_go(setup, oracle_target, monkeypatch):
    """The parity stage makes its fake-quant reference from the float model in place, so a
    real-size target is never held twice: nothing in quantize_model may keep a replaced
    Linear's float weight alive (the skipped lm_head's stays)."""
    import copy
    import gc
    import weakref
    from eagle_trt.quant import fakequant
    model = copy.deepcopy(oracle_target.model)
    cfg = QuantConfig("fp8", skip=("lm_head",))
    weights = {path: weakref.ref(linear.weight) for path, linear in linear_paths(model).items()}
    alive = []     # float weights still alive as each QuantLinear is made: the peak, not just the end

    class Counting(fakequant.QuantLinear):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            gc.collect()
            alive.append(sum(r() is not None for r in weights.values()))
    monkeypatch.setattr(fakequant, "QuantLinear", Counting)
    summary = quantize_model(model, cfg, setup["amax"]["target"])
    gc.collect()
    n = len(summary.quantized)
    assert n and set(summary.quantized) | set(summary.skipped) == set(weights)
    # the i-th construction still sees its own Linear and the n - i - 1 not yet replaced, plus the skipped
    assert alive == [n - i + len(summary.skipped) for i in range(n)]
    assert [p for p in summary.quantized if weights[p]() is not None] == []
    assert all(weights[p]() is not None for p in summary.skipped)


def test_layer_parity_catches_a_wrong_scale(setup, oracle_target):
    """The per-layer check can fail: a reference calibrated differently disagrees."""
    amax = dict(setup["amax"]["target"], **{"layers.2.mlp.down_proj": setup["amax"]["target"]["layers.2.mlp.down_proj"] * 3})
    reference, _ = quantized_copy(oracle_target.model, QuantConfig("fp8"), amax)
    feeds, _ = target_feeds(oracle_target.config, _ids(9, seed=3), past=0)
    bad = {r.module for r in layer_parity(str(setup["graphs"]["target", "fp8"]), reference, feeds) if r.rel_l2 > 1e-3}
    assert bad == {"layers.2.mlp.down_proj"}


def test_fp8_graph_structure(setup):
    m = onnx.load(str(setup["graphs"]["target", "fp8"]))
    assert next(o.version for o in m.opset_import if o.domain == "") == 19
    inits = {i.name: i for i in m.graph.initializer}
    producer = {o: n for n in m.graph.node for o in n.output}
    matmuls = {n.name: n for n in m.graph.node if n.op_type == "MatMul"}
    for name in setup["summary"]["target", "fp8"].quantized:
        node = matmuls[name]
        wdq = producer[node.input[1]]
        assert wdq.op_type == "DequantizeLinear"
        w, s = inits[wdq.input[0]], inits[wdq.input[1]]
        assert w.data_type == TensorProto.FLOAT8E4M3FN and len(w.dims) == 2
        assert list(s.dims) == [w.dims[1]] and helper.get_attribute_value(wdq.attribute[0]) == 1   # per out channel
        adq = producer[node.input[0]]
        q = producer[adq.input[0]]
        assert (adq.op_type, q.op_type) == ("DequantizeLinear", "QuantizeLinear")
        assert inits[q.input[2]].data_type == TensorProto.FLOAT8E4M3FN and inits[q.input[1]].dims == []
    lm_head = matmuls["/model/lm_head/MatMul"]
    assert inits[lm_head.input[1]].data_type == TensorProto.FLOAT      # skipped by default
    assert not any(i.data_type == TensorProto.FLOAT and len(i.dims) == 2 and i.dims[0] * i.dims[1] == 64 * 128
                   for i in m.graph.initializer), "a float MLP weight survived the rewrite"
    onnx.checker.check_model(m)
    check_graph(m)


def test_nvfp4_graph_structure(setup):
    m = onnx.load(str(setup["graphs"]["target", "nvfp4"]))
    assert next(o.version for o in m.opset_import if o.domain == "") == 23
    assert any(o.domain == "trt" for o in m.opset_import)
    inits = {i.name: i for i in m.graph.initializer}
    producer = {o: n for n in m.graph.node for o in n.output}
    node = next(n for n in m.graph.node if n.name == "/model/layers.1/mlp/down_proj/MatMul")
    dq2 = producer[node.input[1]]
    dq1 = producer[dq2.input[1]]
    w4, sb8, g = inits[dq2.input[0]], inits[dq1.input[0]], inits[dq1.input[1]]
    assert (w4.data_type, list(w4.dims), len(w4.raw_data)) == (TensorProto.FLOAT4E2M1, [128, 64], 128 * 64 // 2)
    assert (sb8.data_type, list(sb8.dims)) == (TensorProto.FLOAT8E4M3FN, [8, 64])
    assert g.data_type == TensorProto.FLOAT and list(g.dims) == []
    assert {a.name: helper.get_attribute_value(a) for a in dq2.attribute} == {"axis": 0, "block_size": 16}
    a2 = producer[node.input[0]]
    a1 = producer[a2.input[1]]
    dyn = producer[a2.input[0]]
    assert (dyn.domain, dyn.op_type) == ("trt", "TRT_FP4DynamicQuantize")
    assert {a.name: helper.get_attribute_value(a) for a in dyn.attribute} == \
        {"axis": -1, "block_size": 16, "scale_type": TensorProto.FLOAT8E4M3FN}
    assert dyn.output[1] == a1.input[0] and dyn.input[1] == a1.input[1]     # block scales DQ'd by the global scale
    assert {a.name: helper.get_attribute_value(a) for a in a2.attribute} == {"axis": -1, "block_size": 16}
    onnx.checker.check_model(m)
    check_graph(m)


def test_drafter_tree_shares_each_converted_weight(setup):
    """The unrolled tree graph reads one initializer per drafter module: converted once, one DQ."""
    for fmt in FORMATS:
        summary = setup["summary"]["drafter", fmt]
        assert summary.weights_converted == len(summary.modules) == 8       # all but lm_head
        assert summary.unmatched == []
        assert sorted(summary.modules) == sorted(p for p in linear_paths(setup["models"]["drafter"]) if p != "lm_head")
        m = onnx.load(str(setup["graphs"]["drafter", fmt]))
        matmuls = [n for n in m.graph.node if n.name in summary.quantized]
        by_weight: dict[str, list[str]] = {}
        for n in matmuls:
            by_weight.setdefault(n.input[1], []).append(summary.quantized[n.name])
        assert len(by_weight) == 8
        q_proj = [w for w, mods in by_weight.items() if mods[0] == "midlayer.self_attn.q_proj"]
        assert len(q_proj) == 1 and len(by_weight[q_proj[0]]) == SHAPE.depth     # step 0 + 3 tree steps
        weight_dqs = [n for n in m.graph.node if n.op_type == "DequantizeLinear" and n.output[0] in by_weight]
        assert len(weight_dqs) == 8
        assert len(summary.skipped) == SHAPE.depth and all("lm_head" in r for r in summary.skipped.values())
        check_graph(m)


def _drafter_inputs(oracle_target, seed: int):
    ids = _ids(10, seed)
    past_k, past_v = oracle_target.model.empty_past()
    with torch.no_grad():
        out = oracle_target.model(torch.tensor([ids]), torch.arange(10)[None], causal_mask(10, 0), past_k, past_v)
    return out.captured[0], torch.tensor(ids[1:] + [int(out.logits[0, -1].argmax())])


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_drafter_tree_matches_fake_quant_drafter(setup, oracle_target, fmt):
    reference, _ = quantized_copy(setup["models"]["drafter"], QuantConfig(fmt), setup["amax"]["drafter"])
    for seed in range(3):
        captured, ids = _drafter_inputs(oracle_target, seed)
        ref = TorchDrafter(reference, SHAPE)
        ref.reset()
        ref.add_sequence()
        tree = ref.draft(captured[None], ids[None]).row(0)
        kv = np.zeros((1, 2, 0, 16), np.float32)
        got = run_graph(setup["graphs"]["drafter", fmt], {"captured": captured[None].numpy(),
                                                          "input_ids": ids[None].numpy(), "past_key": kv, "past_value": kv,
                                                          "past_lengths": np.array([0]), "new_lengths": np.array([len(ids)])})
        got = {name: value[0] for name, value in got.items()}
        assert got["tree_tokens"].tolist() == tree.tokens.tolist()
        assert got["tree_parents"].tolist() == tree.parents.tolist()
        assert (got["tree_mask"] == tree.mask.numpy()).all()
        assert np.abs(got["tree_scores"] - tree.scores.numpy()).max() <= 1e-4


def test_speculative_decoding_on_fp8_graphs_equals_autoregressive(setup, oracle_target, tmp_path):
    """FP8 target + FP8 drafter graphs on ONNX Runtime give exactly the tokens of greedy decoding
    with the FP8 target graph alone, and of the fake-quant PyTorch models; the two composed into
    an iteration graph (run with the FP8 session settings by open_backends, as the Triton model
    serves FP8 builds) give the tokens and accept lengths of the two-call loop, every drafting
    step in one call, whole trees and the cost model's subtrees."""
    cfg = QuantConfig("fp8")
    ref_target, _ = quantized_copy(oracle_target.model, cfg, setup["amax"]["target"])
    ref_drafter, _ = quantized_copy(setup["models"]["drafter"], cfg, setup["amax"]["drafter"])
    composed = compose_iteration(setup["graphs"]["target", "fp8"], setup["graphs"]["drafter", "fp8"],
                                 tmp_path / "iteration.fp8.onnx").path      # the TensorRT op check included
    graphs = {"target": setup["graphs"]["target", "fp8"], "drafter_tree": setup["graphs"]["drafter", "fp8"],
              "iteration": composed}
    target, drafter, iteration = open_backends(graphs, SHAPE, oracle_target.config.max_position_embeddings, threads=1,
                                               precision={"target": "fp8", "drafter_tree": "fp8"})
    accepted = []
    for seed in range(3):
        prompt = _ids(8 + 9 * seed, seed=20 + seed)
        ar = two_call(target).generate(prompt, 32)
        torch_ar = two_call(TorchTarget(ref_target)).generate(prompt, 32)
        assert ar.tokens == torch_ar.tokens
        spec = two_call(target, PlantedDrafter(drafter, len(prompt), ar.tokens, seed=seed)).generate(prompt, 32)
        assert spec.tokens == ar.tokens
        accepted += spec.accept_lengths
        plain = two_call(target, drafter).generate(prompt, 32)
        torch_spec = two_call(TorchTarget(ref_target), TorchDrafter(ref_drafter, SHAPE)).generate(prompt, 32)
        assert plain.tokens == ar.tokens == torch_spec.tokens
        assert plain.accept_lengths == torch_spec.accept_lengths
        calls = iteration.graph_calls
        one_call = on_graph(iteration).generate(prompt, 32)
        assert (one_call.tokens, one_call.accept_lengths) == (plain.tokens, plain.accept_lengths)
        assert iteration.graph_calls - calls == one_call.drafter_calls > 0
    assert max(accepted) >= 3, "no draft was accepted deeply: the check would be vacuous"
    # continuously batched (batch 3 and 8, prompts of mixed lengths, one stopping at an EOS that
    # greedy decoding emits): each sequence still gets greedy FP8 decoding's tokens
    prompts = [_ids(5 + 4 * i, seed=40 + i) for i in range(8)]
    solo = [two_call(target).generate(p, 24).tokens for p in prompts]
    eos = {solo[2][9]}
    solo = [two_call(target, None, eos).generate(p, 24).tokens for p in prompts]
    assert any(len(t) < 24 for t in solo), "no sequence stopped at the EOS: the check would be vacuous"
    for batch in (3, 8):
        results = two_call(target, drafter, eos).generate_batch([Request(p, 24) for p in prompts], max_batch=batch)
        assert [r.tokens for r in results] == solo, f"FP8 graphs at batch {batch} differ from greedy"
    # the iteration graph under the cost model: warm-up trees in two calls, then every drafting
    # step in one, subtrees too (a seeded model that finds 2 nodes the best, whatever it measures)
    model = CostModel(SHAPE.total_tokens, SHAPE.top_k * (SHAPE.depth - 1), warmup=2)
    model.choose = lambda batch, backlog=0, remaining=None: SHAPE.total_tokens if model.warming_up else 2
    decoder = on_graph(iteration, eos, cost_model=model)
    calls = iteration.graph_calls
    results = decoder.generate_batch([Request(p, 24) for p in prompts], max_batch=3)
    assert [r.tokens for r in results] == solo, "FP8 iteration graph with subtrees differs from greedy"
    assert 2 in decoder.verified and iteration.graph_calls - calls == decoder.verified.count(2)


def test_single_step_drafter_graph(setup, tmp_path):
    """A later-step drafter graph has no fc: it is reported unmatched, the rest is quantized and
    matches the fake-quant drafter step."""
    drafter = setup["models"]["drafter"]
    step = export_drafter_step(drafter, tmp_path / "step.onnx", first=False).path
    summary = quantize_onnx(step, tmp_path / "step.fp8.onnx", QuantConfig("fp8"), setup["amax"]["drafter"],
                            linear_paths(drafter))
    assert summary.unmatched == ["fc"] and len(summary.modules) == 7
    reference, _ = quantized_copy(drafter, QuantConfig("fp8"), setup["amax"]["drafter"])
    gen = torch.Generator().manual_seed(5)
    hidden, ids = torch.randn(1, 4, 64, generator=gen), torch.tensor([_ids(4, seed=5)])
    past = torch.randn(1, 2, 6, 16, generator=gen)       # [B, Hkv, rows, D]
    args = (hidden, ids, torch.arange(6, 10)[None], causal_mask(4, 6), past, past)
    with torch.no_grad():
        ref = reference(*args)
    got = run_graph(tmp_path / "step.fp8.onnx", dict(zip(["hidden", "input_ids", "position_ids", "attention_mask",
                                                          "past_key", "past_value"], [a.numpy() for a in args])))
    assert rel_l2(got["logits"], ref.logits) <= 1e-3 and rel_l2(got["feedback"], ref.feedback) <= 1e-3


@pytest.mark.parametrize("fmt", FORMATS)
def test_float16_graph_quantizes_in_float32_behind_casts(oracle_target, setup, tmp_path, fmt):
    """An FP8 / NVFP4 target on a float16 base (what the 8B configs build): the quantizers read
    float32 casts of the float16 activations and their outputs are cast back, so each quantized
    MatMul equals its float16 QuantLinear, and the logits the float16 fake-quant model's."""
    import copy
    half = copy.deepcopy(oracle_target.model).half()
    path = export_target(half, tmp_path / "t16.onnx", dtype="float16").path
    dst = tmp_path / f"t16.{fmt}.onnx"
    summary = quantize_onnx(path, dst, QuantConfig(fmt), setup["amax"]["target"], linear_paths(half))
    assert len(summary.quantized) == 6 * 7
    model = onnx.load(str(dst), load_external_data=False)
    scales = [i for i in model.graph.initializer if i.name.endswith(("_scale", "/scale", "global_scale"))]
    assert scales and all(i.data_type == TensorProto.FLOAT for i in scales)     # float32 scales
    to16 = [n for n in model.graph.node if n.op_type == "Cast" and n.attribute[0].i == TensorProto.FLOAT16]
    assert len(to16) >= summary.weights_converted        # every dequantized weight and activation cast back
    reference, _ = quantized_copy(half, QuantConfig(fmt), setup["amax"]["target"])
    feeds, _ = target_feeds(oracle_target.config, _ids(9, seed=3), past=4)
    feeds = {k: v.astype(np.float16) if v.dtype == np.float32 and k.startswith("past") else v for k, v in feeds.items()}
    report = layer_parity(str(dst), reference, feeds)
    assert len(report) == 6 * 7
    worst = max(report, key=lambda r: r.rel_l2)
    print(f"{fmt} float16: worst layer rel L2 {worst.rel_l2:.2e} ({worst.module})")
    assert worst.rel_l2 <= 1e-3, worst
    amax = dict(setup["amax"]["target"], **{"layers.2.mlp.down_proj": setup["amax"]["target"]["layers.2.mlp.down_proj"] * 3})
    wrong, _ = quantized_copy(half, QuantConfig(fmt), amax)      # the check can fail at float16 tolerance
    assert {r.module for r in layer_parity(str(dst), wrong, feeds) if r.rel_l2 > 5e-3} == {"layers.2.mlp.down_proj"}


def test_module_paths_from_node_names(setup):
    target_paths = list(linear_paths(setup["models"]["target"]))
    drafter_paths = list(linear_paths(setup["models"]["drafter"]))
    assert module_for_node("/model/layers.3/self_attn/q_proj/MatMul", target_paths) == "layers.3.self_attn.q_proj"
    assert module_for_node("/model/lm_head/MatMul", target_paths) == "lm_head"
    assert module_for_node("/drafter/self_attn/q_proj_2/MatMul", drafter_paths) == "midlayer.self_attn.q_proj"
    assert module_for_node("/drafter/mlp_1/down_proj_1/MatMul", drafter_paths) == "midlayer.mlp.down_proj"
    assert module_for_node("/fc/MatMul", drafter_paths) == "fc"
    many = [f"layers.{i}.mlp.up_proj" for i in (0, 1, 10, 11)]
    assert module_for_node("/model/layers.1/mlp/up_proj/MatMul", many) == "layers.1.mlp.up_proj"
    assert module_for_node("/model/layers.2/mlp/up_proj/MatMul", many) is None
    with pytest.raises(QuantError, match="several modules"):
        module_for_node("/up_proj/MatMul", many)


def test_skip_patterns_apply_to_graph_and_reference_alike(setup, tmp_path):
    cfg = QuantConfig("fp8", per_channel=False, skip=("lm_head", "layers.0.*", "*.o_proj"))
    amax = setup["amax"]["target"]
    summary = quantize_onnx(setup["graphs"]["target"], tmp_path / "t.onnx", cfg, amax)
    _, ref = quantized_copy(setup["models"]["target"], cfg, amax)
    assert summary.modules == sorted(ref.quantized)
    assert not any(p.startswith("layers.0.") or p.endswith("o_proj") for p in summary.modules)
    assert summary.skipped["/model/layers.0/mlp/up_proj/MatMul"] == "layers.0.mlp.up_proj: skip pattern 'layers.0.*'"
    assert len(summary.modules) == 42 - 7 - 5 and len(ref.skipped) == 1 + 7 + 5   # o_proj of layer 0 counted once
    m = onnx.load(str(tmp_path / "t.onnx"))
    per_tensor = [n for n in m.graph.node if n.op_type == "DequantizeLinear" and n.input[0].endswith("_fp8")]
    assert per_tensor and all(not n.attribute for n in per_tensor)


def test_missing_calibration_module_is_named_and_nothing_is_written(setup, tmp_path):
    amax = {k: v for k, v in setup["amax"]["target"].items() if k != "layers.2.mlp.down_proj"}
    out = tmp_path / "out"
    with pytest.raises(QuantError, match=r"layers\.2\.mlp\.down_proj"):
        quantize_onnx(setup["graphs"]["target"], out / "t.onnx", QuantConfig("fp8"), amax,
                      linear_paths(setup["models"]["target"]), source="target.amax.json")
    assert not out.exists() or list(out.iterdir()) == []
    # the same calibration without the module list (as from a calibration file alone)
    with pytest.raises(QuantError, match=r"target.amax.json: no calibrated amax for module\(s\) \['layers.2.mlp.down_proj'\]"):
        quantize_onnx(setup["graphs"]["target"], out / "t.onnx", QuantConfig("fp8"), amax, source="target.amax.json")
    with pytest.raises(QuantError, match=r"layers\.2\.mlp\.down_proj"):
        quantized_copy(setup["models"]["target"], QuantConfig("nvfp4"), amax)
    with pytest.raises(QuantError, match="format is 'none'"):
        quantize_onnx(setup["graphs"]["target"], out / "t.onnx", QuantConfig("none"), amax)
    with pytest.raises(QuantError, match="nope.onnx: ONNX graph not found"):
        quantize_onnx(tmp_path / "nope.onnx", out / "t.onnx", QuantConfig("fp8"), amax)


def test_graph_failing_the_tensorrt_check_leaves_nothing_behind(setup, tmp_path):
    """A real failure after the graph is written to its temporary folder: an op TensorRT lacks."""
    m = onnx.load(str(setup["graphs"]["target"]))
    m.graph.node.append(helper.make_node("Det", ["/model/layers.0/self_attn/q_proj/MatMul_output_0"], ["det_out"],
                                         name="det0"))
    src = tmp_path / "with_det.onnx"
    onnx.save(m, str(src))
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(Exception, match="det0"):
        quantize_onnx(src, out / "t.onnx", QuantConfig("fp8"), setup["amax"]["target"])
    assert list(out.iterdir()) == []


def test_calibration_reports_progress_per_prompt(setup):
    """The build prints a line per calibration prompt with the time left (long on multi-GB targets)."""
    import io

    from eagle_trt.build.store import Progress
    assert setup["calls"] == {"target": 6, "drafter": 6}
    stream = io.StringIO()
    progress = Progress("calibrate target", 3, stream)
    for _ in range(3):
        progress.step()
    lines = stream.getvalue().splitlines()
    assert [("1/3" in l, "left" in l) for l in lines] == [(True, True), (False, True), (False, False)], lines


def test_tied_lm_head_is_stored_once_and_quantizes_through_the_transpose(tmp_path):
    """A tied target's graph holds the embedding table once: the lm_head MatMul reads
    Transpose(table), not the exporter's folded copy; ONNX Runtime matches PyTorch, the op check
    passes, and an FP8 rewrite that quantizes lm_head (skip: none) converts the transposed
    table for the MatMul while the Gather keeps reading the float one."""
    from conftest import write_tiny_hf_target
    from eagle_trt.checkpoints import load_target
    from eagle_trt.parity import check_case, target_case
    tied = load_target(write_tiny_hf_target(tmp_path / "tied", tie=True, seed=5))
    untied = export_target(load_target(write_tiny_hf_target(tmp_path / "untied", seed=5)).model, tmp_path / "u.onnx")
    path = export_target(tied.model, tmp_path / "target.onnx").path
    m = onnx.load(str(path))
    inits = {i.name: i for i in m.graph.initializer}
    vocab, hidden = tied.config.vocab_size, tied.config.hidden_size
    assert [list(i.dims) for i in inits.values()].count([vocab, hidden]) == 1
    assert [list(i.dims) for i in inits.values()].count([hidden, vocab]) == 0, "the transposed copy is still there"
    producer = {o: n for n in m.graph.node for o in n.output}
    lm_head = next(n for n in m.graph.node if n.name == "/model/lm_head/MatMul")
    transpose = producer[lm_head.input[1]]
    assert transpose.op_type == "Transpose" and list(inits[transpose.input[0]].dims) == [vocab, hidden]
    assert path.stat().st_size < untied.path.stat().st_size - 0.9 * vocab * hidden * 4
    check_graph(str(path))
    report = check_case(target_case(tied.model, path, "float32", [list(range(3, 40))]))
    assert report.passed, [(o.output, o.max_abs) for o in report.outputs if not o.passed]

    cfg = QuantConfig("fp8", skip=())
    amax = calibrate_target(tied.model, [list(range(3, 30)), list(range(40, 60))])
    summary = quantize_onnx(path, tmp_path / "target.fp8.onnx", cfg, amax, linear_paths(tied.model))
    assert "/model/lm_head/MatMul" in summary.quantized
    q = onnx.load(str(tmp_path / "target.fp8.onnx"))
    assert not any(n.name == transpose.name for n in q.graph.node)      # its only reader was converted
    assert [list(i.dims) for i in q.graph.initializer if i.data_type == TensorProto.FLOAT].count([vocab, hidden]) == 1
    check_graph(q)
    reference, _ = quantized_copy(tied.model, cfg, amax)
    feeds, _ = target_feeds(tied.config, list(range(3, 20)), past=0)
    parity = {r.module: r.rel_l2 for r in layer_parity(str(tmp_path / "target.fp8.onnx"), reference, feeds)}
    assert parity["lm_head"] <= 1e-5 and max(parity.values()) <= 1e-5


def test_a_base_model_without_chat_template_calibrates_on_plain_text(tmp_path):
    """A target whose tokenizer has no chat template (a base model) is calibrated on the prompts'
    plain text, as `generate` and parity encode them, not refused by transformers."""
    from transformers import AutoTokenizer

    from eagle_trt.quant import calibration_prompts
    from test_build_support import write_char_tokenizer
    tok = AutoTokenizer.from_pretrained(str(write_char_tokenizer(tmp_path / "tok")))
    chat = calibration_prompts(tok, count=3, max_tokens=400)
    tok.chat_template = None
    plain = calibration_prompts(tok, count=3, max_tokens=400)
    assert len(plain) == 3 and [sid for sid, _ in plain] == [sid for sid, _ in chat]
    from eagle_trt.train.data import first_turns
    for (sid, ids), (_, text, _) in zip(plain, first_turns(tok, "val", 3, 400, min_tokens=2)):
        assert ids == tok(text, add_special_tokens=False)["input_ids"] and len(ids) < len(dict(chat)[sid])


def test_layer_check_dequantizes_each_weight_where_it_is_used(setup):
    """The layer check's probe moves each weight's DequantizeLinear to just before its first
    MatMul and makes it wait for that MatMul's input (ONNX Runtime would otherwise dequantize
    every weight first and hold them all); the probe stays a valid, topologically sorted graph."""
    from eagle_trt.quant.check import _dequantize_weights_where_used
    for name in ("target", "drafter"):
        model = onnx.load(str(setup["graphs"][name, "fp8"]), load_external_data=False)
        _dequantize_weights_where_used(model)
        onnx.checker.check_model(model)
        nodes = list(model.graph.node)
        at = {o: i for i, n in enumerate(nodes) for o in n.output}
        checked, seen = 0, set()
        for i, n in enumerate(nodes):
            dq = nodes[at[n.input[1]]] if n.op_type == "MatMul" and n.input[1] in at else None
            if dq is not None and dq.op_type == "DequantizeLinear" and dq.input[0] not in at \
                    and dq.output[0] not in seen:          # a stored weight, at its first MatMul
                assert at[n.input[0]] < at[dq.output[0]] < i
                seen.add(dq.output[0])
                checked += 1
        assert checked >= 6 * 7 if name == "target" else checked > 0
