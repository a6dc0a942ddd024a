"""Does torch.compile speed up a TTT training step on this CPU? The shipped EAGLE 3.1 drafter on the
committed distillation set (its cached features), batch 4, bf16 autocast, anchored TTT (share
0.25), frozen head and embeddings: eager and compiled (inductor, dynamic shapes) steps
alternating, --steps each, --rounds rounds, after a compiled warm-up whose time is printed.

    python scripts/compile_speed.py [--steps 12] [--rounds 3] [--threads 1]
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from eagle_trt.checkpoints import load_drafter, load_target
from eagle_trt.config import CaptureLayers
from eagle_trt.train.__main__ import distilled_features
from eagle_trt.train.ttt import TrainConfig, autocast, collate, sample_anchors, ttt_forward


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target("smollm2")
    capture = CaptureLayers.eagle_default(target.config.num_hidden_layers)
    store = distilled_features(target, capture, Path("data/distill/smollm2-sharegpt"), "bfloat16")
    drafter = load_drafter(Path("eagle_trt/drafters/smollm2-eagle3.1"), target, torch.float32)
    head_rows = drafter.lm_head.weight.detach().clone()
    for frozen in (drafter.lm_head.weight, drafter.embed_tokens.weight):
        frozen.requires_grad_(False)
    opt = torch.optim.AdamW([w for w in drafter.parameters() if w.requires_grad], lr=1e-5)
    cfg = TrainConfig(variant="eagle3.1", autocast="bf16", ttt_share=0.25)
    drafter.train()
    compiled = torch.compile(ttt_forward, dynamic=True)

    def run(forward, steps: int, base: int) -> float:
        tokens, start = 0, time.perf_counter()
        for s in range(steps):
            batch = collate([store.get((base + 4 * s + i) % len(store)) for i in range(4)])
            with autocast(drafter, cfg):
                out = forward(drafter, batch, head_rows, 3, True, anchors=sample_anchors(batch, 0.25, 0, base + s))
            loss = out.total(1.0)
            opt.zero_grad()
            loss.backward()
            opt.step()
            tokens += batch.tokens
        return tokens / (time.perf_counter() - start)

    start = time.perf_counter()
    run(compiled, 3, 0)
    print(f"compile warm-up {time.perf_counter() - start:.0f} s", flush=True)
    for r in range(args.rounds):
        for name, forward in (("eager", ttt_forward), ("compiled", compiled)):
            print(f"{name:9s} {run(forward, args.steps, 1000 + 100 * r):.0f} training tokens/s", flush=True)


if __name__ == "__main__":
    main()
