import json,sys
from datetime import datetime
def t(s):
    s=s.rstrip('Z'); a,b=s.split('.'); return datetime.fromisoformat(a).timestamp()+float('0.'+b[:6].ljust(6,'0'))
rs=[json.loads(l) for l in open(sys.argv[1])]
dbg=[]
for l in open(sys.argv[2]):
    if l.startswith('DBG'):
        parts=l.split(' | '); h=parts[0].split()
        d={}
        for p in parts[1:]:
            f=p.split(); d[f[0]]={k:float(v.split('/')[0]) for k,v in (x.split('=') for x in f[1:])}
        dbg.append((int(h[1])/1e9,int(h[2].split('=')[1]),d))
for r in rs: r['s']=t(r['Sent']); r['f']=r['s']+r['TTFT']/1e9
rs.sort(key=lambda r:r['s']); ups=sorted(set(r['Upstream'] for r in rs)); t0=rs[0]['s']; T=rs[-1]['s']-t0
used=set(); zero=[];busy=[]; nz=[0,0]
for i,r in enumerate(rs):
    if r['s']-t0 < T/3: continue
    c=[(abs(d[0]-r['s']),j) for j,d in enumerate(dbg) if d[1]==r['PolicyPrompt'] and j not in used]
    if not c: continue
    _,j=min(c); used.add(j)
    pend={u:0 for u in ups}; inf={u:0 for u in ups}
    for q in rs[:i]:
        if q['f']>r['s']: pend[q['Upstream']]+=q['PromptTokens']
    for u in ups:
        m=dbg[j][2][u[-5:]]
        (zero if pend[u]==0 else busy).append(m['q']);
        if pend[u]>0: nz[0]+=pend[u]/20.0; nz[1]+=1
print('true pending where something is: mean=%.0f ms'%(nz[0]/nz[1]));print('decisions after the first third: model queue (ms wall) where nothing is truly pending: n=%d mean=%.0f; where something is: n=%d mean=%.0f'%(len(zero),sum(zero)/len(zero),len(busy),sum(busy)/len(busy)))
