"""Reading `go run ./bench -dump DIR` files for this page's scripts: one request a line, times in wall
time (the simulators run at the workload's time scale)."""
import json
from datetime import datetime


def sent_seconds(stamp):
    """A dump's RFC 3339 timestamp (nanoseconds) as Unix seconds, to the microsecond."""
    stamp = stamp.rstrip('Z')
    whole, frac = stamp.split('.')
    return datetime.fromisoformat(whole).timestamp() + float('0.' + frac[:6].ljust(6, '0'))


def load(path):
    """The run's requests in sending order, each with 's' (sent), 'f' (first token) and 'e' (end) in
    seconds, and the run's upstreams in address order."""
    rs = [json.loads(line) for line in open(path)]
    for r in rs:
        r['s'] = sent_seconds(r['Sent'])
        r['f'] = r['s'] + r['TTFT'] / 1e9
        r['e'] = sent_seconds(r['End'])
    rs.sort(key=lambda r: r['s'])
    return rs, sorted(set(r['Upstream'] for r in rs))


def at_send(rs, i, ups):
    """What each upstream had when rs[i] was sent, per upstream: the prompt tokens truly pending (sent
    there, no first token yet), the requests in flight, and their prompt tokens."""
    pending, inflight, tokens = ({u: 0 for u in ups} for _ in range(3))
    for q in rs[:i]:
        if q['f'] > rs[i]['s']:
            pending[q['Upstream']] += q['PromptTokens']
        if q['e'] > rs[i]['s']:
            inflight[q['Upstream']] += 1
            tokens[q['Upstream']] += q['PromptTokens']
    return pending, inflight, tokens
