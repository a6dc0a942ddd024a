"""Where a drafter training step's time goes, with online target features (the GPU path):
the batch's target forward, the anchors, the TTT forward, backward, the optimizer, and the
per-step reads of the loss the training loop logs, each timed with the device synchronised.

    python scripts/profile_train_step.py [--batch-size 64] [--steps 6] [--device auto] [--variant eagle3.1]

The first H200 run trained at 34,500 tokens/s per process (two at once), far below what
../shared/GPU.md measured for the target forward and a drafter-sized step alone; run this
first on the next GPU to see which part is slow. Prints a table (ms per step, share) and,
with --trace FILE, the top operators of torch.profiler to FILE."""
from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path

import torch

from eagle_trt.checkpoints import load_drafter, load_target
from eagle_trt.devices import resolve_device
from eagle_trt.train.__main__ import distilled_features
from eagle_trt.train.features import OnlineFeatures
from eagle_trt.train.regenerate import DistillSet
from eagle_trt.train.ttt import TrainConfig, auto_autocast, autocast, batch_indices, fetch_batch, sample_anchors, ttt_forward


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafter", default="eagle_trt/drafters/smollm2-eagle3.1", help="weights to time (any will do)")
    p.add_argument("--distill", default="data/distill/smollm2-sharegpt")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--ttt-steps", type=int, default=5)
    p.add_argument("--ttt-share", type=float, default=0.5)
    p.add_argument("--length-groups", type=int, default=1, help="as train's --length-groups (1: off)")
    p.add_argument("--features", choices=("online", "cache"), default="online",
                   help="online: the batch's target forward in the step (the GPU path); cache: read the "
                        "distillation set's feature cache (the CPU legs' path; computed first where missing)")
    p.add_argument("--steps", type=int, default=6, help="timed steps (after one untimed warm-up step)")
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--trace", type=Path, default=None, help="write torch.profiler's operator table here")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    target = load_target(args.target)
    target.model.to(device)
    drafter = load_drafter(args.drafter, target, torch.float32).to(device)
    variant = "eagle3.1" if drafter.cfg.norm_output else "eagle3"
    dset = DistillSet(Path(args.distill))
    capture = drafter.cfg.capture_for(target.config)
    store = (OnlineFeatures(target, [s for _, g in dset.chunks() for s in g], capture, "bfloat16")
             if args.features == "online" else distilled_features(target, capture, Path(args.distill), "bfloat16"))
    cfg = TrainConfig(variant=variant, ttt_steps=args.ttt_steps, batch_size=args.batch_size, ttt_share=args.ttt_share,
                      autocast=auto_autocast(device), freeze_head=True,
                      length_groups=args.length_groups)
    head = drafter.lm_head.weight.detach()
    drafter.lm_head.weight.requires_grad_(False)
    drafter.train()
    params = [q for q in drafter.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    spent: dict[str, float] = defaultdict(float)
    tokens = padded = 0

    def timed(name, fn):
        sync()
        start = time.perf_counter()
        out = fn()
        sync()
        spent[name] += time.perf_counter() - start
        return out

    def step(i: int) -> None:
        nonlocal tokens, padded
        ids = batch_indices(i, list(range(len(store))), cfg, store.lengths)
        batch = timed("target forward (fetch_batch)" if args.features == "online" else "read + collate (fetch_batch)",
                      lambda: fetch_batch(store, ids))
        anchors = timed("anchors (sample_anchors)", lambda: sample_anchors(batch, cfg.ttt_share, 0, i))
        with autocast(drafter, cfg):
            out = timed("TTT forward", lambda: ttt_forward(drafter, batch, head, cfg.ttt_steps, True, anchors=anchors))
        loss = out.total(cfg.step_decay)
        opt.zero_grad(set_to_none=True)
        timed("backward", loss.backward)
        timed("clip + AdamW", lambda: (torch.nn.utils.clip_grad_norm_(params, 0.5), opt.step()))
        timed("loss reads (the log)", lambda: [float(x.detach()) for x in out.losses])
        tokens, padded = tokens + batch.tokens, padded + batch.ids.numel()

    step(0)
    spent.clear()
    tokens = padded = 0
    profiler = (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                                       + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else []))
                if args.trace else None)
    wall = time.perf_counter()
    if profiler:
        profiler.__enter__()
    for i in range(1, args.steps + 1):
        step(i)
    if profiler:
        profiler.__exit__(None, None, None)
    wall = time.perf_counter() - wall
    total = sum(spent.values())
    print(f"{device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), {variant}, batch "
          f"{args.batch_size}, TTT {args.ttt_steps} x share {args.ttt_share}, length groups {args.length_groups}, "
          f"{args.features} features: {tokens / wall:.0f} tokens/s "
          f"({padded / wall:.0f} padded), {1e3 * wall / args.steps:.1f} ms per step")
    for name, s in spent.items():
        print(f"  {name:<30} {1e3 * s / args.steps:9.1f} ms  {s / total:6.1%}")
    if profiler:
        key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        args.trace.write_text(profiler.key_averages().table(sort_by=key, row_limit=30))
        print(f"operators: {args.trace}")


if __name__ == "__main__":
    main()
