"""The target read part by part from its checkpoint files (models/streamed.py, tensor_files.py):
the same outputs as the loaded model, bit for bit, and bad checkpoint files named."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from conftest import share, write_tiny_hf_target

from eagle_trt.checkpoints import CheckpointError, load_target
from eagle_trt.models.streamed import StreamedTarget, TargetCall
from eagle_trt.models.target import causal_mask
from eagle_trt.tensor_files import TensorFiles



@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A tiny Llama in several safetensors shards with an index, as transformers writes large models."""
    import transformers
    folder = tmp_path_factory.mktemp("sharded")
    write_tiny_hf_target(folder / "single", layers=3)
    model = transformers.LlamaForCausalLM.from_pretrained(str(folder / "single"))
    model.save_pretrained(str(folder / "target"), max_shard_size="40KB")
    assert (folder / "target" / "model.safetensors.index.json").is_file()
    return folder / "target"


def calls_for(cfg, gen) -> list[TargetCall]:
    """A prefill, and a tree-like call after a past of 4 rows with a hole in its mask."""
    shape = (1, cfg.num_key_value_heads, 0, cfg.head_dim)
    empty = [torch.zeros(shape) for _ in range(cfg.num_hidden_layers)]
    past = [torch.randn(1, cfg.num_key_value_heads, 4, cfg.head_dim, generator=gen) for _ in range(cfg.num_hidden_layers)]
    mask = causal_mask(3, 4).clone()
    mask[0, 2, 5] = False
    return [TargetCall(torch.randint(0, cfg.vocab_size, (1, 6), generator=gen), torch.arange(6)[None],
                       causal_mask(6, 0), empty, list(empty)),
            TargetCall(torch.randint(0, cfg.vocab_size, (1, 3), generator=gen), torch.arange(4, 7)[None], mask,
                       past, [p.flip(2) for p in past], torch.tensor([0, 2]))]


@pytest.mark.parametrize("tie,dtype", [(False, torch.float32), (True, torch.float32), (False, torch.float16)])
def test_part_by_part_outputs_are_the_loaded_models_bit_for_bit(tmp_path, tie, dtype):
    folder = write_tiny_hf_target(tmp_path / "t", layers=4, tie=tie)
    loaded = load_target(folder, dtype)
    streamed = StreamedTarget(folder, dtype)
    calls = calls_for(loaded.config, torch.Generator().manual_seed(0))
    for c in calls:
        c.past_k, c.past_v = [k.to(dtype) for k in c.past_k], [v.to(dtype) for v in c.past_v]
    got = streamed.forward_many(calls)
    for call, out in zip(calls, got):
        with torch.no_grad():
            want = loaded.model(call.input_ids, call.position_ids, call.attention_mask, call.past_k, call.past_v,
                                call.logits_index)
        assert torch.equal(out.logits, want.logits) and torch.equal(out.captured, want.captured)
        assert all(torch.equal(a, b) for a, b in zip(out.new_k + out.new_v, want.new_k + want.new_v))
    # nothing stays loaded: every parameter is on the meta device again
    assert all(p.is_meta for p in streamed.model.parameters())


def test_shards_are_read_through_the_index(sharded):
    files = TensorFiles(sharded)
    assert len({e.file for e in files.entries.values()}) > 1
    loaded, streamed = load_target(sharded), StreamedTarget(sharded)
    call = calls_for(loaded.config, torch.Generator().manual_seed(1))[0]
    with torch.no_grad():
        want = loaded.model(call.input_ids, call.position_ids, call.attention_mask, call.past_k, call.past_v)
    assert torch.equal(streamed.forward_many([call])[0].logits, want.logits)


def test_a_missing_shard_is_named(sharded, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(sharded, broken)
    shard = sorted(broken.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"{shard}: shard listed in model.safetensors.index.json is missing"):
        StreamedTarget(broken)


def test_a_truncated_shard_is_named_with_the_tensor_it_cuts(sharded, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(sharded, broken)
    shard = sorted(broken.glob("model-*.safetensors"))[0]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 10)
    with pytest.raises(CheckpointError, match=rf"{shard}: truncated: tensor '[\w.]+' needs bytes up to \d+, the file has"):
        StreamedTarget(broken)
    with open(shard, "r+b") as f:          # cut inside the header: not mistaken for an empty shard
        f.truncate(20)
    with pytest.raises(CheckpointError, match=f"{shard}: not a readable safetensors file"):
        TensorFiles(broken)


def test_a_tensor_missing_from_the_checkpoint_is_named_as_the_file_names_it(sharded, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(sharded, broken)
    index = broken / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    del data["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    index.write_text(json.dumps(data))
    # the shard still holds it: unexpected is fine for the reader; the target misses nothing it reads
    files = TensorFiles(broken)
    assert "model.layers.1.mlp.up_proj.weight" in files.entries
    shard = broken / json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"][
        "model.layers.1.mlp.up_proj.weight"]
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(shard))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(shard))
    with pytest.raises(CheckpointError, match=r"missing tensors \['model.layers.1.mlp.up_proj.weight'\]"):
        StreamedTarget(broken)


