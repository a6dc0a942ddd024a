"""Pooled acceptance (tokens over verification calls) per drafter, depth and workload from the
per-prompt lines of an `evaluate` log; --skip 6,7 leaves those prompts out."""
import collections
import re
import sys

pat = re.compile(r"^\s+(\S+) (?:depth (\d+) )?(\S+) (\d+)/(\d+): accept ([\d.]+) \((\d+) tokens")
skip = {int(x) for x in sys.argv[3].split(",")} if len(sys.argv) > 3 and sys.argv[2] == "--skip" else set()
agg = collections.defaultdict(lambda: [0, 0.0, 0])
for line in open(sys.argv[1]):
    m = pat.match(line)
    if m:
        d, depth, w, i, n, a, t = m.groups()
        if int(i) in skip:
            continue
        a, t = float(a), int(t)
        g = agg[(d, depth or "-", w)]
        g[0] += t
        g[1] += t / a
        g[2] += 1
for (d, depth, w), (t, c, n) in agg.items():
    print(f"{d:<9} depth {depth:<2} {w:<10} prompts {n:>2}  pooled accept {t / c:.3f}")
