"""The drafter-tree graph with int8 weights (export/cpu_int8.py): every weight MatMul of every
tree level reads int8, the graph is re-made only when its source graph changes, and speculative
decoding with it on ONNX Runtime stays token-identical to the target's own greedy output."""
from __future__ import annotations

import onnx
import torch

from eagle_trt.api import Models
from eagle_trt.checkpoints import random_drafter
from eagle_trt.config import TreeShape
from eagle_trt.export import export_pipeline
from eagle_trt.export.cpu_int8 import fold_weight_aliases
from eagle_trt.runtime.backend import TorchTarget
from eagle_trt.runtime.onnxruntime_backend import OrtDrafter, OrtTarget

from conftest import capturing, on_graph, two_call

SHAPE = TreeShape(depth=3, top_k=2, total_tokens=5)


def _weight_matmuls(model: onnx.ModelProto) -> int:
    initializers = {t.name for t in model.graph.initializer}
    return sum(n.op_type == "MatMul" and n.input[1] in initializers for n in model.graph.node)


def test_int8_drafter_graph_quantizes_every_level_and_stays_lossless(tiny_target, tiny_drafter, tmp_path):
    captured = capturing(tiny_target, tiny_drafter)
    models = Models(captured, tiny_drafter, "drafters/mine", None)
    paths = export_pipeline(models, SHAPE, tmp_path, log=None, only=("target", "drafter_tree_int8"))
    assert set(paths) == {"target", "drafter_tree", "drafter_tree_int8"}

    source = onnx.load(str(paths["drafter_tree"]))
    fold_weight_aliases(source)      # graphs before format 6 read later levels' weights through Identity
    weight_matmuls = _weight_matmuls(source)          # every level's linears
    shared = {n.input[1] for n in source.graph.node if n.op_type == "MatMul"} & {t.name for t in source.graph.initializer}
    assert weight_matmuls > len(shared)               # the tree's levels read the same initializers
    int8 = onnx.load(str(paths["drafter_tree_int8"]))
    assert _weight_matmuls(int8) == 0
    assert sum(n.op_type == "MatMulInteger" for n in int8.graph.node) == weight_matmuls
    int8_weights = {t.name for t in int8.graph.initializer if t.data_type == onnx.TensorProto.INT8}
    assert all(n.input[1] in int8_weights for n in int8.graph.node if n.op_type == "MatMulInteger")

    target = OrtTarget(paths["target"], tiny_target.config.max_position_embeddings)
    ort_int8 = OrtDrafter(paths["drafter_tree_int8"], SHAPE)
    accepted = []
    for seed in range(3):
        prompt = torch.randint(3, tiny_target.config.vocab_size, (7 + 9 * seed,),
                               generator=torch.Generator().manual_seed(seed)).tolist()
        ref = two_call(TorchTarget(captured.model)).generate(prompt, 30)
        out = two_call(target, ort_int8).generate(prompt, 30)
        assert out.tokens == ref.tokens
        accepted += out.accept_lengths
    assert max(accepted) >= 2, "no int8 draft was ever accepted: the check would be vacuous"

    stamps = {n: p.stat().st_mtime_ns for n, p in paths.items()}
    export_pipeline(models, SHAPE, tmp_path, log=None, only=("drafter_tree_int8",))
    assert paths["drafter_tree_int8"].stat().st_mtime_ns == stamps["drafter_tree_int8"]     # current: kept
    retrained = Models(captured, random_drafter(tiny_target, "eagle3.1", seed=5, draft_vocab_size=48),
                       "drafters/mine", None)
    export_pipeline(retrained, SHAPE, tmp_path, log=None, only=("drafter_tree_int8",))
    assert paths["drafter_tree_int8"].stat().st_mtime_ns != stamps["drafter_tree_int8"]
    assert paths["target"].stat().st_mtime_ns == stamps["target"]


