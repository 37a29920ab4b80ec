# One slow-prefill mixed run of the debug build (debug-choose.patch): after the first third of the run,
# the queue the decision priced (Candidate.Queued, wall ms) on the upstreams with nothing truly pending
# and on those with some, beside what was truly pending there.
# python3 queues.py DUMP.jsonl STDERR
import sys
from dumps import load, at_send

# slow-prefill's backends prefill 2k tokens a second of simulated time, 20 a wall millisecond at mixed's
# time scale of 10.
TOKENS_PER_WALL_MS = 20.0

rs, ups = load(sys.argv[1])
decisions = []  # (when, the policy's prompt count, {upstream port: {field: value}})
for line in open(sys.argv[2]):
    if not line.startswith('DBG'):
        continue
    parts = line.split(' | ')
    head = parts[0].split()
    cands = {}
    for p in parts[1:]:
        f = p.split()
        cands[f[0]] = {k: float(v.split('/')[0]) for k, v in (x.split('=') for x in f[1:])}
    decisions.append((int(head[1]) / 1e9, int(head[2].split('=')[1]), cands))

t0 = rs[0]['s']
span = rs[-1]['s'] - t0
used, idle, busy, truly = set(), [], [], []
for i, r in enumerate(rs):
    if r['s'] - t0 < span / 3:
        continue
    # The request's decision: the nearest in time of those with its prompt count not matched yet.
    near = [(abs(d[0] - r['s']), j) for j, d in enumerate(decisions) if d[1] == r['PolicyPrompt'] and j not in used]
    if not near:
        continue
    _, j = min(near)
    used.add(j)
    pending, _, _ = at_send(rs, i, ups)
    for u in ups:
        queued = decisions[j][2][u[-5:]]['q']
        if pending[u] == 0:
            idle.append(queued)
        else:
            busy.append(queued)
            truly.append(pending[u] / TOKENS_PER_WALL_MS)
print('true pending where something is: mean=%.0f ms' % (sum(truly) / len(truly)))
print('decisions after the first third: model queue (ms wall) where nothing is truly pending: n=%d mean=%.0f; where something is: n=%d mean=%.0f'
      % (len(idle), sum(idle) / len(idle), len(busy), sum(busy) / len(busy)))
