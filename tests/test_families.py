"""Target families beyond plain Llama, each exact against transformers or refused.

Every case is a small random checkpoint written by transformers itself. Greedy speculative
decoding (a real EAGLE drafter whose trees are planted with the reference continuation, so
acceptance runs deep and tree masks cross the sliding window) must equal transformers' own
greedy generation, token for token, on the PyTorch backend and on the exported ONNX graphs.
Each case also has a control: the same checkpoint with the feature turned off in transformers
generates something else, so the test would fail if the feature were ignored."""
from __future__ import annotations

import json
import shutil
import tempfile

import pytest
import torch

from eagle_trt.checkpoints import load_target, random_drafter
from eagle_trt.config import TreeShape
from eagle_trt.export import export_drafter_tree, export_target
from eagle_trt.runtime.backend import TorchDrafter, TorchTarget
from eagle_trt.runtime.onnxruntime_backend import OrtDrafter, OrtTarget

from conftest import HF_FAMILIES, NEW_TOKENS, check_planted_greedy, write_tiny_hf_target

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
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (40, 23)]
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


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_speculative_greedy_equals_transformers(case, backend, tmp_path):
    name, folder, prompts, references, _ = case
    target = load_target(folder)
    drafter = random_drafter(target, "eagle3.1", seed=1, draft_vocab_size=64)
    target.model.set_capture(drafter.cfg.capture_for(target.config))
    if backend == "torch":
        t, d = TorchTarget(target.model), TorchDrafter(drafter, SHAPE)
    else:
        t = OrtTarget(export_target(target.model, tmp_path / "target.onnx").path, target.config.max_position_embeddings)
        d = OrtDrafter(export_drafter_tree(drafter, SHAPE, tmp_path / "drafter_tree.onnx").path, SHAPE)
    check_planted_greedy(t, d, prompts, references, eos=())


def test_family_configs_round_trip(case):
    """to_hf writes what from_hf reads: the arch switches survive (GGUF conversion writes it)."""
    from eagle_trt.config import TargetConfig
    _, folder, _, _, _ = case
    cfg = load_target(folder).config
    again = TargetConfig.from_hf(cfg.to_hf(), "round trip")
    assert again.arch == cfg.arch and again.rope_scaling == cfg.rope_scaling and again.head_dim == cfg.head_dim


def test_random_drafter_fallback_leaves_nothing_on_disk(tmp_path, monkeypatch):
    from eagle_trt.api import prepare_models
    from eagle_trt.checkpoints import CheckpointError
    folder = write_tiny_hf_target(tmp_path / "target", family="qwen3", extra=dict(head_dim=16))
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    try:
        models = prepare_models(str(folder), None)
        assert models.drafter_source.startswith("random")
    except CheckpointError as exc:   # the tiny checkpoint has no tokenizer: loaded after the drafter
        assert "tokenizer" in str(exc)
    assert list(scratch.iterdir()) == []
