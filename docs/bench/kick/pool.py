import json,sys,statistics,math
def load(fs):
    d={}
    for f in fs:
        for r in json.load(open(f))['runs']:
            p=[p for p in r['policies'] if p['policy']=='llm'][0]
            d.setdefault((r['regime'],r['workload']),[]).append((p['ttft_p50_ms'],p['ttft_p99_ms']))
    return d
A=load(sys.argv[1].split(',')); B=load(sys.argv[2].split(','))
lp50=[];lp99=[]
for k in A:
    a=A[k];b=B[k]
    m=lambda v,i:statistics.median(x[i] for x in v)
    r50=m(b,0)/m(a,0); r99=m(b,1)/m(a,1); lp50.append(math.log(r50)); lp99.append(math.log(r99))
    flag='*' if (r99>1.15 or r99<0.87) else ''
    print('%-13s %-17s p50 %6.0f -> %6.0f %.2f   p99 %6.0f -> %6.0f %.2f %s'%(k[0],k[1],m(a,0),m(b,0),r50,m(a,1),m(b,1),r99,flag))
print('geo p50 %.3f p99 %.3f'%(math.exp(sum(lp50)/len(lp50)),math.exp(sum(lp99)/len(lp99))))