@pytest.mark.parametrize("tie", [False, True])
def test_the_graph_exported_from_the_files_is_the_one_exported_from_the_loaded_model(tmp_path, monkeypatch, tie):
    import onnx
    from onnx import numpy_helper
    from eagle_trt.export import export_target
    monkeypatch.setenv("EAGLE_TRT_EXTERNAL_DATA_BYTES", "20000")      # weights in a data file, as at 8B
    folder = write_tiny_hf_target(tmp_path / "t", layers=2, tie=tie)
    export_target(load_target(folder).model, tmp_path / "loaded" / "target.onnx", "float16")
    export_target(StreamedTarget(folder), tmp_path / "streamed" / "target.onnx", "float16")
    graphs = [onnx.load(str(tmp_path / d / "target.onnx")) for d in ("loaded", "streamed")]
    assert (tmp_path / "streamed" / "target.onnx.data").is_file()
    assert [n.op_type for n in graphs[0].graph.node] == [n.op_type for n in graphs[1].graph.node]
    weights = [{i.name: numpy_helper.to_array(i) for i in g.graph.initializer} for g in graphs]
    assert weights[0].keys() == weights[1].keys() and len(weights[0]) > 10
    assert all(weights[0][k].tobytes() == weights[1][k].tobytes() for k in weights[0])


@pytest.fixture(scope="module")
def pair(request, tmp_path_factory):
    """A tiny target loaded and read part by part, and a random drafter fitted to it."""
    from eagle_trt.checkpoints import random_drafter
    folder = write_tiny_hf_target(tmp_path_factory.mktemp("pair") / "t", layers=3)
    loaded = load_target(folder)
    drafter = random_drafter(loaded, "eagle3.1", draft_vocab_size=48)
    loaded.model.set_capture(drafter.cfg.capture_for(loaded.config))
    streamed = StreamedTarget(folder)
    streamed.set_capture(drafter.cfg.capture_for(loaded.config))
    share(request, loaded, "pair loaded")
    return loaded, streamed, drafter


def test_parity_references_part_by_part_are_the_loaded_models(pair, tmp_path):
    from eagle_trt.config import TreeShape
    from eagle_trt.parity import iteration_case, target_case
    loaded, streamed, drafter = pair
    shape = TreeShape(3, 2, 4)
    prompts = [list(range(3, 20)), list(range(30, 41))]
    cases = [target_case(m, tmp_path / "t.onnx", "float32", prompts, shape, drafter) for m in (loaded.model, streamed)]
    assert cases[0].labels == cases[1].labels and len(cases[0].labels) == 6
    for want, got in zip(cases[0].reference, cases[1].reference):
        assert want.keys() == got.keys() and all(np.array_equal(want[k], got[k]) for k in want)
    real = [(c, p[1:] + [int(c["logits"][0, -1].argmax())]) for c, p in zip(cases[0].reference[1::2], prompts)]
    its = [iteration_case(m, drafter, shape, tmp_path / "i.onnx", "float32", real) for m in (loaded.model, streamed)]
    for want, got in zip(its[0].reference, its[1].reference):
        assert want.keys() == got.keys() and all(np.array_equal(want[k], got[k]) for k in want)


def test_calibration_and_the_fake_quant_check_part_by_part_are_the_loaded_models(pair, tmp_path):
    from eagle_trt.config import TreeShape
    from eagle_trt.export import export_target
    from eagle_trt.parity import _target_feed, target_outputs
    from eagle_trt.quant import (LinearQuantizer, QuantConfig, calibrate_drafter, calibrate_target, layer_parity,
                                 linear_paths, quantize_onnx, quantized_copy)
    loaded, streamed, drafter = pair
    prompts = [list(range(3, 20)), list(range(30, 41))]
    amax = calibrate_target(loaded.model, prompts)
    parts = []
    assert calibrate_target(streamed, prompts, lambda: parts.append(1)) == amax
    assert len(parts) == 3 + 2          # embedding, each layer, the head
    shape = TreeShape(3, 2, 4)
    assert calibrate_drafter(drafter, streamed, prompts, shape) == calibrate_drafter(drafter, loaded.model, prompts, shape)

    cfg = QuantConfig("fp8")
    graph = tmp_path / "target.fp8.onnx"
    quantize_onnx(export_target(streamed, tmp_path / "target.onnx").path, graph, cfg, amax, linear_paths(loaded.model))
    reference, _ = quantized_copy(loaded.model, cfg, amax)
    fake_quant = streamed.with_dtype(torch.float32)
    fake_quant.fake_quant = LinearQuantizer(cfg, amax, "test")
    L = loaded.config.num_hidden_layers
    empty = [(torch.zeros(1, loaded.config.num_key_value_heads, 0, loaded.config.head_dim),) * 2] * L
    feed = _target_feed(torch.tensor([prompts[0]]), torch.arange(17)[None], causal_mask(17, 0), empty)
    want, got = (layer_parity(str(graph), r, feed) for r in (reference, fake_quant))
    assert [(r.node, r.module, r.rel_l2) for r in got] == [(r.node, r.module, r.rel_l2) for r in want]
    assert len(got) == 7 * L and max(r.rel_l2 for r in got) < 1e-4
    outs = [target_outputs(r, [feed])[0] for r in (reference, fake_quant)]
    assert all(np.array_equal(outs[0][k], outs[1][k]) for k in outs[0])
    assert all(p.is_meta for p in fake_quant.model.parameters())    # the QuantLinears went with their parts


