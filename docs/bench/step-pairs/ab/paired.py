import json,sys,math,statistics as st
# Usage: [POL=policy] python3 paired.py "BASE1.json+BASE2.json" "NEW1.json+NEW2.json" (POL: llm unless set)
import os
POL=os.environ.get("POL","llm")
def load(fs):
    out={}
    for f in fs.split('+'):
        d=json.load(open(f))
        for r in d['runs']:
            for p in r['policies']:
                if p["policy"]==POL: out[(r['regime'],r['workload'],r['seed'])]=(p['ttft_p50_ms'],p['ttft_p99_ms'])
    return out
a=load(sys.argv[1]); b=load(sys.argv[2])
cells={}
for k in a:
    if k in b: cells.setdefault(k[:2],[]).append((b[k][0]/a[k][0], b[k][1]/a[k][1], a[k], b[k]))
g50=[];g99=[]
for c,v in sorted(cells.items()):
    r50=math.exp(st.mean(math.log(x[0]) for x in v)); r99=math.exp(st.mean(math.log(x[1]) for x in v))
    g50+= [math.log(x[0]) for x in v]; g99+=[math.log(x[1]) for x in v]
    print("%-13s %-17s p50 %.2f p99 %.2f  (old med p99 %.0f new %.0f) worse99 %d/%d"%(c[0],c[1],r50,r99,st.median(x[2][1] for x in v),st.median(x[3][1] for x in v),sum(x[1]>1 for x in v),len(v)))
print("all: p50 %.3f p99 %.3f n=%d"%(math.exp(st.mean(g50)),math.exp(st.mean(g99)),len(g50)))
