import json,math,statistics as st,sys
def load(fs):
    out={}
    for f in fs:
        d=json.load(open(f))
        for r in d['runs']:
            for p in r['policies']:
                if p['policy']=='llm': out[(r['regime'],r['workload'],r['seed'])]=p
    return out
A=load(sys.argv[1].split('+')); B=load(sys.argv[2].split('+'))
keys=[k for k in A if k in B]
g50=[math.log(B[k]['ttft_p50_ms']/A[k]['ttft_p50_ms']) for k in keys]; g99=[math.log(B[k]['ttft_p99_ms']/A[k]['ttft_p99_ms']) for k in keys]
print("n=%d p50 %.3f p99 %.3f"%(len(keys),math.exp(st.mean(g50)),math.exp(st.mean(g99))))
by={}
for k in keys: by.setdefault(k[0],[]).append(k)
for reg,ks in sorted(by.items()):
    a=[math.log(B[k]['ttft_p50_ms']/A[k]['ttft_p50_ms']) for k in ks]; b=[math.log(B[k]['ttft_p99_ms']/A[k]['ttft_p99_ms']) for k in ks]
    print("  %-12s n=%2d p50 %.3f p99 %.3f"%(reg,len(ks),math.exp(st.mean(a)),math.exp(st.mean(b))))
