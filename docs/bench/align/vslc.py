# Pairs -policies llm runs of fast-prefill agentic with the least_conn runs of the same seeds in another results.json:
# the median over seeds of llm's TTFT p99 (and p50) over least_conn's, how many seeds are worse, llm's median p99 and mean hit rate.
# usage: python3 vslc.py LEAST_CONN_RESULTS.json LLM_RESULTS.json ...
import json, statistics as st, sys
lc={r['seed']:[p for p in r['policies'] if p['policy']=='least_conn'][0] for r in json.load(open(sys.argv[1]))['runs']}
for path in sys.argv[2:]:
    d=json.load(open(path))
    rs=[]; r5=[]; row=[]
    for r in d['runs']:
        l=[p for p in r['policies'] if p['policy']=='llm'][0]
        rs.append(l['ttft_p99_ms']/lc[r['seed']]['ttft_p99_ms']); r5.append(l['ttft_p50_ms']/lc[r['seed']]['ttft_p50_ms'])
        row.append('%d:%.2f'%(r['seed'], rs[-1]))
    p99s=[[p for p in r['policies'] if p['policy']=='llm'][0]['ttft_p99_ms'] for r in d['runs']]
    hr=st.mean([[p for p in r['policies'] if p['policy']=='llm'][0]['cache_hit_rate'] for r in d['runs']])
    print(path.split('/')[-1].removesuffix('.json'), 'paired p99 %.3f p50 %.3f worse %d/%d medp99 %.0f hit %.3f'%(st.median(rs), st.median(r5), sum(x>1 for x in rs), len(rs), st.median(p99s), hr))
    print('   ', ' '.join(row))
