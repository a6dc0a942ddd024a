import re, sys, collections
pat = re.compile(r"^\s+(\S+) (\S+) (\d+)/(\d+): accept ([\d.]+) \((\d+) tokens")
agg = collections.defaultdict(lambda: [0, 0.0, 0])
for line in open(sys.argv[1]):
    m = pat.match(line)
    if m:
        d, w, i, n, a, t = m.groups()
        a, t = float(a), int(t)
        g = agg[(d, w)]; g[0] += t; g[1] += t / a; g[2] += 1
for (d, w), (t, c, n) in agg.items():
    print(f"{d:<9} {w:<10} prompts {n:>2}  pooled accept {t / c:.3f}")
