"""Caches of generated files are keyed by the code that makes them (eagle_trt/codehash.py): a
one-line change to the exporter, or to anything it imports from the package, changes the key and
the next run makes the graphs again (the SmolLM2 graphs the tests share under ~/.cache, bench's
graphs, the build's stages); a comment, a docstring or an unrelated module does not."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import eagle_trt
from eagle_trt.build.pipeline import STAGE_CODE
from eagle_trt.codehash import code_digest, module_closure

from conftest import capturing

PACKAGE = Path(eagle_trt.__file__).parent
EXPORTER = "eagle_trt.export.onnx_export"


def package_copy(tmp_path: Path) -> Path:
    dst = tmp_path / "eagle_trt"
    shutil.copytree(PACKAGE, dst, ignore=shutil.ignore_patterns("__pycache__", "*.safetensors", "*.json"))
    return dst


def edit(root: Path, rel: str, old: str, new: str) -> None:
    path = root / rel
    text = path.read_text()
    assert text.count(old) == 1, f"{rel}: {old!r} is not there once"
    path.write_text(text.replace(old, new))


def test_the_exporters_closure_is_what_it_imports():
    closure = module_closure(EXPORTER)
    assert {"eagle_trt.models.target", "eagle_trt.models.drafter", "eagle_trt.tree", "eagle_trt.verify",
            "eagle_trt.export.graphs", "eagle_trt.export.weights", "eagle_trt.config"} <= set(closure)
    assert not {"eagle_trt.bench", "eagle_trt.runtime.loop", "eagle_trt.build.pipeline", "eagle_trt.checkpoints",
                "eagle_trt.quant.fakequant"} & set(closure)
    with pytest.raises(ValueError, match="no module"):
        module_closure("eagle_trt.no_such_module")


@pytest.mark.parametrize("rel, old, new, changes", [
    ("graph_names.py", "ACCEPT_OUTPUTS = [", "ACCEPT_OUTPUTS = [] or [", True),         # the graphs' names
    ("models/target.py", "* (1.0 / math.sqrt(D))", "* (1.0 / math.sqrt(D + 0))", True),   # a module it imports
    ("config.py", "return max(1, math.ceil", "return max(2, math.ceil", True),       # two imports away
    ("models/target.py", "# Reduce in fp32 like transformers does", "# reduce in fp32", False),   # a comment
    ("tree.py", '"""EAGLE-2 dynamic draft tree', '"""The EAGLE-2 draft tree', False),            # a docstring
    ("bench.py", "def main(", "def main_cli(", False),                                # not imported by it
])
def test_a_change_to_the_exporters_code_changes_its_key(tmp_path, rel, old, new, changes):
    root = package_copy(tmp_path)
    before = code_digest(EXPORTER, root=root)
    assert before == code_digest(EXPORTER), "a copy of the package hashes like the package"
    edit(root, rel, old, new)
    code_digest.cache_clear()
    assert (code_digest(EXPORTER, root=root) != before) == changes


# What keys the export stage's graphs: export_pipeline's code (EXPORTER) and the build's export stage
EXPORT_KEYS = {"export_pipeline": (EXPORTER,), "build export stage": STAGE_CODE["export"]}


@pytest.mark.parametrize("rel, old, new, changes", [
    ("quant/fakequant.py", "def check_amax(", "def check_amax_of(", False),      # quantization: after export
    ("quant/run.py", "def run_graph(", "def run_quantized_graph(", False),
    ("export/onnx_export.py", "DEFAULT_OPSET = 19", "DEFAULT_OPSET = 19 + 0", True),   # the exporter
])
def test_the_export_stages_key_follows_only_the_code_it_runs(tmp_path, rel, old, new, changes):
    """Imports point down (models/ imports neither quant nor checkpoints): an edit to the
    quantization code keeps every cached graph, an edit to the exporter re-exports them."""
    root = package_copy(tmp_path)
    before = {name: code_digest(*modules, root=root) for name, modules in EXPORT_KEYS.items()}
    edit(root, rel, old, new)
    code_digest.cache_clear()
    after = {name: code_digest(*modules, root=root) for name, modules in EXPORT_KEYS.items()}
    assert {name: after[name] != before[name] for name in before} == {name: changes for name in before}


def test_export_pipeline_exports_again_when_its_code_changes(tiny_target, tiny_drafter, tmp_path, monkeypatch):
    """export_pipeline's graphs (the tests' shared SmolLM2 graphs, bench's) with the key taken
    from a copy of the package: unchanged code reuses them, a changed constant in the target
    model re-exports both graphs."""
    from eagle_trt.api import Models
    from eagle_trt.config import TreeShape
    import eagle_trt.export as export
    root = package_copy(tmp_path / "src")
    monkeypatch.setattr(export, "code_digest", lambda *modules: code_digest(*modules, root=root))
    target = capturing(tiny_target, tiny_drafter)
    out = tmp_path / "graphs"

    def export_times():
        paths = export.export_pipeline(Models(target, tiny_drafter, "drafters/mine", None), TreeShape(2, 2, 3), out,
                                       log=None)
        return {name: p.stat().st_mtime_ns for name, p in paths.items()}
    first = export_times()
    assert export_times() == first
    edit(root, "models/target.py", "* (1.0 / math.sqrt(D))", "* (1.0 / math.sqrt(D + 0))")
    code_digest.cache_clear()
    again = export_times()
    assert again["target"] != first["target"] and again["drafter_tree"] != first["drafter_tree"]
