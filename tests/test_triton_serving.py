"""A real Triton server (the tritonserver 2.51 binary bundled in nvidia-pytriton, CPU, 127.0.0.1)
serving the repository that python -m eagle_trt.build writes for SmolLM2, over streaming gRPC:
streamed tokens equal the offline runtime's (same ONNX graphs, greedy), 16 concurrent streams
continuously batched, a client that disconnects mid-stream, and malformed requests that get
errors at once, even under load, while the server keeps serving."""
from __future__ import annotations

import queue
import threading
import time

import numpy as np
import pytest
import torch

from conftest import SERVING_NEW_TOKENS as NEW_TOKENS
from conftest import require_serving

require_serving()   # tritonclient and the bundled tritonserver: missing, the module fails naming it
import tritonclient.grpc as grpcclient  # noqa: E402

from eagle_trt.build.local_triton import LocalTriton  # noqa: E402

pytestmark = pytest.mark.slow
MODEL = "eagle_trt"


@pytest.fixture(scope="module")
def server(built):
    with LocalTriton(built[1].artifact("triton")) as s:
        yield s


def flat(pieces: list[list[int]]) -> list[int]:
    return [t for piece in pieces for t in piece]


def _input(name, array, dtype):
    t = grpcclient.InferInput(name, list(array.shape), dtype)
    t.set_data_from_numpy(array)
    return t


def text_request(prompt: str, max_tokens: int | None = NEW_TOKENS) -> list:
    inputs = [_input("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES")]
    if max_tokens is not None:
        inputs.append(_input("max_tokens", np.array([max_tokens], dtype=np.int32), "INT32"))
    return inputs


class Stream:
    """One gRPC stream; collect() gathers one request's responses until the final flag or an error."""

    def __init__(self, server: LocalTriton):
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.results: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.results.put((result, error)))

    def send(self, inputs, request_id: str = "r") -> None:
        self.client.async_stream_infer(MODEL, inputs, request_id=request_id, enable_empty_final_response=True)

    def collect(self, timeout: float = 120) -> tuple[list[list[int]], list[str], str | None]:
        ids, texts = [], []
        while True:
            result, error = self.results.get(timeout=timeout)
            if error is not None:
                return ids, texts, str(error)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return ids, texts, None
            ids.append(result.as_numpy("token_ids").tolist())
            texts.append(result.as_numpy("text_output")[0].decode())

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def assert_still_serving(server, offline) -> None:
    """A fresh well-formed request after trouble gets its full offline output."""
    again = Stream(server)
    try:
        again.send(text_request(offline["prompts"][0]))
        pieces, _, error = again.collect()
        assert error is None and flat(pieces) == offline["tokens"][0]
    finally:
        again.close()


def test_streamed_tokens_equal_the_offline_runtime(server, offline):
    stream = Stream(server)
    try:
        for prompt, expected in list(zip(offline["prompts"], offline["tokens"]))[:2]:
            stream.send(text_request(prompt))
            pieces, texts, error = stream.collect()
            assert error is None
            assert len(pieces) > 1, "tokens must arrive as a stream, not one final blob"
            assert flat(pieces) == expected
            assert "".join(texts) == offline["tokenizer"].decode(expected, skip_special_tokens=True)
        # The same request by token ids (the chat-rendered prompt) gives the same tokens.
        stream.send([_input("input_ids", np.array(offline["ids"][0], dtype=np.int64), "INT64")])
        pieces, _, error = stream.collect()
        assert error is None and flat(pieces) == offline["tokens"][0]
    finally:
        stream.close()


BAD_UNDER_LOAD = {
    "invalid UTF-8": (lambda: [_input("text_input", np.array([b"caf\xc3 \xff"], dtype=np.object_), "BYTES")],
                      "not valid UTF-8"),
    "out-of-range id": (lambda: [_input("input_ids", np.array([5, 10**7], dtype=np.int64), "INT64")],
                        "outside the vocabulary"),
    "no prompt": (lambda: [_input("max_tokens", np.array([8], dtype=np.int32), "INT32")], "exactly one of text_input"),
    "beyond context": (lambda: text_request("Hi", max_tokens=10**6), "exceeds the target's context"),
}


