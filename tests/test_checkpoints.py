"""Checkpoint loading and writing: HF target folders (single file, sharded, .bin, tied),
drafter key layouts (SafeAILab, speculators / ModelOpt, .bin), the captured-layer numbering
conventions pinned against transformers, mismatch errors that name the file and the values,
and atomic writes."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import eagle_trt.checkpoints as ckpt
from eagle_trt.checkpoints import CheckpointError, load_drafter, load_target, random_drafter, save_drafter
from eagle_trt.config import CaptureLayers, ConfigError, DrafterConfig
from eagle_trt.models.target import causal_mask

from conftest import capturing, share, write_json, write_tiny_hf_target

L = 8            # layers of the module's target: EAGLE default (2, 4, 5) has no repeats
HID, VOCAB = 64, 96
DRAFT_VOCAB = 40


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return write_tiny_hf_target(tmp_path_factory.mktemp("target8"), layers=L, seed=3)


@pytest.fixture(scope="module")
def target(request, target_dir):
    return share(request, load_target(target_dir))


def target_logits_and_captured(loaded, ids, capture=None):
    m = (loaded if capture is None else capturing(loaded, capture)).model
    T = ids.shape[1]
    pk, pv = m.empty_past(ids.shape[0])
    with torch.no_grad():
        out = m(ids, torch.arange(T)[None].expand(ids.shape[0], -1), causal_mask(T, 0), pk, pv)
    return out.logits, out.captured


def hf_model(folder):
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager").eval()


def ids_for(seed=0, B=2, T=7):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


# ============================================================================= target

def test_default_tiny_target_loads(tmp_path):
    """conftest's write_tiny_hf_target default (6 layers) must load: the EAGLE default ids
    (2, L//2, L-3) are (2, 3, 3) there, a repeat that the captured tensor handles fine."""
    folder = write_tiny_hf_target(tmp_path / "t6")
    loaded = load_target(folder)
    _, captured = target_logits_and_captured(loaded, ids_for(T=4))
    assert captured.shape == (2, 4, 3 * HID)


def test_target_matches_transformers(target, target_dir):
    ids = ids_for()
    logits, _ = target_logits_and_captured(target, ids)
    with torch.no_grad():
        ref = hf_model(target_dir)(ids).logits
    assert (logits - ref).abs().max().item() < 1e-4
    assert target.config.num_hidden_layers == L and target.config.hidden_size == HID
    assert target.folder == target_dir


def test_captured_layers_pinned_to_transformers(target, target_dir):
    """input of layer i (ids 2, L//2, L-3) == output of layer i-1 (ids 1, L//2-1, L-4) ==
    HF hidden_states[2], [L//2], [L-3] (HF's hidden_states[i] is the input of layer i)."""
    ids = ids_for(seed=1)
    _, cap_in = target_logits_and_captured(target, ids, CaptureLayers((2, L // 2, L - 3), "layer_input"))
    _, cap_out = target_logits_and_captured(target, ids, CaptureLayers((1, L // 2 - 1, L - 4), "layer_output"))
    _, cap_default = target_logits_and_captured(target, ids, CaptureLayers.eagle_default(L))
    _, cap_shift = target_logits_and_captured(target, ids, CaptureLayers((2, L // 2, L - 3), "layer_output"))
    with torch.no_grad():
        hs = hf_model(target_dir)(ids, output_hidden_states=True).hidden_states
    assert len(hs) == L + 1
    ref = torch.cat([hs[2], hs[L // 2], hs[L - 3]], dim=-1)
    assert cap_in.shape == (2, 7, 3 * HID)
    assert torch.equal(cap_in, cap_out)
    assert torch.equal(cap_in, cap_default)
    assert (cap_in - ref).abs().max().item() < 1e-4
    assert (cap_shift - ref).abs().max().item() > 1e-2     # the off-by-one is visible


def _split_into_shards(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    tensors = load_file(str(src / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:]), start=1):
        shard = f"model-0000{i}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, str(dst / shard), metadata={"format": "pt"})
        weight_map.update({k: shard for k in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    write_json(dst / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})


def test_target_sharded_and_bin_load_identically(target, target_dir, tmp_path):
    sharded = tmp_path / "sharded"
    _split_into_shards(target_dir, sharded)
    assert len(list(sharded.glob("model-*.safetensors"))) == 2
    binf = tmp_path / "bin"
    shutil.copytree(target_dir, binf)
    torch.save(load_file(str(binf / "model.safetensors")), binf / "pytorch_model.bin")
    (binf / "model.safetensors").unlink()
    ref = target.model.state_dict()
    for folder in (sharded, binf):
        got = load_target(folder).model.state_dict()
        assert got.keys() == ref.keys()
        for k in ref:
            assert torch.equal(got[k], ref[k]), (folder.name, k)


def test_sharded_target_with_missing_shard_tensor(target_dir, tmp_path):
    sharded = tmp_path / "sharded"
    _split_into_shards(target_dir, sharded)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = "model-00001-of-00002.safetensors"
    write_json(sharded / "model.safetensors.index.json", index)
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json") as ei:
        load_target(sharded)
    assert "model.layers.9.mlp.up_proj.weight" in str(ei.value)


def test_tied_target_loads(tmp_path):
    folder = write_tiny_hf_target(tmp_path / "tied", layers=L, tie=True, seed=4)
    loaded = load_target(folder)
    assert loaded.config.tie_word_embeddings
    m = loaded.model
    assert m.lm_head.weight.data_ptr() == m.embed_tokens.weight.data_ptr()
    ids = ids_for(seed=2)
    logits, _ = target_logits_and_captured(loaded, ids)
    with torch.no_grad():
        ref = hf_model(folder)(ids).logits
    assert (logits - ref).abs().max().item() < 1e-4


def test_target_missing_tensor_named(target_dir, tmp_path):
    folder = tmp_path / "t"
    shutil.copytree(target_dir, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.3.mlp.up_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.safetensors") as ei:
        load_target(folder)
    assert "layers.3.mlp.up_proj.weight" in str(ei.value)


def test_target_missing_folder(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(CheckpointError, match="not found") as ei:
        load_target(missing)
    assert str(missing) in str(ei.value)


def test_target_folder_without_config(target_dir, tmp_path):
    folder = tmp_path / "noconfig"
    shutil.copytree(target_dir, folder)
    (folder / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json") as ei:
        load_target(folder)
    assert str(folder) in str(ei.value)


def test_target_unsupported_model_type(target_dir, tmp_path):
    folder = tmp_path / "gpt2"
    shutil.copytree(target_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    write_json(folder / "config.json", cfg)
    with pytest.raises(ConfigError, match="gpt2") as ei:
        load_target(folder)
    assert str(folder / "config.json") in str(ei.value)


# ============================================================================= drafter layouts

def drafter_outputs(drafter, seed=0, T=5):
    g = torch.Generator().manual_seed(seed)
    A, Ht = drafter.cfg.num_aux_hidden_states, drafter.cfg.target_hidden_size
    captured = torch.randn(1, T, A * Ht, generator=g)
    ids = torch.randint(0, VOCAB, (1, T), generator=g)
    pk, pv = drafter.empty_past(1)
    with torch.no_grad():
        out = drafter(drafter.project(captured), ids, torch.arange(T)[None], causal_mask(T, 0), pk, pv)
    return out.logits, out.feedback


def speculators_config(drafter, ids) -> dict:
    c = drafter.cfg
    return {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": {
            "model_type": "llama", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim, "num_hidden_layers": 1, "vocab_size": c.vocab_size,
            "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
            "max_position_embeddings": c.max_position_embeddings, "hidden_act": "silu",
        },
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(ids),
        "norm_before_residual": c.norm_before_residual,
        "fc_norm": c.fc_norm,
        "norm_output": c.norm_output,
    }


@pytest.fixture(params=["eagle3", "eagle3.1"])
def saved_drafter(request, target, tmp_path):
    d = random_drafter(target, request.param, seed=5, draft_vocab_size=DRAFT_VOCAB)
    folder = save_drafter(d, tmp_path / "safeailab")
    return d, folder


def test_save_drafter_safeailab_layout(saved_drafter):
    d, folder = saved_drafter
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    keys = set(load_file(str(folder / "model.safetensors")))
    assert any(k.startswith("midlayer.self_attn.") for k in keys)
    assert {"fc.weight", "d2t", "norm.weight", "lm_head.weight", "midlayer.hidden_norm.weight"} <= keys
    assert "embed_tokens.weight" not in keys          # shared with the target
    assert not any(k.startswith("layers.") for k in keys)
    assert ("fc_norm.0.weight" in keys) == (d.cfg.variant == "eagle3.1")
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["draft_vocab_size"] == DRAFT_VOCAB and cfg["target_hidden_size"] == HID
    assert cfg["fc_norm"] == cfg["norm_output"] == (d.cfg.variant == "eagle3.1")


def test_drafter_layouts_load_identically(saved_drafter, target, tmp_path):
    d, safeailab = saved_drafter
    tensors = load_file(str(safeailab / "model.safetensors"))

    spec = tmp_path / "speculators"
    spec.mkdir()
    renamed = {k.replace("midlayer.", "layers.0.", 1) if k.startswith("midlayer.") else k: v for k, v in tensors.items()}
    assert any(k.startswith("layers.0.") for k in renamed) and not any(k.startswith("midlayer") for k in renamed)
    save_file(renamed, str(spec / "model.safetensors"))
    write_json(spec / "config.json", speculators_config(d, (2, L // 2, L - 3)))

    binf = tmp_path / "bin"
    binf.mkdir()
    torch.save(tensors, binf / "pytorch_model.bin")
    shutil.copy(safeailab / "config.json", binf / "config.json")

    ref_logits, ref_fb = drafter_outputs(d)
    loaded = {name: load_drafter(folder, target) for name, folder in
              (("safeailab", safeailab), ("speculators", spec), ("bin", binf))}
    for name, ld in loaded.items():
        assert ld.cfg.variant == d.cfg.variant, name
        assert ld.embed_shared and ld.embed_tokens.weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()
        assert ld.cfg.capture_for(target.config).streams() == (2, L // 2, L - 3), name
        for k, v in d.state_dict().items():
            assert torch.equal(ld.state_dict()[k], v), (name, k)
        logits, fb = drafter_outputs(ld)
        assert torch.equal(logits, ref_logits), name
        assert torch.equal(fb, ref_fb), name
    assert torch.equal(loaded["speculators"].t2d, d.t2d)
    assert loaded["speculators"].cfg.capture == CaptureLayers((2, L // 2, L - 3), "layer_input")


def test_drafter_without_t2d_derives_it(saved_drafter, target, tmp_path):
    """ModelOpt omits t2d: it is rebuilt from the d2t offsets."""
    d, folder = saved_drafter
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["t2d"]
    save_file(tensors, str(folder / "model.safetensors"))
    ld = load_drafter(folder, target)
    assert torch.equal(ld.t2d, d.t2d)
    assert int(ld.t2d.sum()) == DRAFT_VOCAB


def test_modelopt_config_is_layer_output(target, tmp_path):
    d = random_drafter(target, "eagle3", seed=6)
    folder = save_drafter(d, tmp_path / "modelopt")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, L // 2 - 1, L - 4]}
    write_json(folder / "config.json", cfg)
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({k.replace("midlayer.", "layers.0.", 1): v for k, v in tensors.items()}, str(folder / "model.safetensors"))
    ld = load_drafter(folder, target)
    assert ld.cfg.capture == CaptureLayers((1, L // 2 - 1, L - 4), "layer_output")
    assert ld.cfg.capture.streams() == (2, L // 2, L - 3)
    assert torch.equal(drafter_outputs(ld)[0], drafter_outputs(d)[0])


def test_capture_conventions_from_config():
    base = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "vocab_size": 96}
    top = DrafterConfig.from_hf(dict(base, eagle_aux_hidden_state_layer_ids=[2, 10, 19]), "c")
    assert top.capture == CaptureLayers((2, 10, 19), "layer_input")
    assert top.capture.streams() == (2, 10, 19)
    nested = DrafterConfig.from_hf(dict(base, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 9, 18]}), "c")
    assert nested.capture == CaptureLayers((1, 9, 18), "layer_output")
    assert nested.capture.streams() == (2, 10, 19)          # the same tensors
    # An eagle_config block without ids does not change a top-level list's convention.
    both = DrafterConfig.from_hf(dict(base, eagle_aux_hidden_state_layer_ids=[2, 10, 19],
                                      eagle_config={"norm_before_fc": False}), "c")
    assert both.capture.convention == "layer_input"
    # Our own writer names the convention explicitly and it round-trips.
    explicit = DrafterConfig.from_hf(dict(base, eagle_aux_hidden_state_layer_ids=[1, 9, 18],
                                          aux_hidden_state_layer_convention="layer_output"), "c")
    assert DrafterConfig.from_hf(explicit.to_hf(), "c").capture == explicit.capture
    none = DrafterConfig.from_hf(base, "c")
    assert none.capture is None
    from eagle_trt.config import TargetConfig
    tcfg = TargetConfig.from_hf({"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
                                 "vocab_size": 96, "num_hidden_layers": 22}, "t")
    assert none.capture_for(tcfg) == CaptureLayers((2, 11, 19), "layer_input")
    assert CaptureLayers.eagle_default(30).layer_ids == (2, 15, 27)
    assert CaptureLayers((0, 5), "layer_input").streams() == (0, 5)
    assert CaptureLayers((0, 5), "layer_output").streams() == (1, 6)


# ============================================================================= drafter mismatch errors

def edit_config(folder: Path, **changes) -> Path:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    write_json(folder / "config.json", cfg)
    return folder / "config.json"


def edit_tensors(folder: Path, fn) -> Path:
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path))
    return path


@pytest.fixture
def good_drafter(target, tmp_path):
    return save_drafter(random_drafter(target, "eagle3.1", seed=7, draft_vocab_size=DRAFT_VOCAB),
                        tmp_path / "drafter")


def test_good_drafter_loads(good_drafter, target):
    assert load_drafter(good_drafter, target).cfg.variant == "eagle3.1"


def test_target_hidden_size_mismatch(good_drafter, target):
    path = edit_config(good_drafter, target_hidden_size=48)
    with pytest.raises(CheckpointError, match="target_hidden_size") as ei:
        load_drafter(good_drafter, target)
    msg = str(ei.value)
    assert str(path) in msg and "48" in msg and str(HID) in msg


def test_vocab_size_mismatch(good_drafter, target):
    path = edit_config(good_drafter, vocab_size=100)
    with pytest.raises(CheckpointError, match="vocab_size") as ei:
        load_drafter(good_drafter, target)
    msg = str(ei.value)
    assert str(path) in msg and "100" in msg and str(VOCAB) in msg


def test_aux_layer_beyond_target(good_drafter, target):
    path = edit_config(good_drafter, eagle_aux_hidden_state_layer_ids=[2, 4, 11])
    with pytest.raises(CheckpointError, match="11") as ei:
        load_drafter(good_drafter, target)
    msg = str(ei.value)
    assert str(path) in msg and str(L) in msg


def test_missing_tensor_named(good_drafter, target):
    path = edit_tensors(good_drafter, lambda t: t.pop("fc.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors.*fc\.weight") as ei:
        load_drafter(good_drafter, target)
    assert str(path) in str(ei.value)


def test_extra_tensor_named(good_drafter, target):
    path = edit_tensors(good_drafter, lambda t: t.__setitem__("foo.bar", torch.zeros(3)))
    with pytest.raises(CheckpointError, match=r"unexpected tensors.*foo\.bar") as ei:
        load_drafter(good_drafter, target)
    assert str(path) in str(ei.value)


def test_misshaped_tensor(good_drafter, target):
    def cut(t):
        t["midlayer.mlp.up_proj.weight"] = t["midlayer.mlp.up_proj.weight"][:-1].contiguous()
    path = edit_tensors(good_drafter, cut)
    with pytest.raises(CheckpointError, match=r"midlayer\.mlp\.up_proj\.weight") as ei:
        load_drafter(good_drafter, target)
    msg = str(ei.value)
    assert str(path) in msg and "(127, 64)" in msg and "(128, 64)" in msg


def test_missing_config(good_drafter, target):
    (good_drafter / "config.json").unlink()
    with pytest.raises((ConfigError, CheckpointError), match="not found") as ei:
        load_drafter(good_drafter, target)
    assert str(good_drafter / "config.json") in str(ei.value)


def test_missing_folder(target, tmp_path):
    with pytest.raises((ConfigError, CheckpointError), match="not found") as ei:
        load_drafter(tmp_path / "nothing", target)
    assert str(tmp_path / "nothing") in str(ei.value)


def test_missing_weights(good_drafter, target):
    (good_drafter / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no weights found") as ei:
        load_drafter(good_drafter, target)
    assert str(good_drafter) in str(ei.value)


def test_corrupt_safetensors(good_drafter, target):
    (good_drafter / "model.safetensors").write_bytes(os.urandom(4096))
    with pytest.raises(CheckpointError, match="safetensors") as ei:
        load_drafter(good_drafter, target)
    assert str(good_drafter / "model.safetensors") in str(ei.value)


def test_corrupt_bin(good_drafter, target):
    (good_drafter / "model.safetensors").unlink()
    (good_drafter / "pytorch_model.bin").write_bytes(os.urandom(4096))
    with pytest.raises(CheckpointError, match="cannot read") as ei:
        load_drafter(good_drafter, target)
    assert str(good_drafter / "pytorch_model.bin") in str(ei.value)


def test_invalid_json_config(good_drafter, target):
    (good_drafter / "config.json").write_text('{"hidden_size": 64,')
    with pytest.raises(ConfigError, match="not valid JSON") as ei:
        load_drafter(good_drafter, target)
    assert str(good_drafter / "config.json") in str(ei.value)


def test_reduced_vocab_without_d2t(good_drafter, target):
    path = edit_tensors(good_drafter, lambda t: t.pop("d2t"))
    with pytest.raises(CheckpointError, match="d2t") as ei:
        load_drafter(good_drafter, target)
    msg = str(ei.value)
    assert str(path) in msg and str(DRAFT_VOCAB) in msg and str(VOCAB) in msg


def test_d2t_out_of_range(good_drafter, target):
    """The last draft id maps to target id VOCAB + 7: the error names the file, the bad id
    and the vocabulary size."""
    def push(t):
        d2t = t["d2t"].clone()
        d2t[-1] = VOCAB + 7 - (DRAFT_VOCAB - 1)
        t["d2t"] = d2t
    path = edit_tensors(good_drafter, push)
    with pytest.raises(CheckpointError, match="d2t") as ei:
        load_drafter(good_drafter, target)
    msg = str(ei.value)
    assert str(path) in msg and (str(VOCAB) in msg or str(VOCAB - 1) in msg)
    assert str(VOCAB + 7) in msg, f"the offending target id is not named: {msg}"


def test_d2t_negative(good_drafter, target):
    def neg(t):
        d2t = t["d2t"].clone()
        d2t[0] = -1
        t["d2t"] = d2t
    edit_tensors(good_drafter, neg)
    with pytest.raises(CheckpointError, match="outside the target vocabulary"):
        load_drafter(good_drafter, target)


# ============================================================================= atomic save

def _siblings(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir())


def _failing_save_file(tensors, filename, metadata=None):
    Path(filename).write_bytes(b"partial")     # a half-written file, then the disk fills up
    raise OSError(28, "No space left on device")


def test_save_drafter_is_atomic_on_failure(target, tmp_path, monkeypatch):
    d = random_drafter(target, "eagle3", seed=8)
    parent = tmp_path / "out"
    parent.mkdir()
    (parent / "unrelated.txt").write_text("x")
    monkeypatch.setattr(ckpt, "save_file", _failing_save_file)
    with pytest.raises(OSError, match="No space"):
        save_drafter(d, parent / "drafter")
    assert not (parent / "drafter").exists()
    assert _siblings(parent) == ["unrelated.txt"]          # no temporary folder left behind


def test_save_drafter_failure_keeps_previous_checkpoint(target, tmp_path, monkeypatch):
    d_old = random_drafter(target, "eagle3", seed=9)
    dest = save_drafter(d_old, tmp_path / "drafter")
    before = {p.name: p.read_bytes() for p in dest.iterdir()}
    monkeypatch.setattr(ckpt, "save_file", _failing_save_file)
    with pytest.raises(OSError):
        save_drafter(random_drafter(target, "eagle3.1", seed=10), dest)
    assert {p.name: p.read_bytes() for p in dest.iterdir()} == before
    assert _siblings(tmp_path) == ["drafter"]
    monkeypatch.undo()
    ld = load_drafter(dest, target)
    assert torch.equal(drafter_outputs(ld)[0], drafter_outputs(d_old)[0])


def test_save_drafter_overwrites(target, tmp_path):
    dest = save_drafter(random_drafter(target, "eagle3", seed=11), tmp_path / "drafter")
    (dest / "stale.txt").write_text("old")
    d_new = random_drafter(target, "eagle3.1", seed=12, draft_vocab_size=DRAFT_VOCAB)
    save_drafter(d_new, dest)
    assert sorted(p.name for p in dest.iterdir()) == ["config.json", "model.safetensors"]
    assert _siblings(tmp_path) == ["drafter"]
    ld = load_drafter(dest, target)
    assert ld.cfg.variant == "eagle3.1"
    assert torch.equal(drafter_outputs(ld)[0], drafter_outputs(d_new)[0])


def test_random_drafter_from_the_config_alone_saves_what_random_drafter_makes(tiny_target, tmp_path):
    """The build makes its untrained drafter without loading the target's weights: saved and
    loaded against the target, it is random_drafter's drafter, embedding shared."""
    saved = save_drafter(ckpt.random_drafter_for(tiny_target.config, "eagle3.1", seed=3, draft_vocab_size=48),
                         tmp_path / "d")
    loaded = load_drafter(saved, tiny_target)
    made = random_drafter(tiny_target, "eagle3.1", seed=3, draft_vocab_size=48)
    assert loaded.embed_tokens.weight.data_ptr() == tiny_target.model.embed_tokens.weight.data_ptr()
    mine, theirs = loaded.state_dict(), made.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_random_drafter_is_drawn_in_blocks_and_in_its_dtype():
    """The random fallback drafter is made a block of draws at a time, in the drafter's dtype (a
    70B-wide one would be 9 GB in float32): the same numbers as one draw per tensor, rounded."""
    from eagle_trt.checkpoints import _normal_rows, random_drafter_for
    from eagle_trt.config import TargetConfig
    for shape, budget in (((100, 30), 700), ((64, 48), 1000), ((37, 8), 50), ((38, 8), 50), ((300,), 16)):
        whole = torch.randn(shape, generator=torch.Generator().manual_seed(3))
        blocks = list(_normal_rows(shape, torch.Generator().manual_seed(3), budget))
        assert len(blocks) > 1 or len(shape) == 1
        assert torch.equal(torch.cat([draws for _, draws in blocks]), whole), shape
    cfg = TargetConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    full = random_drafter_for(cfg, draft_vocab_size=48)
    half = random_drafter_for(cfg, draft_vocab_size=48, dtype=torch.float16)
    assert half.embed_tokens.weight.is_meta          # shared with the target: never made
    for (name, a), (_, b) in zip(full.state_dict().items(), half.state_dict().items()):
        if name != "embed_tokens.weight":
            assert torch.equal(a.to(b.dtype) if a.is_floating_point() else a, b), name
