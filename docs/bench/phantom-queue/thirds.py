import json,sys,glob
from datetime import datetime
def t(s):
    s=s.rstrip('Z'); a,b=s.split('.'); return datetime.fromisoformat(a).timestamp()+float('0.'+b[:6].ljust(6,'0'))
# per thirds: share of long prompts sent where truly pending prefill exceeded the least, and mean TTFT of long prompts
for pol in sys.argv[2:]:
  agg=[[0,0,0.0] for _ in range(3)]
  for f in sorted(glob.glob(sys.argv[1]+'/*_'+pol+'.jsonl')):
    rs=[json.loads(l) for l in open(f)]
    for r in rs: r['s']=t(r['Sent']); r['f']=r['s']+r['TTFT']/1e9
    rs.sort(key=lambda r:r['s']); ups=sorted(set(r['Upstream'] for r in rs))
    t0=rs[0]['s']; T=rs[-1]['s']-t0+1e-9
    for i,r in enumerate(rs):
        if r['PromptTokens']<1000: continue
        pend={u:0 for u in ups}
        for q in rs[:i]:
            if q['f']>r['s']: pend[q['Upstream']]+=q['PromptTokens']
        k=min(int(3*(r['s']-t0)/T),2)
        agg[k][0]+=1; agg[k][1]+= pend[r['Upstream']]>min(pend.values()); agg[k][2]+=r['TTFT']/1e6
  print('%-11s'%pol, '  '.join('third %d: n=%d not-least=%.0f%% mean-ttft=%.0fms'%(k+1,a[0],100*a[1]/a[0],a[2]/a[0]) for k,a in enumerate(agg)))
