"""Target families beyond plain Llama, each exact against transformers or refused.

Every case is a small random checkpoint written by transformers itself. Greedy speculative
decoding (a real EAGLE drafter whose trees are planted with the reference continuation, so
acceptance runs deep and tree masks cross the sliding window) must equal transformers' own
greedy generation, token for token, on the PyTorch backend and on the exported ONNX graphs.
Each case also has a control: the same checkpoint with the feature turned off in transformers
generates something else, so the test would fail if the feature were ignored."""
from __future__ import annotations

import json
import math
import shutil
import tempfile

import pytest
import torch

from eagle_trt.checkpoints import load_target, random_drafter
from eagle_trt.config import TreeShape
from eagle_trt.export import export_drafter_tree, export_target
from eagle_trt.export.cpu_attention import FusedAttentionError, check_fusable, fuse_attention
from eagle_trt.runtime.backend import TorchDrafter, TorchTarget
from eagle_trt.runtime.onnxruntime_backend import OrtDrafter, OrtTarget

from conftest import (HF_FAMILIES, NEW_TOKENS, capturing, check_planted_greedy, random_prompts, share,
                      write_tiny_hf_target)

VOCAB = 128
SHAPE = TreeShape(depth=5, top_k=3, total_tokens=16)
WINDOW = 6
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}


def _no_biases(model):
    for name, p in model.named_parameters():
        if name.endswith(".bias"):
            p.zero_()


def _no_qk_norm(model):
    for layer in model.model.layers:
        layer.self_attn.q_norm = torch.nn.Identity()
        layer.self_attn.k_norm = torch.nn.Identity()


def _full_attention(cfg):
    cfg["use_sliding_window"] = False
    cfg["layer_types"] = ["full_attention"] * cfg["num_hidden_layers"]


# name: (family, config extras, what is exercised, control: ("config", edit) or ("model", edit))
CASES = {
    "qwen2-biases": ("qwen2", {}, ("model", _no_biases)),
    "qwen2-sliding": ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2),
                      ("config", _full_attention)),
    "qwen3-qk-norm": ("qwen3", dict(head_dim=16), ("model", _no_qk_norm)),
    "qwen3-sliding-yarn": ("qwen3", dict(head_dim=16, use_sliding_window=True, sliding_window=WINDOW,
                                         max_window_layers=3, rope_parameters=dict(YARN, rope_theta=10000.0)),
                           ("config", _full_attention)),
    "mistral-sliding": ("mistral", dict(sliding_window=WINDOW), ("config", lambda c: c.update(sliding_window=None))),
    "smollm3-no-rope": ("smollm3", dict(no_rope_layer_interval=2),
                        ("config", lambda c: c.update(no_rope_layers=[1] * c["num_hidden_layers"]))),
    "llama-yarn": ("llama", dict(rope_scaling=YARN),
                   ("config", lambda c: c.update(rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                                 rope_scaling=None))),
    "llama-biases": ("llama", dict(attention_bias=True, mlp_bias=True), ("model", _no_biases)),
}


def _hf(folder):
    import transformers
    cls = getattr(transformers, HF_FAMILIES[json.loads((folder / "config.json").read_text())["model_type"]][1])
    model = cls.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None   # the full length, whatever comes out
    return model


def _greedy(model, prompts) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False,
                               pad_token_id=0)
            out.append(y[0, len(ids):].tolist())
    return out


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    family, extra, control = CASES[request.param]
    extra = dict(extra)
    rope = extra.pop("rope_scaling", None)
    folder = write_tiny_hf_target(tmp_path_factory.mktemp(request.param), family=family, vocab=VOCAB, layers=4,
                                  seed=5, std=0.25, rope_scaling=rope, extra=extra)
    prompts = random_prompts(VOCAB, (40, 23))
    references = _greedy(_hf(folder), prompts)
    # The control: the same checkpoint, feature off, in transformers.
    where, edit = control
    if where == "config":
        off = tmp_path_factory.mktemp(request.param + "-off")
        shutil.copytree(folder, off, dirs_exist_ok=True)
        cfg = json.loads((off / "config.json").read_text())
        edit(cfg)
        (off / "config.json").write_text(json.dumps(cfg))
        without = _greedy(_hf(off), prompts)
    else:
        model = _hf(folder)
        with torch.no_grad():
            edit(model)
        without = _greedy(model, prompts)
    return request.param, folder, prompts, references, without


