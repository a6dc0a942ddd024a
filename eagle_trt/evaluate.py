"""python -m eagle_trt.evaluate: acceptance of one or more drafters on the evaluation workloads,
at temperature 0, measured in one run with the same target and tree.

    python -m eagle_trt.evaluate --drafter eagle3.1=eagle_trt/drafters/smollm2-eagle3.1 \\
        --drafter eagle3=eagle_trt/drafters/smollm2-eagle3 --json eval.json

For every (drafter, workload): mean acceptance length (tokens per target verification call,
bonus token included) and per-depth acceptance: the share of verification calls that accepted
at least d draft tokens, and the same conditioned on having reached depth d - 1. Greedy decoding
is lossless, so every drafter must produce the same tokens on the same prompt; the report says
whether they did (a free losslessness check across drafters)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .api import load_target_on
from .checkpoints import CheckpointError, load_drafter
from .devices import add_device_options
from .config import ConfigError, TreeShape
from .runtime.backend import TorchDrafter, TorchTarget
from .runtime.decoder import SpeculativeDecoder
from .workloads import WORKLOADS, build

DEFAULT_WORKLOADS = ("mtbench", "long-1k", "long-2k", "long-4k", "system-custom", "system-none", "plain")


@dataclass
class WorkloadResult:
    drafter: str
    workload: str
    prompts: int
    prompt_tokens: float                  # mean prompt length
    new_tokens: int
    verify_calls: int
    mean_accept_length: float
    accepted_at_least: list[float]        # [d-1]: share of calls with >= d drafts accepted
    conditional: list[float]              # [d-1]: P(>= d accepted | >= d-1 accepted)
    seconds: float
    tokens: list[list[int]] = field(default_factory=list, repr=False)


def depth_rates(accept_lengths: list[int], depth: int) -> tuple[list[float], list[float]]:
    drafts = [a - 1 for a in accept_lengths]
    n = len(drafts)
    reach = [sum(1 for k in drafts if k >= d) for d in range(depth + 1)]   # reach[0] == n
    absolute = [reach[d] / n if n else 0.0 for d in range(1, depth + 1)]
    conditional = [reach[d] / reach[d - 1] if reach[d - 1] else 0.0 for d in range(1, depth + 1)]
    return absolute, conditional


def evaluate_drafter(decoder: SpeculativeDecoder, name: str, workload: str, prompts: list[list[int]],
                     max_new_tokens: int, depth: int, log=None) -> WorkloadResult:
    accepts, tokens, seconds = [], [], 0.0
    for i, ids in enumerate(prompts):
        r = decoder.generate(ids, max_new_tokens)
        accepts += r.accept_lengths
        tokens.append(r.tokens)
        seconds += r.seconds
        if log is not None:
            print(f"  {name} {workload} {i + 1}/{len(prompts)}: accept {r.mean_accept_length:.2f} "
                  f"({len(r.tokens)} tokens, {r.seconds:.1f}s)", file=log, flush=True)
    absolute, conditional = depth_rates(accepts, depth)
    return WorkloadResult(name, workload, len(prompts), sum(map(len, prompts)) / len(prompts),
                          sum(map(len, tokens)), len(accepts), sum(accepts) / max(len(accepts), 1),
                          absolute, conditional, seconds, tokens)


def parse_drafters(specs: list[str]) -> list[tuple[str, Path]]:
    out = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--drafter {spec!r}: expected NAME=PATH")
        if any(name == n for n, _ in out):
            raise ConfigError(f"--drafter {spec!r}: the name {name!r} is used twice")
        out.append((name, Path(path)))
    return out


def format_table(results: list[WorkloadResult]) -> str:
    depth = len(results[0].accepted_at_least) if results else 0
    head = f"{'drafter':<10} {'workload':<14} {'prompts':>7} {'ctx':>6} {'accept':>7}  " + \
        " ".join(f"{'>=' + str(d):>6}" for d in range(1, depth + 1))
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(f"{r.drafter:<10} {r.workload:<14} {r.prompts:>7} {r.prompt_tokens:>6.0f} "
                     f"{r.mean_accept_length:>7.3f}  " + " ".join(f"{x:>6.3f}" for x in r.accepted_at_least))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m eagle_trt.evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafter", action="append", required=True, help="NAME=PATH (repeatable)")
    p.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS),
                   help=f"comma-separated, from: {', '.join(WORKLOADS)}")
    p.add_argument("--prompts", type=int, default=80, help="prompts per MT-bench-based workload")
    p.add_argument("--long-prompts", type=int, default=3, help="prompts per long-context workload")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--tree-top-k", type=int, default=8)
    p.add_argument("--total-tokens", type=int, default=60)
    p.add_argument("--threads", type=int, default=0)
    add_device_options(p)
    p.add_argument("--json", type=Path, default=None, help="write the results (and generated tokens) here")
    p.add_argument("--quiet", action="store_true", help="no per-prompt progress")
    args = p.parse_args(argv)
    try:
        if args.threads:
            torch.set_num_threads(args.threads)
        drafters = parse_drafters(args.drafter)
        names = [w.strip() for w in args.workloads.split(",") if w.strip()]
        shape = TreeShape(args.depth, args.tree_top_k, args.total_tokens).validate()
        target = load_target_on(args.target, args.device, args.dtype)
        tok = target.tokenizer()
        prompts = {w: build(tok, w, args.long_prompts if w.startswith("long-") else args.prompts) for w in names}
        eos = set(target.config.eos_token_ids) | ({tok.eos_token_id} if tok.eos_token_id is not None else set())
        loaded = []
        for name, path in drafters:
            d = load_drafter(path, target)
            loaded.append((name, d, str(path)))
        captures = {d.cfg.capture_for(target.config) for _, d, _ in loaded}
        if len(captures) > 1:
            raise ConfigError("the drafters capture different target layers; evaluate them in separate runs")
        target.model.set_capture(captures.pop())
    except (ConfigError, CheckpointError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    log = None if args.quiet else sys.stderr
    results: list[WorkloadResult] = []
    t0 = time.perf_counter()
    for w in names:
        for name, d, _ in loaded:
            dec = SpeculativeDecoder(TorchTarget(target.model), TorchDrafter(d, shape), eos, target.config.vocab_size)
            results.append(evaluate_drafter(dec, name, w, prompts[w], args.max_new_tokens, shape.depth, log))
    same = {w: len({str(r.tokens) for r in results if r.workload == w}) == 1 for w in names}
    print(f"tree depth {shape.depth}, top-k {shape.top_k}, {shape.total_tokens} nodes; temperature 0; "
          f"{args.max_new_tokens} new tokens per prompt; {time.perf_counter() - t0:.0f}s")
    print(format_table(results))
    if len(loaded) > 1:
        print("identical tokens across drafters: " + ", ".join(f"{w} {'yes' if s else 'NO'}" for w, s in same.items()))
    if args.json:
        report = {"target": args.target, "drafters": {n: p for n, _, p in loaded},
                  "tree": [shape.depth, shape.top_k, shape.total_tokens], "max_new_tokens": args.max_new_tokens,
                  "identical_across_drafters": same, "results": [asdict(r) for r in results]}
        tmp = args.json.with_name(args.json.name + ".tmp")
        tmp.write_text(json.dumps(report, indent=1))
        os.replace(tmp, args.json)
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
