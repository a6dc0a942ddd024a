"""python -m eagle_trt.build on a tiny Llama target (with a real tokenizer) and a random EAGLE 3.1
drafter, FP8 target: every stage for real except engines (no TensorRT here), the stage cache,
resuming after kill -9, corrupt artifacts, the manifest and the Triton repository files."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from test_build_support import tiny_config, write_config, write_tiny_target

from eagle_trt.build import STAGES, BuildConfigError, build, config_from_dict
from eagle_trt.build.store import sha256_file

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def statuses(manifest) -> dict[str, str]:
    return {s["name"]: s["status"] for s in manifest.data["stages"]}


def leftovers(out: Path) -> list[str]:
    names = [p.name for p in out.iterdir()] + [p.name for p in (out / ".stages").iterdir()]
    return [n for n in names if n.startswith((".tmp-", ".old-")) or n.endswith(".tmp")]


def tensorrt_here() -> bool:
    from eagle_trt.build.engines import tensorrt_status
    return tensorrt_status()[0] is not None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("build_tiny")
    target = write_tiny_target(folder / "target")
    data = tiny_config(target, precision={"target": {"format": "fp8", "base": "fp32"}})
    out = folder / "out"
    manifest = build(config_from_dict(data, "tiny.yaml"), out, log=None)
    return {"folder": folder, "target": target, "data": data, "out": out, "manifest": manifest}


def copy_build(tiny, tmp_path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(tiny["out"], out)
    return out


def test_every_stage_runs_and_the_manifest_lists_every_artifact(tiny):
    m = tiny["manifest"]
    expected = {"validate": "ran", "export": "ran", "quantize": "ran", "parity": "ran", "triton": "ran",
                "engines": "ran" if tensorrt_here() else "skipped"}
    assert statuses(m) == expected
    assert m.data["status"] == "ok"
    assert set(m.data["versions"]) >= {"python", "torch", "onnx", "onnxruntime", "transformers", "tensorrt"}
    paths = {a["path"] for a in m.data["artifacts"]}
    assert {"export/target.onnx", "export/drafter_tree.onnx", "quantize/target.fp8.onnx",
            "quantize/target.amax.json", "parity/report.json", "parity/bundles/target.inputs.json",
            "parity/bundles/target.reference.json",
            "parity/bundles/target.fp8.reference.json", "triton/eagle_trt/config.pbtxt",
            "triton/eagle_trt/1/model.py", "triton/eagle_trt/1/graphs/target.fp8.onnx",
            "triton/eagle_trt/1/graphs/drafter_tree.int8.onnx"} <= paths
    on_disk = {str(p.relative_to(tiny["out"])) for p in tiny["out"].rglob("*") if p.is_file()
               and not p.relative_to(tiny["out"]).parts[0].startswith(".") and p.name != "manifest.json"}
    assert on_disk == paths, "the manifest must list exactly the files the build wrote"
    for a in m.data["artifacts"]:
        assert sha256_file(tiny["out"] / a["path"]) == a["sha256"], a["path"]
    for graph in ("export/target.onnx", "export/drafter_tree.onnx", "quantize/target.fp8.onnx"):
        onnx.checker.check_model(str(tiny["out"] / graph))
    # ONNX Runtime serves the drafter with int8 weights (serving.drafter_weights: auto, fp32 drafter)
    served = onnx.load(str(tiny["out"] / "triton/eagle_trt/1/graphs/drafter_tree.int8.onnx"))
    assert sum(n.op_type == "MatMulInteger" for n in served.graph.node) > 0
    assert not (tiny["out"] / "triton/eagle_trt/1/graphs/drafter_tree.onnx").exists()
    from eagle_trt.build.triton import served_graphs    # what make demo times
    assert served_graphs(tiny["out"] / "triton", "eagle_trt") == {   # and the two composed (FP8 included)
        "target": tiny["out"] / "triton/eagle_trt/1/graphs/target.fp8.onnx",
        "drafter_tree": tiny["out"] / "triton/eagle_trt/1/graphs/drafter_tree.int8.onnx",
        "iteration": tiny["out"] / "triton/eagle_trt/1/graphs/iteration.onnx"}
    report = json.loads((tiny["out"] / "parity/report.json").read_text())
    assert report["passed"] and report["quantized"]["target"]["layers"] > 0
    target = next(g for g in report["graphs"] if g["name"] == "target")    # greedy acceptance inside the target graph
    accept = [o for o in target["outputs"] if o["output"].startswith("accept_")]
    assert len(accept) == 3 and all(o["exact"] and o["passed"] for o in accept)
    assert any(label.startswith("real tree verification") for label in target["inputs"])


@pytest.mark.skipif(tensorrt_here(), reason="TensorRT and a GPU are present: the engines stage runs")
def test_engines_stage_is_skipped_with_its_reason_here(tiny):
    engines = next(s for s in tiny["manifest"].data["stages"] if s["name"] == "engines")
    assert engines["status"] == "skipped"
    assert "TensorRT is not installed" in engines["reason"] or "GPU" in engines["reason"]
    assert not (tiny["out"] / "engines").exists()


def test_second_run_is_all_cached_and_rewrites_nothing(tiny, tmp_path):
    out = copy_build(tiny, tmp_path)
    mtimes = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and p.name != "manifest.json"}
    m = build(config_from_dict(tiny["data"], "tiny.yaml"), out, log=None)
    assert set(statuses(m).values()) <= {"cached", "skipped"}
    assert statuses(m)["export"] == "cached"
    assert {p: p.stat().st_mtime_ns for p in mtimes} == mtimes


def test_a_stage_made_by_changed_code_is_made_again(tiny, tmp_path, monkeypatch):
    """The stage keys hold the hash of the code that makes each stage (codehash.py): here taken
    from a copy of the package in which one constant of the quantizer's rewrite changed, so the
    quantize stage runs again (and what reads its graphs, where they changed), the rest is cached."""
    import eagle_trt.build.pipeline as pipeline
    from eagle_trt.codehash import code_digest
    from test_codehash import edit, package_copy
    out = copy_build(tiny, tmp_path)
    root = package_copy(tmp_path / "src")
    monkeypatch.setattr(pipeline, "code_digest", lambda *modules: code_digest(*modules, root=root))
    m = build(config_from_dict(tiny["data"], "tiny.yaml"), out, log=None)
    assert set(statuses(m).values()) <= {"cached", "skipped"}, "an unchanged copy of the code keeps every stage"
    edit(root, "quant/onnx_qdq.py", "from __future__ import annotations", "from __future__ import annotations\nX = 1")
    code_digest.cache_clear()
    m = build(config_from_dict(tiny["data"], "tiny.yaml"), out, log=None)
    ran = {n for n, s in statuses(m).items() if s == "ran"}
    assert "quantize" in ran and not {"validate", "export"} & ran, statuses(m)


def test_a_target_rewritten_in_place_is_exported_again(tmp_path):
    """Same folder, same config, other weights (a checkpoint retrained or re-downloaded into its
    folder): the validate stage's record of the checkpoint's content changes, so the graphs are
    exported again instead of taken from the cache."""
    target = write_tiny_target(tmp_path / "target", seed=1)
    data = tiny_config(target, parity={"enabled": False}, outputs={"triton": False})
    first = build(config_from_dict(data, "tiny.yaml"), tmp_path / "out", stages=["validate", "export"], log=None)
    graph = sha256_file(first.artifact("export/target.onnx"))
    write_tiny_target(tmp_path / "target", seed=2)
    again = build(config_from_dict(data, "tiny.yaml"), tmp_path / "out", stages=["validate", "export"], log=None)
    assert statuses(again)["export"] == "ran"
    assert sha256_file(again.artifact("export/target.onnx")) != graph


@pytest.mark.parametrize("change, reran", [
    ({"serving": {"max_tokens": 5}}, {"triton"}),
    ({"serving": {"drafter_weights": "float"}}, {"triton"}),
    ({"serving": {"iteration_graph": "off"}}, {"triton"}),
    ({"precision": {"target": {"format": "fp32"}}, "serving": {"iteration_graph": "on"}}, {"parity", "triton"}),
    ({"parity": {"prompts": 2}}, {"parity"}),
    ({"calibration": {"prompts": 3}}, {"quantize", "parity", "triton"}),
    ({"tree": {"depth": 2}}, {"validate", "export", "quantize", "parity", "triton"}),
])
def test_a_changed_section_reruns_only_the_stages_that_depend_on_it(tiny, tmp_path, change, reran):
    out = copy_build(tiny, tmp_path)
    data = json.loads(json.dumps(tiny["data"]))
    for key, value in change.items():
        data[key].update(value)
    m = build(config_from_dict(data, "tiny.yaml"), out, log=None)
    ran = {n for n, s in statuses(m).items() if s == "ran"}
    assert ran == reran
    assert all(s in ("cached", "skipped") for n, s in statuses(m).items() if n not in reran)
    if "triton" in reran and "serving" in change:
        settings = json.loads((out / "triton/eagle_trt/1/eagle.json").read_text())
        assert settings["max_tokens"] == data["serving"]["max_tokens"]
        float_drafter = change["serving"].get("drafter_weights") == "float"
        assert settings["graphs"]["drafter_tree"] == ("graphs/drafter_tree.onnx" if float_drafter
                                                      else "graphs/drafter_tree.int8.onnx")
        assert settings["precision"]["drafter_tree"] == ("float" if float_drafter else "int8")
        # the served graphs composed into one unless serving.iteration_graph is off (FP8 ones too)
        assert ("iteration" in settings["graphs"]) == (change["serving"].get("iteration_graph") != "off")
        # with an fp32 target the parity stage checked that composition against PyTorch, leaving
        # its bundle, not the graph (a quantized target's graphs are checked apart)
        fp32 = change.get("precision", {}).get("target", {}).get("format") == "fp32"
        report = json.loads((out / "parity/report.json").read_text())
        assert ("iteration" in {g["name"] for g in report["graphs"]}) == fp32 and report["passed"]
        assert (out / "parity/bundles/iteration.reference.json").exists() == fp32
        assert not (out / "parity/iteration").exists()


def test_device_keys_calibration_and_parity_by_the_device_it_resolves_to(tiny, tmp_path):
    """`device: cpu` where `auto` means the CPU reruns nothing; where auto means CUDA, the
    calibration and parity (and what reads them) rerun on the CPU."""
    out = copy_build(tiny, tmp_path)
    m = build(config_from_dict(dict(tiny["data"], device="cpu"), "tiny.yaml"), out, log=None)
    reran = {n for n, s in statuses(m).items() if s == "ran"}
    assert reran == ({"quantize", "parity", "triton"} if torch.cuda.is_available() else set())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on machines without a CUDA device")
def test_device_cuda_without_a_gpu_stops_before_any_stage_runs(tiny, tmp_path):
    cfg = write_config(tmp_path / "tiny.yaml", dict(tiny["data"], device="cuda"))
    done = run_cli("--config", str(cfg), "--output", str(tmp_path / "out"))
    assert_one_line_error(done, "tiny.yaml: device:", "PyTorch sees no CUDA device")
    assert not (tmp_path / "out" / "validate").exists()


def run_cli(*args, env=None, **kwargs):
    return subprocess.run([sys.executable, "-m", "eagle_trt.build", *args], capture_output=True, text=True,
                          check=False, env=env or ENV, cwd=ROOT, timeout=600, **kwargs)


def assert_one_line_error(done, *fragments):
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and all(f in last for f in fragments), last


def test_corrupt_graph_is_named_with_exit_2_and_a_full_run_rebuilds_it(tiny, tmp_path):
    out = copy_build(tiny, tmp_path)
    cfg = write_config(tmp_path / "tiny.yaml", tiny["data"])
    graph = out / "export" / "target.onnx"
    graph.write_bytes(graph.read_bytes()[: graph.stat().st_size // 2])   # truncated, as by a full disk
    done = run_cli("--config", str(cfg), "--output", str(out), "--stages", "parity", "--quiet")
    assert_one_line_error(done, "export/target.onnx changed since the export stage wrote it",
                          "stage 'parity' needs the export stage")
    m = build(config_from_dict(tiny["data"], "tiny.yaml"), out, log=None)
    assert statuses(m)["export"] == "ran"
    onnx.checker.check_model(str(graph))
    assert sha256_file(graph) == sha256_file(tiny["out"] / "export/target.onnx"), "export is deterministic"


def test_stage_that_needs_an_unbuilt_upstream_fails_with_exit_2(tiny, tmp_path):
    cfg = write_config(tmp_path / "tiny.yaml", tiny["data"])
    done = run_cli("--config", str(cfg), "--output", str(tmp_path / "fresh"), "--stages", "triton")
    assert_one_line_error(done, "stage 'triton' needs the export stage's artifacts", "not built")


@pytest.mark.skipif(tensorrt_here(), reason="TensorRT and a GPU are present")
def test_require_tensorrt_fails_here_with_the_reason(tiny, tmp_path):
    out = copy_build(tiny, tmp_path)
    cfg = write_config(tmp_path / "tiny.yaml", tiny["data"])
    done = run_cli("--config", str(cfg), "--output", str(out), "--require-tensorrt")
    assert_one_line_error(done, "--require-tensorrt: cannot build engines:", "TensorRT")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "failed" and "--require-tensorrt" in manifest["error"]


@pytest.mark.parametrize("stage", ["export", "parity"])
def test_kill_9_in_the_middle_of_a_stage_then_rerun_resumes(tiny, tmp_path, stage):
    """kill -9 while the stage writes into its temp folder; the rerun removes the leftovers,
    keeps the stages that finished, completes, and every artifact matches its recorded hash."""
    cfg = write_config(tmp_path / "tiny.yaml", tiny["data"])
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "eagle_trt.build", "--config", str(cfg), "--output", str(out)],
                            env=ENV, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    try:
        while not (out.is_dir() and any(p.name.startswith(f".tmp-{stage}-") for p in out.iterdir())):
            assert proc.poll() is None, "the build finished before it could be interrupted"
            assert time.monotonic() < deadline, f"the {stage} stage never started"
            time.sleep(0.01)
        time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not (out / stage).exists() and not (out / ".stages" / f"{stage}.json").exists()
    assert leftovers(out), "the kill should have left the stage's temp folder behind"
    done = run_cli("--config", str(cfg), "--output", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "removed leftovers of an interrupted build" in done.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    status = {s["name"]: s["status"] for s in manifest["stages"]}
    assert status[stage] == "ran" and status["validate"] == "cached"
    if stage == "parity":
        assert status["export"] == status["quantize"] == "cached", "finished stages must not be redone"
    assert leftovers(out) == []
    for a in manifest["artifacts"]:
        assert sha256_file(out / a["path"]) == a["sha256"], a["path"]
    onnx.checker.check_model(str(out / "export/target.onnx"))


def test_capture_ids_that_contradict_the_checkpoint_are_rejected(tiny, tmp_path):
    """The drafter says layer_output [1, 2, 3] (streams 2, 3, 4); the same numbers read as
    layer_input name other tensors: the off-by-one the two conventions invite."""
    from eagle_trt.checkpoints import load_target, random_drafter, save_drafter
    from eagle_trt.config import CaptureLayers
    target = load_target(tiny["target"])
    d = random_drafter(target, "eagle3.1", draft_vocab_size=48)
    d.cfg.capture = CaptureLayers((1, 2, 3), "layer_output")
    drafter = save_drafter(d, tmp_path / "drafter")
    data = dict(tiny["data"], drafter={"source": str(drafter)})
    wrong = dict(data, target={"source": str(tiny["target"]), "capture": {"convention": "layer_input",
                                                                          "layer_ids": [1, 2, 3]}})
    with pytest.raises(BuildConfigError) as err:
        build(config_from_dict(wrong, "tiny.yaml"), tmp_path / "out", stages=["validate"], log=None)
    assert "tiny.yaml: target.capture.layer_ids: [1, 2, 3] (layer_input) names residual streams [1, 2, 3]" in str(err.value)
    assert "[1, 2, 3] (layer_output) = streams [2, 3, 4]" in str(err.value)
    right = dict(data, target={"source": str(tiny["target"]), "capture": {"convention": "layer_input",
                                                                          "layer_ids": [2, 3, 4]}})
    build(config_from_dict(right, "tiny.yaml"), tmp_path / "out", stages=["validate"], log=None)
    resolved = json.loads((tmp_path / "out/validate/resolved.json").read_text())
    assert resolved["capture"]["streams"] == [2, 3, 4] and resolved["capture"]["source"] == "config"


def test_profile_shapes_follow_the_graphs_named_axes(tiny):
    from eagle_trt.build.engines import input_dims, profile_shapes
    cfg = config_from_dict(tiny["data"])
    dims = input_dims(tiny["out"] / "export/target.onnx")
    verify = profile_shapes(dims, cfg.engines.profiles.verify, "target.onnx")
    p = cfg.engines.profiles.verify
    assert verify["input_ids"] == ((1, p.min_tokens), (1, p.opt_tokens), (1, p.max_tokens))
    assert verify["attention_mask"][2] == (1, p.max_tokens, p.max_tokens + p.max_past)
    assert verify["past_key_0"][0] == (1, 2, p.min_past, 16) and verify["past_key_5"][2] == (1, 2, p.max_past, 16)
    assert verify["logits_index"] == ((1,), (p.opt_tokens,), (p.max_tokens,))
    drafter = profile_shapes(input_dims(tiny["out"] / "export/drafter_tree.onnx"), cfg.engines.profiles.drafter, "d")
    assert drafter["captured"][2] == (1, cfg.engines.profiles.drafter.max_tokens, 3 * 64)


def test_triton_configs_parse_as_triton_model_configs(tiny):
    from conftest import require_serving
    require_serving()
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    from eagle_trt.build.triton import plan_model_config
    text = (tiny["out"] / "triton/eagle_trt/config.pbtxt").read_text()
    cfg = text_format.Parse(text, model_config_pb2.ModelConfig())
    assert cfg.backend == "python" and cfg.model_transaction_policy.decoupled
    assert {i.name for i in cfg.input if i.optional} == {i.name for i in cfg.input}
    assert [(o.name, model_config_pb2.DataType.Name(o.data_type)) for o in cfg.output] == \
        [("text_output", "TYPE_STRING"), ("token_ids", "TYPE_INT64"), ("accepted", "TYPE_INT32"),
         ("finish_reason", "TYPE_STRING")]
    assert "stop_token_ids" in {i.name for i in cfg.input}
    plan = text_format.Parse(plan_model_config("t", tiny["out"] / "export/target.onnx", [0, 1]),
                             model_config_pb2.ModelConfig())
    assert plan.platform == "tensorrt_plan" and list(plan.instance_group[0].profile) == ["0", "1"]
    assert len(plan.input) == 4 + 2 * 6 and plan.input[2].data_type == model_config_pb2.TYPE_BOOL


def test_stage_list_is_checked(tiny, tmp_path):
    from eagle_trt.build import BuildError
    with pytest.raises(BuildError, match="unknown stage"):
        build(config_from_dict(tiny["data"]), tmp_path / "o", stages=["exprt"], log=None)
    assert STAGES[0] == "validate" and dataclasses.is_dataclass(config_from_dict({}))


def test_the_loop_streams_exactly_the_final_tokens_and_stops_when_told(tiny):
    """DecodingLoop.generate(on_tokens=...), which the Triton model streams through, on the
    built graphs: the streamed pieces concatenate to the result, and returning False stops."""
    from eagle_trt.runtime.loop import DecodingLoop
    from eagle_trt.runtime.ort_engines import open_backends
    cfg = config_from_dict(tiny["data"])
    graphs = {g: tiny["out"] / f"export/{g}.onnx" for g in ("target", "drafter_tree")}
    decoder = DecodingLoop(open_backends(graphs, cfg.tree.shape, 512, threads=1).engine(), [])
    pieces = []
    result = decoder.generate(list(range(4, 20)), 24, on_tokens=pieces.append)
    assert [t for p in pieces for t in p] == result.tokens and len(result.tokens) == 24 and len(pieces) > 1
    seen = []
    stopped = decoder.generate(list(range(4, 20)), 24, on_tokens=lambda ids: seen.append(ids) or len(seen) < 3)
    assert stopped.stop_reason == "cancelled" and len(seen) == 3
    assert stopped.tokens == [t for p in seen for t in p] == result.tokens[: len(stopped.tokens)]


@pytest.mark.skipif(tensorrt_here(), reason="TensorRT is installed")
def test_tensorrt_backend_says_what_is_missing_when_imported_here():
    import importlib
    spec_missing = importlib.util.find_spec("tensorrt") is None
    with pytest.raises(ImportError, match="needs TensorRT 10.x" if spec_missing else "."):
        importlib.import_module("eagle_trt.runtime.tensorrt_backend")


def test_external_data_is_one_named_file_per_graph_and_the_repository_travels(tiny, tmp_path, monkeypatch):
    """With the external-data threshold at 0 every graph keeps its weights outside: exactly one
    `<graph>.data` per graph, shared by none, linked into the Triton repository and checked there;
    a copy of the repository loads elsewhere; a deleted or truncated weights file is named."""
    from eagle_trt.export.graph_files import GraphFileError, check_graph_files, graph_files
    from eagle_trt.runtime.sessions import fp8_session
    monkeypatch.setenv("EAGLE_TRT_EXTERNAL_DATA_BYTES", "0")
    out = tmp_path / "out"
    build(config_from_dict(tiny["data"], "tiny.yaml"), out, log=None)
    graphs = sorted(p for p in out.rglob("*.onnx") if "triton" not in p.parts)
    assert {p.name for p in graphs} >= {"target.onnx", "drafter_tree.onnx", "target.fp8.onnx"}
    seen: dict[Path, Path] = {}
    for graph in graphs:
        files = graph_files(graph)
        assert [f.name for f in files] == [graph.name, graph.name + ".data"], files
        for f in files[1:]:
            assert f not in seen, f"{f} is read by {graph} and {seen[f]}"
            seen[f] = graph
    export_files = {p.name for p in (out / "export").iterdir()}
    assert export_files == {"target.onnx", "target.onnx.data", "drafter_tree.onnx", "drafter_tree.onnx.data"}, \
        export_files
    served = json.loads((out / "triton/eagle_trt/1/eagle.json").read_text())["graphs"]
    moved = tmp_path / "elsewhere" / "triton"
    shutil.copytree(out / "triton", moved)
    shutil.rmtree(out / "triton")
    for rel in served.values():
        graph = moved / "eagle_trt/1" / rel
        check_graph_files(graph)
        fp8_session(graph, 1)        # loads with its weights (the FP8 settings also run float graphs)
    data = moved / "eagle_trt/1" / served["target"]
    data = data.with_name(data.name + ".data")
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(GraphFileError, match=f"{data}.*has 100 bytes"):
        check_graph_files(data.with_name(data.name[:-5]))
    data.unlink()
    with pytest.raises(GraphFileError, match=f"{data} is missing"):
        check_graph_files(data.with_name(data.name[:-5]))
    weights = out / "export" / "target.onnx.data"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    done = run_cli("--config", str(write_config(tmp_path / "tiny.yaml", tiny["data"])), "--output", str(out),
                   "--stages", "parity", "--quiet", env=dict(ENV, EAGLE_TRT_EXTERNAL_DATA_BYTES="0"))
    assert_one_line_error(done, "export/target.onnx.data changed since the export stage wrote it")


def test_float16_graphs_with_external_weights_are_checked_without_float32_copies(tmp_path, monkeypatch):
    """An FP8 target on an fp16 base with every weight outside its graph: parity runs the float16
    graph with its weights fed as memory maps of the data file (ONNX Runtime would otherwise
    hold float32 copies of float16 initializers), gets what ONNX Runtime's own loading gets, and
    the build passes."""
    import onnxruntime as ort
    from polygraphy.json import load_json

    from eagle_trt.parity import WeightsFed, parity_session
    from test_build_support import tiny_config, write_tiny_target
    monkeypatch.setenv("EAGLE_TRT_EXTERNAL_DATA_BYTES", "0")
    data = tiny_config(write_tiny_target(tmp_path / "t"), precision={"target": {"format": "fp8", "base": "fp16"},
                                                                     "drafter": {"format": "fp16"}})
    out = tmp_path / "out"
    assert build(config_from_dict(data, "tiny.yaml"), out, log=None).data["status"] == "ok"
    assert json.loads((out / "parity" / "report.json").read_text())["passed"]
    graph = out / "export" / "target.onnx"
    fed = parity_session(graph, "float16")
    assert isinstance(fed, WeightsFed) and len(fed.weights) > 10
    assert all(isinstance(w, np.memmap) and w.dtype == np.float16 for w in fed.weights.values())
    assert not {i.name for i in fed.get_inputs()} & set(fed.weights)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    plain = ort.InferenceSession(str(graph), so, providers=["CPUExecutionProvider"])
    feed = load_json(str(out / "parity" / "bundles" / "target.inputs.json"))[1]
    for a, b in zip(fed.run(None, feed), plain.run(None, feed)):
        np.testing.assert_array_equal(a, b)
