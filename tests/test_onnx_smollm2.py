"""The exported graphs of the real SmolLM2 target: parity with PyTorch, and greedy generation
on ONNX Runtime token-identical to transformers' generate on MT-bench prompts: the first 8 one
at a time (64 tokens each), then all 20 continuously batched with mixed limits (64, 55 and 46
tokens; conftest.check_planted_greedy), on the portable target graph and on the fused-attention one."""
from __future__ import annotations

import json

import pytest

from eagle_trt.api import Models
from eagle_trt.checkpoints import random_drafter
from eagle_trt.config import TreeShape
from eagle_trt.export import export_drafter_tree
from eagle_trt.export.cpu_attention import fuse_attention
from eagle_trt.generate import main as generate_main
from eagle_trt.parity import run_parity
from eagle_trt.runtime.onnxruntime_backend import OrtDrafter, OrtTarget

from conftest import capturing, check_planted_greedy, onnx_dir_copy

SHAPES = {"chain": TreeShape.chain(5), "tree": TreeShape(depth=5, top_k=4, total_tokens=24)}
# The pairings test_lossless_greedy.py does not run on PyTorch: each variant and each shape on both backends.
PAIRS = [("eagle3.1", "chain"), ("eagle3", "tree")]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def drafters(smollm2):
    return {v: random_drafter(smollm2, v, seed=1, draft_vocab_size=4096) for v in ("eagle3", "eagle3.1")}


@pytest.fixture(scope="module")
def target_graph(smollm2, drafters, smollm2_onnx_dir):
    # Both drafters use the EAGLE default capture layers, so one target graph (the shared export) serves both.
    assert drafters["eagle3"].cfg.capture_for(smollm2.config) == drafters["eagle3.1"].cfg.capture_for(smollm2.config)
    assert list(capturing(smollm2, drafters["eagle3"]).model.capture_streams) == json.loads(
        (smollm2_onnx_dir / "export.json").read_text())["target"]["capture"]
    return smollm2_onnx_dir / "target.onnx"


def test_parity_report_on_smollm2(smollm2, smollm2_tokenizer, drafters, target_graph, tmp_path):
    shape = TreeShape(depth=5, top_k=8, total_tokens=60)
    graphs = {"target": target_graph,
              "drafter_tree": export_drafter_tree(drafters["eagle3.1"], shape, tmp_path / "tree.onnx").path}
    models = Models(capturing(smollm2, drafters["eagle3.1"]), drafters["eagle3.1"], "random eagle3.1", smollm2_tokenizer)
    reports = run_parity(models, shape, graphs, "float32", num_prompts=2, bundle_dir=tmp_path / "bundles")
    by_name = {r.name: r for r in reports}
    assert all(r.passed for r in reports), [(r.name, o.output, o.max_abs) for r in reports for o in r.outputs
                                            if not o.passed]
    logits = next(o for o in by_name["target"].outputs if o.output == "logits")
    assert logits.max_abs <= 2e-4      # the fp32 floor: 9.5e-5 (AVX-512) to 1.2e-4 (AVX2) by CPU
    for o in by_name["drafter_tree"].outputs:
        if o.exact:
            assert o.max_abs == 0.0
    assert (tmp_path / "bundles" / "target.inputs.json").is_file()


@pytest.mark.parametrize("variant,shape_name", PAIRS)
def test_onnxruntime_greedy_equals_transformers_generate(smollm2, drafters, target_graph, mtbench_ids, hf_greedy,
                                                         variant, shape_name, tmp_path):
    shape = SHAPES[shape_name]
    tree_graph = export_drafter_tree(drafters[variant], shape, tmp_path / "tree.onnx").path
    # Then the same prompts continuously batched: 3 at a time (chain), 8 at a time (tree).
    check_planted_greedy(OrtTarget(target_graph, smollm2.config.max_position_embeddings), OrtDrafter(tree_graph, shape),
                         mtbench_ids, hf_greedy, smollm2.config.eos_token_ids, batch=3 if shape_name == "chain" else 8)


def test_fused_attention_graph_greedy_equals_transformers_generate(smollm2, drafters, target_graph, mtbench_ids,
                                                                   hf_greedy, tmp_path):
    """The fused-attention target graph (export/cpu_attention.py): ONNX Runtime's GroupQueryAttention
    with the caches written in place, tree verification through its attention bias; one sequence at
    a time (the operator's CPU kernel verifies one sequence a call), the first 8 prompts."""
    fused = tmp_path / "target_fused.onnx"
    fuse_attention(target_graph, fused, smollm2.config)
    shape = SHAPES["tree"]
    tree_graph = export_drafter_tree(drafters["eagle3.1"], shape, tmp_path / "tree.onnx").path
    check_planted_greedy(OrtTarget(fused, smollm2.config.max_position_embeddings), OrtDrafter(tree_graph, shape),
                         mtbench_ids[:8], hf_greedy[:8], smollm2.config.eos_token_ids)


def test_generate_cli_onnxruntime_backend(tmp_path, capsys, smollm2_onnx_dir):
    args = ["--prompt", "What is 2 + 2?", "--chat", "--max-new-tokens", "16", "--depth", "3", "--tree-top-k", "2",
            "--total-tokens", "5", "--json", "--onnx-dir", str(onnx_dir_copy(smollm2_onnx_dir, tmp_path / "graphs"))]
    assert generate_main(args + ["--backend", "onnxruntime"]) == 0     # the iteration graph, by default
    ort = json.loads(capsys.readouterr().out)
    assert all((tmp_path / "graphs" / f"{g}.onnx").is_file() for g in ("target", "drafter_tree", "iteration"))
    assert generate_main(args + ["--backend", "onnxruntime", "--iteration-graph", "off"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == ort["tokens"]
    assert generate_main(args + ["--backend", "onnxruntime", "--attention", "fused"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == ort["tokens"]
    assert (tmp_path / "graphs" / "target_fused.onnx").is_file()
    assert generate_main(args + ["--backend", "torch"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == ort["tokens"]
