import json,glob,statistics as st,math,sys
# pair.py BASE NEW: llm's figures of two sets of runs (directory prefixes), paired by regime and seed
def load(pre):
    d={}
    for f in glob.glob(pre+'-*/results.json'):
        for x in json.load(open(f))['runs']:
            q=[p for p in x['policies'] if p['policy']=='llm'][0]
            d[(x['regime'],x['seed'])]=q
    return d
B=load(sys.argv[1]);N=load(sys.argv[2])
ref={}
for s in ('1-3','4-6','7-9'):
    for x in json.load(open('docs/bench/seeded-ports/full-seeds%s/results.json'%s))['runs']:
        if x['workload']=='hot-prefix':
            ref[(x['regime'],x['seed'])]={p['policy']:p for p in x['policies']}
regs=[]
for k in B:
    if k[0] not in regs: regs.append(k[0])
L50=[];L99=[]
for r in ['small-batch','default','large-batch','hetero','kv-pressure','fast-prefill','slow-prefill']:
    ks=[k for k in B if k[0]==r and k in N]
    if not ks: continue
    m=lambda D,f:st.median(D[k][f] for k in ks)
    best50=st.median(min(ref[k][p]['ttft_p50_ms'] for p in ('round_robin','least_conn','header')) for k in ks)
    best99=st.median(min(ref[k][p]['ttft_p99_ms'] for p in ('round_robin','least_conn','header')) for k in ks)
    for k in ks:
        L50.append(math.log(N[k]['ttft_p50_ms']/B[k]['ttft_p50_ms'])); L99.append(math.log(N[k]['ttft_p99_ms']/B[k]['ttft_p99_ms']))
    w99=sum(N[k]['ttft_p99_ms']>B[k]['ttft_p99_ms'] for k in ks)
    print('%-13s n%d p50 %6.1f -> %6.1f (%.2f)  p99 %6.0f -> %6.0f (%.2f) worse99 %d/%d  hit %.2f->%.2f  best-stock-median p50 %.0f p99 %.0f'%(r,len(ks),m(B,'ttft_p50_ms'),m(N,'ttft_p50_ms'),m(N,'ttft_p50_ms')/m(B,'ttft_p50_ms'),m(B,'ttft_p99_ms'),m(N,'ttft_p99_ms'),m(N,'ttft_p99_ms')/m(B,'ttft_p99_ms'),w99,len(ks),m(B,'cache_hit_rate'),m(N,'cache_hit_rate'),best50,best99))
print('geo paired p50 %.3f p99 %.3f over %d'%(math.exp(sum(L50)/len(L50)),math.exp(sum(L99)/len(L99)),len(L50)))
