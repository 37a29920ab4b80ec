# The slowest first tokens of one dumped run, each with what was truly pending (prompt tokens sent
# there whose first token had not come), requests in flight and their prompt tokens, per upstream.
# python3 worst.py DUMP.jsonl
import sys
from dumps import load, at_send

rs, ups = load(sys.argv[1])
t0 = rs[0]['s']
for r in sorted(rs, key=lambda r: -r['TTFT'])[:6]:
    pending, inflight, tokens = at_send(rs, rs.index(r), ups)
    print('%.3f s prompt=%d ttft=%.0f ms to=%d pending=%s in-flight=%s their prompt tokens=%s' % (
        r['s'] - t0, r['PromptTokens'], r['TTFT'] / 1e6, ups.index(r['Upstream']),
        [pending[u] for u in ups], [inflight[u] for u in ups], [tokens[u] for u in ups]))