def test_sixteen_concurrent_streams_with_a_cancel_and_bad_requests(server, offline):
    """16 streaming clients at once (8 decode in the running batch, 8 wait for a slot), mixed
    prompts and max_tokens; one cancels mid-stream; malformed requests sent under that load are
    refused without waiting for a batch slot: before the ninth stream finishes (a request queued
    behind the eight waiting ones would get its slot only after nine have). Every completed
    stream equals its offline batch-1 output. (No wall-clock bound: scripts/triton_load.py
    measures refusal latency.)"""
    limits = [NEW_TOKENS - (i % 4) * 3 for i in range(16)]
    results: dict[int, tuple] = {}
    refusals: dict[str, tuple[int, str | None]] = {}

    def one(i: int) -> None:
        stream = Stream(server)
        try:
            stream.send(text_request(offline["prompts"][i], max_tokens=limits[i]), request_id=str(i))
            results[i] = stream.collect(timeout=300)
        finally:
            stream.close()

    def cancelling() -> None:
        stream = Stream(server)
        stream.send(text_request(offline["prompts"][3], max_tokens=400))
        for _ in range(2):
            _, error = stream.results.get(timeout=300)
            results["cancel"] = error
        stream.close(cancel=True)

    def bad(name: str) -> None:
        make, _ = BAD_UNDER_LOAD[name]
        stream = Stream(server)
        try:
            stream.send(make())
            _, _, error = stream.collect(timeout=60)
            refusals[name] = (sum(1 for i in range(16) if i in results), error)   # streams finished by then
        finally:
            stream.close()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)] + [threading.Thread(target=cancelling)]
    for t in threads:
        t.start()
    time.sleep(1.0)   # the batch is full and requests are queued: now the malformed ones
    bad_threads = [threading.Thread(target=bad, args=(name,)) for name in BAD_UNDER_LOAD]
    for t in bad_threads:
        t.start()
    for t in threads + bad_threads:
        t.join(timeout=600)
    assert results.get("cancel", "missing") is None, "the cancelling client got an error before it cancelled"
    for i in range(16):
        pieces, _, error = results[i]
        assert error is None, f"stream {i}: {error}"
        assert flat(pieces) == offline["tokens"][i][:limits[i]], f"stream {i} differs from its offline output"
    for name, (_, message) in BAD_UNDER_LOAD.items():
        finished, error = refusals[name]
        assert error is not None and message in error, (name, error)
        assert finished <= 8, f"{name}: refused after {finished} streams finished: validation waited for a slot"
    assert server.alive()
    assert "waiting for a batch slot" in server.log
    assert_still_serving(server, offline)


def test_client_disconnecting_mid_stream_leaves_the_server_serving(server, offline):
    stream = Stream(server)
    stream.send(text_request(offline["prompts"][2], max_tokens=400))
    got = 0
    while got < 2:   # a couple of responses, then the client goes away
        _, error = stream.results.get(timeout=120)
        assert error is None
        got += 1
    stream.close(cancel=True)
    time.sleep(1.0)
    assert server.alive()
    assert_still_serving(server, offline)
    assert "not healthy" not in server.log and "terminate called" not in server.log
    assert "eagle_trt: request cancelled by the client after" in server.log, "the abandoned request kept decoding"


def test_cancelled_stream_is_closed_and_the_model_unloads_cleanly(built, offline, monkeypatch):
    """A client that cancels mid-stream: the model still closes the stream with the final flag,
    which Triton's Python backend needs to unload the model gracefully at shutdown."""
    import shutil
    monkeypatch.setenv("EAGLE_TRT_KEEP_TRITON_LOG", "1")
    server = LocalTriton(built[1].artifact("triton"))
    try:
        with server:
            stream = Stream(server)
            stream.send(text_request(offline["prompts"][2], max_tokens=400))
            for _ in range(2):
                _, error = stream.results.get(timeout=120)
                assert error is None
            stream.close(cancel=True)
            time.sleep(2.0)
        log = server.log
    finally:
        shutil.rmtree(server.workdir, ignore_errors=True)
    assert "eagle_trt: request cancelled by the client after" in log
    assert "Exit timeout expired" not in log and "successfully unloaded 'eagle_trt'" in log, log[-3000:]