def test_iteration_graph_of_the_int8_drafter_is_composed_kept_and_remade(tiny_target, tiny_drafter, tmp_path,
                                                                        monkeypatch):
    """export_pipeline's `iteration_int8`: the int8 drafter graph composed with a target graph
    from another folder (as bench keeps them), whose weights lie in a data file: that file is
    hard-linked beside the iteration graph, not copied, and the drafter's weights are read from
    its own data file beside it (the glue's few tensors stay in the graph). Decoding with one call an iteration equals the
    target's own greedy output. The graph is kept while its inputs are current, and composed
    again when the drafter is retrained or the target graph is exported anew."""
    from eagle_trt.export import export_target
    from eagle_trt.export.graph_files import graph_files
    from eagle_trt.runtime.onnxruntime_backend import OrtIteration
    monkeypatch.setenv("EAGLE_TRT_EXTERNAL_DATA_BYTES", "0")          # every graph with a data file
    captured = capturing(tiny_target, tiny_drafter)
    models = Models(captured, tiny_drafter, "drafters/mine", None)
    target_graph = export_pipeline(models, SHAPE, tmp_path / "target", log=None, only=("target",))["target"]
    trees = tmp_path / "trees"
    paths = export_pipeline(models, SHAPE, trees, log=None, only=("iteration_int8",), target_graph=target_graph)
    assert set(paths) == {"drafter_tree", "drafter_tree_int8", "iteration_int8"}    # no second target graph
    graph = paths["iteration_int8"]
    shared, drafter_data = trees / "target.onnx.data", trees / "drafter_tree_int8.onnx.data"
    assert graph_files(graph) == [graph, drafter_data, shared]        # both graphs' weights files, no third
    assert shared.samefile(target_graph.with_name("target.onnx.data"))              # a link, no copy
    ops = [n.op_type for n in onnx.load(str(graph), load_external_data=False).graph.node]
    assert "MatMulInteger" in ops and "GatherElements" in ops                     # int8 drafter, glue

    target = OrtTarget(target_graph, tiny_target.config.max_position_embeddings)
    ort_int8 = OrtDrafter(paths["drafter_tree_int8"], SHAPE)
    iteration = OrtIteration(graph, target, ort_int8)
    accepted = []
    for seed in range(3):
        prompt = torch.randint(3, tiny_target.config.vocab_size, (7 + 9 * seed,),
                               generator=torch.Generator().manual_seed(seed)).tolist()
        ref = two_call(TorchTarget(captured.model)).generate(prompt, 30)
        out = on_graph(iteration).generate(prompt, 30)
        assert out.tokens == ref.tokens
        accepted += out.accept_lengths
    assert max(accepted) >= 2 and iteration.graph_calls > 0

    def stamp():
        return graph.stat().st_mtime_ns
    before = stamp()
    export_pipeline(models, SHAPE, trees, log=None, only=("iteration_int8",), target_graph=target_graph)
    assert stamp() == before                                                        # current: kept
    export_target(captured.model, target_graph)                                  # the target graph anew
    export_pipeline(models, SHAPE, trees, log=None, only=("iteration_int8",), target_graph=target_graph)
    assert stamp() != before
    before = stamp()
    retrained = Models(captured, random_drafter(tiny_target, "eagle3.1", seed=5, draft_vocab_size=48),
                       "drafters/mine", None)
    export_pipeline(retrained, SHAPE, trees, log=None, only=("iteration_int8",), target_graph=target_graph)
    assert stamp() != before


def _int8_graph(path) -> tuple[list, dict]:
    """A graph's nodes (sorted: the two writers order independent nodes differently) and its
    initializers as arrays, read wherever they lie."""
    from eagle_trt.export.graph_files import read_array
    model = onnx.load(str(path), load_external_data=False)
    nodes = sorted((n.op_type, n.name, tuple(n.input), tuple(n.output),
                    tuple(sorted((a.name, str(onnx.helper.get_attribute_value(a))) for a in n.attribute)))
                   for n in model.graph.node)
    return nodes, {t.name: read_array(t, path.parent) for t in model.graph.initializer}


def test_streamed_int8_equals_onnxruntime_quantizer_bit_for_bit(tiny_target, tiny_drafter, tmp_path, monkeypatch):
    """quantize_int8 reads and writes one weight at a time (a 70B-wide drafter graph does not fit
    in memory twice, which ONNX Runtime's quantizer needs); its graph is the quantizer's: the
    same nodes and every tensor bit for bit, with the weights inside the graph and in a data file."""
    import numpy as np
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from eagle_trt.export.cpu_int8 import quantize_int8
    captured = capturing(tiny_target, tiny_drafter)
    models = Models(captured, tiny_drafter, "drafters/mine", None)
    for threshold in (None, "0"):                  # inside the protobuf; every weight in a data file
        if threshold is not None:
            monkeypatch.setenv("EAGLE_TRT_EXTERNAL_DATA_BYTES", threshold)
        out = tmp_path / f"data-{threshold}"
        src = export_pipeline(models, SHAPE, out, log=None, only=("drafter_tree",))["drafter_tree"]
        folded = onnx.load(str(src))
        fold_weight_aliases(folded)
        onnx.save(folded, str(out / "folded.onnx"))
        quantize_dynamic(out / "folded.onnx", out / "reference.onnx", weight_type=QuantType.QInt8,
                         per_channel=True, op_types_to_quantize=["MatMul"])
        counts = quantize_int8(src, out / "streamed.onnx")
        assert (out / "streamed.onnx.data").exists() == (threshold is not None)
        ref_nodes, ref_weights = _int8_graph(out / "reference.onnx")
        nodes, weights = _int8_graph(out / "streamed.onnx")
        assert nodes == ref_nodes
        assert counts["int8_matmuls"] == sum(n[0] == "MatMulInteger" for n in nodes) > 0
        assert sorted(weights) == sorted(ref_weights)
        for name, ref in ref_weights.items():
            assert weights[name].dtype == ref.dtype and np.array_equal(weights[name], ref), name
        assert any(n.endswith("_quantized") and w.dtype == np.int8 and w.ndim == 2 for n, w in weights.items())