def test_reference_depends_on_the_feature(case):
    name, _, _, references, without = case
    for ref in references:
        assert len(set(ref)) >= 20, f"{name}: the reference repeats itself; the weights do not make context matter"
    assert without != references, f"{name}: turning the feature off changes nothing, so the test could not fail"


@pytest.mark.parametrize("backend", ["torch", "onnxruntime", "onnxruntime fused"])
def test_speculative_greedy_equals_transformers(case, backend, tmp_path):
    """"onnxruntime fused": the CPU target graph (export/cpu_attention.py: GroupQueryAttention,
    packed q / k / v and gate / up projections with their biases) where the family maps to it."""
    name, folder, prompts, references, _ = case
    target = load_target(folder)
    drafter = random_drafter(target, "eagle3.1", seed=1, draft_vocab_size=64)
    target.model.set_capture(drafter.cfg.capture_for(target.config))
    if backend == "torch":
        t, d = TorchTarget(target.model), TorchDrafter(drafter, SHAPE)
    else:
        graph = export_target(target.model, tmp_path / "target.onnx").path
        if backend == "onnxruntime fused":
            try:
                check_fusable(target.config, name)
            except FusedAttentionError as e:
                pytest.skip(str(e))
            counts = fuse_attention(graph, tmp_path / "target_fused.onnx", target.config)
            assert counts["packed_layers"] == target.config.num_hidden_layers
            graph = tmp_path / "target_fused.onnx"
        t = OrtTarget(graph, target.config.max_position_embeddings)
        d = OrtDrafter(export_drafter_tree(drafter, SHAPE, tmp_path / "drafter_tree.onnx").path, SHAPE)
    # the fused graph verifies one sequence a call: its batched pass would be refused
    check_planted_greedy(t, d, prompts, references, eos=(), batch=0 if backend == "onnxruntime fused" else 2)


def test_family_configs_round_trip(case):
    """to_hf writes what from_hf reads: the arch switches survive (GGUF conversion writes it)."""
    from eagle_trt.config import TargetConfig
    _, folder, _, _, _ = case
    cfg = load_target(folder).config
    again = TargetConfig.from_hf(cfg.to_hf(), "round trip")
    assert again.arch == cfg.arch and again.rope_scaling == cfg.rope_scaling and again.head_dim == cfg.head_dim


def test_random_drafter_fallback_leaves_nothing_on_disk(tmp_path, monkeypatch):
    from test_build_support import write_tiny_target

    from eagle_trt.api import prepare_models
    folder = write_tiny_target(tmp_path / "target", family="qwen3", extra=dict(head_dim=16))
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    models = prepare_models(str(folder), None)
    assert models.drafter_source.startswith("random") and models.drafter.cfg.variant == "eagle3.1"
    assert list(scratch.iterdir()) == []


# ============================================================================= drafter layers

def _qwen3_layer_drafter(target):
    """A drafter whose decoder layer is a Qwen3 layer (q_norm / k_norm), saved as speculators
    writes it: `layers.0.*` keys, the layer shape under transformer_layer_config."""
    import dataclasses

    from eagle_trt.config import Arch
    from eagle_trt.models.drafter import EagleDrafter
    base = random_drafter(target, "eagle3.1", seed=2, draft_vocab_size=64)
    cfg = dataclasses.replace(base.cfg, arch=Arch(model_type="qwen3", qk_norm=True))
    drafter = EagleDrafter(cfg)
    state = base.state_dict()
    g = torch.Generator().manual_seed(3)
    for name in ("midlayer.self_attn.q_norm.weight", "midlayer.self_attn.k_norm.weight"):
        state[name] = 1.0 + 0.5 * torch.randn(cfg.head_dim, generator=g)
    drafter.load_state_dict(state)
    return drafter.eval()


