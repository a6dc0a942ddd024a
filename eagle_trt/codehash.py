"""A hash of the package code that makes an artifact, for the keys of caches of generated files
(exported graphs, build stages): a change to that code makes the next run regenerate, with no
format number to remember to bump (format numbers describe files on disk, not their makers).

`code_digest("eagle_trt.export.onnx_export")` covers that module and every module of this
package it imports, transitively, at module level or inside functions (read from the source,
nothing is imported). Each module is hashed as its syntax tree without docstrings, so an edit
to a comment or a docstring keeps the caches, and any change to code, a constant included,
does not. Parent packages' `__init__` modules count only where imported by name."""
from __future__ import annotations

import ast
import functools
import hashlib
from pathlib import Path

PACKAGE = __name__.rpartition(".")[0]
PACKAGE_DIR = Path(__file__).resolve().parent


def _source(module: str, root: Path) -> Path | None:
    """The file of a module of the package under `root` (None: not one of its modules)."""
    parts = module.split(".")
    if parts[0] != PACKAGE:
        return None
    base = root.joinpath(*parts[1:])
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def imported_names(module: str, tree: ast.AST, is_package: bool) -> set[str]:
    """The package modules a module's source names in its imports (candidates: a name imported
    from a package may be a submodule or an attribute; _source sorts them out)."""
    package = module if is_package else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            out.add(source)
            out.update(f"{source}.{alias.name}" for alias in node.names)
    return out


def _without_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body and \
                isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and \
                isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
    return tree


def module_closure(*modules: str, root: Path = PACKAGE_DIR) -> dict[str, Path]:
    """The named modules and every package module they import, transitively: name -> file."""
    seen: dict[str, Path] = {}
    todo = list(modules)
    while todo:
        name = todo.pop()
        path = _source(name, root)
        if name in seen or path is None:
            continue
        seen[name] = path
        todo += imported_names(name, ast.parse(path.read_text(), str(path)), path.name == "__init__.py")
    missing = [m for m in modules if m not in seen]
    if missing:
        raise ValueError(f"no module {missing} under {root}")
    return dict(sorted(seen.items()))


@functools.cache
def code_digest(*modules: str, root: Path = PACKAGE_DIR) -> str:
    """A hex digest of the code of `modules` and what they import from the package (see above)."""
    h = hashlib.blake2b(digest_size=12)
    for name, path in module_closure(*modules, root=root).items():
        tree = _without_docstrings(ast.parse(path.read_text(), str(path)))
        h.update(name.encode() + b"\0" + ast.dump(tree).encode() + b"\0")
    return h.hexdigest()
