import json,sys,math,statistics as st
# Pools repeated runs of the same seeds (paired.py keeps one run per seed): usage: pool.py NAME=POLICY:A.json+B.json ...
# prints per cell the geometric means of TTFT p50/p99 over every run of each, and how many runs
vs=[]
for a in sys.argv[1:]:
    name,rest=a.split('=',1); pol,fs=rest.split(':',1)
    d={}
    for f in fs.split('+'):
        for r in json.load(open(f))['runs']:
            for p in r['policies']:
                if p['policy']==pol: d.setdefault((r['regime'],r['workload']),[]).append((p['ttft_p50_ms'],p['ttft_p99_ms']))
    vs.append((name,d))
gm=lambda xs: math.exp(st.mean(math.log(x) for x in xs))
cells=sorted(set.intersection(*[set(d) for _,d in vs]))
print("%-26s"%"cell"+"".join("%22s"%n for n,_ in vs))
for c in cells:
    row="%-26s"%(c[0]+" "+c[1])
    for n,d in vs:
        v=d[c]; row+="%22s"%("%5.0f/%6.0f (%d)"%(gm([x[0] for x in v]),gm([x[1] for x in v]),len(v)))
    print(row)
