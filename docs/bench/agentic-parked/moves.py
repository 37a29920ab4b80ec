# Prints the first N sessions and turns that did not find their history where they went, in order of sending, from a -dump file
# of the agentic workload (times in simulated seconds at its time scale, 30). usage: python3 moves.py DUMP.jsonl N
import json,sys
from datetime import datetime
def ts(s):
    s=s.rstrip('Z'); a,b=s.split('.'); return datetime.fromisoformat(a).timestamp()+float('0.'+b)
rs=[json.loads(l) for l in open(sys.argv[1])]
rs.sort(key=lambda r:ts(r['Sent']))
t0=ts(rs[0]['Sent']); last={}
n=0
for r in rs:
    c=r['Conversation']; up=r['Upstream'][-5:]
    t=(ts(r['Sent'])-t0)*30
    if c in last:
        pu,pp=last[c]
        if up!=pu or r['CachedTokens']<0.5*pp:
            n+=1
            if n<=int(sys.argv[2]):
                print(f"{t:8.0f}s {c:9s} home {pu} -> {up} {'MOVE' if up!=pu else 'EVICTED'} prompt {r['PromptTokens']} cached {r['CachedTokens']} matched {r['Matched']} pred {r['PredictedTTFT']} ttft {r['TTFT']/1e6*30:.0f} {r['Reason']}")
    else:
        if n<int(sys.argv[2]): print(f"{t:8.0f}s {c:9s} NEW -> {up} prompt {r['PromptTokens']} pred {r['PredictedTTFT']} ttft {r['TTFT']/1e6*30:.0f} {r['Reason']}")
    last[c]=(up,r['PromptTokens'])
