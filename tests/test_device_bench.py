"""`python -m eagle_trt.bench --device cuda` (eagle_trt/device_bench.py) run on the CPU, as the
GPU check's dry run does: the rows it compares on a GPU, decoding SmolLM2 with the shipped
EAGLE 3.1 drafter. The ONNX Runtime rows run the exported fp32 graphs, speculative decoding
through the iteration graph, on the CPU provider (the reference of the CUDA rows) and, where
onnxruntime has no CUDA provider, report that as the CUDA rows' result instead of failing the run."""
from __future__ import annotations

import json

from conftest import onnx_dir_copy

from eagle_trt.api import ort_cuda_available
from eagle_trt.device_bench import main


def test_device_bench_rows_decode_alike_on_the_cpu(smollm2, smollm2_onnx_dir, tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["--device", "cpu", "--dtype", "float32", "--threads", "2", "--prompts", "2",
                 "--max-new-tokens", "12", "--tree", "3,2,4",
                 "--rows", "captured-plain,captured-speculative,onnxruntime-cpu,onnxruntime-cuda,onnxruntime-cuda-host-kv",
                 "--onnx-dir", str(onnx_dir_copy(smollm2_onnx_dir, tmp_path / "onnx")), "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    rows = {r["row"]: r for r in json.loads((out / "device_bench.json").read_text())["rows"]}
    cuda = [f"onnxruntime cuda{kv} {kind}" for kv in ("", " host-kv") for kind in ("plain", "speculative")]
    assert set(rows) == {"captured plain", "captured speculative 3,2,4", "onnxruntime cpu plain",
                         "onnxruntime cpu speculative", *cuda}
    for name in ("captured speculative 3,2,4", "onnxruntime cpu plain", "onnxruntime cpu speculative"):
        assert rows[name]["error"] is None and rows[name]["identical_to_captured_plain"] == 2, rows[name]
    assert rows["onnxruntime cpu speculative"]["mean_accept_length"] > 1      # the iteration graph drafted
    why = ort_cuda_available()
    for name in cuda:
        if why is None:       # onnxruntime-gpu installed: fp32 on both providers, token for token
            assert rows[name]["identical_to_cpu_provider"] == 2, rows[name]
        else:
            assert "no CUDAExecutionProvider" in rows[name]["error"] and f"{name:<38}  failed" in printed