@pytest.mark.parametrize("inputs, message", [
    (lambda: [_input("max_tokens", np.array([8], dtype=np.int32), "INT32")], "exactly one of text_input"),
    (lambda: text_request("Hello", max_tokens=-3), "max_tokens must be a positive integer, got -3"),
    (lambda: text_request("Hello", None) + [_input("max_tokens", np.array([8.0], dtype=np.float32), "FP32")],
     "max_tokens"),
    (lambda: text_request("Hello", None) + [_input("temperature", np.array([-1.0], dtype=np.float32), "FP32")],
     "temperature must be a finite number >= 0"),
    (lambda: text_request("Hello", max_tokens=10**6), "exceeds the target's context"),
    (lambda: [_input("text_input", np.array([b"caf\xc3 \xff tea"], dtype=np.object_), "BYTES")],
     "text_input: not valid UTF-8 (byte 0xc3 at offset 3)"),
    (lambda: [_input("input_ids", np.array([5, 10**7, 6], dtype=np.int64), "INT64")],
     "prompt token id 10000000 is outside the vocabulary"),
], ids=["missing prompt", "negative max_tokens", "wrong dtype", "negative temperature", "beyond context",
        "invalid UTF-8", "out-of-range id"])
def test_malformed_requests_get_errors_and_the_server_keeps_serving(server, offline, inputs, message):
    stream = Stream(server)
    try:
        stream.send(inputs())
        pieces, _, error = stream.collect()
        assert error is not None and message in error, error
        assert pieces == []
        stream.send(text_request(offline["prompts"][1]))
        pieces, _, error = stream.collect()
        assert error is None and flat(pieces) == offline["tokens"][1]
    finally:
        stream.close()


def assert_streams(repository, prompt: list[int], expected: list[int]) -> None:
    """A tritonserver on `repository` streams `expected` for the token ids `prompt`."""
    with LocalTriton(repository) as server:
        stream = Stream(server)
        try:
            stream.send([_input("input_ids", np.array(prompt, dtype=np.int64), "INT64")])
            pieces, _, error = stream.collect()
            assert error is None and flat(pieces) == expected
        finally:
            stream.close()


# Qwen3 (q/k norm, q/k/v/o biases, a sliding window on the last layers): the parity stage runs too.
FP8_TARGETS = {"llama": {}, "qwen3": {"family": "qwen3", "extra": dict(head_dim=16, attention_bias=True,
                                                                      use_sliding_window=True, sliding_window=8,
                                                                      max_window_layers=4)}}


@pytest.mark.parametrize("family", list(FP8_TARGETS))
def test_fp8_repository_serves_with_the_fp8_runtime_settings(tmp_path, family, monkeypatch):
    """An FP8 build (tiny target and drafter) served in-process: the model opens its FP8 graphs,
    and the iteration graph composed of them, with the FP8 ONNX Runtime settings (weight DQs
    folded, 2-row padding), so its stream equals the offline FP8 runtime's tokens, which equal
    FP8 greedy decoding. The weights are kept outside the graphs (threshold 0: the iteration
    graph is composed from the repository's hard-linked data files) and the repository is
    served from a copy in another folder, the built one deleted: it holds every file its graphs
    read."""
    import json
    import shutil

    from test_build_support import tiny_config, write_tiny_target

    from eagle_trt.build import build, config_from_dict
    from eagle_trt.runtime.loop import DecodingLoop
    from eagle_trt.runtime.ort_engines import open_backends
    from eagle_trt.runtime.two_call import TwoCallEngine

    parity = {"enabled": family != "llama"}
    data = tiny_config(write_tiny_target(tmp_path / "target", **FP8_TARGETS[family]), parity=parity,
                       precision={"target": {"format": "fp8", "base": "fp32"}, "drafter": {"format": "fp8", "base": "fp32"}})
    cfg = config_from_dict(data, "tiny fp8")
    monkeypatch.setenv("EAGLE_TRT_EXTERNAL_DATA_BYTES", "0")
    m = build(cfg, tmp_path / "out", log=None)
    stages = {s["name"]: s["status"] for s in m.data["stages"]}
    assert stages["parity"] == ("skipped" if family == "llama" else "ran"), stages
    settings = json.loads((m.artifact("triton") / MODEL / "1" / "eagle.json").read_text())
    assert settings["precision"] == {"target": "fp8", "drafter_tree": "fp8"}
    resolved = json.loads(m.artifact("validate/resolved.json").read_text())
    graphs = {"target": m.artifact("quantize/target.fp8.onnx"), "drafter_tree": m.artifact("quantize/drafter_tree.fp8.onnx")}
    fp8 = open_backends(graphs, cfg.tree.shape, resolved["target"]["max_context"], threads=1,
                        precision=settings["precision"])
    eos = resolved["target"]["eos_ids"]
    prompt = list(range(5, 25))
    expected = DecodingLoop(fp8.engine(), eos).generate(prompt, 8).tokens
    assert expected == DecodingLoop(TwoCallEngine(fp8.target), eos).generate(prompt, 8).tokens
    moved = tmp_path / "elsewhere" / "triton"
    shutil.copytree(m.artifact("triton"), moved)
    shutil.rmtree(m.artifact("triton"))
    graphs = moved / MODEL / "1" / "graphs"
    assert {p.name for p in graphs.iterdir()} == {   # the iteration graph: both in one
        "target.fp8.onnx", "target.fp8.onnx.data", "drafter_tree.fp8.onnx", "drafter_tree.fp8.onnx.data",
        "iteration.onnx"}
    from eagle_trt.export.graph_files import graph_files   # which reads the two graphs' own weights files
    assert [p.name for p in graph_files(graphs / "iteration.onnx")] == [
        "iteration.onnx", "drafter_tree.fp8.onnx.data", "target.fp8.onnx.data"]
    assert_streams(moved, prompt, expected)