def test_weights_fed_as_memory_maps_leave_no_pages_in_the_process_after_a_call(tmp_path):
    """An fp16 graph's weights fed from its data file: the same outputs as ONNX Runtime's own
    loading, and after the call the file's pages are no longer mapped into the process."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from eagle_trt.export.graph_files import DataFile
    from eagle_trt.parity import WeightsFed

    n, m = 1024, 16384      # a 32 MB float16 weight
    w = np.random.default_rng(0).standard_normal((n, m)).astype(np.float16)
    graph = tmp_path / "g.onnx"
    with DataFile(tmp_path / "g.onnx.data") as data:
        init = data.append(onnx.TensorProto(name="w", data_type=TensorProto.FLOAT16, dims=w.shape), [w.tobytes()])
    model = helper.make_model(helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [1, m])], [init]),
        opset_imports=[helper.make_opsetid("", 19)], ir_version=9)
    onnx.save(model, str(graph))
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    fed = WeightsFed(graph, so)
    x = {"x": np.ones((1, n), np.float16)}

    def mapped_kb() -> int:       # resident pages of the weights file mapped into this process
        total, inside = 0, False
        for line in open("/proc/self/smaps"):
            if "-" in line.split()[0] and len(line.split()) >= 5:
                inside = line.rstrip().endswith(str(tmp_path / "g.onnx.data"))
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
        return total
    got = fed.run(None, x)[0]
    plain = ort.InferenceSession(str(graph), so, providers=["CPUExecutionProvider"]).run(None, x)[0]
    np.testing.assert_array_equal(got, plain)
    assert mapped_kb() < 1024, f"{mapped_kb()} kB of the weights file still mapped after the call"


def test_weights_fed_reads_a_weights_file_with_several_hard_links(tmp_path):
    """A graph whose weights file is hard-linked elsewhere too (the Triton repository's graphs,
    or the iteration graph parity composes beside the drafter's): its integer tensors, which
    WeightsFed puts into the graph, are read although onnx's own loader refuses such a file."""
    import os

    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from eagle_trt.export.graph_files import DataFile
    from eagle_trt.parity import WeightsFed

    offsets = np.arange(512, dtype=np.int64)
    graph = tmp_path / "g.onnx"
    with DataFile(tmp_path / "g.onnx.data") as data:
        init = data.append(onnx.TensorProto(name="d2t", data_type=TensorProto.INT64, dims=offsets.shape),
                           [offsets.tobytes()])
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Add", ["x", "d2t"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.INT64, [512])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, [512])], [init]),
        opset_imports=[helper.make_opsetid("", 19)], ir_version=9)
    onnx.save(model, str(graph))
    os.link(tmp_path / "g.onnx.data", tmp_path / "elsewhere.data")
    x = {"x": np.full(512, 7, np.int64)}
    got = WeightsFed(graph, ort.SessionOptions()).run(None, x)[0]
    np.testing.assert_array_equal(got, offsets + 7)


@pytest.mark.parametrize("legacy", [False, True])
def test_a_pytorch_model_bin_target_is_read_part_by_part_too(tmp_path, legacy):
    """pytorch_model.bin (mapped by torch.load; the legacy pre-zip format read whole)."""
    from safetensors.torch import load_file
    folder = write_tiny_hf_target(tmp_path / "t", layers=2)
    torch.save(load_file(str(folder / "model.safetensors")), folder / "pytorch_model.bin",
               _use_new_zipfile_serialization=not legacy)
    (folder / "model.safetensors").unlink()
    loaded, streamed = load_target(folder), StreamedTarget(folder)
    call = calls_for(loaded.config, torch.Generator().manual_seed(2))[1]
    with torch.no_grad():
        want = loaded.model(call.input_ids, call.position_ids, call.attention_mask, call.past_k, call.past_v,
                            call.logits_index)
    assert torch.equal(streamed.forward_many([call])[0].logits, want.logits)
