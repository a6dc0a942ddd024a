"""The build's on-disk bookkeeping: content hashes, stage records, atomic stage folders,
progress lines and the manifest.

A stage writes everything into a temporary folder `<out>/.tmp-<stage>-*`, which is renamed
to `<out>/<stage>` only when complete; its record `<out>/.stages/<stage>.json` (cache key +
sha256 of every file) is written after the rename. A build killed at any point leaves either
the previous complete folder, or the new complete folder without a record (rerun), or temp
folders that the next build deletes before it starts: never a half-written artifact."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

RECORDS = ".stages"
TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"
# Source checkpoints can be tens of GB: files above this are fingerprinted by size, mtime and
# sampled blocks instead of a full read on every build (artifacts we write are hashed fully).
FULL_HASH_LIMIT = 1 << 30
SAMPLE = 4 << 20


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_json(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def fingerprint(path: Path) -> dict:
    """Content fingerprint of a source file or folder (a checkpoint), for cache keys."""
    path = Path(path)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    out = {}
    for f in files:
        rel = str(f.relative_to(path)) if path.is_dir() else f.name
        if rel.startswith("."):
            continue
        st = f.stat()
        if st.st_size <= FULL_HASH_LIMIT:
            out[rel] = sha256_file(f)
        else:
            h = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}".encode())
            with open(f, "rb") as fh:
                h.update(fh.read(SAMPLE))
                fh.seek(st.st_size - SAMPLE)
                h.update(fh.read(SAMPLE))
            out[rel] = "sampled:" + h.hexdigest()
    return out


def hash_tree(folder: Path) -> dict[str, dict]:
    """{relative path: {sha256, bytes}} for every file under folder."""
    return {str(p.relative_to(folder)): {"sha256": sha256_file(p), "bytes": p.stat().st_size}
            for p in sorted(folder.rglob("*")) if p.is_file()}


def write_json_atomic(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2, sort_keys=False, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


@dataclass
class StageRecord:
    name: str
    key: str
    artifacts: dict[str, dict]                 # path relative to the stage folder -> {sha256, bytes}
    info: dict = field(default_factory=dict)   # stage summary (what was built, parity numbers...)
    seconds: float = 0.0
    stats: dict = field(default_factory=dict)  # path -> [size, mtime_ns] when hashed (fast re-check)


class Store:
    def __init__(self, root: Path):
        self.root = Path(root)

    def stage_dir(self, name: str) -> Path:
        return self.root / name

    def clean_temporaries(self) -> list[str]:
        """Delete what an interrupted build left: temp stage folders, old folders mid-swap,
        temp files of atomic writes. Returns what was removed."""
        removed = []
        if not self.root.is_dir():
            return removed
        for p in list(self.root.iterdir()) + list((self.root / RECORDS).glob(".*.tmp")):
            if p.name.startswith((TMP_PREFIX, OLD_PREFIX)) or (p.name.startswith(".") and p.name.endswith(".tmp")):
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
                removed.append(p.name)
        return removed

    def record(self, name: str) -> StageRecord | None:
        path = self.root / RECORDS / f"{name}.json"
        try:
            return StageRecord(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def valid(self, rec: StageRecord) -> str | None:
        """None if every recorded artifact is present with its recorded content, else why not."""
        folder = self.stage_dir(rec.name)
        for rel, meta in rec.artifacts.items():
            p = folder / rel
            if not p.is_file():
                return f"{rec.name}/{rel} is missing"
            st = p.stat()
            if rec.stats.get(rel) == [st.st_size, st.st_mtime_ns]:
                continue            # untouched since hashed
            if st.st_size != meta["bytes"] or sha256_file(p) != meta["sha256"]:
                return f"{rec.name}/{rel} changed since the {rec.name} stage wrote it (sha256 differs)"
        return None

    def new_tmp(self, name: str) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{name}-", dir=self.root))

    def commit(self, name: str, tmp: Path, key: str, info: dict, seconds: float) -> StageRecord:
        """Hash the finished temp folder, swap it into place, then write the record."""
        artifacts = hash_tree(tmp)
        os.chmod(tmp, 0o755)
        final = self.stage_dir(name)
        self.drop(name)
        os.replace(tmp, final)
        stats = {rel: [(final / rel).stat().st_size, (final / rel).stat().st_mtime_ns] for rel in artifacts}
        rec = StageRecord(name, key, artifacts, info, round(seconds, 3), stats)
        write_json_atomic(self.root / RECORDS / f"{name}.json", asdict(rec))
        return rec

    def drop(self, name: str) -> None:
        """Remove a stage's record first, then its folder (renamed aside, then deleted), so a
        kill in between never leaves a record describing a folder that is not there."""
        (self.root / RECORDS / f"{name}.json").unlink(missing_ok=True)
        final = self.stage_dir(name)
        if final.exists():
            old = Path(tempfile.mkdtemp(prefix=f"{OLD_PREFIX}{name}-", dir=self.root))
            os.replace(final, old / name)
            shutil.rmtree(old, ignore_errors=True)


class Progress:
    """Percent lines on stderr for long stages, with the time so far and, until the last step, the
    time left at the pace so far: `  export [##########..........] 1/2 (50%) target.onnx 12.0s, ~12s left`.
    label: what is counted, when not the stage's steps; every: at most one line per that many
    seconds (the last step always prints)."""

    def __init__(self, stage: str, total: int, stream: TextIO | None = sys.stderr, label: str = "",
                 every: float = 0.0):
        self.stage, self.total, self.done, self.stream = stage, max(total, 1), 0, stream
        self.label, self.every, self.printed = label, every, float("-inf")
        self.start = time.perf_counter()

    def step(self, what: str = "") -> None:
        self.done += 1
        if self.stream is None:
            return
        spent = time.perf_counter() - self.start
        if self.done < self.total and spent - self.printed < self.every:
            return
        self.printed = spent
        pct = 100 * self.done // self.total
        bar = "#" * (pct // 5) + "." * (20 - pct // 5)
        left = f", ~{spent / self.done * (self.total - self.done):.0f}s left" if self.done < self.total else ""
        label = f"{self.label} " if self.label else ""
        print(f"  {self.stage:<9} [{bar}] {label}{self.done}/{self.total} ({pct}%) {what} {spent:.1f}s{left}",
              file=self.stream, flush=True)


def progress_callback(stage: str, stream: TextIO | None, label: str, every: float = 10.0):
    """A (done, total[, what]) callback for work that learns its total as it starts (weights
    written, MatMuls rewritten): a Progress made at the first call, one line at most every
    `every` seconds, with an ETA."""
    bar: list[Progress] = []

    def step(done: int, total: int, what: str = "") -> None:
        if not bar:
            bar.append(Progress(stage, total, stream, label, every))
        bar[0].step(what)
    return step


def human_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def versions() -> dict[str, str | None]:
    import platform
    from importlib import metadata
    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in ("torch", "onnx", "onnxruntime", "transformers", "polygraphy", "numpy", "tensorrt"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    try:   # the module itself (NGC images ship tensorrt without pip metadata)
        import tensorrt
        out["tensorrt"] = tensorrt.__version__
    except Exception:  # noqa: BLE001 - absent or broken: the engines stage says why
        pass
    return out


__all__ = ["Progress", "StageRecord", "Store", "fingerprint", "hash_tree", "human_bytes", "sha256_file",
           "sha256_json", "versions", "write_json_atomic"]
