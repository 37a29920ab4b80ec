# usage (in this directory): python3 pool.py llm-base3,llm-base4,llm-base5 llm-newc1,llm-newc2
# Per cell: the mean TTFT p50 and p99 (over the runs given, each the median of 3 seeds) of each side,
# their ratio and the mean hit rates; then the geometric means of the ratios over the cells, by
# workload and by regime. The files are `go run ./bench -matrix -policies llm` results.json.
import json, sys, math
def load(dirs):
    out = {}
    for d in dirs.split(','):
        for c in json.load(open(f'{d}.json'))['cells']:
            p = c['policies'][0]
            out.setdefault((c['regime'], c['workload']), []).append((p['ttft_p50_ms'], p['ttft_p99_ms'], p['cache_hit_rate']))
    return out
A, B = load(sys.argv[1]), load(sys.argv[2])
l50 = l99 = 0; n = 0; byw = {}
for k in A:
    a, b = A[k], B[k]
    m = lambda xs, i: sum(x[i] for x in xs) / len(xs)
    r50, r99 = m(b, 0) / m(a, 0), m(b, 1) / m(a, 1)
    l50 += math.log(r50); l99 += math.log(r99); n += 1
    byw.setdefault(k[1], []).append((r50, r99)); byw.setdefault(k[0], []).append((r50, r99))
    print(f"{k[0]:13s} {k[1]:17s} p50 {r50:5.2f} p99 {r99:5.2f} hit {m(a,2)*100:4.1f} -> {m(b,2)*100:4.1f}")
print(f"geomean p50 {math.exp(l50/n):.3f} p99 {math.exp(l99/n):.3f} over {n}")
for w, rs in byw.items():
    g = lambda i: math.exp(sum(math.log(r[i]) for r in rs) / len(rs))
    print(f"  {w:17s} p50 {g(0):.3f} p99 {g(1):.3f}")
