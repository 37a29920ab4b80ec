# For each policy's dumps in DIR: by third of each run, how many prompts of 1,000 tokens or more were sent
# to an upstream with more prompt tokens truly pending than the least, and their mean TTFT (wall ms).
# python3 thirds.py DIR POLICY...
import glob, sys
from dumps import load, at_send

for pol in sys.argv[2:]:
    agg = [[0, 0, 0.0] for _ in range(3)]  # per third: prompts, sent to more than the least, TTFT sum
    for f in sorted(glob.glob(sys.argv[1] + '/*_' + pol + '.jsonl')):
        rs, ups = load(f)
        t0 = rs[0]['s']
        span = rs[-1]['s'] - t0 + 1e-9
        for i, r in enumerate(rs):
            if r['PromptTokens'] < 1000:
                continue
            pending, _, _ = at_send(rs, i, ups)
            a = agg[min(int(3 * (r['s'] - t0) / span), 2)]
            a[0] += 1
            a[1] += pending[r['Upstream']] > min(pending.values())
            a[2] += r['TTFT'] / 1e6
    print('%-11s' % pol, '  '.join('third %d: n=%d not-least=%.0f%% mean-ttft=%.0fms' % (k + 1, a[0], 100 * a[1] / a[0], a[2] / a[0])
                                   for k, a in enumerate(agg)))
