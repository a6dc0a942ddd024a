"""The 4-bit weight-only target graph (export/cpu_int4.py, ONNX Runtime's MatMulNBits quantizer):
every weight MatMul, the tied lm_head included, reads 4-bit blocks; speculative decoding on it,
with two calls and with the iteration graph, is token-identical to that graph's own greedy
decoding; its logits lie near the float model's but not on them (the distance is reported)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from eagle_trt.api import Models
from eagle_trt.config import TreeShape
from eagle_trt.export import export_pipeline
from eagle_trt.export.cpu_attention import fuse_attention, fused_feeds
from eagle_trt.runtime.backend import TorchTarget
from eagle_trt.runtime.onnxruntime_backend import OrtDrafter, OrtIteration, OrtTarget
from eagle_trt.runtime.sessions import make_session

from conftest import capturing, chain_feed, on_graph, rel_l2, two_call

SHAPE = TreeShape(depth=3, top_k=2, total_tokens=5)


@pytest.fixture(scope="module")
def int4_graphs(tiny_target, tiny_drafter, tmp_path_factory):
    captured = capturing(tiny_target, tiny_drafter)
    models = Models(captured, tiny_drafter, "drafters/mine", None)
    folder = tmp_path_factory.mktemp("int4")
    paths = export_pipeline(models, SHAPE, folder, log=None, only=("target_int4", "drafter_tree"))
    paths.update(export_pipeline(models, SHAPE, folder, log=None, only=("iteration",),
                                 target_graph=paths["target_int4"]))
    return captured, paths


def test_every_weight_matmul_of_the_int4_target_reads_4_bit_blocks(int4_graphs):
    _, paths = int4_graphs
    source = onnx.load(str(paths["target"]))
    inits = {t.name for t in source.graph.initializer}
    producer = {o: n for n in source.graph.node for o in n.output}
    weight_matmuls = [n for n in source.graph.node if n.op_type == "MatMul" and (
        n.input[1] in inits or (n.input[1] in producer and producer[n.input[1]].op_type == "Transpose"
                                and producer[n.input[1]].input[0] in inits))]
    int4 = onnx.load(str(paths["target_int4"]))
    nbits = [n for n in int4.graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == len(weight_matmuls) > 0                 # the tied lm_head too
    assert {a.name: onnx.helper.get_attribute_value(a) for a in nbits[0].attribute}["bits"] == 4
    assert not any(n.op_type == "MatMul" and n.input[1] in {t.name for t in int4.graph.initializer}
                   for n in int4.graph.node)
    assert paths["target_int4"].stat().st_size < 0.5 * paths["target"].stat().st_size


def test_speculative_decoding_on_the_int4_target_equals_its_own_greedy_decoding(int4_graphs, tiny_target, tiny_drafter):
    captured, paths = int4_graphs
    max_context = tiny_target.config.max_position_embeddings
    target = OrtTarget(paths["target_int4"], max_context)
    drafter = OrtDrafter(paths["drafter_tree"], SHAPE)
    iteration = OrtIteration(paths["iteration"], target, drafter)
    accepted, differs = [], 0
    for seed in range(4):
        prompt = torch.randint(3, tiny_target.config.vocab_size, (7 + 9 * seed,),
                               generator=torch.Generator().manual_seed(seed)).tolist()
        plain = two_call(target).generate(prompt, 30)
        for loop in (two_call(target, drafter), on_graph(iteration)):
            out = loop.generate(prompt, 30)
            assert out.tokens == plain.tokens
            accepted += out.accept_lengths
        differs += plain.tokens != two_call(TorchTarget(captured.model)).generate(prompt, 30).tokens
    assert max(accepted) >= 2, "no draft was ever accepted: the check would be vacuous"
    assert iteration.graph_calls > 0
    print(f"int4 target: greedy output differs from the float model's on {differs} of 4 prompts")


def test_int4_logits_lie_near_the_float_graphs(int4_graphs, tiny_target):
    """How far 4-bit weights move the logits of a prefill: off the float graph's, but related (a
    broken graph lies ~1.4 away: unrelated logits). The tiny model's random weights quantize badly
    (0.5 here); SmolLM2's logits move 0.13 (docs/benchmarks.md)."""
    import onnxruntime as ort

    from eagle_trt.models.target import causal_mask
    _, paths = int4_graphs
    cfg = tiny_target.config
    ids = list(range(3, 40))
    T = len(ids)
    feeds = {"input_ids": np.array([ids]), "position_ids": np.arange(T)[None],
             "attention_mask": causal_mask(T, 0).numpy(), "logits_index": np.arange(T)}
    for i in range(cfg.num_hidden_layers):
        for kind in ("key", "value"):
            feeds[f"past_{kind}_{i}"] = np.zeros((1, cfg.num_key_value_heads, 0, cfg.head_dim), np.float32)
    logits = [ort.InferenceSession(str(paths[g]), providers=["CPUExecutionProvider"]).run(["logits"], feeds)[0]
              for g in ("target", "target_int4")]
    err = rel_l2(torch.from_numpy(logits[1]), torch.from_numpy(logits[0]))
    print(f"int4 target: prefill logits rel L2 {err:.3e} from the float graph's")
    assert 1e-4 < err < 0.9


