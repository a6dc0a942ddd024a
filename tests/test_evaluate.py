"""Evaluation workloads and the acceptance report (python -m eagle_trt.evaluate)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle_trt import evaluate, workloads
from eagle_trt.config import ConfigError

from conftest import onnx_dir_copy


def test_depth_rates_by_hand():
    # accept lengths include the bonus token: drafts accepted = 0, 1, 3, 3, 5
    absolute, conditional = evaluate.depth_rates([1, 2, 4, 4, 6], depth=5)
    assert absolute == [4 / 5, 3 / 5, 3 / 5, 1 / 5, 1 / 5]
    assert conditional == [4 / 5, 3 / 4, 1.0, 1 / 3, 1.0]


def test_parse_drafters_rejects_bad_specs():
    assert evaluate.parse_drafters(["a=/x", "b=/y"]) == [("a", evaluate.Path("/x")), ("b", evaluate.Path("/y"))]
    for bad in (["nopath"], ["=x"], ["a="], ["a=/x", "a=/y"]):
        with pytest.raises(ConfigError):
            evaluate.parse_drafters(bad)


def test_workloads_render_as_described(smollm2_tokenizer):
    tok = smollm2_tokenizer
    text = {name: tok.decode(workloads.build(tok, name, 1)[0]) for name in workloads.WORKLOADS}
    assert "You are a helpful AI assistant" in text["mtbench"]
    assert workloads.CUSTOM_SYSTEM in text["system-custom"] and "helpful AI assistant" not in text["system-custom"]
    assert "system" not in text["system-none"] and text["system-none"].startswith("<|im_start|>user\n")
    assert "<|im_start|>" not in text["plain"] and text["plain"].startswith("Question: ")
    assert "def has_close_elements(" in text["humaneval"] and "Complete the following Python" in text["humaneval"]
    for name, length in workloads.LONG_LENGTHS.items():
        ids = workloads.build(tok, name, 2)
        assert len(ids) == 2 and ids[0] != ids[1]
        assert all(length < len(p) < length + 120 for p in ids), [len(p) for p in ids]
        assert text[name].rstrip().endswith("<|im_start|>assistant")
    with pytest.raises(ConfigError, match="unknown workload"):
        workloads.build(tok, "nope", 1)


@pytest.mark.slow
def test_evaluate_cli_reports_same_tokens_for_two_copies_of_a_drafter(smollm2, tmp_path, capsys):
    from eagle_trt.checkpoints import random_drafter, save_drafter
    path = save_drafter(random_drafter(smollm2, "eagle3.1", draft_vocab_size=2048), tmp_path / "d")
    rc = evaluate.main(["--drafter", f"a={path}", "--drafter", f"b={path}", "--workloads", "mtbench,plain",
                        "--prompts", "2", "--max-new-tokens", "8", "--depth", "3,2", "--tree-top-k", "2",
                        "--total-tokens", "4,3", "--threads", "1", "--quiet", "--json", str(tmp_path / "r.json")])
    assert rc == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["identical_across_drafters"] == {"mtbench": True, "plain": True}
    assert report["trees"] == [[3, 2, 4], [2, 2, 3]]
    rows = report["results"]
    assert len(rows) == 8 and all(r["new_tokens"] == 16 for r in rows)
    assert sorted(r["tree"][0] for r in rows) == [2] * 4 + [3] * 4
    assert all(1.0 <= r["mean_accept_length"] <= r["tree"][0] + 1 for r in rows)
    assert "identical tokens across drafters" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="one per depth"):
        evaluate.parse_trees("3,2", 2, "4,3,2")


def test_a_shared_prefill_is_reused_only_for_an_identical_prompt(smollm2):
    """evaluate's engines share one PrefillCache: the same prompt is prefilled once for all of
    them (the same tokens follow), another prompt is prefilled again, decoding steps never reuse."""
    from conftest import static
    from eagle_trt.runtime.static import PrefillCache
    prefills, calls = PrefillCache(), []
    hook = smollm2.model.register_forward_hook(lambda m, a, o: calls.append(a[0].shape[1]))
    try:
        first, second = (static(smollm2.model, max_batch=1, prefills=prefills) for _ in range(2))
        a = first.generate([1, 2, 3, 4], 3).tokens
        assert calls == [4, 1, 1]
        assert second.generate([1, 2, 3, 4], 3).tokens == a and calls == [4, 1, 1, 1, 1]
        first.generate([1, 2, 3, 5], 3)
        assert calls[5:] == [4, 1, 1]
    finally:
        hook.remove()


@pytest.mark.slow
def test_diagnose_measures_attention_shares_and_feedback_norms(smollm2, tmp_path):
    """Shares are probabilities that add up with the rest of the context to 1; EAGLE 3.1's fed-back
    state is norm(h2), so its norm is that of an RMS-normed vector times the norm weight, while
    EAGLE-3 feeds back h2 itself; the CLI writes the JSON and the PNG."""
    import torch

    from eagle_trt import diagnose
    from eagle_trt.checkpoints import random_drafter, save_drafter
    from eagle_trt.models.target import causal_mask
    d31 = random_drafter(smollm2, "eagle3.1", seed=0, draft_vocab_size=2048)
    seq = workloads.build(smollm2.tokenizer(), "mtbench", 1)[0][:40]
    assert len(seq) == 40
    smollm2.model.set_capture(d31.cfg.capture_for(smollm2.config))
    with torch.inference_mode():
        pk, pv = smollm2.model.empty_past(1)
        captured = smollm2.model(torch.tensor([seq]), torch.arange(40)[None], causal_mask(40, 0), pk, pv).captured[0]
        stats = diagnose.chain_stats(d31, captured, seq, [20, 30], depth=4, sinks=4)
        # the same chain by hand: the norm of EAGLE 3.1's feedback is that of norm(h2)
        hidden = d31.project(captured[None, :39])
        first = d31(hidden[:, :21], torch.tensor([seq[1:22]]), torch.arange(21)[None], causal_mask(21, 0),
                    *d31.empty_past(1))
    assert stats["state_norm"][0][1] == pytest.approx(float(first.feedback[0, 20].norm()), rel=1e-4)
    for rows in zip(stats["sink_share"], stats["draft_share"]):
        for sink, draft in zip(*rows):
            assert 0.0 <= sink <= 1.0 and 0.0 <= draft <= 1.0 and sink + draft <= 1.0 + 1e-6
    assert all(row[0] == 0.0 and row[1] > 0.0 for row in stats["draft_share"])
    assert d31.midlayer.self_attn.record_probs is False     # recording is switched off again

    path = save_drafter(random_drafter(smollm2, "eagle3", seed=1, draft_vocab_size=2048), tmp_path / "e3")
    rc = diagnose.main(["--drafter", f"e3={path}", "--workloads", "plain", "--prompts", "1", "--continuation", "8",
                        "--cuts", "2", "--depth", "3", "--threads", "1", "--out", str(tmp_path / "out")])
    assert rc == 0
    report = json.loads((tmp_path / "out" / "diagnose.json").read_text())
    assert set(report["drafters"]["e3"]["plain"]) == set(diagnose.METRICS)
    assert (tmp_path / "out" / "diagnose.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_bench_cli_measures_three_modes_with_identical_outputs(smollm2, smollm2_onnx_dir, tmp_path, capsys):
    """transformers generate, autoregressive and speculative decoding on the exported graphs:
    identical greedy tokens, a time split that adds up, a cost breakdown whose break-even
    acceptance is the iteration cost in autoregressive steps, and the --tree auto sweep; then
    all three sampled (--temperature)."""
    from eagle_trt import bench, bench_rows, concurrency
    from eagle_trt.checkpoints import random_drafter, save_drafter
    path = save_drafter(random_drafter(smollm2, "eagle3.1", seed=2, draft_vocab_size=2048), tmp_path / "d")
    rc = bench.main(["--drafter", str(path), "--workloads", "mtbench", "--prompts", "2", "--max-new-tokens", "6",
                     "--tree-candidates", "2,1,2;2,2,3", "--sweep-prompts", "1", "--threads", "1",
                     "--onnx-dir", str(onnx_dir_copy(smollm2_onnx_dir, tmp_path / "onnx")), "--device", "cpu",
                     "--concurrency", "1,2", "--concurrency-prompts", "3", "--concurrency-repeats", "2",
                     "--out", str(tmp_path / "out")])
    assert rc == 0
    report = json.loads((tmp_path / "out" / "bench.json").read_text())
    (row,) = report["results"]
    assert row["identical_outputs"] == 2                    # transformers, autoregressive and speculative agree
    assert report["drafter_weights"] == "int8"              # the default, as the Triton repository serves it
    assert all(row["modes"][m]["tokens"] == 12 and row["modes"][m]["tokens_per_second"] > 0
               for m in bench_rows.MODES)
    assert 0 < row["time_split"]["host"] < 1 and len(row["accepted_at_least"]) == 2
    assert sum(row["time_split"].values()) == pytest.approx(1.0)
    sweep = report["tree_sweep"]
    assert sorted(s["tree"] for s in sweep) == [[2, 1, 2], [2, 2, 3]] and report["tree"] == sweep[0]["tree"]
    assert sweep[0]["tokens_per_second"] >= max(s["tokens_per_second"] for s in sweep[1:])
    assert all(0 < s["mean_nodes_verified"] <= s["tree"][2] for s in sweep)
    c = row["cost"]
    assert report["iteration_graph"] and c["iteration_call_ms"] > 0      # one call an iteration
    assert c["iteration_ms"] == pytest.approx(c["draft_call_ms"] + c["verify_call_ms"] + c["iteration_call_ms"]
                                              + c["host_ms_per_iteration"])
    assert c["break_even_accept_length"] == pytest.approx(c["iteration_ms"] / c["autoregressive_step_ms"])
    rows = report["concurrency"]
    assert [(r["streams"], r["mode"]) for r in rows] == [(c, m) for c in (1, 2) for m in concurrency.MODES]
    for r in rows:   # every stream equals its batch-1 run; 3 requests x 6 tokens (or EOS) each
        assert r["identical_to_solo"] and 0 < r["tokens"] <= 18 and r["tokens_per_second"] > 0
        assert 0 <= r["p50_token_latency_ms"] <= r["p99_token_latency_ms"]
        host = r["host_ms_per_iteration"]
        assert host is None if r["mode"] == "speculative-per-request" else 0 < host < 1e3 * r["seconds"]
        assert len(r["tokens_per_second_runs"]) == 2 and min(r["tokens_per_second_runs"]) <= r["tokens_per_second"]
    assert rows[0]["vs_one_stream"] == 1.0
    for name in ("speedup.png", "acceptance_per_depth.png", "concurrency.png"):
        assert (tmp_path / "out" / name).read_bytes()[:4] == b"\x89PNG"
    out = capsys.readouterr().out
    assert "vs AR" in out and "where the time goes" in out and "tree sweep" in out
    assert "concurrent streams" in out and "autoregressive-batched" in out
    assert bench.main(["--tree", "3,2", "--out", str(tmp_path / "c")]) == 2
    assert "expected depth,top_k,total_tokens" in capsys.readouterr().err
    assert bench.main(["--drafter", str(path), "--workloads", "", "--concurrency", "1", "--concurrency-repeats", "0",
                       "--out", str(tmp_path / "d")]) == 2
    assert "--concurrency-repeats 0: must be >= 1" in capsys.readouterr().err
    # --temperature: every mode samples (prompt i seeded with i) on the graphs exported above; the
    # outputs are not compared and the settings are recorded; --concurrency (whose rows compare
    # outputs) refuses it
    common = ["--drafter", str(path), "--threads", "1", "--tree", ",".join(map(str, report["tree"])),
              "--onnx-dir", str(tmp_path / "onnx"), "--temperature", "0.8"]
    assert bench.main(common + ["--workloads", "mtbench", "--prompts", "2", "--max-new-tokens", "6", "--top-p", "0.9",
                                "--top-k", "40", "--out", str(tmp_path / "sampled")]) == 0
    sampled = json.loads((tmp_path / "sampled" / "bench.json").read_text())
    assert sampled["sampling"] == {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "seed": None}
    (row,) = sampled["results"]
    assert row["identical_outputs"] is None and row["mean_accept_length"] >= 1
    assert all(0 < row["modes"][m]["tokens"] <= 12 for m in bench_rows.MODES)
    assert "sampled: temperature 0.8, top-p 0.9, top-k 40" in capsys.readouterr().out
    assert bench.main(common + ["--workloads", "", "--concurrency", "2", "--out", str(tmp_path / "e")]) == 2
    assert "--concurrency measures greedy decoding" in capsys.readouterr().err
    assert bench.main(common[:-1] + ["-1", "--out", str(tmp_path / "e")]) == 2
    assert "temperature must be a finite number >= 0" in capsys.readouterr().err


def test_decoding_threads_hold_inside_every_timed_loop_and_restore_after():
    """The one thread setting every timing entry point (demo, bench, bench --concurrency) decodes
    under, whatever the process had set before (runtime/timing.py)."""
    import torch

    from eagle_trt.runtime.timing import HOST_THREADS, decoding_threads
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with decoding_threads():
            assert torch.get_num_threads() == HOST_THREADS
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_compare_alternates_the_modes_and_keeps_each_ones_fastest_run():
    """bench and the demo time a prompt by OrtDecoding.compare: a slow spell lands on one run,
    not on one mode, and the speculative run kept brings its own graph-time split."""
    from types import SimpleNamespace

    from eagle_trt.runtime.loop import GenerationResult
    from eagle_trt.runtime.ort_engines import OrtBackends
    from eagle_trt.runtime.timing import OrtDecoding
    target, drafter = SimpleNamespace(graph_seconds=0.0), SimpleNamespace(graph_seconds=0.0)
    ort = OrtDecoding(OrtBackends(target, drafter), None, None, None, set())
    order, seconds = [], {"autoregressive": [3.0, 2.0, 2.5], "speculative": [1.0, 1.5, 0.8]}

    sampling = SimpleNamespace(temperature=0.7)     # handed to every run as it is

    def run(mode):
        def decode(ids, max_new_tokens, how):
            assert how is sampling
            order.append(mode)
            s = seconds[mode][sum(m == mode for m in order) - 1]
            target.graph_seconds += s / 2
            drafter.graph_seconds += s / 4
            return GenerationResult(tokens=[1, 2], seconds=s)
        return decode
    ort.speculative, ort.autoregressive = run("speculative"), run("autoregressive")
    spec, ar, graph_s = ort.compare([5], 2, repeats=3, sampling=sampling)
    assert order == ["autoregressive", "speculative", "speculative", "autoregressive", "autoregressive", "speculative"]
    assert (spec.seconds, ar.seconds) == (0.8, 2.0)
    assert graph_s == pytest.approx({"target_graph": 0.4, "drafter_graph": 0.2})


@pytest.mark.slow
def test_bench_measures_a_builds_served_graphs_and_the_int4_target(built, smollm2_onnx_dir, tmp_path, capsys):
    """--build DIR (what make demo runs): the graphs the build's Triton repository serves, its tree
    and drafter weights, with its target; --target-weights int4: plain and speculative decoding
    on the 4-bit target graph, speculative equal to plain. A folder that is no build is refused, and
    a branching tree on the fused 4-bit graph (lossless for chains only)."""
    from eagle_trt import bench
    _, manifest = built
    out = Path(manifest.output)
    assert bench.main(["--build", str(out), "--workloads", "mtbench", "--prompts", "1", "--max-new-tokens", "6",
                       "--threads", "1", "--repeats", "1", "--out", str(tmp_path / "b")]) == 0
    report = json.loads((tmp_path / "b" / "bench.json").read_text())
    assert report["build"] == str(out) and report["tree"] == [3, 2, 4] and not report["tree_sweep"]
    assert report["drafter_weights"] == "int8" and report["iteration_graph"]
    assert report["results"][0]["speculative_equals_autoregressive"] == 1
    assert bench.main(["--build", str(tmp_path), "--out", str(tmp_path / "c")]) == 2
    assert "not a python -m eagle_trt.build output" in capsys.readouterr().err
    assert bench.main(["--target-weights", "int4", "--tree", "3,2,4", "--workloads", "mtbench", "--prompts", "2",
                       "--max-new-tokens", "8", "--threads", "1", "--repeats", "1",
                       "--onnx-dir", str(onnx_dir_copy(smollm2_onnx_dir, tmp_path / "onnx")),
                       "--out", str(tmp_path / "i")]) == 0
    report = json.loads((tmp_path / "i" / "bench.json").read_text())
    assert report["target_weights"] == "int4" and (tmp_path / "onnx" / "target_int4.onnx").is_file()
    assert report["results"][0]["speculative_equals_autoregressive"] == 2
    # the fused 4-bit target (int8 activations) is lossless for chains: a branching tree is refused
    assert bench.main(["--target-weights", "int4", "--attention", "fused", "--tree", "3,2,4", "--workloads", "mtbench",
                       "--prompts", "1", "--max-new-tokens", "4", "--threads", "1", "--repeats", "1",
                       "--onnx-dir", str(tmp_path / "onnx"), "--out", str(tmp_path / "f")]) == 2
    assert "chain trees only (top_k 1, e.g. tree 3,1,3)" in capsys.readouterr().err
