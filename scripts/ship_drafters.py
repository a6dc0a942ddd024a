"""Is this training run good enough to ship, and if so, ship it: copy the drafter from its run
folder into eagle_trt/drafters/ with a compact train log (the run's args, data, vocabulary and
final eval, the log entries of every 50th step, and `shipped`: the date, commit and machine). A
run whose final held-out agreement (same held-out set, mean over the TTT steps both evaluated) is
below the drafter it would replace is refused (exit 1, the run stays in its folder) unless --force.

    python scripts/ship_drafters.py ~/.cache/eagle_trt/runs/smollm2-eagle3.1 eagle_trt/drafters/smollm2-eagle3.1 \
        --note "400 steps on a 600-step schedule, then resumed to 800"
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path


def compact_log(run: Path, every: int = 50) -> dict:
    log = json.loads((run / "train_log.json").read_text())
    if not log.get("finished"):
        raise SystemExit(f"{run / 'train_log.json'}: the run has not finished (step {log.get('step')})")
    entries = log.pop("log")
    # every evaluated entry (the held-out curve) and every 50th step's training numbers
    log["log_every_50"] = [e for e in entries if e["step"] % every == 0 or "eval_acc" in e]
    last = next((e for e in reversed(entries) if "eval_acc" in e), None)
    if last is not None:
        log["final_eval"] = {k: last[k] for k in ("step", "eval_loss", "eval_acc")}
    return log


def held_out(log: dict) -> list[float] | None:
    return (log.get("final_eval") or {}).get("eval_acc")


def not_better(log: dict, dest: Path) -> str | None:
    """Why the run should not replace the drafter shipped at `dest`: its final held-out agreement
    (mean over the TTT steps both evaluated, on the same held-out set) is lower. None otherwise."""
    old_path = dest / "train_log.json"
    if not old_path.is_file():
        return None
    old = json.loads(old_path.read_text())
    new_acc, old_acc = held_out(log), held_out(old)
    same_set = log.get("args", {}).get("eval_distill") == old.get("args", {}).get("eval_distill")
    if not (new_acc and old_acc and same_set):
        return None
    k = min(len(new_acc), len(old_acc))
    new_mean, old_mean = sum(new_acc[:k]) / k, sum(old_acc[:k]) / k
    if new_mean >= old_mean:
        return None
    return (f"held-out agreement {' / '.join(f'{x:.3f}' for x in new_acc[:k])} (mean {new_mean:.4f}) is below the "
            f"shipped drafter's {' / '.join(f'{x:.3f}' for x in old_acc[:k])} (mean {old_mean:.4f})")


def shipped_on() -> dict:
    """When and on what a drafter is shipped: the UTC date, the checkout's commit and the machine
    (CPU model, AVX-512 or not, cores), the labels the docs use instead of run numbers."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parent, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    cpu, flags = platform.processor() or platform.machine(), ""
    try:
        info = Path("/proc/cpuinfo").read_text()
        cpu = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), cpu)
        flags = next((line for line in info.splitlines() if line.startswith("flags")), "")
    except OSError:
        pass
    isa = "AVX-512" if " avx512f" in flags else "AVX2" if " avx2" in flags else platform.machine()
    return {"date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(), "commit": commit,
            "machine": f"{cpu}, {isa}, {os.cpu_count()} cores"}


def ship(run: Path, dest: Path, note: str | None, force: bool = False) -> None:
    src = run / "drafter"
    for name in ("config.json", "model.safetensors"):
        if not (src / name).is_file():
            raise SystemExit(f"{src / name}: missing; finish the run first (python -m eagle_trt.train ... --resume)")
    log = compact_log(run)
    worse = not_better(log, dest)
    if worse and not force:
        raise SystemExit(f"{run}: not shipped to {dest}: {worse} (--force ships it anyway)")
    start = log.get("init_from", {}).get("path")
    if start and (Path(start) / "train_log.json").is_file():    # the lineage: the starting weights' own runs
        log["previous"] = json.loads((Path(start) / "train_log.json").read_text())
    log["shipped"] = shipped_on()
    if note:
        log["note"] = note
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy2(src / name, tmp / name)
    (tmp / "train_log.json").write_text(json.dumps(log, indent=1))
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(tmp, dest)
    size = (dest / "model.safetensors").stat().st_size / 2 ** 20
    print(f"{dest}: step {log['step']}, {size:.1f} MiB, final eval acc {log.get('final_eval', {}).get('eval_acc')}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", type=Path)
    p.add_argument("dest", type=Path)
    p.add_argument("--note", default=None)
    p.add_argument("--force", action="store_true", help="ship even if its held-out agreement is below the shipped one's")
    args = p.parse_args(argv)
    ship(args.run, args.dest, args.note, args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
