"""The 4-bit weight-only target graph (export/cpu_int4.py, ONNX Runtime's MatMulNBits quantizer):
every weight MatMul, the tied lm_head included, reads 4-bit blocks; speculative decoding on it,
with two calls and with the iteration graph, is token-identical to that graph's own greedy
decoding; its logits lie near the float model's but not on them (the distance is reported)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from eagle_trt.api import Models
from eagle_trt.config import ConfigError, TreeShape
from eagle_trt.export import export_pipeline
from eagle_trt.export.cpu_attention import fuse_attention, fused_feeds
from eagle_trt.graph_names import LOSSLESS_TREES, PADS_ONE_ROW
from eagle_trt.runtime.backend import TorchTarget
from eagle_trt.runtime.loop import Request
from eagle_trt.runtime.onnxruntime_backend import OrtDrafter, OrtIteration, OrtTarget
from eagle_trt.runtime.ort_engines import open_backends
from eagle_trt.runtime.sessions import make_session

from conftest import (NEW_TOKENS, SOLO_PROMPTS, capturing, chain_feed, check_planted_greedy, on_graph, rel_l2,
                      two_call)

SHAPE = TreeShape(depth=3, top_k=2, total_tokens=5)
CHAIN = TreeShape.chain(3)


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


@pytest.fixture(scope="module")
def smollm2_int4(smollm2_onnx_dir, tmp_path_factory) -> Path:
    """SmolLM2's 4-bit target graph (float compute), made once for this module's slow tests."""
    from eagle_trt.export.cpu_int4 import quantize_int4
    path = tmp_path_factory.mktemp("smollm2_int4") / "target.int4.onnx"
    quantize_int4(smollm2_onnx_dir / "target.onnx", path)
    return path


@pytest.mark.slow
def test_int4_logits_of_one_call_equal_those_of_one_row_calls(smollm2_int4, smollm2):
    """Verification scores a tree's rows in one call, plain decoding one row a call: on the same
    graph their logits must agree to float rounding, or speculative output is not the graph's own
    greedy output. SmolLM2's 4-bit target (float compute; int8 activations need the fused graph's
    padding, the next test)."""
    import onnxruntime as ort

    from eagle_trt.models.target import causal_mask
    cfg = smollm2.config
    L = cfg.num_hidden_layers
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    session = ort.InferenceSession(str(smollm2_int4), so, providers=["CPUExecutionProvider"])

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


def chain_and_rows(session, feed: dict) -> tuple[np.ndarray, np.ndarray]:
    """A fused target graph's logits [T, V] for a chain feed (conftest.chain_feed, batch 1) in one
    call, and for the same tokens one row a call, each after the KV rows the calls before wrote."""
    names = [i.name for i in session.get_inputs() if i.name.startswith("past_")]
    outputs = ["logits"] + [n.replace("past_", "present_") for n in names]
    T = feed["input_ids"].shape[1]
    P = feed["attention_mask"].shape[2] - T
    chain = session.run(["logits"], fused_feeds(feed))[0][0]
    pasts, rows = {n: feed[n] for n in names}, []
    for j in range(T):
        one = {"input_ids": feed["input_ids"][:, j:j + 1], "position_ids": feed["position_ids"][:, j:j + 1],
               "attention_mask": np.ones((1, 1, P + j + 1), bool), "logits_index": np.arange(1), **pasts}
        got = session.run(outputs, fused_feeds(one))
        rows.append(got[0][0, 0])
        pasts = {n: present[:, :, :P + j + 1] for n, present in zip(names, got[1:])}
    return chain, np.stack(rows)


def test_the_fused_int4_target_computes_with_int8_activations_lossless_on_chains(int4_graphs, tiny_target,
                                                                               tiny_drafter, tmp_path):
    """The 4-bit target rewritten with ONNX Runtime's fused attention (export/cpu_attention.py):
    its MatMulNBits compute with int8 activations and its one-row calls are padded, so a chain
    call's rows are bit-identical to one-row calls, and speculative decoding on chains (two calls,
    iteration graph) equals the graph's own greedy decoding. A branching tree and a batch of
    plain steps are refused with the reason. Packing its projections changes no bit."""
    captured, paths = int4_graphs
    models = Models(captured, tiny_drafter, "drafters/mine", None)
    folder = paths["target_int4"].parent
    fused = export_pipeline(models, CHAIN, folder, log=None, only=("target_int4_fused",))["target_int4_fused"]
    chain_graphs = export_pipeline(models, CHAIN, tmp_path, log=None, only=("iteration",), target_graph=fused)
    model = onnx.load(str(fused), load_external_data=False)
    nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert "GroupQueryAttention" in {n.op_type for n in model.graph.node}
    assert all({a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}["accuracy_level"] == 4 for n in nbits)
    assert {e.key: e.value for e in model.metadata_props} == {PADS_ONE_ROW: "1", LOSSLESS_TREES: "chains"}
    # q / k / v and gate / up packed (their blocks, scales and zero points stacked): bit-identical
    cfg = tiny_target.config
    separate, packed = tmp_path / "separate.onnx", tmp_path / "packed.onnx"
    fuse_attention(paths["target_int4"], separate, cfg, pack=False)
    fuse_attention(paths["target_int4"], packed, cfg)
    counts = [sum(n.op_type == "MatMulNBits" for n in onnx.load(str(g), load_external_data=False).graph.node)
              for g in (separate, packed)]
    assert counts[0] - counts[1] == 3 * cfg.num_hidden_layers == counts[0] - len(nbits)
    feed = fused_feeds(chain_feed(cfg, 1, 4, 9, np.random.default_rng(0)))
    a, b = make_session(separate, 1), make_session(packed, 1)
    np.testing.assert_array_equal(a.run(["logits"], feed)[0], b.run(["logits"], feed)[0])
    # a chain of 4 new rows after 9 random past rows, in one call and one row a call
    chain, rows = chain_and_rows(make_session(fused, 1), chain_feed(cfg, 1, 4, 9, np.random.default_rng(1)))
    np.testing.assert_array_equal(chain, rows)
    max_context = cfg.max_position_embeddings
    target = OrtTarget(fused, max_context)
    assert target.pads_one_row and target.lossless_trees == "chains"
    drafter = OrtDrafter(chain_graphs["drafter_tree"], CHAIN)
    accepted = []
    for seed in range(3):
        prompt = torch.randint(3, cfg.vocab_size, (7 + 9 * seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        plain = two_call(target).generate(prompt, 30)
        for loop in (two_call(target, drafter), on_graph(OrtIteration(chain_graphs["iteration"], target, drafter))):
            out = loop.generate(prompt, 30)
            assert out.tokens == plain.tokens
            accepted += out.accept_lengths
    assert max(accepted) >= 2, "no draft was ever accepted: the check would be vacuous"
    with pytest.raises(ConfigError, match="chain trees only"):
        open_backends({"target": fused, "drafter_tree": paths["drafter_tree"]}, SHAPE, max_context)
    prompts = [list(range(3, 10)), list(range(5, 17))]
    with pytest.raises(ValueError, match="one padded to 2"):
        two_call(target).generate_batch([Request(p, 5) for p in prompts], max_batch=2)


@pytest.mark.slow
def test_smollm2_fused_int4_with_int8_activations_is_lossless_on_chains(smollm2, smollm2_int4, mtbench_ids,
                                                                       tmp_path):
    """SmolLM2's fused 4-bit target with int8 activations (the fast CPU graph, 9 of 10 MT-bench
    prompts diverging without its padding): a chain call's rows bit-identical to one-row calls,
    and speculative decoding with chains, deeply accepted through planted greedy paths,
    reproducing the graph's own greedy output on real prompts."""
    from eagle_trt.checkpoints import random_drafter
    from eagle_trt.export import export_drafter_tree
    fused = tmp_path / "target.int4.fused.onnx"
    fuse_attention(smollm2_int4, fused, smollm2.config, int8_activations=True)
    chain, rows = chain_and_rows(make_session(fused, 2), chain_feed(smollm2.config, 1, 5, 40, np.random.default_rng(0)))
    np.testing.assert_array_equal(chain, rows)
    shape = TreeShape.chain(5)
    drafter = random_drafter(smollm2, "eagle3.1", seed=1, draft_vocab_size=4096)
    tree_graph = export_drafter_tree(drafter, shape, tmp_path / "tree.onnx").path
    target = OrtTarget(fused, smollm2.config.max_position_embeddings, 2)
    eos = smollm2.config.eos_token_ids
    prompts = mtbench_ids[:SOLO_PROMPTS]
    greedy = [two_call(target, None, eos).generate(ids, NEW_TOKENS).tokens for ids in prompts]
    check_planted_greedy(target, OrtDrafter(tree_graph, shape, 2), prompts, greedy, eos)
