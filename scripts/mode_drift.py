"""Milliseconds per token of plain and speculative decoding, run back to back on the same prompts
in one process (the sessions, thread settings and warm-up of `python -m eagle_trt.bench`), to
tell a slow machine from a slow mode: if the plain steps are slow in every position of the
sequence, the machine is, not the baseline's setting.

    python scripts/mode_drift.py [--prompts 3] [--max-new-tokens 128] [--threads 2]
        [--sequence autoregressive,autoregressive,speculative,autoregressive,speculative,autoregressive]

To compare commits, run it from a worktree of the other one with PYTHONPATH set to it."""
from __future__ import annotations

import argparse
import sys

from eagle_trt.api import prepare_models, real_prompt_ids
from eagle_trt.bench import parse_tree
from eagle_trt.checkpoints import cache_dir
from eagle_trt.export import export_pipeline
from eagle_trt.runtime.timing import OrtDecoding

MODES = ("autoregressive", "speculative")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", default="3,2,4")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sequence", default="autoregressive,autoregressive,speculative,autoregressive,speculative,"
                   "autoregressive", help="the modes to run on each prompt, in order")
    args = p.parse_args(argv)
    sequence = [m.strip() for m in args.sequence.split(",") if m.strip()]
    bad = [m for m in sequence if m not in MODES]
    if bad or not sequence:
        print(f"error: --sequence {args.sequence!r}: modes are {', '.join(MODES)}", file=sys.stderr)
        return 2
    shape = parse_tree(args.tree)
    models = prepare_models("smollm2", None, log=sys.stderr)
    folder = cache_dir() / "profile" / models.target.folder.name / f"{shape.depth}-{shape.top_k}-{shape.total_tokens}"
    graphs = export_pipeline(models, shape, folder, log=sys.stderr, only=("target", "drafter_tree"))
    prompts = real_prompt_ids(models, args.prompts + 1)
    ort = OrtDecoding.open(graphs["target"], graphs["drafter_tree"], shape, models.target.config.max_position_embeddings,
                           models.eos_ids, models.target.config.vocab_size, threads=args.threads)
    ort.warm_up(prompts[0])
    print("ms per token, prefill included, in the order run:")
    for i, ids in enumerate(prompts[1:], 1):
        cells = []
        for mode in sequence:
            r = getattr(ort, mode)(ids, args.max_new_tokens)
            cells.append(f"{mode[:4]} {1e3 * r.seconds / len(r.tokens):5.1f}")
        print(f"  prompt {i}: " + "  ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
