"""`python -m eagle_trt.bench`'s rows (eagle_trt/bench_rows.py: what it measures on a GPU) run on
the CPU with --rows, as the GPU check's dry run does, decoding SmolLM2 with the shipped EAGLE 3.1
drafter. The ONNX Runtime rows run the exported fp32 graphs, speculative decoding through the
iteration graph, on the CPU provider (the reference of the CUDA rows) and, where onnxruntime has
no CUDA provider, report that as the CUDA rows' result instead of failing the run. The flags the
GPU refused before (--repeats, --concurrency, --temperature) work on the rows, and the ones that
cannot apply there are refused by name."""
from __future__ import annotations

import json

from conftest import onnx_dir_copy

from eagle_trt.api import ort_cuda_available
from eagle_trt.bench import main


def test_bench_rows_decode_alike_on_the_cpu(smollm2, smollm2_onnx_dir, tmp_path, capsys):
    out = tmp_path / "out"
    onnx = onnx_dir_copy(smollm2_onnx_dir, tmp_path / "onnx")
    common = ["--device", "cpu", "--dtype", "float32", "--threads", "1", "--workloads", "mtbench", "--prompts", "2",
              "--max-new-tokens", "8", "--tree", "3,2,4", "--onnx-dir", str(onnx), "--drafter-weights", "float32"]
    code = main(common + ["--rows", "captured-plain,captured-speculative,onnxruntime-cpu,onnxruntime-cuda,"
                          "onnxruntime-cuda-host-kv", "--repeats", "2", "--concurrency", "1,2",
                          "--concurrency-prompts", "2", "--concurrency-repeats", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    report = json.loads((out / "bench.json").read_text())
    rows = {r["row"]: r for r in report["rows"]}
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
    # --concurrency: the captured rows continuously batched, every stream equal to its batch-1 run
    batched = report["concurrency"]
    assert [(r["streams"], r["mode"]) for r in batched] == [
        (c, m) for c in (1, 2) for m in ("captured plain", "captured speculative 3,2,4")]
    assert all(r["identical_to_solo"] and 0 < r["tokens"] <= 16 for r in batched)
    assert (out / "concurrency.png").read_bytes()[:4] == b"\x89PNG" and "continuously batched" in printed

    # --temperature on the rows: every row samples, prompt i seeded with i; outputs not compared
    assert main(common + ["--rows", "captured-speculative,onnxruntime-cpu", "--temperature", "0.8", "--top-k", "40",
                          "--out", str(tmp_path / "sampled")]) == 0
    sampled = json.loads((tmp_path / "sampled" / "bench.json").read_text())
    assert sampled["sampling"] == {"temperature": 0.8, "top_p": 1.0, "top_k": 40, "seed": None}
    assert all(r["error"] is None and r["tokens_per_second"] and r["identical_to_captured_plain"] is None
               for r in sampled["rows"])
    assert "sampled: temperature 0.8" in capsys.readouterr().out

    # what has no meaning on the rows is refused, by name and why
    for flags, message in ((["--sweep-prompts", "2"], "--sweep-prompts: the rows"),
                           (["--rows", "captured-plain,nonsense"], "--rows: unknown ['nonsense']")):
        rows_flag = [] if "--rows" in flags else ["--rows", "captured-plain"]
        assert main(common + rows_flag + flags + ["--out", str(tmp_path / "x")]) == 2
        assert message in capsys.readouterr().err