def _save_speculators(drafter, folder):
    from safetensors.torch import save_file
    c = drafter.cfg
    folder.mkdir()
    tensors = {k.replace("midlayer.", "layers.0.", 1): v.contiguous() for k, v in drafter.state_dict().items()
               if k != "embed_tokens.weight"}
    save_file(tensors, str(folder / "model.safetensors"))
    layer = {"model_type": "qwen3", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
             "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
             "head_dim": c.head_dim, "num_hidden_layers": 1, "vocab_size": c.vocab_size, "rms_norm_eps": c.rms_norm_eps,
             "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position_embeddings, "hidden_act": "silu",
             "attention_bias": False, "use_sliding_window": False, "sliding_window": None, "max_window_layers": 1,
             "tie_word_embeddings": True, "attention_dropout": 0.0}
    config = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"], "speculators_version": "0.3.0",
              "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy"},
              "transformer_layer_config": layer, "draft_vocab_size": c.draft_vocab_size,
              "target_hidden_size": c.target_hidden_size, "norm_before_residual": False, "fc_norm": True,
              "norm_output": True}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def qwen3_target(request, tmp_path_factory):
    folder = write_tiny_hf_target(tmp_path_factory.mktemp("qwen3"), family="qwen3", vocab=VOCAB, layers=4, seed=5,
                                  std=0.25, extra=dict(head_dim=16))
    prompts = random_prompts(VOCAB, (30, 17))
    return share(request, load_target(folder), "qwen3_target target"), prompts, _greedy(_hf(folder), prompts)


def test_qwen3_layer_drafter_in_speculators_layout_is_lossless(qwen3_target, tmp_path):
    from eagle_trt.checkpoints import load_drafter
    target, prompts, references = qwen3_target
    drafter = _qwen3_layer_drafter(target)
    loaded = load_drafter(_save_speculators(drafter, tmp_path / "spec"), target)
    assert loaded.cfg.arch.qk_norm and hasattr(loaded.midlayer.self_attn, "q_norm")
    for k, v in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    # The q/k norm weights are used: unit weights give other draft logits.
    from test_checkpoints import drafter_outputs
    plain = _qwen3_layer_drafter(target)
    with torch.no_grad():
        plain.midlayer.self_attn.q_norm.weight.fill_(1.0)
    assert not torch.allclose(drafter_outputs(loaded)[0], drafter_outputs(plain)[0])
    check_planted_greedy(TorchTarget(capturing(target, loaded).model), TorchDrafter(loaded, SHAPE), prompts, references,
                         eos=())


def test_qwen3_layer_keys_under_a_llama_config_are_named_as_in_the_file(qwen3_target, tmp_path):
    from eagle_trt.checkpoints import CheckpointError, load_drafter
    target, _, _ = qwen3_target
    folder = _save_speculators(_qwen3_layer_drafter(target), tmp_path / "spec")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["transformer_layer_config"]["model_type"] = "llama"
    for key in ("use_sliding_window", "sliding_window", "max_window_layers"):
        del cfg["transformer_layer_config"][key]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"unexpected tensors \['layers\.0\.self_attn\.k_norm\.weight'"):
        load_drafter(folder, target)


