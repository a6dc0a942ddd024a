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
from .runtime.loop import DecodingLoop
from .runtime.static import PrefillCache, StaticEngine
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
    seconds: float                        # decoding; of the runs sharing a prefill, the first pays for it
    tree: list[int]                       # depth, top-k, total tokens
    tokens: list[list[int]] = field(default_factory=list, repr=False)


def depth_rates(accept_lengths: list[int], depth: int) -> tuple[list[float], list[float]]:
    drafts = [a - 1 for a in accept_lengths]
    n = len(drafts)
    reach = [sum(1 for k in drafts if k >= d) for d in range(depth + 1)]   # reach[0] == n
    absolute = [reach[d] / n if n else 0.0 for d in range(1, depth + 1)]
    conditional = [reach[d] / reach[d - 1] if reach[d - 1] else 0.0 for d in range(1, depth + 1)]
    return absolute, conditional


def evaluate_prompts(runs: list[tuple[str, TreeShape, DecodingLoop]], workload: str,
                     prompts: list[list[int]], max_new_tokens: int, log=None) -> list[WorkloadResult]:
    """Every run (drafter name, tree, decoder) on each prompt in turn, prompt-major, so that
    engines sharing a PrefillCache prefill each prompt once."""
    accepts: list[list[int]] = [[] for _ in runs]
    tokens: list[list[list[int]]] = [[] for _ in runs]
    seconds = [0.0] * len(runs)
    for i, ids in enumerate(prompts):
        for j, (name, shape, decoder) in enumerate(runs):
            r = decoder.generate(ids, max_new_tokens)
            accepts[j] += r.accept_lengths
            tokens[j].append(r.tokens)
            seconds[j] += r.seconds
            if log is not None:
                print(f"  {name} depth {shape.depth} {workload} {i + 1}/{len(prompts)}: accept "
                      f"{r.mean_accept_length:.2f} ({len(r.tokens)} tokens, {r.seconds:.1f}s)", file=log, flush=True)
    out = []
    for j, (name, shape, _) in enumerate(runs):
        absolute, conditional = depth_rates(accepts[j], shape.depth)
        out.append(WorkloadResult(name, workload, len(prompts), sum(map(len, prompts)) / len(prompts),
                                  sum(map(len, tokens[j])), len(accepts[j]),
                                  sum(accepts[j]) / max(len(accepts[j]), 1), absolute, conditional, seconds[j],
                                  [shape.depth, shape.top_k, shape.total_tokens], tokens[j]))
    return out


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


def parse_trees(depths: str, top_k: int, total_tokens: str) -> list[TreeShape]:
    """--depth 5,7 --total-tokens 5,7 (or one total for every depth) -> validated tree shapes."""
    try:
        ds = [int(x) for x in depths.split(",")]
        ts = [int(x) for x in total_tokens.split(",")]
    except ValueError:
        raise ConfigError(f"--depth {depths!r} / --total-tokens {total_tokens!r}: expected integers, "
                          f"comma-separated") from None
    if len(ts) not in (1, len(ds)):
        raise ConfigError(f"--total-tokens {total_tokens!r}: give one value, or one per depth ({len(ds)})")
    return [TreeShape(d, top_k, ts[0] if len(ts) == 1 else t).validate() for d, t in zip(ds, ts * len(ds))]


def format_table(results: list[WorkloadResult]) -> str:
    depth = max((len(r.accepted_at_least) for r in results), default=0)
    head = f"{'drafter':<10} {'workload':<14} {'depth':>5} {'prompts':>7} {'ctx':>6} {'accept':>7}  " + \
        " ".join(f"{'>=' + str(d):>6}" for d in range(1, depth + 1))
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(f"{r.drafter:<10} {r.workload:<14} {r.tree[0]:>5} {r.prompts:>7} {r.prompt_tokens:>6.0f} "
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
    p.add_argument("--depth", default="5", help="tree depth; several (5,7) run in one pass, each prompt prefilled once")
    p.add_argument("--tree-top-k", type=int, default=8)
    p.add_argument("--total-tokens", default="60", help="tree nodes: one value, or one per --depth")
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
        shapes = parse_trees(args.depth, args.tree_top_k, args.total_tokens)
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
    # each prompt prefilled once for every drafter and tree: a long prompt's prefill is most of
    # its time (a ~7k-token prefill takes ~270 s of one core, the 128 tokens after it ~25 s)
    prefills = PrefillCache()
    runs = [(name, shape, DecodingLoop(StaticEngine(target.model, d, shape, max_batch=1, prefills=prefills), eos,
                                       target.config.vocab_size))
            for shape in shapes for name, d, _ in loaded]
    for w in names:
        results += evaluate_prompts(runs, w, prompts[w], args.max_new_tokens, log)
    same = {w: len({str(r.tokens) for r in results if r.workload == w}) == 1 for w in names}
    trees = "; ".join(f"depth {s.depth}, top-k {s.top_k}, {s.total_tokens} nodes" for s in shapes)
    print(f"tree {trees}; temperature 0; {args.max_new_tokens} new tokens per prompt; "
          f"{time.perf_counter() - t0:.0f}s")
    print(format_table(results))
    if len(loaded) > 1:
        print("identical tokens across drafters: " + ", ".join(f"{w} {'yes' if s else 'NO'}" for w, s in same.items()))
    if args.json:
        report = {"target": args.target, "drafters": {n: p for n, _, p in loaded},
                  "trees": [[s.depth, s.top_k, s.total_tokens] for s in shapes], "max_new_tokens": args.max_new_tokens,
                  "identical_across_drafters": same, "results": [asdict(r) for r in results]}
        tmp = args.json.with_name(args.json.name + ".tmp")
        tmp.write_text(json.dumps(report, indent=1))
        os.replace(tmp, args.json)
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
