# The slowest first tokens of one dumped run, each with what was truly pending (prompt tokens sent
# there whose first token had not come), requests in flight and their prompt tokens, per upstream.
# python3 worst.py DUMP.jsonl
import json, sys
from datetime import datetime
def t(s):
    s = s.rstrip('Z'); a, b = s.split('.'); return datetime.fromisoformat(a).timestamp() + float('0.' + b[:6].ljust(6, '0'))
rs = [json.loads(l) for l in open(sys.argv[1])]
for r in rs: r['s'] = t(r['Sent']); r['f'] = r['s'] + r['TTFT'] / 1e9; r['e'] = t(r['End'])
rs.sort(key=lambda r: r['s']); t0 = rs[0]['s']
ups = sorted(set(r['Upstream'] for r in rs))
for r in sorted(rs, key=lambda r: -r['TTFT'])[:6]:
    i = rs.index(r)
    pend = {u: 0 for u in ups}; infl = {u: 0 for u in ups}; tok = {u: 0 for u in ups}
    for q in rs[:i]:
        if q['f'] > r['s']: pend[q['Upstream']] += q['PromptTokens']
        if q['e'] > r['s']: infl[q['Upstream']] += 1; tok[q['Upstream']] += q['PromptTokens']
    print('%.3f s prompt=%d ttft=%.0f ms to=%d pending=%s in-flight=%s their prompt tokens=%s' % (
        r['s'] - t0, r['PromptTokens'], r['TTFT'] / 1e6, ups.index(r['Upstream']),
        [pend[u] for u in ups], [infl[u] for u in ups], [tok[u] for u in ups]))
