# How docs/bench/length4/six-seeds-*: "after the first quarter" figures were computed from those runs' -dump
# files (they ran before the bench computed its late verdict): python3 late-from-dumps.py DUMPDIR...
# Per cell: llm over the best stock policy, TTFT p50/p99 medians over seeds, for the measured requests
# (after warm-up) and for the last three quarters of each run (requests sent after its first quarter).
import json,sys,glob,statistics as st,collections
def pct(xs,q):
    xs=sorted(xs); return xs[min(len(xs)-1,int(len(xs)*q))]
runs=collections.defaultdict(dict)  # (regime,workload) -> {(seed,policy): (all, rest)}
for d in sys.argv[1:]:
    for f in glob.glob(d+'/*.jsonl'):
        name=f.split('/')[-1][:-6]
        parts=name.split('_')
        policy='_'.join(parts[4:]); seed=parts[2]; cell=(parts[0],parts[1])
        rs=[json.loads(l) for l in open(f)]
        m=sorted([r for r in rs if not r['Warmup'] and not r['Failed']],key=lambda r:r['Sent'])
        allt=[r['TTFT'] for r in m]
        q=len(rs)//4
        order=sorted(rs,key=lambda r:r['Sent'])
        cut=order[q]['Sent']
        rest=[r['TTFT'] for r in m if r['Sent']>=cut]
        runs[cell][(seed,policy)]=(allt,rest)
for cell,rr in sorted(runs.items()):
    pols=sorted(set(p for _,p in rr)); seeds=sorted(set(s for s,_ in rr))
    out=[]
    for k,label in ((0,'measured'),(1,'after 1st quarter')):
        med={}
        for p in pols:
            med[p]=(st.median(pct(rr[(s,p)][k],.5) for s in seeds), st.median(pct(rr[(s,p)][k],.99) for s in seeds))
        stock=[p for p in pols if p in('round_robin','least_conn','header')]
        b50=min(stock,key=lambda p:med[p][0]); b99=min(stock,key=lambda p:med[p][1])
        wins=sum(1 for s in seeds if pct(rr[(s,'llm')][k],.99)<=min(pct(rr[(s,p)][k],.99) for p in stock))
        out.append(f"{label}: p50 {med['llm'][0]/med[b50][0]:.2f} ({b50}) p99 {med['llm'][1]/med[b99][1]:.2f} ({b99}), p99 vs least_conn {med['llm'][1]/med['least_conn'][1]:.2f}, p99 best on {wins}/{len(seeds)} seeds")
    print(cell[0],cell[1],'|',' | '.join(out))
