"""The repository travels: the tracked checkout stays within 64 MiB, the most one transfer to a
GPU machine carries, so the whole project (drafters, distillation data, docs) goes in one call.

The size is what `git ls-files -z | xargs -0 du -cb | tail -1` prints: the apparent size of every
tracked file in the working tree. A failure names the largest files, where to cut first (result
files no doc links are deleted, git history keeps them)."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LIMIT = 64 * 2 ** 20


def tracked_files(repo: Path) -> list[str] | None:
    """The paths `git ls-files` lists, or None where this is not a git checkout (or git is missing)."""
    if shutil.which("git") is None:
        return None
    proc = subprocess.run(["git", "-C", str(repo), "ls-files", "-z"], capture_output=True, timeout=60)
    if proc.returncode != 0:
        return None
    return [p for p in proc.stdout.decode("utf-8", "surrogateescape").split("\0") if p]


def sizes(repo: Path, paths: list[str]) -> dict[str, int]:
    """Apparent size of each tracked path present in the working tree (a link counts as itself)."""
    out = {}
    for path in paths:
        try:
            out[path] = os.lstat(repo / path).st_size
        except FileNotFoundError:          # deleted in the working tree, not yet committed
            continue
    return out


def report(by_path: dict[str, int], limit: int, top: int = 15) -> str | None:
    """None when the total is within the limit; otherwise the total and the largest files."""
    total = sum(by_path.values())
    if total <= limit:
        return None
    largest = sorted(by_path.items(), key=lambda kv: -kv[1])[:top]
    lines = [f"{size / 2 ** 20:8.2f} MiB  {path}" for path, size in largest]
    return (f"the tracked checkout is {total:,} bytes ({total / 2 ** 20:.1f} MiB), over {limit / 2 ** 20:.0f} MiB; "
            f"largest files:\n" + "\n".join(lines))


def test_the_tracked_checkout_fits_one_transfer():
    paths = tracked_files(REPO)
    if paths is None:
        pytest.skip("not a git checkout (or no git): the tracked files cannot be listed")
    by_path = sizes(REPO, paths)
    assert by_path, "git ls-files listed no file present in the working tree"
    problem = report(by_path, LIMIT)
    assert problem is None, problem


def test_an_oversized_checkout_names_its_largest_files(tmp_path):
    (tmp_path / "big.bin").write_bytes(b"\0" * 3000)
    (tmp_path / "small.txt").write_bytes(b"x" * 10)
    by_path = sizes(tmp_path, ["big.bin", "small.txt", "gone.txt"])
    assert by_path == {"big.bin": 3000, "small.txt": 10}
    assert report(by_path, 3010) is None
    problem = report(by_path, 3009, top=1)
    assert problem is not None and "3,010 bytes" in problem and "big.bin" in problem and "small.txt" not in problem


@pytest.mark.parametrize("skip", [False, True], ids=["fails", "skips-when-told"])
def test_serving_tests_fail_naming_a_missing_tritonclient(skip):
    """A broken install (tritonclient unimportable) fails the serving tests with one line naming
    it; they skip only where EAGLE_TRT_SKIP_SERVING=1 says so."""
    import sys
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("EAGLE_TRT_SKIP_SERVING", None)
    if skip:
        env["EAGLE_TRT_SKIP_SERVING"] = "1"
    code = ("import sys; sys.modules['tritonclient'] = None; import pytest; "
            "sys.exit(pytest.main(['-q', '-rs', '-p', 'no:xdist', '-p', 'no:cacheprovider', "
            "'tests/test_triton_serving.py']))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if "tritonclient is missing" in line]
    if skip:
        assert proc.returncode == 5 and lines and lines[0].startswith("SKIPPED"), proc.stdout[-2000:]
    else:
        assert proc.returncode not in (0, 5), proc.stdout[-2000:]
        assert any("the serving tests need it" in line for line in lines), proc.stdout[-2000:]
