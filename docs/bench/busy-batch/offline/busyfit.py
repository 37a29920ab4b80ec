import sys
def lstsq(A,y):
    n=len(A[0]); M=[[sum(a[i]*a[j] for a in A) for j in range(n)] for i in range(n)]; v=[sum(a[i]*yy for a,yy in zip(A,y)) for i in range(n)]
    # gaussian elimination
    for i in range(n):
        p=M[i][i]
        for j in range(i+1,n):
            f=M[j][i]/p
            for k in range(n): M[j][k]-=f*M[i][k]
            v[j]-=f*v[i]
    x=[0]*n
    for i in reversed(range(n)):
        x[i]=(v[i]-sum(M[i][k]*x[k] for k in range(i+1,n)))/M[i][i]
    return x
for f in sys.argv[1:]:
    rows=[l.split() for l in open(f) if l.startswith('BUSY')]
    S=[float(r[4]) for r in rows]; G=[float(r[5]) for r in rows]; U=[float(r[3]) for r in rows]; y=[float(r[2]) for r in rows]
    sc=float(rows[0][6])
    t2=lstsq([[s,u/1000] for s,u in zip(S,U)],y)
    t3=lstsq([[s,g/1000,u/1000] for s,g,u in zip(S,G,U)],y)
    print(f,'n',len(y),'scale %.2f'%sc,'mean batch %.1f'%(sum(G)/sum(S)),'prefill tok/step %.0f'%(sum(U)/sum(S)), 'mean sec/step %.2f ms'%(sum(y)/sum(S)*1e3))
    print('  2-term: step %.2f ms, prefill %.0f tok/s'%(t2[0]*1e3, 1000/t2[1]))
    print('  3-term: step %.2f ms, per-seq %.4f ms, prefill %.0f tok/s'%(t3[0]*1e3, t3[1], 1000/t3[2]))