def test_int4_repository_streams_the_offline_int4_tokens(tmp_path):
    """A build with the 4-bit MatMulNBits target (precision.target.format int4) served by a real
    tritonserver: the stream equals the offline speculative decoding of the repository's own
    graphs (the int4 target composed with the int8 drafter), which equals their greedy decoding."""
    import json

    from test_build_support import tiny_config, write_tiny_target

    from eagle_trt.build import build, config_from_dict
    from eagle_trt.build.triton import served_graphs
    from eagle_trt.runtime.loop import DecodingLoop
    from eagle_trt.runtime.ort_engines import open_backends
    from eagle_trt.runtime.two_call import TwoCallEngine

    data = tiny_config(write_tiny_target(tmp_path / "target"), parity={"enabled": False},
                       precision={"target": {"format": "int4"}})
    cfg = config_from_dict(data, "tiny int4")
    m = build(cfg, tmp_path / "out", log=None)
    settings = json.loads((m.artifact("triton") / MODEL / "1" / "eagle.json").read_text())
    assert settings["precision"] == {"target": "int4", "drafter_tree": "int8"} and "iteration" in settings["graphs"]
    graphs = served_graphs(m.artifact("triton"), MODEL)
    opened = open_backends(graphs, cfg.tree.shape, settings["max_context"], threads=1, precision=settings["precision"])
    eos = settings["eos_ids"]
    prompt = list(range(5, 25))
    expected = DecodingLoop(opened.engine(), eos).generate(prompt, 8).tokens
    assert expected == DecodingLoop(TwoCallEngine(opened.target), eos).generate(prompt, 8).tokens
    assert_streams(m.artifact("triton"), prompt, expected)


def test_one_stream_repository_streams_the_fused_attention_tokens(tmp_path):
    """A build serving one stream at a time (serving.max_concurrent 1) of an fp32 target serves
    the fused-attention target graph (serving.attention auto, export/cpu_attention.py) by a real
    tritonserver: the stream equals the offline speculative decoding of the repository's own
    graphs, which equals the build's portable target graph's greedy decoding."""
    import json

    from test_build_support import tiny_config, write_tiny_target

    from eagle_trt.build import build, config_from_dict
    from eagle_trt.build.triton import served_graphs
    from eagle_trt.runtime.loop import DecodingLoop
    from eagle_trt.runtime.onnxruntime_backend import OrtTarget
    from eagle_trt.runtime.ort_engines import open_backends
    from eagle_trt.runtime.two_call import TwoCallEngine

    data = tiny_config(write_tiny_target(tmp_path / "target"), parity={"enabled": False},
                       serving={"max_concurrent": 1})
    cfg = config_from_dict(data, "tiny one stream")
    m = build(cfg, tmp_path / "out", log=None)
    settings = json.loads((m.artifact("triton") / MODEL / "1" / "eagle.json").read_text())
    assert settings["graphs"]["target"] == "graphs/target.fused.onnx" and "iteration" in settings["graphs"]
    opened = open_backends(served_graphs(m.artifact("triton"), MODEL), cfg.tree.shape, settings["max_context"],
                           threads=1, precision=settings["precision"])
    eos = settings["eos_ids"]
    prompt = list(range(5, 25))
    expected = DecodingLoop(opened.engine(), eos).generate(prompt, 8).tokens
    portable = OrtTarget(m.artifact("export/target.onnx"), settings["max_context"], threads=1)
    assert expected == DecodingLoop(TwoCallEngine(portable), eos).generate(prompt, 8).tokens
    assert_streams(m.artifact("triton"), prompt, expected)


