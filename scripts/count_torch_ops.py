"""How many ATen ops the PyTorch backend issues: per plain decoding step and per speculative
iteration (drafting, verification and the loop between them), counted with the PyTorch profiler
on the CPU. On a GPU each top-level op is at least one kernel launch made from Python, so this
count times the host's cost per op bounds a step from below however fast the device is (the
H200 of session 44: a plain SmolLM2-135M step took 32 ms, ~13 us per op, for weights the device
reads in 0.06 ms): what CUDA-graph capture of the calls would remove.

    python scripts/count_torch_ops.py [--target smollm2] [--tree 3,2,4] [--tokens 32]
"""
from __future__ import annotations

import argparse
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from eagle_trt.api import prepare_models
from eagle_trt.config import TreeShape
from eagle_trt.runtime.backend import TorchDrafter, TorchTarget
from eagle_trt.runtime.decoder import SpeculativeDecoder, generate_autoregressive
from eagle_trt.workloads import build


def top_level_ops(fn) -> tuple[object, Counter]:
    """fn's result and its ATen ops that no other ATen op called (what Python dispatched)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        result = fn()
    ops = Counter(e.name for e in prof.events() if e.name.startswith("aten::")
                  and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))
    return result, ops


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafter", default=None)
    p.add_argument("--tree", default="3,2,4", help="depth,top_k,total_tokens")
    p.add_argument("--tokens", type=int, default=32, help="new tokens per measured run")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    models = prepare_models(args.target, args.drafter)
    prompts = build(models.tokenizer, "mtbench", 2)
    decoder = SpeculativeDecoder(TorchTarget(models.target.model),
                                 TorchDrafter(models.drafter, TreeShape(*map(int, args.tree.split(",")))),
                                 models.eos_ids, models.target.config.vocab_size)
    decoder.generate(prompts[0], 4)                                          # first-call work stays out
    plain, ops = top_level_ops(lambda: generate_autoregressive(decoder.target, prompts[1], args.tokens,
                                                               models.eos_ids))
    steps = plain.target_calls                                                   # prefill included
    print(f"plain decoding: {sum(ops.values()) / steps:.0f} top-level ATen ops per target call "
          f"({steps} calls); most frequent per call: "
          + ", ".join(f"{name[6:]} {n / steps:.0f}" for name, n in ops.most_common(8)))
    spec, ops = top_level_ops(lambda: decoder.generate(prompts[1], args.tokens))
    print(f"speculative decoding: {sum(ops.values()) / spec.drafter_calls:.0f} top-level ATen ops per iteration "
          f"({spec.drafter_calls} iterations, tree {args.tree}, prefill included)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
