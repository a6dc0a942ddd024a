"""The documentation stays true to the repository: README.md and docs/**/*.md.

- Every relative link resolves to an existing file, and an anchor into a markdown file names one
  of its headings (GitHub's slugs).
- Every `python -m <module>` the docs mention is importable and accepts `--help` (exit 0), and
  every `--flag` the docs give it appears in that help; the same for `python scripts/<x>.py`,
  whose files must exist, as must those of `bash scripts/<x>.sh`. All `--help` runs share ONE
  subprocess (runpy), so this stays fast.
- Every ```yaml block is a valid build config, and the reference block in docs/build.md equals
  the built-in defaults.
- The code map in docs/architecture.md names every module of the package, read from the file
  system when the test runs (so a module added, moved or removed fails it until the map
  follows), and no module that no longer exists.

The helpers are tested on planted mistakes too, so a broken link or a misspelled module fails.
"""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
PACKAGE = REPO / "eagle_trt"
ARCHITECTURE = REPO / "docs" / "architecture.md"

FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)
LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
MODULE = re.compile(r"\bpython3? -m ([A-Za-z_][\w.]*)")
SCRIPT = re.compile(r"\b(python3?|bash) (scripts/[\w./-]+\.(?:py|sh))\b")
FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")
# Where one command ends inside a line: the next command of another tool, or a comment.
NEXT_COMMAND = re.compile(r"\s(?:python3?|bash|curl|polygraphy|tritonserver|make|pytest|docker)\s|\s#\s")


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    return [(m.group(1).strip().lower(), m.group(2)) for m in FENCE.finditer(text)]


