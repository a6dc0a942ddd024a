"""fold_shapes (export/shape_folding.py): the traced views' run-time shape arithmetic made
constant. The exported graphs of every target family and of the drafter tree compute exactly
what the same graphs traced without the pass compute, at sizes other than the traced ones (an
empty past, batches, one and several new tokens); no Reshape in them computes its target at
run time; and where the symbolic sizes do not prove a target, it is left as it was."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import eagle_trt.export.onnx_export as onnx_export
from eagle_trt.checkpoints import load_target, random_drafter
from eagle_trt.config import TreeShape
from eagle_trt.export import export_drafter_tree, export_target
from eagle_trt.export.shape_folding import fold_shapes

from conftest import chain_feed, write_tiny_hf_target

SHAPE = TreeShape(depth=3, top_k=3, total_tokens=8)
SIZES = [(1, 1, 0), (2, 3, 7), (1, 6, 1), (3, 1, 4)]     # (batch, new tokens, past tokens)
FAMILIES = {"llama": {}, "mistral": {"sliding_window": 4}, "qwen3": {}, "smollm3": {"no_rope_layers": [1, 1, 0, 1]}}


def session(path) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def both(export, tmp_path, monkeypatch, name: str):
    """The graph exported as it is, and exported with fold_shapes switched off."""
    folded = export(tmp_path / f"{name}.onnx").path
    monkeypatch.setattr(onnx_export, "fold_shapes", lambda graph, **facts: None)
    traced = export(tmp_path / f"{name}.traced.onnx").path
    monkeypatch.undo()
    return folded, traced


def computed_reshapes(path) -> list[str]:
    """Reshapes whose target a node computes (not an initializer or a Constant)."""
    m = onnx.load(str(path), load_external_data=False)
    constant = {i.name for i in m.graph.initializer} | {o for n in m.graph.node if n.op_type == "Constant"
                                                        for o in n.output}
    return [n.name for n in m.graph.node if n.op_type == "Reshape" and n.input[1] not in constant]


def assert_same_outputs(folded, traced, feeds_list):
    a, b = session(folded), session(traced)
    assert [o.name for o in a.get_outputs()] == [o.name for o in b.get_outputs()]
    for feeds in feeds_list:
        for o, x, y in zip(a.get_outputs(), a.run(None, feeds), b.run(None, feeds)):
            assert x.shape == y.shape, (o.name, feeds_shapes(feeds))
            if np.issubdtype(x.dtype, np.floating):
                np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5, err_msg=o.name)
            else:
                assert np.array_equal(x, y), (o.name, feeds_shapes(feeds))


def feeds_shapes(feeds):
    return {k: v.shape for k, v in feeds.items() if k in ("input_ids", "captured")}


@pytest.mark.parametrize("family", FAMILIES)
def test_target_graph_folded_equals_traced_at_other_sizes(family, tmp_path, monkeypatch):
    folder = write_tiny_hf_target(tmp_path / family, layers=4, family=family, extra=FAMILIES[family], seed=3)
    model = load_target(folder).model
    folded, traced = both(lambda p: export_target(model, p), tmp_path, monkeypatch, "target")
    assert computed_reshapes(traced), "the traced graph computes its views' sizes (what the pass removes)"
    assert computed_reshapes(folded) == []
    nodes = [len(onnx.load(str(p), load_external_data=False).graph.node) for p in (folded, traced)]
    assert nodes[0] < 0.75 * nodes[1], nodes
    gen = np.random.default_rng(0)
    assert_same_outputs(folded, traced, [chain_feed(model.cfg, B, T, P, gen) for B, T, P in SIZES])


def test_drafter_tree_graph_folded_equals_traced_at_other_sizes(tiny_target, tmp_path, monkeypatch):
    drafter = random_drafter(tiny_target, "eagle3.1", seed=4, draft_vocab_size=48)
    folded, traced = both(lambda p: export_drafter_tree(drafter, SHAPE, p), tmp_path, monkeypatch, "tree")
    assert computed_reshapes(folded) == []
    c = drafter.cfg
    gen = np.random.default_rng(1)
    feeds_list = []
    for B, T, P in SIZES:
        feeds_list.append({
            "captured": gen.standard_normal((B, T, c.num_aux_hidden_states * c.target_hidden_size), dtype=np.float32),
            "input_ids": gen.integers(3, c.vocab_size, (B, T)),
            "past_key": gen.standard_normal((B, c.num_key_value_heads, P, c.head_dim), dtype=np.float32),
            "past_value": gen.standard_normal((B, c.num_key_value_heads, P, c.head_dim), dtype=np.float32),
            "past_lengths": np.array([P - (b % 2 if P else 0) for b in range(B)]),
            "new_lengths": np.array([T - (b % 2 if T > 1 else 0) for b in range(B)])})
    assert_same_outputs(folded, traced, feeds_list)


def _graph(nodes, inputs, outputs, inits=()):
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)


def _view(x_dims, sizes):
    """x [*x_dims] reshaped to Concat(sizes): an int is a constant, (axis, times) is
    x.shape[axis] * times computed at run time (Shape / Gather / Mul / Unsqueeze, as traced)."""
    nodes, parts, inits = [helper.make_node("Shape", ["x"], ["s"])], [], \
        [helper.make_tensor("zero", TensorProto.INT64, [1], [0])]
    for k, size in enumerate(sizes):
        if isinstance(size, int):
            inits.append(helper.make_tensor(f"u{k}", TensorProto.INT64, [1], [size]))
        else:
            axis, times = size
            inits += [helper.make_tensor(f"axis{k}", TensorProto.INT64, [], [axis]),
                      helper.make_tensor(f"times{k}", TensorProto.INT64, [], [times])]
            nodes += [helper.make_node("Gather", ["s", f"axis{k}"], [f"g{k}"], axis=0),
                      helper.make_node("Mul", [f"g{k}", f"times{k}"], [f"m{k}"]),
                      helper.make_node("Unsqueeze", [f"m{k}", "zero"], [f"u{k}"])]
        parts.append(f"u{k}")
    nodes += [helper.make_node("Concat", parts, ["target"], axis=0),
              helper.make_node("Reshape", ["x", "target"], ["y"], name="view")]
    return _graph(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_dims)],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)


def _run(model, x):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def test_a_provable_view_is_folded_and_an_unprovable_one_is_left():
    # [batch, past, 6] viewed as [batch, past, 2, 3]: sizes copied (0), nothing left to compute
    m = _view(["batch", "past_tokens", 6], [(0, 1), (1, 1), 2, 3])
    report = fold_shapes(m, positive=("batch",))
    assert report.reshapes == 1 and report.kept == []
    assert [n.op_type for n in m.graph.node] == ["Reshape"]
    for past in (0, 3):
        x = np.random.rand(2, past, 6).astype(np.float32)
        assert np.array_equal(_run(m, x), x.reshape(2, past, 2, 3))
    # [batch, past * 2, 3]: the middle size would be -1, but past may be 0, where a computed 0
    # means "copy the input's size" and -1 would not: left computed
    m = _view(["batch", "past_tokens", 6], [(0, 1), (1, 2), 3])
    report = fold_shapes(m, positive=("batch",))
    assert report.reshapes == 0 and report.kept == ["view"]
    for past in (0, 3):
        x = np.random.rand(2, past, 6).astype(np.float32)
        assert _run(m, x).shape == (2, past * 2 if past else past, 3)
    # the same with a past that is never empty: folded to [0, -1, 3]
    m = _view(["batch", "past_tokens", 6], [(0, 1), (1, 2), 3])
    assert fold_shapes(m, positive=("batch", "past_tokens")).reshapes == 1
    x = np.random.rand(2, 3, 6).astype(np.float32)
    assert np.array_equal(_run(m, x), x.reshape(2, 6, 3))
    # a size the pass cannot derive (NonZero's count) stays a run-time size
    nodes = [helper.make_node("NonZero", ["x"], ["nz"]), helper.make_node("Shape", ["nz"], ["s"]),
             helper.make_node("Gather", ["s", "one"], ["n"], axis=0),
             helper.make_node("Unsqueeze", ["n", "zero"], ["un"]),
             helper.make_node("Concat", ["un", "minus1"], ["target"], axis=0),
             helper.make_node("Cast", ["nz"], ["nzf"], to=TensorProto.FLOAT),
             helper.make_node("Reshape", ["nzf", "target"], ["y"], name="view")]
    m = _graph(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
               [helper.make_tensor("one", TensorProto.INT64, [], [1]),
                helper.make_tensor("zero", TensorProto.INT64, [1], [0]),
                helper.make_tensor("minus1", TensorProto.INT64, [1], [-1])])
    report = fold_shapes(m)
    assert report.reshapes == 0 and report.kept == ["view"]
    assert _run(m, np.array([0, 1, 2, 0], np.float32)).shape == (2, 1)


def test_graph_ab_times_graphs_and_their_weight_matmuls(tiny_graphs, tmp_path, capsys):
    """scripts/graph_ab.py on a tiny target graph: a timing line per graph and token count and a
    distance line per graph, the --floor graph holding exactly the target's weight MatMuls (the
    tied head included) and running; a fused-attention graph beside the portable one is fed its
    own layout (more cache rows) and lies within the fp32 floor of it."""
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("graph_ab", Path(__file__).parents[1] / "scripts" / "graph_ab.py")
    graph_ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(graph_ab)
    target = tiny_graphs[2]["target"]
    assert graph_ab.main([str(target), "--floor", "--tokens", "1,3", "--rounds", "1", "--threads", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    timing, distance = [x for x in lines if "median" in x], [x for x in lines if "max abs difference" in x]
    assert len(timing) == 4 and sum("weight MatMuls only" in line for line in timing) == 2, lines
    assert len(distance) == 2 and all(x.endswith("0.00e+00") for x in distance), lines
    from eagle_trt.export.cpu_attention import fuse_attention
    fuse_attention(target, tmp_path / "fused.onnx", tiny_graphs[0].config)
    context = tiny_graphs[0].config.max_position_embeddings // 2      # positions the model has
    assert graph_ab.main([str(target), str(tmp_path / "fused.onnx"), "--tokens", "1,3", "--rounds", "1",
                          "--threads", "1", "--context", str(context)]) == 0
    fused = [x for x in capsys.readouterr().out.splitlines() if "max abs difference" in x and "fused.onnx" in x]
    assert len(fused) == 2 and all(float(x.rsplit(" ", 1)[1]) < 1e-3 for x in fused), fused
    m = onnx.load(str(target), load_external_data=False)
    weights = {i.name for i in m.graph.initializer} | {n.output[0] for n in m.graph.node if n.op_type == "Transpose"
                                                       and n.input[0] in {i.name for i in m.graph.initializer}}
    floor = onnx.load(str(graph_ab.matmul_floor(target, tmp_path)), load_external_data=False)
    assert [n.input[1] for n in floor.graph.node] == [n.input[1] for n in m.graph.node
                                                      if n.op_type == "MatMul" and n.input[1] in weights]
    assert graph_ab.main([str(tmp_path / "missing.onnx")]) == 2


def test_one_computed_target_read_by_two_reshapes_becomes_two_constants():
    """Concat(batch, 6) reshapes x [batch, 2, 3] (batch copied: [0, 6]) and y [6, batch] (batch
    inferred: [-1, 6]): two constants of their own, both graph outputs still right."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Gather", ["s", "i0"], ["b"], axis=0),
             helper.make_node("Unsqueeze", ["b", "zero"], ["ub"]),
             helper.make_node("Concat", ["ub", "six"], ["target"], axis=0),
             helper.make_node("Reshape", ["x", "target"], ["x2"], name="view_x"),
             helper.make_node("Reshape", ["y", "target"], ["y2"], name="view_y")]
    m = _graph(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 2, 3]),
                       helper.make_tensor_value_info("y", TensorProto.FLOAT, [6, "batch"])],
               [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", 6]) for n in ("x2", "y2")],
               [helper.make_tensor("i0", TensorProto.INT64, [], [0]),
                helper.make_tensor("zero", TensorProto.INT64, [1], [0]),
                helper.make_tensor("six", TensorProto.INT64, [1], [6])])
    report = fold_shapes(m, positive=("batch",))
    assert report.reshapes == 2 and [n.op_type for n in m.graph.node] == ["Reshape", "Reshape"]
    names = [i.name for i in m.graph.initializer]
    assert len(names) == len(set(names))
    onnx.checker.check_model(m)
    inits = {i.name: onnx.numpy_helper.to_array(i).tolist() for i in m.graph.initializer}
    targets = {n.name: inits[n.input[1]] for n in m.graph.node}
    assert targets == {"view_x": [0, 6], "view_y": [-1, 6]}
    x, y = np.random.rand(4, 2, 3).astype(np.float32), np.random.rand(6, 4).astype(np.float32)
    got = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x, "y": y})
    assert np.array_equal(got[0], x.reshape(4, 6)) and np.array_equal(got[1], y.reshape(4, 6))
