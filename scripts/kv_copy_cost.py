"""What the KV cache's own copies cost on this CPU, apart from the decoding loop (issue 22): the
commit of each sequence's accepted rows after a verification, and a re-layout when the longest
sequence outgrows the cache's rows. Both run on the real `KVCache` (SmolLM2-135M's layout: 30
layers, 3 KV heads of 64, float32), once with warm caches and once after reading `--stream-mb`
of memory, as a target graph call does with its weights (540 MB for SmolLM2 in fp32):

    python scripts/kv_copy_cost.py [--streams 8] [--rows 2] [--length 250] [--stream-mb 540]

Prints the median microseconds of a commit of `--rows` rows per sequence (each at its own
length, one run of rows) and the milliseconds of growing the cache by one chunk of rows (in
place, inside its storage), into memory that has never been touched (each page faults in) and
again into memory that has. The
commit moves rows x 180 runs of 256 bytes per sequence (K and V of 30 layers x 3 heads), each
in its own page of a cache of ~100 MB: after a graph call that is memory latency, not Python."""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from eagle_trt.runtime.kv_cache import CHUNK, KVCache


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--rows", type=int, default=2, help="accepted rows committed per sequence")
    p.add_argument("--length", type=int, default=250, help="committed rows per sequence before the commits")
    p.add_argument("--stream-mb", type=int, default=540, help="memory read between commits in the cold runs")
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args(argv)
    layers, heads, dim, T = 30, 3, 64, 5
    cache = KVCache(layers, heads, dim, batch=args.streams)
    for _ in range(args.streams):
        cache.add(args.length + 2 * args.repeats * args.rows)   # room for both runs' commits
    cache.lengths = [args.length] * args.streams
    new = np.random.default_rng(0).standard_normal((2, layers, args.streams, heads, T, dim), dtype=np.float32)
    weights = np.ones(args.stream_mb * 2**18, dtype=np.float32)   # what a graph call reads
    slots = range(args.streams)
    for cold in (False, True):
        times = []
        for _ in range(args.repeats):
            if cold:
                weights.sum()
            cache.staged, cache.staged_slots, cache.new_rows = T, slots, new
            start = time.perf_counter()
            cache.commit([list(range(args.rows))] * args.streams)
            times.append(time.perf_counter() - start)
        print(f"commit of {args.rows} rows x {args.streams} sequences, {'after reading ' + str(args.stream_mb) + ' MB' if cold else 'warm'}: "
              f"median {1e6 * statistics.median(times):.0f} us")
    mb = cache.kv.numel() * cache.kv.element_size() / 2**20
    rows = cache.capacity
    for memory in ("memory never touched before", "memory touched before"):   # the second time: shrunk first
        weights.sum()
        start = time.perf_counter()
        cache.reserve(slots, rows - max(cache.lengths) + CHUNK)     # one chunk more than the rows there were
        print(f"growing the cache by {CHUNK} rows ({args.streams} slots, {mb:.0f} MB before) into {memory}: "
              f"{1e3 * (time.perf_counter() - start):.1f} ms")
        cache._allocate(args.streams, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
