"""A target graph's calls with its weights in 2 MB pages against 4 KB pages, in one process (a
VM's speed drifts between minutes and processes, so only interleaved calls compare): the first
session made as the runtime makes it (runtime/huge_pages.py), the second with transparent huge
pages off for the rest of the process (PR_SET_THP_DISABLE); their calls take turns. Prints the
median and minimum ms a call per token count.

    python scripts/huge_pages_ab.py [~/.cache/eagle_trt/onnx/smollm2-135m-instruct/target_fused.onnx] [--tokens 1,5]
"""
from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))
from graph_ab import print_times, take_turns, target_feeds  # noqa: E402

from eagle_trt.checkpoints import cache_dir  # noqa: E402
from eagle_trt.runtime import huge_pages  # noqa: E402
from eagle_trt.runtime.sessions import make_session  # noqa: E402

PR_SET_THP_DISABLE = 41


def anon_huge_kb() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("graph", type=Path, nargs="?",
                   default=cache_dir() / "onnx" / "smollm2-135m-instruct" / "target_fused.onnx")
    p.add_argument("--tokens", default="1,5")
    p.add_argument("--context", type=int, default=200, help="rows of past")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    if not huge_pages.enabled():
        print(f"error: {huge_pages.summary()}: nothing to compare", file=sys.stderr)
        return 2
    sessions = {"2 MB pages": make_session(args.graph, args.threads)}
    print(f"2 MB pages: {huge_pages.summary()}; AnonHugePages {anon_huge_kb() >> 10} MB")
    if ctypes.CDLL(None).prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0) != 0:
        print("error: PR_SET_THP_DISABLE refused", file=sys.stderr)
        return 2
    sessions["4 KB pages"] = make_session(args.graph, args.threads, huge_pages=False)
    print(f"4 KB pages: AnonHugePages still {anon_huge_kb() >> 10} MB")
    for tokens in (int(t) for t in args.tokens.split(",")):
        calls = {name: (s, None, target_feeds(s, tokens, args.context)) for name, s in sessions.items()}
        print_times(tokens, args.context, take_turns(calls, args.rounds, 3, alternate=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
