"""`precision.target.format: int4` through `python -m eagle_trt.build` on a tiny target: the
quantize stage makes the 4-bit MatMulNBits target (no calibration), parity reports its distance
from the float model, the engines stage says why TensorRT takes no part, and the Triton
repository serves it, composed with the drafter into its iteration graph; speculative decoding
on the served graphs equals their own greedy decoding. Settings it cannot serve are refused."""
from __future__ import annotations

import json

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


def test_speculative_decoding_on_the_served_int4_graphs_equals_their_greedy_decoding(int4_build):
    from eagle_trt.build.triton import served_graphs
    from eagle_trt.config import TreeShape
    from eagle_trt.runtime.loop import DecodingLoop
    from eagle_trt.runtime.ort_engines import open_backends
    from eagle_trt.runtime.two_call import TwoCallEngine
    graphs = served_graphs(int4_build["out"] / "triton", "eagle_trt")
    settings = json.loads((int4_build["out"] / "triton/eagle_trt/1/eagle.json").read_text())
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
    # the build's untrained fallback drafter rarely guesses right on this target; accepted drafts on
    # an int4 target are checked in test_cpu_int4.py
    assert opened.iteration.graph_calls > 0 and len(accepted) > 10


@pytest.mark.parametrize("precision, serving, message", [
    ({"drafter": {"format": "int4"}}, {}, "precision.drafter.format: int4 is a target format"),
    ({"target": {"format": "int4"}}, {"runtime": "torch"}, "int4 runs on ONNX Runtime only"),
])
def test_int4_where_it_cannot_run_is_refused(tmp_path, precision, serving, message):
    data = tiny_config(tmp_path / "t", precision=precision, serving=serving)
    with pytest.raises(BuildConfigError, match=message):
        config_from_dict(data, "tiny.yaml")
