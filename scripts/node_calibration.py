"""Are a drafter's tree scores calibrated, and what would verifying fewer or more of a tree's
nodes accept? Decodes MT-bench prompts at temperature 0 on the PyTorch backend with a large
tree, every node verified, and records per iteration each node's score (cumulative draft
log-prob) and the accepted path. Prints the share of nodes accepted per band of exp(score)
(calibrated: the share matches the band) and the mean acceptance length had only the n
best-scored nodes been verified (the accepted path's nodes among them: the n best of a tree are
closed under ancestry). What runtime/cost.py's NodeTrim assumes, measured.

    python scripts/node_calibration.py [--drafter eagle_trt/drafters/smollm2-eagle3.1] [--tree 6,4,24] \\
        [--first 10 --prompts 20] [--threads 2]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing
from eagle_trt.api import load_pipeline  # noqa: E402
from eagle_trt.bench import parse_tree  # noqa: E402
from eagle_trt.tree import rank_desc  # noqa: E402
from eagle_trt.workloads import build  # noqa: E402

BANDS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1.01)


def record(decoder, prompts: list[list[int]], max_new_tokens: int) -> list[tuple[torch.Tensor, list[int]]]:
    """(scores [N], accepted node indices 0..N-1) of every drafting iteration."""
    out, last = [], {}
    draft, accept = decoder.drafter.draft, decoder.target.accept_greedy

    def drafting(states, ids, lengths, *rest):
        tree = draft(states, ids, lengths, *rest)
        if lengths is not None:               # the iteration's tree, not a catch-up call
            last["scores"] = tree.scores[0].clone()
        return tree

    def accepting(*args):
        path, length, tokens = accept(*args)
        if "scores" in last:
            out.append((last.pop("scores"), [j - 1 for j in path[0, 1:int(length[0])].tolist()]))
        return path, length, tokens
    decoder.drafter.draft, decoder.target.accept_greedy = drafting, accepting
    for i, ids in enumerate(prompts):
        r = decoder.generate(ids, max_new_tokens)
        print(f"  prompt {i + 1}/{len(prompts)}: accept {r.mean_accept_length:.2f}", file=sys.stderr, flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", default=None, help="drafter folder (default: the shipped one for smollm2)")
    p.add_argument("--tree", type=parse_tree, default=parse_tree("6,4,24"))
    p.add_argument("--first", type=int, default=10, help="first MT-bench prompt (bench measures 0..9)")
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    pipe = load_pipeline("smollm2", args.drafter, args.tree)
    prompts = build(pipe.tokenizer, "mtbench", args.first + args.prompts)[args.first:]
    runs = record(pipe.decoder, prompts, args.max_new_tokens)
    prob = torch.cat([s.exp() for s, _ in runs])
    hit = torch.cat([torch.zeros_like(s).index_fill_(0, torch.tensor(a, dtype=torch.long), 1.0) for s, a in runs])
    print(f"{len(runs)} iterations, tree ({args.tree.depth}, {args.tree.top_k}, {args.tree.total_tokens}), {args.prompts} MT-bench prompts "
          f"from #{args.first}\n\n| exp(score) | nodes | accepted |\n|---|---|---|")
    for lo, hi in zip(BANDS, BANDS[1:]):
        band = (prob >= lo) & (prob < hi)
        share = hit[band].mean().item() if band.any() else float("nan")
        print(f"| {lo:.2f}-{min(hi, 1.0):.2f} | {int(band.sum())} | {share:.3f} |")
    ranks = [rank_desc(s)[torch.tensor(a, dtype=torch.long)] for s, a in runs]
    print("\n| nodes verified (best n) | mean acceptance length |\n|---|---|")
    for n in sorted({1, 2, 3, 4, 6, 8, 12, 16, args.tree.total_tokens}):
        if n <= args.tree.total_tokens:
            print(f"| {n} | {1 + sum(int((r < n).sum()) for r in ranks) / len(ranks):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
