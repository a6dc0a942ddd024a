"""Table of scripts/cpu_train_ablation.sh: per run, seconds per step and held-out top-1
agreement per TTT step at each evaluation (from each run's train_log.json)."""
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
print(f"{'run':<20}{'s/step':>8}  held-out agreement per TTT step at each evaluation (step: a1/a2/a3/a4/a5)")
for log_path in sorted(out.glob("*/train_log.json")):
    log = json.loads(log_path.read_text())
    steps = log["step"]
    evals = [e for e in log["log"] if "eval_acc" in e]
    rate = log["seconds_this_session"] / max(steps, 1)
    cells = "  ".join(f"{e['step']}: " + "/".join(f"{a:.3f}" for a in e["eval_acc"]) for e in evals)
    print(f"{log_path.parent.name:<20}{rate:>8.2f}  {cells}")
