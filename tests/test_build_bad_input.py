"""Bad input to `python -m eagle_trt.build`, on a tiny target through the code paths a real-size
one takes (safetensors shards with an index, weights in external data files): a shard missing or
truncated, a file system that fills up in the middle of the export. Each stops with one line
naming the file, leaves no half-written artifact, and the rerun resumes where it stopped. (kill -9
in the middle of a stage: test_build_stages.py.)"""
from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_build_support import tiny_config, write_char_tokenizer, write_config

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def run_cli(*args, env=None, limit_file_bytes: int | None = None):
    def limit():     # a file system that is full past this many bytes of any one file
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)       # write() then fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_file_bytes, limit_file_bytes))
    return subprocess.run([sys.executable, "-m", "eagle_trt.build", *args], capture_output=True, text=True,
                          check=False, env=env or ENV, cwd=ROOT, timeout=600,
                          preexec_fn=limit if limit_file_bytes else None)


def one_line_error(done) -> str:
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), last
    return last


def statuses(out: Path) -> dict[str, str]:
    return {s["name"]: s["status"] for s in json.loads((out / "manifest.json").read_text())["stages"]}


def leftovers(out: Path) -> list[str]:
    return [p.name for p in out.iterdir() if p.name.startswith((".tmp-", ".old-"))]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    """The tiny Llama in safetensors shards with an index (as transformers writes an 8B model), with a tokenizer."""
    import transformers
    from conftest import write_tiny_hf_target
    folder = tmp_path_factory.mktemp("bad_input")
    write_tiny_hf_target(folder / "single")
    model = transformers.LlamaForCausalLM.from_pretrained(str(folder / "single"))
    model.save_pretrained(str(folder / "target"), max_shard_size="200KB")
    write_char_tokenizer(folder / "target")
    assert len(list((folder / "target").glob("model-*.safetensors"))) > 2
    return folder / "target"


def test_a_missing_or_truncated_shard_is_named_before_any_stage_and_the_rerun_resumes(sharded, tmp_path):
    from eagle_trt.build import build, config_from_dict
    from eagle_trt.checkpoints import CheckpointError
    target = tmp_path / "target"
    shutil.copytree(sharded, target)
    cfg = config_from_dict(tiny_config(target), "tiny.yaml")
    out = tmp_path / "out"
    build(cfg, out, ["export"], log=None)
    shard = sorted(target.glob("model-*.safetensors"))[1]
    saved = tmp_path / "saved.safetensors"
    shutil.move(shard, saved)
    with pytest.raises(CheckpointError, match=f"{shard}: shard listed in model.safetensors.index.json is missing"):
        build(cfg, out, ["export"], log=None)
    shutil.copy(saved, shard)
    with open(shard, "r+b") as f:
        f.truncate(saved.stat().st_size - 1000)
    with pytest.raises(CheckpointError, match=rf"{shard}: truncated: tensor '[\w.]+' needs bytes up to \d+, the file "
                                              rf"has \d+; copy or download this file again"):
        build(cfg, out, ["export"], log=None)
    assert (out / "export" / "target.onnx").is_file(), "the finished stage stays"
    assert statuses(out)["validate"] == "failed"
    shutil.copy(saved, shard)       # the file as it was: nothing to redo
    build(cfg, out, ["export"], log=None)
    assert statuses(out)["validate"] == statuses(out)["export"] == "cached"


def test_a_full_disk_in_the_middle_of_the_export_names_the_file_and_the_rerun_resumes(sharded, tmp_path, monkeypatch):
    """The target's weights file cannot grow past 400 kB (of ~0.9 MB): the export stops with the
    file named, its temp folder is removed, and the rerun with room to write completes it."""
    env = dict(ENV, EAGLE_TRT_EXTERNAL_DATA_BYTES="0")       # weights in a data file, as at real size
    cfg = write_config(tmp_path / "tiny.yaml", tiny_config(sharded))
    out = tmp_path / "out"
    last = one_line_error(run_cli("--config", str(cfg), "--output", str(out), "--stages", "export", env=env,
                                  limit_file_bytes=400_000))
    assert "the export stage stopped:" in last and "target.onnx.data: File too large after writing" in last, last
    assert "run the build again" in last
    assert not (out / "export").exists() and leftovers(out) == []
    assert statuses(out)["export"] == "failed" and statuses(out)["validate"] == "ran"
    monkeypatch.setenv("EAGLE_TRT_EXTERNAL_DATA_BYTES", "0")
    from eagle_trt.build import build, load_config
    build(load_config(cfg), out, ["export"], log=None)
    assert statuses(out)["validate"] == "cached" and statuses(out)["export"] == "ran"
    assert (out / "export" / "target.onnx.data").stat().st_size > 400_000


def test_a_drafter_made_for_another_target_is_refused_at_validate_naming_the_tensor(sharded, tmp_path):
    """A drafter checkpoint whose tensors do not fit the target (its config claims the target's
    width, one tensor is another width) stops the build at validate, from the files' headers,
    with one line naming the file and the tensor: no stage writes anything."""
    import torch
    from safetensors.torch import load_file, save_file

    from eagle_trt.checkpoints import TargetConfig, random_drafter_for, save_drafter
    from eagle_trt.config import read_json
    tcfg = TargetConfig.from_hf(read_json(sharded / "config.json"), str(sharded / "config.json"))
    drafter = save_drafter(random_drafter_for(tcfg, draft_vocab_size=48), tmp_path / "drafter")
    tensors = load_file(str(drafter / "model.safetensors"))
    up = tensors["midlayer.mlp.up_proj.weight"]
    tensors["midlayer.mlp.up_proj.weight"] = torch.zeros(up.shape[0], up.shape[1] * 2)      # another width's
    save_file(tensors, str(drafter / "model.safetensors"))
    out = tmp_path / "out"
    cfg = write_config(tmp_path / "bad.yaml", tiny_config(sharded, drafter={"source": str(drafter)}))
    last = one_line_error(run_cli("--config", str(cfg), "--output", str(out)))
    assert str(drafter / "model.safetensors") in last and "'midlayer.mlp.up_proj.weight'" in last, last
    assert f"{tuple(up.shape[:1]) + (up.shape[1] * 2,)}" in last and f"{tuple(up.shape)}" in last, last
    written = [p.name for p in out.iterdir()] if out.exists() else []
    assert not any(p in written for p in ("validate", "export", "quantize", "parity", "triton")), written