def test_modelopt_default_config_with_yarn_loads_and_is_lossless(qwen3_target, tmp_path):
    """ModelOpt's EAGLE-3 exporter writes YaRN RoPE (factor 32, original 2048) and an
    eagle_config block; both are read (YaRN as transformers computes it) and decode losslessly."""
    from eagle_trt.checkpoints import load_drafter, save_drafter
    target, prompts, references = qwen3_target
    folder = save_drafter(random_drafter(target, "eagle3", seed=4, draft_vocab_size=64), tmp_path / "modelopt")
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("aux_hidden_state_layer_convention", None)
    L = target.config.num_hidden_layers
    cfg.update(rope_scaling={"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 2048},
               eagle_config={"eagle_aux_hidden_state_layer_ids": [1, L // 2 - 1, L - 4], "use_aux_hidden_state": True,
                             "use_input_layernorm_in_first_layer": True, "use_last_layernorm": True,
                             "use_mtp_layernorm": False, "next_layer_regular": True, "parallel_draft_step": 1,
                             "parallel_draft_heads_num_layers": 1}, pretraining_tp=1, torch_dtype="bfloat16")
    cfg.pop("eagle_aux_hidden_state_layer_ids", None)
    (folder / "config.json").write_text(json.dumps(cfg))
    drafter = load_drafter(folder, target)
    assert drafter.cfg.rope_scaling["rope_type"] == "yarn"
    assert drafter.rope.attention_factor == pytest.approx(0.1 * math.log(32.0) + 1.0)
    check_planted_greedy(TorchTarget(capturing(target, drafter).model), TorchDrafter(drafter, SHAPE), prompts, references,
                         eos=())


# ============================================================================= refusals

def _edit(cfg, **changes):
    cfg.update(changes)


# (family of the checkpoint, config edit, fragment the one-line error must name)
REFUSALS = {
    "unknown key": ("llama", lambda c: _edit(c, attn_logit_softcapping=30.0), "attn_logit_softcapping"),
    "quantized checkpoint": ("qwen3", lambda c: _edit(c, quantization_config={"quant_method": "fp8"}),
                             "quantization_config"),
    "dynamic rope": ("llama", lambda c: _edit(c, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                  "rope_theta": 10000.0}), "dynamic"),
    "longrope": ("qwen2", lambda c: _edit(c, rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                              "short_factor": [1.0], "long_factor": [1.0]}), "longrope"),
    "unknown yarn key": ("qwen3", lambda c: _edit(c, rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                                      "rope_theta": 1e4, "low_freq": 2}), "low_freq"),
    "partial rotary": ("llama", lambda c: _edit(c, partial_rotary_factor=0.5), "partial_rotary_factor"),
    "gelu": ("llama", lambda c: _edit(c, hidden_act="gelu"), "hidden_act"),
    "mistral layer_types": ("mistral", lambda c: _edit(c, layer_types=["full_attention"] * 4), "layer_types"),
    "qwen2 mrope": ("qwen2", lambda c: _edit(c, use_mrope=True), "use_mrope"),
    "moe": ("qwen3", lambda c: _edit(c, model_type="qwen3_moe"), "qwen3_moe"),
    "sliding without a window": ("qwen3", lambda c: _edit(c, use_sliding_window=False, sliding_window=None,
                                                          layer_types=["sliding_attention"] * 4), "layer_types"),
    "bad no_rope_layers": ("smollm3", lambda c: _edit(c, no_rope_layers=[1, 0]), "no_rope_layers"),
    "nested per-layer rope": ("llama", lambda c: _edit(c, rope_parameters={"full_attention": {"rope_type": "default"}}),
                              "full_attention"),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_unsupported_keys_are_refused_in_one_line(name, tmp_path, monkeypatch, capsys):
    from eagle_trt.generate import main
    family, edit, fragment = REFUSALS[name]
    folder = write_tiny_hf_target(tmp_path / "target", family=family, layers=4,
                                  extra=dict(head_dim=16) if family == "qwen3" else None)
    cfg = json.loads((folder / "config.json").read_text())
    edit(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))
    before = sorted(p.name for p in folder.iterdir())
    scratch, cache = tmp_path / "tmp", tmp_path / "cache"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    monkeypatch.setenv("EAGLE_TRT_CACHE", str(cache))
    capsys.readouterr()   # transformers' own output while writing the checkpoint
    code = main(["--target", str(folder), "--prompt", "hello", "--backend", "onnxruntime",
                 "--onnx-dir", str(tmp_path / "onnx")])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert fragment in err and str(folder / "config.json") in err, err
    assert sorted(p.name for p in folder.iterdir()) == before
    assert not (tmp_path / "onnx").exists() and not cache.exists() and list(scratch.iterdir()) == []


DRAFTER_REFUSALS = {
    "two layers": (lambda c: _edit(c, num_hidden_layers=2), "num_hidden_layers"),
    "no last layernorm": (lambda c: _edit(c, eagle_config={"use_last_layernorm": False}), "use_last_layernorm"),
    "EAGLE-1 speculators": (lambda c: _edit(c, speculators_model_type="eagle"), "speculators_model_type"),
    "unknown drafter key": (lambda c: _edit(c, num_eagle_features=1), "num_eagle_features"),
    "sliding drafter layer": (lambda c: _edit(c, model_type="mistral", sliding_window=8), "sliding window"),
}


@pytest.mark.parametrize("name", list(DRAFTER_REFUSALS))
def test_unsupported_drafter_keys_are_refused(name, qwen3_target, tmp_path):
    from eagle_trt.checkpoints import load_drafter, save_drafter
    from eagle_trt.config import ConfigError
    edit, fragment = DRAFTER_REFUSALS[name]
    target, _, _ = qwen3_target
    folder = save_drafter(random_drafter(target, "eagle3", seed=4, draft_vocab_size=64), tmp_path / "d")
    cfg = json.loads((folder / "config.json").read_text())
    edit(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=fragment) as ei:
        load_drafter(folder, target)
    assert str(folder / "config.json") in str(ei.value) and "\n" not in str(ei.value)


