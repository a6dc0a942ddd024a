"""How did held-out agreement move with training? Per TTT step, against training CPU hours (or a GPU run's wall-clock minutes,
--x wall), for drafters' train logs.

    python scripts/plot_training.py eagle_trt/drafters/smollm2-eagle3.1 eagle_trt/drafters/smollm2-eagle3 \\
        --out docs/results/training/agreement.png

Reads each folder's train_log.json (a shipped compact log or a run's full log) and the logs of
the legs before it (`previous`): every entry with
`eval_acc` and `cpu_s` (training CPU seconds, all threads, evaluation excluded, counted from the
weights' first step) is a point. Agreement = the drafter's top-1 equals the target's greedy token
at that TTT step (step 1 = the first draft token) on the held-out set named in the log. Prints
the table it plots."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def held_out_of(log: dict) -> str:
    return log.get("eval", {}).get("distill", "the last training sequences")


def curve(folder: Path, x: str = "cpu") -> tuple[str, list[tuple[float, list[float]]], str]:
    """The points of the weights' whole lineage (each leg's log keeps the log of the weights it
    started from under `previous`), oldest first, where a leg was evaluated on the same held-out
    set as the last one. x "cpu": training CPU hours; "wall": wall-clock minutes (a GPU run's
    time), each leg's counted on from the end of the one before."""
    log = json.loads((folder / "train_log.json").read_text())
    held_out, legs = held_out_of(log), []
    while log:
        legs.append(log)
        log = log.get("previous")
    points, offset = [], 0.0
    for leg in reversed(legs):
        entries = leg.get("log") or leg.get("log_every_50") or []
        if x == "wall":
            points += [(offset + e.get("wall_s", 0.0) / 60, e["eval_acc"]) for e in entries if "eval_acc" in e]
            offset += max((e.get("wall_s", 0.0) for e in entries), default=0.0) / 60
        elif held_out_of(leg) == held_out:
            points += [(e["cpu_s"] / 3600, e["eval_acc"]) for e in entries if "eval_acc" in e and "cpu_s" in e]
    return folder.name, points, held_out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folders", type=Path, nargs="+")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--json", type=Path, default=None, help="also write the points (and each run's options) here")
    p.add_argument("--x", choices=("cpu", "wall"), default="cpu",
                   help="cpu: training CPU hours (CPU runs); wall: wall-clock minutes (GPU runs)")
    args = p.parse_args(argv)
    table = {}
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.2))
    styles = ["-", "--", ":", "-."]
    for n, folder in enumerate(args.folders):
        name, points, held_out = curve(folder, args.x)
        if not points:
            print(f"{folder}: no evaluated entries with cpu_s", file=sys.stderr)
            continue
        log = json.loads((folder / "train_log.json").read_text())
        last = (log.get("log") or log.get("log_every_50"))[-1]
        unit = "cpu_hours" if args.x == "cpu" else "wall_minutes"
        table[name] = {"held_out": held_out, "points": [{unit: round(h, 4), "eval_acc": a} for h, a in points],
                       "steps": log.get("step"), "tokens_seen": last.get("tokens_seen"),
                       "options": {k: log.get("config", {}).get(k) for k in
                                   ("ttt_steps", "ttt_share", "freeze_head", "batch_size", "lr", "autocast")}}
        print(f"{name} (held out: {held_out})")
        print(("  CPU h   " if args.x == "cpu" else "  minutes " ) + "  ".join(f"step {k + 1}" for k in range(len(points[0][1]))))
        for hours, acc in points:
            print(f"  {hours:6.2f}  " + "  ".join(f"{a:6.3f}" for a in acc))
        for k in range(len(points[0][1])):
            ax.plot([h for h, _ in points], [a[k] for _, a in points], styles[n % len(styles)], color=f"C{k}",
                    label=f"{name}, TTT step {k + 1}")
    ax.set_xlabel("training CPU hours (all threads; evaluation excluded)" if args.x == "cpu"
                  else "wall-clock minutes on the GPU (evaluation included)")
    ax.set_ylabel("held-out top-1 agreement with the target")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    if args.json:
        args.json.write_text(json.dumps(table, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
