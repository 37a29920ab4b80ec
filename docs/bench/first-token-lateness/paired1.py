import json,sys,math,statistics as st,os
POL=os.environ.get("POL","llm")
def load(f):
    out={}
    d=json.load(open(f))
    for r in d['runs']:
        for p in r['policies']:
            if p['policy']==POL: out[(r['regime'],r['workload'],r['seed'])]=p
    return out
a=load(sys.argv[1]); b=load(sys.argv[2])
cells={}
for k in a:
    if k in b: cells.setdefault(k[:2],[]).append((a[k],b[k]))
g50=[];g99=[]
for c,v in sorted(cells.items()):
    r50=[x[1]['ttft_p50_ms']/x[0]['ttft_p50_ms'] for x in v]; r99=[x[1]['ttft_p99_ms']/x[0]['ttft_p99_ms'] for x in v]
    g50+=[math.log(x) for x in r50]; g99+=[math.log(x) for x in r99]
    print("%-12s %-17s p50 %.2f p99 %.2f  base med %.0f/%.0f new %.0f/%.0f"%(c[0],c[1],math.exp(st.mean(map(math.log,r50))),math.exp(st.mean(map(math.log,r99))),st.median(x[0]['ttft_p50_ms'] for x in v),st.median(x[0]['ttft_p99_ms'] for x in v),st.median(x[1]['ttft_p50_ms'] for x in v),st.median(x[1]['ttft_p99_ms'] for x in v)))
print("all: p50 %.3f p99 %.3f n=%d"%(math.exp(st.mean(g50)),math.exp(st.mean(g99)),len(g50)))
