"""Held-out top-1 agreement and loss of drafters at every TTT step, on a distillation set's
features (the numbers a training run logs as eval_acc / eval_loss), for any number of steps:
the CPU legs train and evaluate 3 steps, the GPU legs 5, and a tree of depth 5 uses all 5.

    python scripts/heldout_agreement.py eagle_trt/drafters/smollm2-eagle3.1 eagle_trt/drafters/smollm2-eagle3 \
        [--ttt-steps 5] [--eval-distill data/distill/smollm2-val] [--threads 2]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from eagle_trt.checkpoints import CheckpointError, load_drafter, load_target
from eagle_trt.train.__main__ import distilled_features
from eagle_trt.train.ttt import TrainConfig, auto_autocast, evaluate


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("drafters", nargs="+", type=Path)
    p.add_argument("--target", default="smollm2")
    p.add_argument("--eval-distill", type=Path, default=Path("data/distill/smollm2-val"))
    p.add_argument("--ttt-steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.target)
    head = target.model.lm_head.weight.detach()
    for folder in args.drafters:
        try:
            drafter = load_drafter(folder, target, torch.float32)
        except CheckpointError as exc:
            print(f"error: {folder}: {exc}", file=sys.stderr)
            return 2
        store = distilled_features(target, drafter.cfg.capture_for(target.config), args.eval_distill)
        variant = "eagle3.1" if drafter.cfg.norm_output else "eagle3"
        # the training runs evaluate under the autocast they train with (bf16 on these CPUs)
        cfg = TrainConfig(variant=variant, ttt_steps=args.ttt_steps, autocast=auto_autocast(drafter.fc.weight.device))
        used = drafter.to_target_ids(torch.arange(drafter.cfg.draft_vocab_size))
        out = evaluate(drafter, store, list(range(len(store))), head[used].clone(), cfg)
        print(f"{folder}: {variant}, {len(store)} sequences, {store.tokens} tokens, {args.ttt_steps} TTT steps\n"
              f"  agreement {' / '.join(f'{x:.3f}' for x in out['eval_acc'])}\n"
              f"  loss      {' / '.join(f'{x:.4f}' for x in out['eval_loss'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
