import json,math,statistics as st,sys
def load(fs):
    out={}
    for f in fs:
        d=json.load(open(f))
        for r in d['runs']:
            for p in r['policies']:
                if p['policy']=='llm': out[(r['regime'],r['workload'],r['seed'])]=p
    return out
A,B,seeds=sys.argv[1],sys.argv[2],sys.argv[3].split(',')
a=load([f"{A}-s{s}/results.json" for s in seeds]); b=load([f"{B}-s{s}/results.json" for s in seeds])
cells={}
for k in a:
    if k in b: cells.setdefault(k[:2],[]).append((a[k],b[k]))
g50=[];g99=[];fl={}
for c,v in sorted(cells.items()):
    r50=[x[1]['ttft_p50_ms']/x[0]['ttft_p50_ms'] for x in v]; r99=[x[1]['ttft_p99_ms']/x[0]['ttft_p99_ms'] for x in v]
    g50+=[math.log(x) for x in r50]; g99+=[math.log(x) for x in r99]
    fl.setdefault(c[0],[]).extend([(math.log(p),math.log(q)) for p,q in zip(r50,r99)])
    worse=sum(1 for x in r99 if x>1)
    print("%-12s %-17s p50 %.2f p99 %.2f  p99 worse %d/%d  base med %.0f/%.0f new %.0f/%.0f"%(c[0],c[1],math.exp(st.mean(map(math.log,r50))),math.exp(st.mean(map(math.log,r99))),worse,len(v),st.median(x[0]['ttft_p50_ms'] for x in v),st.median(x[0]['ttft_p99_ms'] for x in v),st.median(x[1]['ttft_p50_ms'] for x in v),st.median(x[1]['ttft_p99_ms'] for x in v)))
print("all: p50 %.3f p99 %.3f n=%d"%(math.exp(st.mean(g50)),math.exp(st.mean(g99)),len(g50)))
for k,v in fl.items(): print(k,"p50 %.3f p99 %.3f n=%d"%(math.exp(st.mean(x[0] for x in v)),math.exp(st.mean(x[1] for x in v)),len(v)))
