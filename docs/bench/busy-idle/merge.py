"""Judge llm-only runs against another run's stock policies: each file of STOCK (every policy, the
same seeds and seed-drawn ports) gets its llm entries replaced by the llm-only run's for the same
regime, workload and seed, written to OUT/N/results.json for `go run ./bench -rejudge`.

    python3 merge.py OUT STOCK1,STOCK2,... LLM1,LLM2,...
"""
import json, os, sys

out, stocks, llms = sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(",")
llm = {}
for f in llms:
    for run in json.load(open(f))["runs"]:
        for p in run["policies"]:
            if p["policy"] == "llm":
                llm[(run["regime"], run["workload"], run["seed"])] = p
for n, f in enumerate(stocks):
    d = json.load(open(f))
    for run in d["runs"]:
        key = (run["regime"], run["workload"], run["seed"])
        run["policies"] = [llm[key] if p["policy"] == "llm" else p for p in run["policies"]]
    os.makedirs(os.path.join(out, str(n)), exist_ok=True)
    json.dump(d, open(os.path.join(out, str(n), "results.json"), "w"))
