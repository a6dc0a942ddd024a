"""The package's imports point one way: lower layers never import higher ones, and no module
imports one that imports it back (directly or through others). The graph is read from the
source with `ast` as the cache keys read it (codehash.imported_names), nothing is imported
(build/triton_model.py imports Triton's own module): every `import` and `from ... import` of a
package module, at module level or inside a function, where `from .x import y` counts y when y
is a submodule, and importing `a.b.c` counts the packages `a.b` runs first (their `__init__`
imports are part of the graph too)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import eagle_trt
from eagle_trt.codehash import imported_names

PACKAGE_DIR = Path(eagle_trt.__file__).parent
PACKAGE = PACKAGE_DIR.name


def package_modules(root: Path = PACKAGE_DIR) -> dict[str, Path]:
    """Every module of the package at `root`: dotted name -> file (a package by its __init__.py)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = (root.name, *path.relative_to(root).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def import_graph(root: Path = PACKAGE_DIR) -> dict[str, set[str]]:
    """module -> the package modules importing it runs (the named module, or the module whose
    attribute a name is, and the packages above it), its own packages left out (already running)."""
    modules = package_modules(root)
    graph = {}
    for module, path in modules.items():
        found = set()
        tree = ast.parse(path.read_text(), str(path))
        for name in imported_names(module, tree, path.name == "__init__.py"):
            while name and name not in modules:       # an attribute of a module: that module
                name = name.rpartition(".")[0]
            parts = name.split(".")
            found.update(".".join(parts[:i]) for i in range(2, len(parts) + 1))
        own = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 2)}
        graph[module] = found - own
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def cycle_path(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One import cycle through the component's first module, for the failure message."""
    members, start = set(component), component[0]
    paths = {start: [start]}
    todo = [start]
    while todo:
        node = todo.pop(0)
        for nxt in sorted(graph[node] & members):
            if nxt == start:
                return paths[node] + [start]
            if nxt not in paths:
                paths[nxt] = paths[node] + [nxt]
                todo.append(nxt)
    return component


GRAPH = import_graph()


def test_the_graph_sees_imports_at_module_level_inside_functions_and_through_packages(tmp_path):
    root = tmp_path / "pkg"
    files = {"__init__.py": "",
             "low.py": "import json\n",
             "mid.py": "from .low import json\nfrom . import low as _\n",
             "top.py": "def main():\n    from pkg.sub.leaf import thing\n",
             "sub/__init__.py": "from .leaf import thing\nfrom . import back\n",
             "sub/leaf.py": "from ..mid import json\nthing = 1\n",
             "sub/back.py": "def f():\n    from .. import top\n"}
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    graph = import_graph(root)
    assert graph["pkg.low"] == set() and graph["pkg.mid"] == {"pkg.low"}         # a name of a module: the module
    assert graph["pkg.top"] == {"pkg.sub", "pkg.sub.leaf"}          # inside a function; the package runs first
    assert graph["pkg.sub"] == {"pkg.sub.leaf", "pkg.sub.back"}
    assert graph["pkg.sub.leaf"] == {"pkg.mid"}                     # its own package: already running
    assert graph["pkg.sub.back"] == {"pkg.top"}                     # `from .. import top`: a submodule
    # top imports sub.leaf, so sub's __init__ runs, which imports back, which imports top
    assert cycles(graph) == [["pkg.sub", "pkg.sub.back", "pkg.top"]]
    assert cycle_path(graph, cycles(graph)[0]) == ["pkg.sub", "pkg.sub.back", "pkg.top", "pkg.sub"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycle_path({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c"]) == ["a", "b", "c", "a"]
    assert "eagle_trt.build.triton_model" in GRAPH                  # parsed, never imported


def test_no_module_imports_one_that_imports_it_back():
    found = [" -> ".join(cycle_path(GRAPH, c)) for c in cycles(GRAPH)]
    assert not found, "import cycles:\n" + "\n".join(found)


def imports_under(folder: str) -> dict[str, set[str]]:
    prefix = f"{PACKAGE}.{folder}"
    return {m: deps for m, deps in GRAPH.items() if m == prefix or m.startswith(prefix + ".")}


def offending(folder: str, banned: tuple[str, ...]) -> dict[str, list[str]]:
    """Each module under `folder` with the banned modules (or their packages' modules) it imports."""
    bad = {m: sorted(d for d in deps if any(d == b or d.startswith(b + ".") or d.startswith(b + "_") for b in banned))
           for m, deps in imports_under(folder).items()}
    return {m: deps for m, deps in bad.items() if deps}


@pytest.mark.parametrize("folder, banned", [
    # the runtime runs graphs: it takes their names from eagle_trt.graph_names, not the exporter
    ("runtime", ("eagle_trt.export", "eagle_trt.quant", "eagle_trt.build", "eagle_trt.parity")),
    # the models are the arithmetic: checkpoints load them, quant wraps them
    ("models", ("eagle_trt.quant", "eagle_trt.checkpoints")),
    # quant runs FP8 graphs with the runtime's session settings, not subclasses of its backends
    ("quant", ("eagle_trt.runtime.onnxruntime_backend",)),
])
def test_lower_layers_do_not_import_higher_ones(folder, banned):
    assert imports_under(folder), f"no modules under eagle_trt/{folder}"
    assert offending(folder, banned) == {}


def test_graph_names_import_nothing_heavy():
    """The runtime and the exporter share the graphs' names from a module without torch or onnx."""
    path = PACKAGE_DIR / "graph_names.py"
    names = imported_names("eagle_trt.graph_names", ast.parse(path.read_text()), False)
    assert not {n.split(".")[0] for n in names} & {"torch", "onnx", "onnxruntime", "numpy", PACKAGE}