# ============================================================================= quantization

@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("name", ["qwen2-sliding", "qwen3-qk-norm", "llama-biases"])
def test_quantized_family_graphs_match_the_fake_quant_reference(name, fmt, tmp_path):
    """Biases stay float after the quantized MatMul, q/k norms and windows pass through the
    Q/DQ rewrite: the graph equals the fake-quant model MatMul by MatMul, and end to end (FP8)."""
    import numpy as np

    from eagle_trt.models.target import causal_mask
    from eagle_trt.quant import QuantConfig, calibrate_target, layer_parity, linear_paths, quantize_onnx, quantized_copy
    from eagle_trt.quant import run_graph
    family, extra, _ = CASES[name]
    target = load_target(write_tiny_hf_target(tmp_path / "t", family=family, vocab=VOCAB, layers=4, seed=5, std=0.25,
                                              extra=extra))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (12, 17, 22)]
    amax = calibrate_target(target.model, prompts)
    graph = export_target(target.model, tmp_path / "target.onnx").path
    quantize_onnx(graph, tmp_path / f"target.{fmt}.onnx", QuantConfig(fmt), amax, linear_paths(target.model))
    reference, _ = quantized_copy(target.model, QuantConfig(fmt), amax)
    ids = prompts[2]
    T = len(ids)
    feeds = {"input_ids": np.array([ids]), "position_ids": np.arange(T)[None], "attention_mask": causal_mask(T, 0).numpy(),
             "logits_index": np.arange(T)}
    pk, pv = target.model.empty_past()
    for i in range(target.config.num_hidden_layers):
        feeds[f"past_key_{i}"], feeds[f"past_value_{i}"] = pk[i].numpy(), pv[i].numpy()
    with torch.no_grad():
        ref = reference(torch.tensor([ids]), torch.arange(T)[None], causal_mask(T, 0), pk, pv).logits
    got = torch.from_numpy(run_graph(tmp_path / f"target.{fmt}.onnx", feeds)["logits"])
    worst = max(r.rel_l2 for r in layer_parity(str(tmp_path / f"target.{fmt}.onnx"), reference, feeds))
    assert worst <= 1e-5
    if fmt == "fp8":
        # NVFP4 end to end is not a sharp test (eagle_trt/quant/check.py): onnx.reference and torch
        # differ in the last float bit outside the MatMuls, and a value on an FP4 rounding boundary
        # then flips a whole step (llama-biases: 0.19 rel L2 while every MatMul matches to 1.4e-7).
        assert float((got - ref).norm() / ref.norm()) <= 1e-3


def test_null_keys_are_unset_and_conflicting_rope_is_refused():
    from eagle_trt.config import ConfigError, TargetConfig
    base = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
            "vocab_size": 96, "num_hidden_layers": 4}
    # ModelOpt's template and old transformers write nulls for unset keys: not refused.
    cfg = TargetConfig.from_hf(dict(base, quantization_config=None, rope_scaling=None, some_future_key=None), "c")
    assert cfg.rope_scaling is None
    with pytest.raises(ConfigError, match="some_future_key"):
        TargetConfig.from_hf(dict(base, some_future_key=1), "c")
    both = dict(base, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ConfigError, match="disagree"):
        TargetConfig.from_hf(both, "c")


def test_llama3_rope_without_original_length_takes_the_context_length():
    """transformers fills original_max_position_embeddings from max_position_embeddings."""
    from eagle_trt.config import TargetConfig
    base = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
            "vocab_size": 96, "num_hidden_layers": 4, "max_position_embeddings": 4096}
    cfg = TargetConfig.from_hf(dict(base, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 4.0}), "c")
    assert cfg.rope_scaling["original_max_position_embeddings"] == 4096


