"""python -m eagle_trt.diagnose: the attention-drift picture of EAGLE-3 vs EAGLE 3.1 drafters.

    python -m eagle_trt.diagnose --drafter eagle3=eagle_trt/drafters/smollm2-eagle3 \\
        --drafter eagle3.1=eagle_trt/drafters/smollm2-eagle3.1 --out docs/diagnose

For each prompt the target first continues it greedily; at several cut points in that
continuation the drafter then drafts a chain of `--depth` tokens from real target features,
feeding back its own state as it does at inference. At every depth it records:

- sink share: the drafter's attention mass (mean over heads) on the first `--sinks` tokens,
- draft share: its attention mass on the draft tokens of the chain (including itself),
- state norm: the L2 norm of the state entering that depth (depth 0: the fc projection of the
  target features; later depths: the fed-back state, h2 for EAGLE-3 and norm(h2) for 3.1).

EAGLE 3.1's claim is that pre-norm feedback lets the fed-back state's norm drift with depth,
pulling attention onto sink tokens; the numbers show what these drafters do."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from .api import load_target_on
from .checkpoints import CheckpointError, load_drafter
from .devices import add_device_options
from .config import ConfigError
from .evaluate import parse_drafters
from .models.drafter import EagleDrafter
from .models.target import causal_mask
from .runtime.loop import DecodingLoop
from .runtime.static import StaticEngine
from .workloads import build

METRICS = ("sink_share", "draft_share", "state_norm")


@torch.inference_mode()
def chain_stats(drafter: EagleDrafter, captured: torch.Tensor, seq: list[int], cuts: list[int], depth: int,
                sinks: int) -> dict[str, list[list[float]]]:
    """Per cut point, per depth: sink share, draft share, state norm. `captured` [S, A*H] holds the
    target states of `seq`; drafter row j pairs the state of token j with token j + 1."""
    dtype, dev = drafter.fc.weight.dtype, drafter.fc.weight.device
    S = len(seq)
    ids = torch.tensor(seq[1:], device=dev)[None]
    hidden = drafter.project(captured[None, : S - 1].to(dev, dtype))
    pk, pv = drafter.empty_past(1)
    attn = drafter.midlayer.self_attn
    ctx = drafter(hidden, ids, torch.arange(S - 1, device=dev)[None], causal_mask(S - 1, 0, dev), pk, pv)
    out = {m: [] for m in METRICS}
    attn.record_probs = True
    try:
        for j0 in cuts:
            rows = {m: [] for m in METRICS}
            past_k, past_v = ctx.new_k[:, :, :j0], ctx.new_v[:, :, :j0]
            state, tok = hidden[:, j0:j0 + 1], ids[:, j0:j0 + 1]
            for d in range(depth):
                P = past_k.shape[2]
                step = drafter(state, tok, torch.tensor([[j0 + d]], device=dev),
                               torch.ones(1, 1, P + 1, dtype=torch.bool, device=dev), past_k, past_v)
                probs = attn.last_probs[0, :, 0].float()              # [heads, P + 1]
                rows["sink_share"].append(float(probs[:, :sinks].sum(-1).mean()))
                rows["draft_share"].append(float(probs[:, j0 + 1:].sum(-1).mean()) if d else 0.0)
                rows["state_norm"].append(float(state.float().norm()))
                past_k, past_v = torch.cat((past_k, step.new_k), 2), torch.cat((past_v, step.new_v), 2)
                state = step.feedback
                tok = drafter.to_target_ids(step.logits.argmax(-1))
            for m in METRICS:
                out[m].append(rows[m])
    finally:
        attn.record_probs, attn.last_probs = False, None
    return out


def mean_by_depth(rows: list[list[float]]) -> list[float]:
    return [sum(r[d] for r in rows) / len(rows) for d in range(len(rows[0]))]


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    titles = {"sink_share": f"attention on the first {report['sinks']} tokens",
              "draft_share": "attention on the chain's own draft tokens", "state_norm": "norm of the state fed in"}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    styles = ["-", "--", ":", "-."]
    for ax, metric in zip(axes, METRICS):
        for ci, (name, per_workload) in enumerate(report["drafters"].items()):
            for wi, (workload, stats) in enumerate(per_workload.items()):
                ax.plot(range(len(stats[metric])), stats[metric], styles[wi % len(styles)], color=f"C{ci}",
                        marker="o", label=f"{name} / {workload}")
        ax.set_title(titles[metric])
        ax.set_xlabel("draft depth")
        ax.set_xticks(range(report["depth"]))
        if metric == "state_norm":
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"drafter attention drift on {report['target']} (chains of {report['depth']}, "
                 f"{report['cuts_total']} draft chains per line)")
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m eagle_trt.diagnose", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafter", action="append", required=True, help="NAME=PATH (repeatable)")
    p.add_argument("--workloads", default="mtbench,long-2k")
    p.add_argument("--prompts", type=int, default=8, help="prompts per workload")
    p.add_argument("--continuation", type=int, default=48, help="greedy target tokens after each prompt")
    p.add_argument("--cuts", type=int, default=4, help="draft chains per prompt, spread over the continuation")
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--threads", type=int, default=0)
    add_device_options(p)
    p.add_argument("--out", type=Path, required=True, help="folder for diagnose.json and diagnose.png")
    args = p.parse_args(argv)
    try:
        if args.threads:
            torch.set_num_threads(args.threads)
        for name in ("prompts", "continuation", "cuts", "depth", "sinks"):
            if getattr(args, name) < 1:
                raise ConfigError(f"--{name} must be >= 1, got {getattr(args, name)}")
        if args.cuts > args.continuation:
            raise ConfigError(f"--cuts ({args.cuts}) cannot exceed --continuation ({args.continuation})")
        target = load_target_on(args.target, args.device, args.dtype)
        tok = target.tokenizer()
        drafters = [(name, load_drafter(path, target)) for name, path in parse_drafters(args.drafter)]
        workloads = {w: build(tok, w.strip(), args.prompts if not w.startswith("long-") else min(args.prompts, 3))
                     for w in args.workloads.split(",") if w.strip()}
    except (ConfigError, CheckpointError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    eos = set(target.config.eos_token_ids)
    acc = {name: {w: {m: [] for m in METRICS} for w in workloads} for name, _ in drafters}
    for w, prompts in workloads.items():
        for i, prompt in enumerate(prompts):
            cont = DecodingLoop(StaticEngine(target.model, max_batch=1), eos).generate(prompt, args.continuation).tokens
            seq = prompt + cont
            n = len(prompt)
            cuts = sorted({n - 1 + round((k + 1) * (len(cont) - 1) / args.cuts) for k in range(args.cuts)})
            for name, d in drafters:
                target.model.set_capture(d.cfg.capture_for(target.config))
                with torch.inference_mode():
                    T, dev = len(seq), target.model.embed_tokens.weight.device
                    pk, pv = target.model.empty_past(1, device=dev)
                    captured = target.model(torch.tensor([seq], device=dev), torch.arange(T, device=dev)[None],
                                            causal_mask(T, 0, dev), pk, pv, torch.tensor([T - 1], device=dev)).captured[0]
                stats = chain_stats(d, captured, seq, cuts, args.depth, args.sinks)
                for m in METRICS:
                    acc[name][w][m] += stats[m]
            print(f"diagnose: {w} {i + 1}/{len(prompts)} ({len(seq)} tokens)", file=sys.stderr, flush=True)
    chains = [len(acc[drafters[0][0]][w]["sink_share"]) for w in workloads]
    report = {"target": args.target, "depth": args.depth, "sinks": args.sinks,
              "cuts_total": sum(chains) // max(len(chains), 1),     # draft chains per plotted line (mean)
              "drafters": {name: {w: {m: mean_by_depth(acc[name][w][m]) for m in METRICS} for w in workloads}
                           for name, _ in drafters}}
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = args.out / "diagnose.json.tmp"
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, args.out / "diagnose.json")
    plot(report, args.out / "diagnose.png")
    for metric in METRICS:
        print(f"\n{metric} by depth")
        for name, per in report["drafters"].items():
            for w, stats in per.items():
                print(f"  {name:<10} {w:<10} " + " ".join(f"{x:8.3f}" for x in stats[metric]))
    print(f"\nwrote {args.out / 'diagnose.json'} and {args.out / 'diagnose.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
