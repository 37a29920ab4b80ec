import json,sys
# usage: vs.py stock.json llm.json : llm from second file vs best stock of first file (medians)
s=json.load(open(sys.argv[1])); n=json.load(open(sys.argv[2]))
stock={(c['regime'],c['workload']):{p['policy']:p for p in c['policies']} for c in s['cells']}
for c in n['cells']:
  k=(c['regime'],c['workload']); ps=stock.get(k)
  if not ps: continue
  l={p['policy']:p for p in c['policies']}['llm']
  st=[v for p,v in ps.items() if p in ('round_robin','least_conn','header')]
  b50=min(v['ttft_p50_ms'] for v in st); b99=min(v['ttft_p99_ms'] for v in st)
  r50=l['ttft_p50_ms']/b50; r99=l['ttft_p99_ms']/b99
  print('%-13s %-17s %s p50 %.2f p99 %.2f | llm %5.0f/%6.0f hit %.2f share %.2f'%(k[0],k[1],'PASS' if r50<=1.05 and r99<=1 else 'FAIL',r50,r99,l['ttft_p50_ms'],l['ttft_p99_ms'],l['cache_hit_rate'],l.get('max_backend_share',0)))