def without_code(text: str) -> str:
    """Markdown text with fenced blocks and inline code spans blanked out (links inside code are not links)."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return re.sub(r"`[^`]*`", "``", text)


def inline_code_spans(text: str) -> list[str]:
    text = FENCE.sub("", text)
    return [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", text) if "\n\n" not in s]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    heading = re.sub(r"[^\w\- ]", "", heading.lower())
    return heading.replace(" ", "-")


def anchors(md: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), md.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(md: Path, text: str | None = None) -> list[str]:
    text = md.read_text() if text is None else text
    bad = []
    for target in LINK.findall(without_code(text)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue                                   # http(s), mailto, ...; anchors within the page
        path, _, anchor = target.partition("#")
        resolved = (md.parent / path).resolve()
        if not resolved.exists():
            bad.append(f"{md.relative_to(REPO)}: {target} -> {resolved} does not exist")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            bad.append(f"{md.relative_to(REPO)}: {target}: no heading with anchor #{anchor} in {path}")
    return bad


def commands(text: str) -> list[str]:
    """Every command line in shell-like fenced blocks (indented and backslash-continued lines
    joined) and every inline code span, split so that each piece starts with one command."""
    lines: list[str] = []
    for lang, body in fenced_blocks(text):
        if lang not in ("", "bash", "sh", "shell", "console"):
            continue
        for line in body.splitlines():
            if lines and (line[:1].isspace() or lines[-1].endswith("\\")) and line.strip():
                lines[-1] = " ".join((lines[-1].rstrip("\\") + " " + line).split())
            else:
                lines.append(line)
    lines += inline_code_spans(text)
    pieces = []
    for line in lines:
        starts = [m.start() for m in re.finditer(r"\b(?:python3? -m|python3? scripts/|bash scripts/)", line)]
        for i, start in enumerate(starts):
            piece = line[start:starts[i + 1] if i + 1 < len(starts) else len(line)]
            cut = NEXT_COMMAND.search(piece, 1)
            pieces.append((piece[:cut.start()] if cut else piece).strip())
    return pieces


def mentions() -> tuple[dict[str, set[str]], dict[str, set[str]], set[str]]:
    """module -> flags, script path -> flags, and every scripts/ path named after python or bash."""
    modules: dict[str, set[str]] = {}
    scripts: dict[str, set[str]] = {}
    paths: set[str] = set()
    for md in DOCS:
        text = md.read_text()
        for mod in MODULE.findall(text):
            modules.setdefault(mod.rstrip("."), set())
        for tool, path in SCRIPT.findall(text):
            paths.add(path)
            if tool.startswith("python"):
                scripts.setdefault(path, set())
        for cmd in commands(text):
            m = MODULE.match(cmd)
            s = re.match(r"python3? (scripts/[\w./-]+\.py)", cmd)
            if m:
                modules[m.group(1).rstrip(".")] |= set(FLAG.findall(cmd))
            elif s:
                scripts[s.group(1)] |= set(FLAG.findall(cmd))
    return modules, scripts, paths


HELP_RUNNER = r"""
import contextlib, io, json, runpy, sys, traceback
targets = json.loads(sys.argv[1])
results = {}
for kind, name in targets:
    out, err = io.StringIO(), io.StringIO()
    code = None
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            sys.argv = [name, "--help"]
            if kind == "module":
                runpy.run_module(name, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(name, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        code = "exception: " + traceback.format_exc(limit=3)
    results[name] = {"code": code, "help": out.getvalue(), "stderr": err.getvalue()[-2000:]}
sys.__stdout__.write("\n@@HELP@@" + json.dumps(results))
"""


def run_help(targets: list[tuple[str, str]]) -> dict[str, dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", HELP_RUNNER, json.dumps(targets)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert "@@HELP@@" in proc.stdout, f"the --help runner died:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.split("@@HELP@@", 1)[1])


def help_failures(results: dict[str, dict], wanted: dict[str, set[str]]) -> list[str]:
    bad = []
    for name, flags in sorted(wanted.items()):
        r = results[name]
        if r["code"] not in (0, None):
            bad.append(f"{name} --help exited with {r['code']!r}; stderr: {r['stderr'][-500:]}")
            continue
        missing = sorted(f for f in flags if not re.search(re.escape(f) + r"(?![\w-])", r["help"]))
        if missing:
            bad.append(f"{name}: the docs give {missing}, which its --help does not list")
    return bad


def only_reexports(path: Path) -> bool:
    """An `__init__.py` with no code of its own: nothing but a docstring, imports and `__all__`."""
    body = ast.parse(path.read_text()).body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        body = body[1:]
    return all(isinstance(node, (ast.Import, ast.ImportFrom))
               or (isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"])
               for node in body)


def package_modules(package: Path = PACKAGE) -> set[str]:
    """Every .py module under the package, by its path there (`runtime/loop.py`), as the file
    system has them now. Left out: `__init__.py` files with no code of their own (empty, or only a
    docstring, imports and `__all__`): a package's re-exports are its modules' names, not a module."""
    return {path.relative_to(package).as_posix() for path in package.rglob("*.py")
            if "__pycache__" not in path.parts and not (path.name == "__init__.py" and only_reexports(path))}


def code_map_entries(text: str) -> list[str]:
    """The modules the `## Code map` section lists: each item starting with a module's path in
    backticks, as in "- `runtime/loop.py`: ..." (an `eagle_trt/` prefix is allowed)."""
    section = re.search(r"^## Code map[ \t]*\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert section, "docs/architecture.md has no '## Code map' section"
    return [p.removeprefix("eagle_trt/") for p in re.findall(r"^[-*] `([\w./]+\.py)`", section.group(1), re.M)]


def code_map_problems(entries: list[str], modules: set[str], package: Path = PACKAGE) -> list[str]:
    """The modules the map does not name, the entries whose file is gone, and entries given twice."""
    problems = [f"not in the code map: {m}" for m in sorted(modules - set(entries))]
    problems += [f"in the code map but not in {package.name}/: {e}" for e in entries if not (package / e).is_file()]
    problems += [f"in the code map twice: {e}" for e in sorted({e for e in entries if entries.count(e) > 1})]
    return problems


# ---------------------------------------------------------------------------------------- the checks

def test_docs_exist_and_readme_is_a_front_page():
    assert len(DOCS) > 1
    assert len((REPO / "README.md").read_text().splitlines()) <= 200


def test_every_relative_link_resolves():
    bad = [b for md in DOCS for b in broken_links(md)]
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_every_documented_command_accepts_help_and_its_flags():
    modules, scripts, paths = mentions()
    missing = sorted(p for p in paths if not (REPO / p).is_file())
    assert not missing, f"the docs name scripts that do not exist: {missing}"
    assert "eagle_trt.build" in modules and "eagle_trt.generate" in modules, modules
    results = run_help([("module", m) for m in sorted(modules)] + [("path", s) for s in sorted(scripts)])
    bad = help_failures(results, {**modules, **scripts})
    assert not bad, "\n".join(bad)


def test_yaml_blocks_are_valid_build_configs_and_the_reference_is_the_default():
    from eagle_trt.build.config import config_from_dict, config_to_dict, load_config
    blocks = [(md, body) for md in DOCS for lang, body in fenced_blocks(md.read_text()) if lang == "yaml"]
    assert blocks
    for md, body in blocks:
        config_from_dict(yaml.safe_load(body), str(md.relative_to(REPO)))
    reference = [body for md, body in blocks if md.name == "build.md"]
    assert len(reference) == 1
    assert config_to_dict(config_from_dict(yaml.safe_load(reference[0]))) == config_to_dict(load_config(None)), \
        "the config reference in docs/build.md differs from the defaults in eagle_trt/build/config.py"


def test_the_code_map_names_every_module():
    modules = package_modules()
    assert "runtime/kv_cache.py" in modules and "__init__.py" not in modules, sorted(modules)
    problems = code_map_problems(code_map_entries(ARCHITECTURE.read_text()), modules)
    assert not problems, "docs/architecture.md's code map and eagle_trt/ differ:\n" + "\n".join(problems)


# ------------------------------------------------------------------------- the checks can fail

def test_a_broken_link_or_anchor_is_caught():
    md = REPO / "docs" / "planted.md"
    text = ("[ok](../README.md) [ok](build.md#config-format) [web](https://example.com) [here](#x) "
            "`[code](nowhere.md)` [bad](nowhere.md) [bad anchor](build.md#no-such-heading)")
    bad = broken_links(md, text)
    assert len(bad) == 2 and "nowhere.md" in bad[0] and "no-such-heading" in bad[1], bad


def test_a_misspelled_module_or_an_unknown_flag_is_caught():
    results = run_help([("module", "eagle_trt.generat"), ("module", "eagle_trt.generate")])
    bad = help_failures(results, {"eagle_trt.generat": set(), "eagle_trt.generate": {"--prompt", "--no-such-flag"}})
    assert len(bad) == 2 and "eagle_trt.generat --help" in bad[0] and "--no-such-flag" in bad[1], bad
    assert "--prompt" not in bad[1]


def test_commands_are_split_per_tool_and_continued_lines_joined():
    text = ("```\npython -m a.b --x 1 \\\n    --y 2   # comment --z\npython -m c --w   python scripts/s.py --v\n"
            "curl -X POST --data 1\n```\nSee `python -m d --u\n--t` and `--alone`.\n")
    assert commands(text) == ["python -m a.b --x 1 --y 2", "python -m c --w", "python scripts/s.py --v",
                              "python -m d --u --t"]


def test_a_module_missing_from_the_code_map_or_a_stale_entry_is_caught(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text('"""Has code."""\nSETTING = 1\n')
    (package / "sub" / "__init__.py").write_text('"""Re-exports."""\nfrom .b import f\n__all__ = ["f"]\n')
    (package / "a.py").write_text("")
    (package / "sub" / "b.py").write_text("def f():\n    pass\n")
    modules = package_modules(package)
    assert modules == {"__init__.py", "a.py", "sub/b.py"}, modules
    text = ("# Title\n\n- `a.py`: not the map\n\n## Code map\n\nIntro naming `sub/b.py` in passing.\n"
            "- `eagle_trt/a.py`: a\n- `gone.py`: removed since\n* `a.py`: again\n- `sub/__init__.py`: allowed\n"
            "\n## Next\n- `sub/b.py`: after the map\n")
    entries = code_map_entries(text)
    assert entries == ["a.py", "gone.py", "a.py", "sub/__init__.py"], entries
    assert code_map_problems(entries, modules, package) == [
        "not in the code map: __init__.py", "not in the code map: sub/b.py",
        "in the code map but not in pkg/: gone.py", "in the code map twice: a.py"]