@pytest.mark.slow
def test_int4_logits_of_one_call_equal_those_of_one_row_calls(smollm2_onnx_dir, smollm2, tmp_path):
    """Verification scores a tree's rows in one call, plain decoding one row a call: on the same
    graph their logits must agree to float rounding, or speculative output is not the graph's own
    greedy output. SmolLM2's 4-bit target (MatMulNBits' int8-activation kernels fail this, 0.94
    apart: export/cpu_int4.py)."""
    import onnxruntime as ort

    from eagle_trt.export.cpu_int4 import quantize_int4
    from eagle_trt.models.target import causal_mask
    quantize_int4(smollm2_onnx_dir / "target.onnx", tmp_path / "target.int4.onnx")
    cfg = smollm2.config
    L = cfg.num_hidden_layers
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    session = ort.InferenceSession(str(tmp_path / "target.int4.onnx"), so, providers=["CPUExecutionProvider"])

    def call(tokens, start, past):
        T = len(tokens)
        feeds = {"input_ids": np.array([tokens]), "position_ids": np.arange(start, start + T)[None],
                 "attention_mask": causal_mask(T, start).numpy(), "logits_index": np.arange(T)}
        for i in range(L):
            feeds[f"past_key_{i}"], feeds[f"past_value_{i}"] = past[i]
        out = session.run(["logits"] + [f"new_{k}_{i}" for k in ("key", "value") for i in range(L)], feeds)
        return out[0][0], [(np.concatenate([past[i][0], out[1 + i]], 2), np.concatenate([past[i][1], out[1 + L + i]], 2))
                           for i in range(L)]
    ids = list(range(200, 240))
    empty = [(np.zeros((1, cfg.num_key_value_heads, 0, cfg.head_dim), np.float32),) * 2 for _ in range(L)]
    _, past = call(ids[:30], 0, empty)
    block, _ = call(ids[30:35], 30, past)
    rows = []
    for j in range(5):
        logits, past = call([ids[30 + j]], 30 + j, past)
        rows.append(logits[0])
    assert np.abs(block - np.stack(rows)).max() <= 1e-3


def test_the_int4_target_with_fused_attention_decodes_as_the_int4_graph(int4_graphs, tiny_target, tiny_drafter,
                                                                      tmp_path):
    """The 4-bit target rewritten with ONNX Runtime's fused attention (export/cpu_attention.py):
    its greedy decoding equals the 4-bit portable graph's, and speculative decoding on it (two
    calls, iteration graph) its own."""
    captured, paths = int4_graphs
    models = Models(captured, tiny_drafter, "drafters/mine", None)
    folder = paths["target_int4"].parent
    fused = export_pipeline(models, SHAPE, folder, log=None, only=("target_int4_fused",))["target_int4_fused"]
    iteration = export_pipeline(models, SHAPE, tmp_path, log=None, only=("iteration",), target_graph=fused)["iteration"]
    model = onnx.load(str(fused), load_external_data=False)
    assert {"MatMulNBits", "GroupQueryAttention"} <= {n.op_type for n in model.graph.node}
    # q / k / v and gate / up packed (their blocks, scales and zero points stacked): bit-identical
    layers = tiny_target.config.num_hidden_layers
    separate = tmp_path / "separate.onnx"
    fuse_attention(paths["target_int4"], separate, tiny_target.config, pack=False)
    nbits = [sum(n.op_type == "MatMulNBits" for n in onnx.load(str(g), load_external_data=False).graph.node)
             for g in (separate, fused)]
    assert nbits[0] - nbits[1] == 3 * layers
    a, b = make_session(separate, 1), make_session(fused, 1)
    # a chain of 4 new rows after 9 random past rows, in the fused graph's layout
    feed = fused_feeds(chain_feed(tiny_target.config, 1, 4, 9, np.random.default_rng(0)))
    np.testing.assert_array_equal(a.run(["logits"], feed)[0], b.run(["logits"], feed)[0])
    max_context = tiny_target.config.max_position_embeddings
    portable, target = OrtTarget(paths["target_int4"], max_context), OrtTarget(fused, max_context)
    drafter = OrtDrafter(paths["drafter_tree"], SHAPE)
    for seed in range(3):
        prompt = torch.randint(3, tiny_target.config.vocab_size, (7 + 9 * seed,),
                               generator=torch.Generator().manual_seed(seed)).tolist()
        plain = two_call(target).generate(prompt, 30)
        assert plain.tokens == two_call(portable).generate(prompt, 30).tokens
        for loop in (two_call(target, drafter), on_graph(OrtIteration(iteration, target, drafter))):
            assert loop.generate(prompt, 30).tokens == plain.tokens
