import json,glob,os,statistics as st,sys
d=sys.argv[1]
def q(xs,p):
    xs=sorted(xs); 
    return xs[min(len(xs)-1,int(p*len(xs)))] if xs else float('nan')
print("%-32s %5s | %-22s | %-22s | %-30s"%("run","n","hits act/pred p50 p90","miss act/pred p50 p90","tail(top5%) act/pred med, pred ms"))
for f in sorted(glob.glob(d+'/*.jsonl')):
    rs=[json.loads(l) for l in open(f)]
    rs=[r for r in rs if not r['Warmup'] and not r['Failed'] and r['PredictedTTFT']>0]
    name=os.path.basename(f).replace('_seed1_load0.75_llm.jsonl','')
    hit=[r['TTFT']/1e6/r['PredictedTTFT'] for r in rs if r['Matched']>0]
    miss=[r['TTFT']/1e6/r['PredictedTTFT'] for r in rs if r['Matched']==0]
    rs2=sorted(rs,key=lambda r:r['TTFT'])
    tail=rs2[int(0.95*len(rs2)):]
    tr=[r['TTFT']/1e6/r['PredictedTTFT'] for r in tail]
    print("%-32s %5d | %5.2f %5.2f (n=%3d)     | %5.2f %5.2f (n=%3d)     | %5.2f  pred %s act %s"%(name,len(rs),q(hit,.5),q(hit,.9),len(hit),q(miss,.5),q(miss,.9),len(miss),q(tr,.5),[int(r['PredictedTTFT']) for r in tail][:6],[int(r['TTFT']/1e6) for r in tail][:6]))
