import json,sys,statistics as st,math
a=json.load(open(sys.argv[1])); b=json.load(open(sys.argv[2]))
def idx(d):
    m={}
    for r in d['runs']:
        for p in r['policies']:
            m[(r['regime'],r['workload'],r['seed'],p['policy'])]=p
    return m
A,B=idx(a),idx(b)
pol=sys.argv[3] if len(sys.argv)>3 else 'llm'
cells={}
for k in A:
    if k[3]!=pol or k not in B: continue
    cells.setdefault((k[0],k[1]),[]).append((A[k],B[k]))
g50=[];g99=[]
for c in sorted(cells):
    v=cells[c]
    r50=[y['ttft_p50_ms']/x['ttft_p50_ms'] for x,y in v]; r99=[y['ttft_p99_ms']/x['ttft_p99_ms'] for x,y in v]
    g50+=r50; g99+=r99
    gm=lambda r: math.exp(sum(map(math.log,r))/len(r))
    print('%-14s %-17s p50 A %6.0f B %6.0f (%.2f)  p99 A %6.0f B %6.0f (%.2f)  worse99 %d/%d  shares A %s B %s'%(c[0],c[1],st.median(x['ttft_p50_ms'] for x,y in v),st.median(y['ttft_p50_ms'] for x,y in v),gm(r50),st.median(x['ttft_p99_ms'] for x,y in v),st.median(y['ttft_p99_ms'] for x,y in v),gm(r99),sum(1 for r in r99 if r>1),len(r99),[x['backend_requests'] for x,y in v][:1],[y['backend_requests'] for x,y in v][:1]))
gm=lambda r: math.exp(sum(map(math.log,r))/len(r))
print('geomean p50 %.3f p99 %.3f over %d runs'%(gm(g50),gm(g99),len(g50)))