def test_torch_runtime_streams_the_offline_tokens(built, offline, tmp_path):
    """serving.runtime torch: the repository carries the checkpoints and the model runs the
    fixed-shape loop of runtime/static.py (on this CPU without capture), only the triton stage
    built again; moved elsewhere, it streams the offline runtime's tokens one request at a time
    and four at once."""
    import json
    import shutil

    from eagle_trt.build import build, config_from_dict
    cfg, m = built
    root = m.artifact("triton").parent
    out = tmp_path / "out"
    shutil.copytree(root, out)
    data = {"name": "serving", "tree": {"depth": 3, "top_k": 2, "total_tokens": 4},
            "engines": {"profiles": {"verify": {"opt_tokens": 5, "max_tokens": 5}}}, "parity": {"enabled": False},
            "serving": {"threads": 1, "max_tokens": NEW_TOKENS, "max_concurrent": 4, "runtime": "torch",
                        "torch_device": "cpu", "capacity": 256}}
    again = build(config_from_dict(data, "serving test, torch runtime"), out, log=None)
    assert {s["name"]: s["status"] for s in again.data["stages"]}["triton"] == "ran"
    moved = tmp_path / "moved"
    shutil.move(str(again.artifact("triton")), moved)
    settings = json.loads((moved / MODEL / "1" / "eagle.json").read_text())
    assert settings["backend"] == "torch" and settings["max_context"] == 256 - (4 + 1) - (3 + 1) and not settings["graphs"]
    assert (moved / MODEL / "1" / "target" / "model.safetensors").is_file()
    with LocalTriton(moved) as server:
        results = {}

        def one(i):
            stream = Stream(server)
            try:
                stream.send(text_request(offline["prompts"][i]))
                results[i] = stream.collect(timeout=300)
            finally:
                stream.close()
        one(0)
        threads = [threading.Thread(target=one, args=(i,)) for i in range(1, 5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
    for i in range(5):
        pieces, _, error = results[i]
        assert error is None and flat(pieces) == offline["tokens"][i], f"stream {i}"


def test_local_triton_cli_stops_its_server_on_sigterm(built):
    """`python -m eagle_trt.build.local_triton` under SIGTERM (docker stop, systemd, kill) takes
    tritonserver down with it, as on Ctrl-C, so nothing keeps holding the ports."""
    import os
    import signal
    import subprocess
    import sys
    import urllib.request
    from pathlib import Path

    from eagle_trt.build.local_triton import free_port
    http, grpc = free_port(), free_port()
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-m", "eagle_trt.build.local_triton", "--repository",
                             str(built[1].artifact("triton")), "--http-port", str(http), "--grpc-port", str(grpc)],
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(root)))
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/health/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail("local_triton did not become ready")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        with pytest.raises(OSError):   # the server went with it: nothing answers on its port
            urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/health/ready", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in filter(str.isdigit, os.listdir("/proc")):   # a server left behind by a failure: stop it
            try:
                if f"--http-port={http}".encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.killpg(int(pid), signal.SIGKILL)
            except OSError:
                pass


def test_local_triton_draws_new_ports_when_a_drawn_one_is_taken(tmp_path):
    """Two test workers start servers at once and their clients take ports too: a drawn port taken
    before the server binds it gets the server restarted on new ones, while a port the caller
    named is refused with Triton's own reason. Drawn ports lie below the ephemeral range, where
    outgoing connections take theirs."""
    import socket

    from eagle_trt.build.local_triton import TritonUnavailable, _ephemeral_range, free_port
    assert all(free_port() < _ephemeral_range()[0] for _ in range(20))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        with pytest.raises(TritonUnavailable, match="already in use"):
            with LocalTriton(tmp_path, grpc_port=taken):
                pass
        server = LocalTriton(tmp_path)
        server.grpc_port = taken
        with server:
            assert server.grpc_port != taken and server.alive()
            assert "already in use" not in server.log
