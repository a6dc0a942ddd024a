"""bench's llama.cpp peer rows (eagle_trt/peers.py): refused with the install command where
llama.cpp is missing (CI does not build it), before anything loads; where it is installed
(scripts/install_llama_cpp.sh), llama.cpp's greedy decoding of SmolLM2 converted to f32 GGUF by
its own converter gives the project's greedy tokens."""
from __future__ import annotations

import importlib.util
import sys

import pytest


@pytest.mark.parametrize("argv, message", [
    (["--peers", "llama.cpp"], "llama.cpp is not installed (llama-cpp-python): bash scripts/install_llama_cpp.sh"),
    (["--peers", "vllm"], "--peers 'vllm': the peer known is llama.cpp"),
    (["--peers", "llama.cpp", "--rows", "captured-plain"], "--peers llama.cpp: the peer rows are a CPU comparison"),
])
def test_bench_refuses_peers_it_cannot_run_before_loading_anything(argv, message, monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)     # as on a machine without it
    from eagle_trt.bench import main
    assert main(["--workloads", "mtbench", "--prompts", "1", "--out", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "bench.json").exists()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                    reason="llama.cpp is not installed (bash scripts/install_llama_cpp.sh); CI does not build it")
def test_llama_cpp_f32_decodes_smollm2_as_the_target_does(smollm2, mtbench_ids, hf_greedy):
    """The f32 peer (the project's converted folder through llama.cpp's converter): transformers'
    greedy tokens on the first MT-bench prompts, 16 tokens each."""
    from eagle_trt.peers import llama_cpp_peers, require_llama_cpp
    require_llama_cpp()
    peer = llama_cpp_peers(smollm2.folder, None, 1, 512, set(smollm2.config.eos_token_ids))[0]
    for ids, want in zip(mtbench_ids[:3], hf_greedy):
        assert peer.generate(ids, 16)["tokens"] == want[:16]
