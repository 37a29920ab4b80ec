#!/usr/bin/env python3
"""Pools the -dump files of `go run ./bench -restart ... -dump DIR` runs (one or more seeds) and prints,
for the minute before the restart, the first 6 simulated seconds after it and the minute after it:
TTFT percentiles (simulated ms), the backends' cache hit rate, the slow backend's share, and how the
policy's cache predictions fared (predicted hit = Matched at least half the policy's prompt count;
actual hit = the backend's cached tokens at least half its prompt). With -age, for every predicted hit
the time since that group was last sent to that backend, split by actual hit or miss.

    python3 analyze.py 'DIR/*.jsonl' ['DIR2/*.jsonl' ...] [-age]
"""
import collections, glob, json, sys
from datetime import datetime

SCALE = 5  # the benchmark's time scale: simulated seconds per wall second


def ts(s):
    s = s.replace('Z', '')
    d, fr = (s.split('.') + ['0'])[:2]
    return datetime.fromisoformat(d).timestamp() + float('0.' + fr.split('+')[0])


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float('nan')


def load(path):
    rs = [json.loads(line) for line in open(path)]
    rs = [r for r in rs if not r['Failed']]
    for r in rs:
        r['t'], r['ttft'] = ts(r['Sent']), r['TTFT'] / 1e6 * SCALE
    rs.sort(key=lambda r: r['t'])
    # The restart is the longest pause between two sends.
    _, i0 = max((rs[i]['t'] - rs[i - 1]['t'], i) for i in range(1, len(rs)))
    t0, tstop = rs[i0]['t'], rs[i0 - 1]['t']
    by = collections.defaultdict(list)
    for r in rs:
        by[r['Upstream']].append(r['ttft'])
    slow = max(by, key=lambda u: pct(by[u], 0.5))
    minute = 60 / SCALE
    windows = {'before': [r for r in rs if tstop - minute <= r['t'] < tstop],
               'first6': [r for r in rs if t0 <= r['t'] < t0 + 6 / SCALE],
               'after': [r for r in rs if t0 <= r['t'] < t0 + minute]}
    return rs, windows, slow


def summary(pattern):
    pools, slowshare = collections.defaultdict(list), collections.defaultdict(list)
    for f in sorted(glob.glob(pattern)):
        _, windows, slow = load(f)
        for k, v in windows.items():
            pools[k] += v
            slowshare[k].append(sum(r['Upstream'] == slow for r in v) / max(1, len(v)))
    print(pattern)
    for k in ['before', 'first6', 'after']:
        v = pools[k]
        tt = [r['ttft'] for r in v]
        hit = sum(r['CachedTokens'] for r in v) / sum(r['PromptTokens'] for r in v)
        pred = collections.Counter(('predicted hit' if r['Matched'] >= r['PolicyPrompt'] / 2 else 'predicted miss') + ', ' +
                                   ('hit' if r['CachedTokens'] >= r['PromptTokens'] / 2 else 'miss') for r in v)
        print('  %-6s n=%5d TTFT p50 %4.0f p90 %4.0f p99 %4.0f mean %4.0f, hit %.1f%%, slow backend %s; %s' % (
            k, len(v), pct(tt, .5), pct(tt, .9), pct(tt, .99), sum(tt) / len(tt), 100 * hit,
            '/'.join('%.2f' % x for x in slowshare[k]), ', '.join('%s %d' % kv for kv in sorted(pred.items()))))


def ages(pattern):
    out = collections.defaultdict(list)
    for f in sorted(glob.glob(pattern)):
        rs, _, _ = load(f)
        last = {}
        for r in rs:
            key = (r['Conversation'], r['Upstream'])
            if r['Matched'] >= r['PolicyPrompt'] / 2 and key in last:
                out['miss' if r['CachedTokens'] < r['PromptTokens'] / 2 else 'hit'].append((r['t'] - last[key]) * SCALE)
            last[key] = r['t']
    for k, v in sorted(out.items()):
        v.sort()
        print('  predicted hit, actual %s: n=%d, group last sent there p10/p50/p90 %.1f/%.1f/%.1f simulated s ago' % (
            k, len(v), pct(v, .1), pct(v, .5), pct(v, .9)))


if __name__ == '__main__':
    for pattern in [a for a in sys.argv[1:] if a != '-age']:
        summary(pattern)
        if '-age' in sys.argv:
            ages(pattern)
