import json,glob,os,sys,statistics as st
d=sys.argv[1]
def q(xs,p):
    xs=sorted(xs); return xs[min(len(xs)-1,int(p*len(xs)))] if xs else float('nan')
groups={}
for f in sorted(glob.glob(d+'/*.jsonl')):
    rs=[json.loads(l) for l in open(f)]
    rs=[r for r in rs if not r['Warmup'] and not r['Failed'] and r['PredictedTTFT']>0]
    reg,wl=os.path.basename(f).split('_')[:2]
    for r in rs:
        cls='append' if r['CachedTokens']>=0.5*r['PromptTokens'] else 'cold'
        if r['PromptTokens']<1000: cls='short'
        groups.setdefault((reg,wl,cls),[]).append(r['TTFT']/1e6/r['PredictedTTFT'])
print("%-14s %-9s %-7s %5s %6s %6s %6s"%("regime","workload","class","n","p25","p50","p75"))
for k in sorted(groups):
    xs=groups[k]; print("%-14s %-9s %-7s %5d %6.2f %6.2f %6.2f"%(k+(len(xs),q(xs,.25),q(xs,.5),q(xs,.75))))