def test_public_config_key_sets_load():
    """The key sets of the public Qwen2.5-7B-Instruct, Qwen3-8B, Mistral-7B-Instruct-v0.3 and
    SmolLM3-3B config.json files (sizes shrunk) are understood, none refused."""
    from eagle_trt.config import TargetConfig
    shape = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
             "num_hidden_layers": 4, "vocab_size": 96, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
             "architectures": ["X"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
             "initializer_range": 0.02, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
             "transformers_version": "4.51.0", "use_cache": True}
    configs = {
        "qwen2": dict(rope_theta=1e6, rope_scaling=None, sliding_window=131072, use_sliding_window=False,
                      max_window_layers=28),
        "qwen3": dict(attention_bias=False, head_dim=16, rope_theta=1e6, rope_scaling=None, sliding_window=None,
                      use_sliding_window=False, max_window_layers=36),
        "mistral": dict(rope_theta=1e6, sliding_window=None, head_dim=16),
        "smollm3": dict(attention_bias=False, mlp_bias=False, max_window_layers=28, no_rope_layer_interval=4,
                        no_rope_layers=[1, 1, 1, 0], pad_token_id=3, pretraining_tp=2, rope_scaling=None,
                        rope_theta=5e6, sliding_window=None, use_sliding_window=False),
    }
    for family, extra in configs.items():
        cfg = TargetConfig.from_hf(dict(shape, model_type=family, **extra), family)
        assert cfg.arch.sliding_layers == () and cfg.arch.nope_layers == ((3,) if family == "smollm3" else ())


def test_public_drafter_config_key_sets_load():
    """SafeAILab's EAGLE3-LLaMA3.1-Instruct-8B config.json and ModelOpt's export template (sizes
    shrunk, null values as the template writes them) are understood, none refused."""
    from eagle_trt.config import DrafterConfig
    safeailab = {"architectures": ["LlamaForCausalLMEagle3"], "bos_token_id": 128000, "eos_token_id": 128001,
                 "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 128,
                 "max_position_embeddings": 2048, "model_type": "llama", "num_attention_heads": 4,
                 "num_key_value_heads": 2, "num_hidden_layers": 1, "pad_token_id": 0, "rms_norm_eps": 1e-05,
                 "tie_word_embeddings": False, "torch_dtype": "float16", "transformers_version": "4.28.1",
                 "use_cache": True, "vocab_size": 96, "draft_vocab_size": 32}
    cfg = DrafterConfig.from_hf(safeailab, "safeailab")
    assert cfg.variant == "eagle3" and cfg.draft_vocab_size == 32 and cfg.capture is None
    modelopt = dict(safeailab, attention_bias=False, attention_dropout=0.0, head_dim=16, mlp_bias=False, pretraining_tp=1,
                    rope_scaling={"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 2048},
                    rope_theta=500000.0, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 4],
                                                       "use_aux_hidden_state": True,
                                                       "use_input_layernorm_in_first_layer": True,
                                                       "use_last_layernorm": True, "use_mtp_layernorm": False,
                                                       "next_layer_regular": True, "parallel_draft_step": 1,
                                                       "parallel_draft_heads_num_layers": None})
    cfg = DrafterConfig.from_hf(modelopt, "modelopt")
    assert cfg.capture.convention == "layer_output" and cfg.rope_scaling["rope_type"] == "yarn"
    speculators = {"architectures": ["Eagle3DraftModel"], "draft_vocab_size": 32, "dtype": "bfloat16",
                   "eagle_aux_hidden_state_layer_ids": [2, 3, 4], "embed_requires_grad": False,
                   "has_no_defaults_at_init": False, "norm_before_fc": False, "norm_before_residual": True,
                   "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                          "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                          "verifier": {"architectures": [], "name_or_path": "some/target"}},
                   "speculators_model_type": "eagle3", "speculators_version": "0.4.0.1", "target_hidden_size": None,
                   "tie_word_embeddings": False, "transformers_version": "4.57.0",
                   "transformer_layer_config": {"attention_bias": False, "head_dim": 16, "hidden_act": "silu",
                                                "hidden_size": 64, "intermediate_size": 128,
                                                "max_position_embeddings": 4096, "model_type": "qwen3",
                                                "num_attention_heads": 4, "num_hidden_layers": 1,
                                                "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
                                                "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
                                                "tie_word_embeddings": True, "vocab_size": 96,
                                                "use_sliding_window": False, "sliding_window": None,
                                                "max_window_layers": 28, "layer_types": ["full_attention"]}}
    cfg = DrafterConfig.from_hf(speculators, "speculators")
    assert cfg.arch.qk_norm and cfg.norm_before_residual and cfg.capture.convention == "layer_input"
