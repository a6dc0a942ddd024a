"""Quantized graphs of the real SmolLM2-135M-Instruct target (and an EAGLE 3.1 drafter for it),
calibrated on held-out ShareGPT prompts, checked on real MT-bench prompts.

End-to-end logits of a deep quantized model are compared on truncated targets (the first
layers of SmolLM2): over all 30 layers, last-bit float differences between ONNX Runtime and
torch flip a few FP8 roundings and the flips cascade (see eagle_trt/quant/check.py), so the
full-depth graph is checked MatMul by MatMul instead, which is the sharper test."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from eagle_trt.checkpoints import random_drafter
from eagle_trt.config import CaptureLayers, TreeShape
from eagle_trt.data import mtbench_prompts
from eagle_trt.export import export_drafter_tree, export_target
from eagle_trt.models.target import LlamaTarget, causal_mask
from eagle_trt.quant import (QuantConfig, calibrate_drafter, calibrate_target, calibration_prompts, layer_parity,
                             linear_paths, load_calibration, quantize_onnx, quantized_copy, run_graph, save_calibration)
from eagle_trt.runtime.backend import TorchDrafter
from eagle_trt.runtime.ort_engines import OrtBackends, open_backends
from eagle_trt.train.data import in_split

from conftest import PlantedDrafter, capturing, rel_l2, two_call

pytestmark = pytest.mark.slow
TREE = TreeShape(depth=5, top_k=4, total_tokens=16)
SPEC_TOKENS = 16


def _fp8(graphs: dict, smollm2) -> OrtBackends:
    """ONNX Runtime backends over FP8 graphs, with the FP8 session settings (as a build serves them)."""
    return open_backends(graphs, TREE, smollm2.config.max_position_embeddings, threads=1,
                         precision={g: "fp8" for g in ("target", "drafter_tree")})


@pytest.fixture(scope="module")
def smol(smollm2, smollm2_tokenizer, smollm2_onnx_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("quant_smol")
    drafter = random_drafter(smollm2, "eagle3.1", seed=1, draft_vocab_size=4096)
    target = capturing(smollm2, drafter)
    prompts = calibration_prompts(smollm2_tokenizer, count=8, max_tokens=192)
    ids = [p for _, p in prompts]
    amax = {"target": load_calibration(save_calibration(folder / "target.amax.json",
                                                        calibrate_target(target.model, ids))),
            "drafter": load_calibration(save_calibration(folder / "drafter.amax.json",
                                                         calibrate_drafter(drafter, target.model, ids, TREE)))}
    graphs = {"target": smollm2_onnx_dir / "target.onnx",     # exported once for the session, same capture layers
              "drafter": export_drafter_tree(drafter, TREE, folder / "drafter.onnx").path}
    for name, model in (("target", target.model), ("drafter", drafter)):
        quantize_onnx(graphs[name], folder / f"{name}.fp8.onnx", QuantConfig("fp8"), amax[name], linear_paths(model))
        graphs[name, "fp8"] = folder / f"{name}.fp8.onnx"
    return {"drafter": drafter, "prompts": prompts, "amax": amax, "graphs": graphs, "folder": folder, "target": target}


def target_feeds(cfg, ids: list[int]) -> dict[str, np.ndarray]:
    T = len(ids)
    feeds = {"input_ids": np.array([ids]), "position_ids": np.arange(T)[None],
             "attention_mask": causal_mask(T, 0).numpy(), "logits_index": np.arange(T)}
    empty = np.zeros((1, cfg.num_key_value_heads, 0, cfg.head_dim), np.float32)
    for i in range(cfg.num_hidden_layers):
        feeds[f"past_key_{i}"] = feeds[f"past_value_{i}"] = empty
    return feeds


def truncated(target, layers: int) -> LlamaTarget:
    """The first `layers` decoder layers of a target, with its embedding, norm and lm_head."""
    cfg = copy.deepcopy(target.config)
    cfg.num_hidden_layers = layers
    model = LlamaTarget(cfg, CaptureLayers.eagle_default(layers))
    keep = {k: v for k, v in target.model.state_dict().items()
            if not k.startswith("layers.") or int(k.split(".")[1]) < layers}
    model.load_state_dict(keep)
    return model.eval()


def test_calibration_prompts_are_held_out_sharegpt(smol, mtbench_ids, smollm2):
    prompts = smol["prompts"]
    assert len(prompts) == 8 and all(in_split(sid, "val", 0.02) for sid, _ in prompts)
    assert not {tuple(ids) for _, ids in prompts} & {tuple(ids) for ids in mtbench_ids}
    tok = smollm2.tokenizer()
    texts = [tok.decode(ids) for _, ids in prompts]
    assert not any(q.strip()[:60] in t for q in mtbench_prompts() for t in texts)
    for name, model in (("target", smol["target"].model), ("drafter", smol["drafter"])):
        assert set(smol["amax"][name]) == set(linear_paths(model))
        assert all(v > 0 for v in smol["amax"][name].values())


def test_fp8_smollm2_graph_matches_reference_layer_by_layer(smol, smollm2, mtbench_ids):
    reference, summary = quantized_copy(smol["target"].model, QuantConfig("fp8"), smol["amax"]["target"])
    assert len(summary.quantized) == 30 * 7 and summary.skipped == {"lm_head": "skip pattern 'lm_head'"}
    feeds = target_feeds(smollm2.config, mtbench_ids[0])
    report = layer_parity(str(smol["graphs"]["target", "fp8"]), reference, feeds)
    assert len(report) == 210
    worst = max(report, key=lambda r: r.rel_l2)
    print(f"SmolLM2 FP8, per MatMul: worst rel L2 {worst.rel_l2:.2e} ({worst.module})")
    assert worst.rel_l2 <= 1e-5
    # End to end over all 30 layers, for the record (rounding-flip cascade, not an arithmetic error).
    with torch.no_grad():
        T = len(mtbench_ids[0])
        past = smol["target"].model.empty_past()
        args = (torch.tensor([mtbench_ids[0]]), torch.arange(T)[None], causal_mask(T, 0), *past)
        ref, flt = reference(*args).logits, smol["target"].model(*args).logits
    got = run_graph(smol["graphs"]["target", "fp8"], feeds)["logits"]
    print(f"SmolLM2 FP8, 30 layers end to end: graph vs reference {rel_l2(got, ref):.2e}, "
          f"reference vs float {rel_l2(ref, flt):.2e}")


@pytest.mark.parametrize("fmt, layers", [("fp8", 1), ("nvfp4", 2)])
def test_truncated_smollm2_end_to_end_logits(smol, smollm2, mtbench_ids, tmp_path, fmt, layers):
    model = truncated(smollm2, layers)
    amax = {k: v for k, v in smol["amax"]["target"].items() if k in linear_paths(model)}
    graph = export_target(model, tmp_path / "target.onnx").path
    quantize_onnx(graph, tmp_path / f"target.{fmt}.onnx", QuantConfig(fmt), amax, linear_paths(model))
    reference, _ = quantized_copy(model, QuantConfig(fmt), amax)
    errors = []
    for ids in mtbench_ids[:3]:
        T = len(ids)
        with torch.no_grad():
            args = (torch.tensor([ids]), torch.arange(T)[None], causal_mask(T, 0), *model.empty_past())
            ref, flt = reference(*args).logits, model(*args).logits
        got = run_graph(tmp_path / f"target.{fmt}.onnx", target_feeds(model.cfg, ids))["logits"]
        err = rel_l2(got, ref)
        print(f"SmolLM2 first {layers} layers {fmt}: graph vs reference {err:.2e}, quantization error "
              f"{rel_l2(ref, flt):.2e}")
        # The same arithmetic gives float32 rounding (~1e-7); a value that lands on the other side
        # of an FP4 / FP8 rounding boundary (the graph's and torch's float sums differ in the last
        # bit: one prompt of three on an AVX-512 Xeon, 2.4e-3 for NVFP4) moves the logits by a
        # few percent of what quantizing does (5e-2); wrong arithmetic moves them by as much.
        assert err <= 0.1 * rel_l2(ref, flt)
        assert rel_l2(ref, flt) > 1e-3
        errors.append(err)
    assert sorted(errors)[1] <= 1e-3, f"graph vs reference {errors}: most prompts must agree to rounding"
    report = layer_parity(str(tmp_path / f"target.{fmt}.onnx"), reference, target_feeds(model.cfg, mtbench_ids[3]))
    assert len(report) == 7 * layers and max(r.rel_l2 for r in report) <= 1e-5


def test_fp8_drafter_tree_matches_fake_quant_drafter(smol, smollm2, mtbench_ids):
    """Real target features of MT-bench prompts through the FP8 drafter-tree graph on ONNX Runtime
    and through the fake-quant drafter: same tree, and every MatMul matches."""
    reference, _ = quantized_copy(smol["drafter"], QuantConfig("fp8"), smol["amax"]["drafter"])
    ort_drafter = _fp8({"drafter_tree": smol["graphs"]["drafter", "fp8"]}, smollm2).drafter
    same = 0
    for ids in mtbench_ids[:4]:
        T = len(ids)
        with torch.no_grad():
            model = smol["target"].model
            out = model(torch.tensor([ids]), torch.arange(T)[None], causal_mask(T, 0), *model.empty_past())
        captured, next_ids = out.captured[0], torch.tensor(ids[1:] + [int(out.logits[0, -1].argmax())])
        ref = TorchDrafter(reference, TREE)
        trees = []
        for backend in (ref, ort_drafter):
            backend.reset()
            backend.add_sequence()
            trees.append(backend.draft(captured[None], next_ids[None]).row(0))
        want, got = trees
        same += got.tokens.tolist() == want.tokens.tolist()
        assert got.parents.tolist() == want.parents.tolist()
        # a rare FP8 rounding flip (float noise across engines) moves a later score by ~3e-3
        assert (got.scores - want.scores).abs().max() <= 1e-2
        kv = np.zeros((1, 3, 0, 64), np.float32)
        feeds = {"captured": captured[None].numpy(), "input_ids": next_ids[None].numpy(), "past_key": kv, "past_value": kv,
                 "past_lengths": np.array([0]), "new_lengths": np.array([T])}
        report = layer_parity(str(smol["graphs"]["drafter", "fp8"]), reference, feeds)
        assert len(report) == 8 + 7 * (TREE.depth - 1) and max(r.rel_l2 for r in report) <= 1e-5
    print(f"SmolLM2 FP8 drafter trees identical on {same}/4 prompts")
    assert same == 4


# An FP8 near-tie: the two candidates' logits (from one causal prefill of the FP8 graph) closer
# than this. A flipped FP8 activation rounding moves SmolLM2's logits by a few hundredths to a
# few tenths: the one divergence on an AVX2-only EPYC (2026-11-26, prompt 0, token 10) had a
# margin of 0.109, the AVX-512 EPYCs saw none above 0.1, and an AVX-512 Xeon (2026-11-28) two,
# 0.21 and 0.23 (prompts 11 and 17, token 10); a wrong KV row or mask moves them by whole units.
FP8_NEAR_TIE = 0.35


def test_speculative_fp8_equals_greedy_fp8_on_17_of_20_prompts_diverging_only_at_near_ties(smol, smollm2,
                                                                                         mtbench_ids):
    """FP8 target + FP8 drafter graphs on ONNX Runtime give the tokens of greedy decoding with the
    same FP8 target graph on 20 real MT-bench prompts, except at FP8 near-ties.

    What makes this hold: ONNX Runtime's CPU MatMul rounds a 1-row call differently from a
    multi-row one (~1e-6), while the rows of any >= 2-row call are bit-identical whatever the row
    count. FP8 activations turn such last-bit differences into different tokens at near-ties, so
    the FP8 target backend pads token-by-token calls to 2 rows (OrtTarget min_rows) and greedy
    decoding runs the arithmetic of tree verification. What it cannot remove: a tree node that
    is not its parent's first child sits at another column than in a causal call (siblings in
    between, masked), which regroups the float sums of its attention, and an FP8 rounding flip
    can then decide a near-tie the other way (found with other planted trees on the code before
    batching too). So every divergence must be such a near-tie, and at most 3 of 20 prompts
    may diverge (0 to 2 have, by CPU). The (untrained) drafter's trees carry a planted path of greedy's continuation
    so that drafts are accepted deep and KV compaction runs."""
    target, drafter, _ = _fp8({"target": smol["graphs"]["target", "fp8"],
                               "drafter_tree": smol["graphs"]["drafter", "fp8"]}, smollm2)
    assert target.min_rows == 2
    eos = set(smollm2.config.eos_token_ids)
    accepted, diverged = [], []
    for i, ids in enumerate(mtbench_ids):
        greedy = two_call(target, None, eos).generate(ids, SPEC_TOKENS).tokens
        spec = two_call(target, PlantedDrafter(drafter, len(ids), greedy, seed=i), eos).generate(ids, SPEC_TOKENS)
        assert spec.target_calls == 1 + spec.drafter_calls
        accepted += spec.accept_lengths
        if spec.tokens != greedy:
            j = next(j for j, (a, b) in enumerate(zip(greedy, spec.tokens)) if a != b)
            seq = ids + greedy[:j]
            target.reset()
            target.add_sequence(len(seq))
            logits = target.forward(torch.tensor([seq]), torch.arange(len(seq))[None], causal_mask(len(seq), 0),
                                    last_only=True).logits
            margin = float(logits[0, -1, greedy[j]] - logits[0, -1, spec.tokens[j]])
            diverged.append((i, j, round(margin, 4)))
    assert len(mtbench_ids) == 20
    assert max(accepted) >= 3 and sum(accepted) / len(accepted) > 1.5, "planted paths were not accepted: vacuous"
    print(f"FP8 speculative vs greedy: divergences (prompt, token, logit margin) {diverged}")
    assert all(abs(m) < FP8_NEAR_TIE for _, _, m in diverged), f"a divergence that is not an FP8 near-tie: {diverged}"
    assert len(diverged) <= 3, f"speculative FP8 output diverges from greedy FP8 on {len(diverged)} prompts: {diverged}"


def test_padded_one_row_calls_give_the_logits_of_multi_row_calls(smol, smollm2, mtbench_ids):
    """The premise of min_rows: the same token on the same past gives bit-identical logits in a
    1-row call padded to 2 rows, a 2-row call and a 17-row call. (An unpadded 1-row call may round
    differently on some CPUs: printed, not asserted, since on others it does not.)"""
    target = _fp8({"target": smol["graphs"]["target", "fp8"]}, smollm2).target
    ids = mtbench_ids[0]
    n = len(ids)

    def row0(T: int, min_rows: int) -> torch.Tensor:
        target.min_rows = min_rows
        target.reset()
        target.add_sequence(n + T + 2)
        target.forward(torch.tensor([ids]), torch.arange(n)[None], causal_mask(n, 0), last_only=True)
        target.commit([list(range(n))])
        toks = torch.tensor([[ids[-1]] + list(range(100, 100 + T - 1))])
        mask = torch.eye(T, dtype=torch.bool)
        mask[:, 0] = True
        logits = target.forward(toks, torch.full((1, T), n), mask[None]).logits
        return logits[0, 0]
    one, padded, two, many = row0(1, 1), row0(1, 2), row0(2, 1), row0(17, 1)
    assert torch.equal(padded, two) and torch.equal(two, many)
    print(f"1-row vs multi-row logits: max abs {float((one - many).abs().max()):.2e}")
