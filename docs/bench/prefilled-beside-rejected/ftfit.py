import sys,collections
ev=collections.defaultdict(list)
for l in open(sys.argv[1]):
    if not l.startswith('FT'): continue
    p=l.split(); d=dict(x.split('=') for x in p[3:])
    ev[p[2]].append((int(p[1]),int(d['start']),int(d['unc']),float(d['waited']),float(d['ttft']),d['slot'],float(d['tps'])))
def ols(xs,ys):
    n=len(xs); mx=sum(xs)/n; my=sum(ys)/n
    sxx=sum((x-mx)**2 for x in xs); sxy=sum((x-mx)*(y-my) for x,y in zip(xs,ys))
    b=sxy/sxx if sxx else float('nan'); return my-b*mx,b
for u,es in ev.items():
    x1=[e[2] for e in es]; y1=[e[4]-e[3] for e in es]
    W=[sum(f[2] for f in es if e[1]<f[0]<=e[0]) for e in es]
    y2=[e[4] for e in es]
    a1,b1=ols(x1,y1); a2,b2=ols(W,y2)
    late=es[len(es)//2:]
    a3,b3=ols([e[2] for e in late],[e[4]-e[3] for e in late]); 
    Wl=W[len(es)//2:]; a4,b4=ols(Wl,[e[4] for e in late])
    print('%s n%3d model-now tps %6.0f | ttft-queued~unc: oh %5.1f tps %6.0f (2nd half %6.0f) | ttft~W: oh %5.1f tps %6.0f (2nd half %6.0f)'%(u[-4:],len(es),es[-1][6],a1,1/b1*1000,1/b3*1000,a2,1/b2*1000,1/b4*1000))
