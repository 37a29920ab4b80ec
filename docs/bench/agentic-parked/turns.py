# Classifies each later turn of a -dump file's agent sessions by where it went and what it found there:
# stayed at its previous turn's upstream and found at least half of that turn's prompt cached (stayed_hit)
# or not (stayed_evicted); moved to another upstream and found it (moved_hit) or not (moved).
# usage: python3 turns.py DUMP.jsonl ...
import json, sys

for path in sys.argv[1:]:
    rs = sorted((json.loads(l) for l in open(path)), key=lambda r: r['Sent'])
    last, n = {}, {'new': 0, 'stayed_hit': 0, 'stayed_evicted': 0, 'moved_hit': 0, 'moved': 0}
    for r in rs:
        c, up = r['Conversation'], r['Upstream']
        if c not in last:
            n['new'] += 1
        else:
            home, prev = last[c]
            hit = r['CachedTokens'] >= 0.5 * prev
            n[('stayed_hit' if hit else 'stayed_evicted') if up == home else ('moved_hit' if hit else 'moved')] += 1
        last[c] = (up, r['PromptTokens'])
    print(path, n)
