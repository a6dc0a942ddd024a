"""`precision.target.format: int4` through `python -m eagle_trt.build` on a tiny target: the
quantize stage makes the 4-bit MatMulNBits target (no calibration), parity reports its distance
from the float model, the engines stage says why TensorRT takes no part, and the Triton
repository serves it, composed with the drafter into its iteration graph; speculative decoding
on the served graphs equals their own greedy decoding. Settings it cannot serve are refused."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_build_support import tiny_config, write_tiny_target

from eagle_trt.build import BuildConfigError, build, config_from_dict


@pytest.fixture(scope="module")
def int4_build(tmp_path_factory):
    folder = tmp_path_factory.mktemp("build_int4")
    target = write_tiny_target(folder / "target")
    data = tiny_config(target, precision={"target": {"format": "int4"}})
    out = folder / "out"
    manifest = build(config_from_dict(data, "tiny.yaml"), out, log=None)
    return {"target": target, "data": data, "out": out, "manifest": manifest}


def test_every_stage_runs_and_the_repository_serves_the_int4_target(int4_build):
    out = int4_build["out"]
    stages = {s["name"]: s for s in int4_build["manifest"].data["stages"]}
    assert {n: s["status"] for n, s in stages.items()} == {"validate": "ran", "export": "ran", "quantize": "ran",
                                                          "parity": "ran", "engines": "skipped", "triton": "ran"}
    assert "int4" in stages["engines"]["reason"] and "MatMulNBits" in stages["engines"]["reason"]
    assert not (out / "quantize" / "target.amax.json").exists()          # weight-only: nothing calibrated
    report = json.loads((out / "parity" / "report.json").read_text())
    entry = report["quantized"]["target"]
    assert report["passed"] and entry["format"] == "int4" and entry["passed"]
    assert 0 < entry["worst_rel_l2"] < entry["tolerance"] and 0 < entry["argmax_agreement"] <= 1
    settings = json.loads((out / "triton/eagle_trt/1/eagle.json").read_text())
    assert settings["graphs"]["target"] == "graphs/target.int4.onnx" and settings["precision"]["target"] == "int4"
    assert settings["graphs"]["iteration"] == "graphs/iteration.onnx"


def check_served_speculative_equals_greedy(repository: Path) -> None:
    """Speculative decoding on a repository's served graphs (its iteration graph) equals their own
    greedy decoding on random prompts. The build's untrained fallback drafter rarely guesses right
    on this target; accepted drafts on an int4 target are checked in test_cpu_int4.py."""
    from eagle_trt.build.triton import served_graphs
    from eagle_trt.config import TreeShape
    from eagle_trt.runtime.loop import DecodingLoop
    from eagle_trt.runtime.ort_engines import open_backends
    from eagle_trt.runtime.two_call import TwoCallEngine
    graphs = served_graphs(repository, "eagle_trt")
    settings = json.loads((repository / "eagle_trt/1/eagle.json").read_text())
    shape = TreeShape(*settings["tree"])
    opened = open_backends(graphs, shape, settings["max_context"], threads=1, precision=settings["precision"])
    assert opened.iteration is not None
    accepted = []
    for seed in range(3):
        prompt = torch.randint(3, settings["vocab_size"], (5 + 8 * seed,),
                               generator=torch.Generator().manual_seed(seed)).tolist()
        plain = DecodingLoop(TwoCallEngine(opened.target), (), settings["vocab_size"]).generate(prompt, 24)
        spec = DecodingLoop(opened.engine(), (), settings["vocab_size"]).generate(prompt, 24)
        assert spec.tokens == plain.tokens
        accepted += spec.accept_lengths
    assert opened.iteration.graph_calls > 0 and len(accepted) > 10


def test_speculative_decoding_on_the_served_int4_graphs_equals_their_greedy_decoding(int4_build):
    check_served_speculative_equals_greedy(int4_build["out"] / "triton")


@pytest.fixture(scope="module")
def int4_fused_build(tmp_path_factory):
    """One stream and a chain tree: the build serves the fused 4-bit graph (int8 activations)."""
    folder = tmp_path_factory.mktemp("build_int4_fused")
    data = tiny_config(write_tiny_target(folder / "target"), precision={"target": {"format": "int4"}},
                       tree={"depth": 3, "top_k": 1, "total_tokens": 3}, serving={"max_concurrent": 1})
    out = folder / "out"
    build(config_from_dict(data, "tiny.yaml"), out, log=None)
    return out


def test_one_stream_with_a_chain_tree_serves_the_fused_int4_graph_lossless(int4_build, int4_fused_build):
    """serving.attention auto, an int4 target, one stream, a chain tree: the repository serves the
    fused 4-bit graph with int8 activations (its metadata says chains), parity reports its own
    distance from the float model beside the portable 4-bit graph's, and speculative decoding on
    the served graphs equals their own greedy decoding. The branching-tree build beside it keeps
    the portable 4-bit graph."""
    import onnx

    from eagle_trt.build.triton import served_graphs
    from eagle_trt.graph_names import LOSSLESS_TREES
    out = int4_fused_build
    settings = json.loads((out / "triton/eagle_trt/1/eagle.json").read_text())
    assert settings["graphs"]["target"] == "graphs/target.int4.fused.onnx" and settings["precision"]["target"] == "int4"
    graphs = served_graphs(out / "triton", "eagle_trt")
    meta = {e.key: e.value for e in onnx.load(str(graphs["target"]), load_external_data=False).metadata_props}
    assert meta[LOSSLESS_TREES] == "chains"
    assert any(n.op_type == "MatMulNBits" for n in onnx.load(str(graphs["target"]), load_external_data=False).graph.node)
    report = json.loads((out / "parity" / "report.json").read_text())
    portable, fused = report["quantized"]["target"], report["quantized"]["target_fused"]
    assert report["passed"] and fused["passed"] and fused["graph"] == "target.int4.fused.onnx"
    assert 0 < fused["worst_rel_l2"] < fused["tolerance"] and 0 < fused["argmax_agreement"] <= 1
    assert fused["worst_rel_l2"] != portable["worst_rel_l2"]        # its own rounding, measured on its own
    other = json.loads((int4_build["out"] / "triton/eagle_trt/1/eagle.json").read_text())
    assert other["graphs"]["target"] == "graphs/target.int4.onnx"
    check_served_speculative_equals_greedy(out / "triton")


@pytest.mark.parametrize("precision, serving, tree, message", [
    ({"drafter": {"format": "int4"}}, {}, {}, "precision.drafter.format: int4 is a target format"),
    ({"target": {"format": "int4"}}, {"runtime": "torch"}, {}, "int4 runs on ONNX Runtime only"),
    ({"target": {"format": "int4"}}, {"attention": "fused", "max_concurrent": 1}, {},
     "lossless for chain trees only: tree.top_k 1"),
])
def test_int4_where_it_cannot_run_is_refused(tmp_path, precision, serving, tree, message):
    data = tiny_config(tmp_path / "t", precision=precision, serving=serving, tree=tree)
    with pytest.raises(BuildConfigError, match=message):
        config_from_dict(data, "tiny.yaml")
