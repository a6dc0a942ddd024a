"""Build configs: the YAML files in build_configs/ load, the embedded default equals its YAML
twin, and every kind of bad value is rejected with the file and the key's dotted path."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from eagle_trt.build.config import (
    BuildConfigError,
    ProfileSection,
    config_from_dict,
    config_to_dict,
    load_config,
)

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "build_configs"
LLAMA = sorted(CONFIGS.glob("llama3.1-8b-*.yaml"))
ENV = {"LLAMA31_8B_INSTRUCT": "/models/llama", "EAGLE3_LLAMA31_8B": "/models/eagle3",
       "EAGLE31_LLAMA31_8B": "/models/eagle31"}


def test_embedded_default_is_the_smollm2_yaml():
    embedded, yaml_file = load_config(None), load_config(CONFIGS / "smollm2-eagle3.1.yaml")
    assert embedded == yaml_file            # source (where it came from) is not compared
    assert embedded.target.source == "smollm2" and embedded.drafter.source == "default"
    assert embedded.precision.target.dtype == "float32"


def test_config_round_trips_through_plain_data():
    cfg = load_config(None)
    assert config_from_dict(config_to_dict(cfg)) == cfg


@pytest.mark.parametrize("path", LLAMA, ids=lambda p: p.stem)
def test_llama_configs_load_with_checkpoint_paths_from_the_environment(path, monkeypatch):
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    cfg = load_config(path)
    fmt = "fp8" if "fp8" in path.stem else "nvfp4"
    assert cfg.precision.target.format == fmt and cfg.precision.target.dtype == "float16"
    assert cfg.precision.target.skip == ("lm_head",)
    assert cfg.precision.drafter.format == "fp16"
    assert cfg.target.source == "/models/llama"
    assert cfg.drafter.source == ("/models/eagle31" if "eagle3.1" in path.stem else "/models/eagle3")
    # The verify profile covers root + every tree node.
    assert cfg.engines.profiles.verify.max_tokens >= cfg.tree.total_tokens + 1
    if "eagle3-" in path.stem:   # the public EAGLE-3 drafter: reference ids in layer-input numbering
        assert (cfg.target.capture.convention, cfg.target.capture.layer_ids) == ("layer_input", (2, 16, 29))


FAMILY_ENV = {"qwen3-8b": ("QWEN3_8B", "EAGLE3_QWEN3_8B"), "qwen2.5-7b": ("QWEN25_7B_INSTRUCT", "EAGLE3_QWEN25_7B"),
              "mistral-7b": ("MISTRAL_7B_INSTRUCT", "EAGLE3_MISTRAL_7B"), "smollm3-3b": ("SMOLLM3_3B", "EAGLE3_SMOLLM3_3B")}


@pytest.mark.parametrize("family", list(FAMILY_ENV))
def test_one_config_per_family_loads_with_paths_from_the_environment(family, monkeypatch):
    path = CONFIGS / f"{family}-eagle3-fp8-hopper.yaml"
    target_var, drafter_var = FAMILY_ENV[family]
    monkeypatch.setenv(target_var, f"/models/{family}")
    monkeypatch.setenv(drafter_var, f"/models/{family}-eagle3")
    cfg = load_config(path)
    assert cfg.target.source == f"/models/{family}" and cfg.drafter.source == f"/models/{family}-eagle3"
    assert cfg.precision.target.format == "fp8" and cfg.precision.target.skip == ("lm_head",)
    assert cfg.target.capture.layer_ids is None          # the checkpoint's ids, else the EAGLE default
    assert cfg.engines.profiles.verify.max_tokens >= cfg.tree.total_tokens + 1
    monkeypatch.delenv(target_var)
    with pytest.raises(BuildConfigError, match=target_var):
        load_config(path)


def test_unset_environment_variable_names_key_and_variable(monkeypatch):
    monkeypatch.delenv("LLAMA31_8B_INSTRUCT", raising=False)
    with pytest.raises(BuildConfigError) as err:
        load_config(LLAMA[0])
    assert str(err.value).startswith(f"{LLAMA[0]}: target.source: environment variable LLAMA31_8B_INSTRUCT is not set")


BAD = [
    ({"engines": {"profiles": {"verify": {"max_tokens": "abc"}}}},
     "x.yaml: engines.profiles.verify.max_tokens: expected int, got 'abc'"),
    ({"engines": {"profiles": {"verify": {"max_token": 5}}}},
     "x.yaml: engines.profiles.verify.max_token: unknown key (known keys of engines.profiles.verify: min_tokens,"),
    ({"colour": "red"}, "x.yaml: colour: unknown key (known keys: name, device, target,"),
    ({"device": "gpu"}, "x.yaml: device: expected one of 'auto', 'cpu', 'cuda', got 'gpu'"),
    ({"tree": {"depth": 2.5}}, "x.yaml: tree.depth: expected int, got 2.5"),
    ({"tree": {"depth": True}}, "x.yaml: tree.depth: expected int, got True"),
    ({"precision": {"target": {"format": "int3"}}},
     "x.yaml: precision.target.format: expected one of 'fp32', 'fp16', 'fp8', 'nvfp4', 'int4', got 'int3'"),
    ({"precision": {"target": {"format": "fp8", "skip": ["lm_head", 3]}}},
     "x.yaml: precision.target.skip[1]: expected str, got 3"),
    ({"precision": {"drafter": {"skip": ["fc"]}}}, "x.yaml: precision.drafter.skip: only used by fp8 / nvfp4"),
    ({"target": {"capture": {"convention": "layer_inputs"}}},
     "x.yaml: target.capture.convention: expected one of 'layer_input', 'layer_output', got 'layer_inputs'"),
    ({"target": {"capture": {"layer_ids": "2,15,27"}}},
     "x.yaml: target.capture.layer_ids: expected a list of int, got '2,15,27'"),
    ({"target": "smollm2"}, "x.yaml: target: expected a mapping, got 'smollm2'"),
    ({"engines": {"profiles": {"prefill": {"min_tokens": 8, "opt_tokens": 4}}}},
     "x.yaml: engines.profiles.prefill: need min_tokens <= opt_tokens <= max_tokens, got 8, 4, 512"),
    ({"tree": {"depth": 5, "top_k": 4, "total_tokens": 20}},
     "x.yaml: engines.profiles.verify.max_tokens: the tree verifies root + 20 nodes = 21 tokens, got 5"),
    ({"engines": {"max_batch": 0}}, "x.yaml: engines.max_batch: must be >= 1, got 0"),
    ({"engines": {"max_batch": 4}}, "x.yaml: serving.max_concurrent: the running batch (8) must fit the engines' batch "
                                    "axis, engines.max_batch = 4"),
    ({"tree": {"depth": 2, "top_k": 2, "total_tokens": 9}}, "x.yaml: tree: tree total_tokens 9 exceeds"),
    ({"serving": {"model_name": "my model"}}, "x.yaml: serving.model_name: not a valid Triton model name"),
    ({"serving": {"prefill_chunk": -1}}, "x.yaml: serving.prefill_chunk: expected 0 (whole prompts) or a positive number"),
    ({"serving": {"cost_model": "no"}}, "x.yaml: serving.cost_model: expected bool, got 'no'"),
    ({"serving": {"drafter_weights": "int8"}, "precision": {"drafter": {"format": "fp8", "base": "fp32"}}},
     "x.yaml: serving.drafter_weights: int8 is made from an fp32 drafter graph, but precision.drafter is fp8 with base fp32"),
    ({"serving": {"drafter_weights": "int8"}, "precision": {"drafter": {"format": "fp16"}}},
     "x.yaml: serving.drafter_weights: int8 is made from an fp32 drafter graph, but precision.drafter is fp16;"),
    ({"serving": {"drafter_weights": "int4"}}, "x.yaml: serving.drafter_weights: expected one of 'auto', 'int8', 'float'"),
    ({"serving": {"iteration_graph": "on"}, "precision": {"target": {"format": "fp8", "base": "fp32"}}},
     "x.yaml: serving.iteration_graph: on needs float graphs, but precision.target is fp8"),
    ({"serving": {"iteration_graph": True}}, "x.yaml: serving.iteration_graph: expected one of 'auto', 'on', 'off'"),
    ([1, 2], "x.yaml: top level: expected a mapping, got [1, 2]"),
]


@pytest.mark.parametrize("data, message", BAD, ids=[m.split(": ")[1] for _, m in BAD])
def test_bad_values_are_rejected_with_their_dotted_path(data, message):
    with pytest.raises(BuildConfigError) as err:
        config_from_dict(data, "x.yaml")
    assert str(err.value).startswith(message), str(err.value)


def test_a_partly_given_section_keeps_the_rest_of_its_own_default():
    cfg = config_from_dict({"engines": {"profiles": {"verify": {"opt_past": 64}}}})
    default = load_config(None).engines.profiles.verify
    assert cfg.engines.profiles.verify == ProfileSection(default.min_tokens, default.opt_tokens, default.max_tokens,
                                                         default.min_past, 64, default.max_past)


def run_cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "eagle_trt.build", *args], capture_output=True, text=True,
                          check=False,
                          cwd=cwd, timeout=300)


@pytest.mark.parametrize("text, message", [
    ("engines:\n  profiles:\n    verify:\n      max_tokens: abc\n",
     "engines.profiles.verify.max_tokens: expected int, got 'abc'"),
    ("tree: {depth: 3\n", "not valid YAML"),
])
def test_cli_bad_config_exits_2_with_one_line(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    done = run_cli("--config", str(path), "--output", str(tmp_path / "out"))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith(f"error: {path}") and message in lines[0]
    assert not (tmp_path / "out").exists(), "a rejected config must not start a build"


def test_cli_missing_config_file(tmp_path):
    done = run_cli("--config", str(tmp_path / "nope.yaml"))
    assert done.returncode == 2 and done.stderr.strip() == f"error: {tmp_path / 'nope.yaml'}: build config not found"
