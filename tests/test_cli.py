"""python -m eagle_trt.generate on the real SmolLM2 weights, and its errors on bad input."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eagle_trt.checkpoints import random_drafter, save_drafter
from eagle_trt.generate import main

REPO = Path(__file__).resolve().parents[1]


def run_cli(args, capsys):
    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.slow
def test_module_entry_point_prints_json():
    """The real `python -m` entry point, in a fresh interpreter."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "eagle_trt.generate", "--prompt", "Name a primary color.", "--chat",
                           "--max-new-tokens", "12", "--depth", "3", "--tree-top-k", "2", "--total-tokens", "4",
                           "--json"], capture_output=True, text=True, env=env, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    for key in ("tokens", "text", "accept_lengths", "target_calls", "seconds"):
        assert key in result
    assert 1 <= len(result["tokens"]) <= 12
    assert len(result["tokens"]) <= 1 + sum(result["accept_lengths"])  # truncation at EOS / max only removes
    assert result["target_calls"] == 1 + len(result["accept_lengths"])
    assert isinstance(result["text"], str) and result["text"]


@pytest.mark.slow
def test_sampled_cli_run_with_shipped_or_saved_drafter(smollm2, tmp_path, capsys):
    drafter_dir = save_drafter(random_drafter(smollm2, "eagle3", seed=3, draft_vocab_size=2048), tmp_path / "d")
    code, out, err = run_cli(["--drafter", str(drafter_dir), "--prompt", "Once upon a time", "--max-new-tokens", "10",
                              "--temperature", "0.8", "--top-p", "0.9", "--top-k", "50", "--seed", "7",
                              "--tree-top-k", "1", "--depth", "3", "--json"], capsys)
    assert code == 0, err
    first = json.loads(out)
    code, out, _ = run_cli(["--drafter", str(drafter_dir), "--prompt", "Once upon a time", "--max-new-tokens", "10",
                            "--temperature", "0.8", "--top-p", "0.9", "--top-k", "50", "--seed", "7",
                            "--tree-top-k", "1", "--depth", "3", "--json"], capsys)
    assert json.loads(out)["tokens"] == first["tokens"], "the same seed must reproduce the same sample"
    assert first["drafter_variant"] == "eagle3"


@pytest.mark.slow
@pytest.mark.parametrize("args,message", [
    (["--prompt", ""], "prompt is empty"),
    (["--prompt", "   "], "prompt is empty"),
    (["--prompt", "hi", "--max-new-tokens", "100000"], "exceeds the target's context of 8192"),
    (["--prompt", "hi", "--max-new-tokens", "0"], "max_new_tokens must be a positive integer"),
    (["--prompt", "hi", "--temperature", "-1"], "temperature must be"),
    (["--prompt", "hi", "--top-p", "0"], "top_p must be in"),
    (["--prompt", "hi", "--tree-top-k", "4", "--depth", "2", "--total-tokens", "50"], "exceeds the 20 candidates"),
    (["--prompt", "hi", "--drafter", "/nonexistent/drafter"], "/nonexistent/drafter"),
    (["--prompt", "hi", "--target", "/nonexistent/target"], "/nonexistent/target"),
])
def test_bad_input_is_a_clear_error(args, message, capsys):
    code, out, err = run_cli(args, capsys)
    assert code == 2
    assert message in err
    assert "Traceback" not in err and out == ""


@pytest.mark.slow
def test_mismatched_drafter_names_both_values(tiny_target, tmp_path, capsys):
    """A drafter made for the tiny 64-wide target does not fit SmolLM2 (576 wide)."""
    drafter_dir = save_drafter(random_drafter(tiny_target, "eagle3.1"), tmp_path / "tiny_drafter")
    code, _, err = run_cli(["--prompt", "hi", "--drafter", str(drafter_dir)], capsys)
    assert code == 2
    assert "target_hidden_size 64" in err and "hidden_size 576" in err and str(drafter_dir) in err
