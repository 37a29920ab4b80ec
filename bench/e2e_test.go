package main

import (
	"context"
	"encoding/json"
	"encoding/xml"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/tokenrouter/caddy-llm/bench/vllmsim"
)

// TestEndToEnd runs a small shared-prefix workload on 2 backends through Caddy with round_robin
// and the oracle, writes the outputs, and checks that results.json has every field and that the
// oracle, which reads the true caches, hits the cache at least as often as round_robin.
func TestEndToEnd(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Caddy and simulated backends")
	}
	t.Setenv("XDG_DATA_HOME", t.TempDir())
	t.Setenv("XDG_CONFIG_HOME", t.TempDir())
	o := options{
		quick:     true,
		workloads: []string{"shared-prefix"},
		backends:  2,
		load:      0.3,
		seed:      7,
		out:       t.TempDir(),
		sim:       defaultSim,
	}
	o.sim.TimeScale = 20
	for _, name := range []string{"round_robin", "oracle"} {
		p, _ := findPolicy(name)
		o.policies = append(o.policies, p)
	}
	// 8 groups x 5 prompts: round robin prefills each system prompt on both backends, a
	// cache-aware choice about once. Low load keeps queueing from outweighing the cache.
	w := sharedPrefix(rand.New(rand.NewPCG(7, 7)), 8, 5, 1500, 100, 16)
	prog := newProgress(os.Stderr, 2*w.NumRequests())
	wls := []WorkloadResult{runWorkload(context.Background(), o, uniformCluster(o.backends, o.sim), w, prog)}
	prog.finish()
	if err := writeOutputs(o.out, Results{Command: "test", Backends: 2, Load: o.load, Sim: o.sim, Workloads: wls}); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"results.json", "report.md", "ttft.svg"} {
		if st, err := os.Stat(filepath.Join(o.out, f)); err != nil || st.Size() == 0 {
			t.Errorf("output %s missing or empty: %v", f, err)
		}
	}

	svg, err := os.Open(filepath.Join(o.out, "ttft.svg"))
	if err != nil {
		t.Fatal(err)
	}
	defer svg.Close()
	polylines := 0
	for dec := xml.NewDecoder(svg); ; {
		tok, err := dec.Token()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("ttft.svg is not well-formed XML: %v", err)
		}
		if se, ok := tok.(xml.StartElement); ok && se.Name.Local == "polyline" {
			polylines++
		}
	}
	if polylines != 2 {
		t.Errorf("ttft.svg has %d curves, want 2 (one per policy)", polylines)
	}
	raw, _ := os.ReadFile(filepath.Join(o.out, "ttft.svg"))
	for _, title := range []string{"TTFT (simulated ms, log scale)", "fraction of requests (cumulative)"} {
		if !strings.Contains(string(raw), title) {
			t.Errorf("ttft.svg lacks the axis title %q", title)
		}
	}
	md, _ := os.ReadFile(filepath.Join(o.out, "report.md"))
	for _, want := range []string{"## shared-prefix", "| round_robin |", "| oracle |", "![TTFT distribution](ttft.svg)", "- shared-prefix: 36 measured requests per policy"} {
		if !strings.Contains(string(md), want) {
			t.Errorf("report.md lacks %q", want)
		}
	}

	js, err := os.ReadFile(filepath.Join(o.out, "results.json"))
	if err != nil {
		t.Fatal(err)
	}
	var doc struct {
		Workloads []struct {
			Workload string           `json:"workload"`
			Policies []map[string]any `json:"policies"`
		} `json:"workloads"`
	}
	if err := json.Unmarshal(js, &doc); err != nil {
		t.Fatalf("decoding results.json: %v", err)
	}
	if len(doc.Workloads) != 1 || doc.Workloads[0].Workload != "shared-prefix" || len(doc.Workloads[0].Policies) != 2 {
		t.Fatalf("results.json has %+v, want shared-prefix with 2 policies", doc.Workloads)
	}
	hit := map[string]float64{}
	for _, p := range doc.Workloads[0].Policies {
		name, _ := p["policy"].(string)
		if s, ok := p["skipped"]; ok {
			t.Fatalf("policy %s skipped: %v", name, s)
		}
		for _, field := range []string{"ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms",
			"e2e_mean_ms", "tpot_p50_ms", "output_tokens_per_s", "cache_hit_rate", "failed"} {
			if _, ok := p[field].(float64); !ok {
				t.Errorf("%s: results.json field %s = %v, want a number", name, field, p[field])
			}
		}
		if failed := p["failed"].(float64); failed != 0 {
			t.Errorf("%s: %v failed requests, want 0", name, failed)
		}
		if p["ttft_p50_ms"].(float64) <= 0 || p["output_tokens_per_s"].(float64) <= 0 {
			t.Errorf("%s: TTFT p50 %v, tokens/s %v, want positive", name, p["ttft_p50_ms"], p["output_tokens_per_s"])
		}
		hit[name] = p["cache_hit_rate"].(float64)
	}
	if hit["oracle"] < hit["round_robin"] {
		t.Errorf("cache hit rate: oracle %.3f < round_robin %.3f, want the oracle at least as high", hit["oracle"], hit["round_robin"])
	}
}

// TestSkipsUnregisteredPolicy checks that a policy whose module is missing is reported as
// skipped instead of failing the run.
func TestSkipsUnregisteredPolicy(t *testing.T) {
	if err := policyAvailable(policy{Name: "nope", JSON: `{"policy":"no_such_policy"}`}); err == nil {
		t.Error("policyAvailable(no_such_policy) = nil, want an error")
	}
	if err := policyAvailable(policy{Name: "rr", JSON: `{"policy":"round_robin"}`}); err != nil {
		t.Errorf("policyAvailable(round_robin) = %v, want nil", err)
	}
	if err := policyAvailable(policy{Name: "oracle", JSON: `{"policy":"oracle"}`}); err != nil {
		t.Errorf("policyAvailable(oracle) = %v, want nil", err)
	}
}

func TestParseOptions(t *testing.T) {
	o, err := parseOptions([]string{"-quick", "-workloads", "mixed,hot-prefix", "-policies", "least_conn,oracle", "-backends", "3"})
	if err != nil {
		t.Fatal(err)
	}
	if len(o.workloads) != 2 || len(o.policies) != 2 || o.backends != 3 || o.sim.TimeScale != 10 {
		t.Errorf("parseOptions = %+v, want 2 workloads, 2 policies, 3 backends, time scale 10", o)
	}
	for _, bad := range [][]string{{"-workloads", "nope"}, {"-policies", "nope"}, {"-backends", "0"}, {"-load", "0"}, {"extra"}} {
		if _, err := parseOptions(bad); err == nil {
			t.Errorf("parseOptions(%q) = nil error, want an error", bad)
		}
	}
}

// TestOverhead runs the overhead mode briefly: both policies measured (llm only if registered),
// nothing failed.
func TestOverhead(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Caddy")
	}
	t.Setenv("XDG_DATA_HOME", t.TempDir())
	t.Setenv("XDG_CONFIG_HOME", t.TempDir())
	res, err := runOverhead(context.Background(), options{backends: 2, seed: 1, overheadSeconds: 0.4})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Policies) == 0 || res.Policies[0].Policy != "round_robin" {
		t.Fatalf("overhead policies = %+v, want round_robin first", res.Policies)
	}
	for _, p := range res.Policies {
		if p.Failed != 0 || p.RequestsPerS <= 0 {
			t.Errorf("%s: %d failed, %.0f req/s; want none failed and some throughput", p.Policy, p.Failed, p.RequestsPerS)
		}
	}
}

// TestMatrixEndToEnd runs one small cell of the matrix (small-batch, a small shared-prefix, one
// seed) with a stock policy and llm, judges it and writes the matrix outputs: results.json with
// the run and the cell, report.md with the pass/fail table, and matrix.svg.
func TestMatrixEndToEnd(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Caddy and simulated backends")
	}
	t.Setenv("XDG_DATA_HOME", t.TempDir())
	t.Setenv("XDG_CONFIG_HOME", t.TempDir())
	o := options{matrix: true, backends: 2, load: 0.5, seed: 3, seeds: 1, out: t.TempDir(), sim: defaultSim, timeScaleSet: true, dump: t.TempDir()}
	o.sim.TimeScale = 20
	// Two llm policies: the second meets the first one's addresses (the ports follow the seed).
	o.policies = policiesNamed([]string{"least_conn", "llm", "llm-observed"})
	w := sharedPrefix(rand.New(rand.NewPCG(3, 3)), 4, 5, 1500, 100, 16)
	prog := newProgress(os.Stderr, 3*w.NumRequests())
	run := runMatrixJob(context.Background(), o, matrixJob{regime: mustRegime("small-batch"), workload: w, seed: 3, load: o.load}, prog)
	prog.finish()
	mr := MatrixResults{runHeader: runHeader{Command: "test", Seeds: []int64{3}, Backends: 2, Load: o.load}, TimeScale: 20, Runs: []MatrixRun{run}}
	mr.Cells = judgeCells(mr.Runs)
	if len(mr.Cells) != 1 || !mr.Cells[0].Judged || mr.Cells[0].Regime != "small-batch" || mr.Cells[0].Workload != "shared-prefix" {
		t.Fatalf("cells = %+v, want one judged small-batch/shared-prefix cell", mr.Cells)
	}
	if err := writeMatrixOutputs(o.out, mr); err != nil {
		t.Fatal(err)
	}
	md, _ := os.ReadFile(filepath.Join(o.out, "report.md"))
	for _, want := range []string{"| small-batch | shared-prefix |", "verdict: llm passes", "![llm TTFT p99 / best stock policy](matrix.svg)",
		"## Net of the proxy's own time", "net of the proxy's own time (counted once, not time-scale times): llm passes"} {
		if !strings.Contains(string(md), want) {
			t.Errorf("report.md lacks %q", want)
		}
	}
	if st, err := os.Stat(filepath.Join(o.out, "matrix.svg")); err != nil || st.Size() == 0 {
		t.Errorf("matrix.svg missing or empty: %v", err)
	}
	var doc MatrixResults
	js, _ := os.ReadFile(filepath.Join(o.out, "results.json"))
	if err := json.Unmarshal(js, &doc); err != nil {
		t.Fatalf("decoding results.json: %v", err)
	}
	if len(doc.Runs) != 1 || len(doc.Runs[0].Policies) != 3 || len(doc.Cells) != 1 || len(doc.Runs[0].BackendRPS) != 2 {
		t.Fatalf("results.json has %d runs, %d cells; want 1 run of 3 policies on 2 backends and 1 cell", len(doc.Runs), len(doc.Cells))
	}
	for _, s := range doc.Runs[0].Policies {
		if s.Skipped != "" || s.Failed != 0 || s.TTFTP50 <= 0 {
			t.Errorf("%s: skipped %q, %d failed, TTFT p50 %v; want it run, nothing failed", s.Policy, s.Skipped, s.Failed, s.TTFTP50)
		}
		// The proxy's time counted once instead of 20 times: less, never more.
		if s.ProxyP50 <= 0 || s.NetTTFTP50 <= 0 || s.NetTTFTP50 > s.TTFTP50 || s.NetTTFTP99 > s.TTFTP99 {
			t.Errorf("%s: proxy p50 %v wall ms, net TTFT p50 %v p99 %v against %v %v; want a proxy time and net figures at most the measured",
				s.Policy, s.ProxyP50, s.NetTTFTP50, s.NetTTFTP99, s.TTFTP50, s.TTFTP99)
		}
		// Each backend's TTFT median, in the backends' order, for the share target.
		if len(s.BackendTTFTP50) != 2 || max(s.BackendTTFTP50[0], s.BackendTTFTP50[1]) <= 0 {
			t.Errorf("%s: backend TTFT medians %v, want one per backend, some positive", s.Policy, s.BackendTTFTP50)
		}
		// -dump wrote every request of the run, each with the backend that answered.
		f, err := os.ReadFile(filepath.Join(o.dump, dumpName(run.Regime+"/"+run.Workload+"/seed 3/load 0.50", s.Policy)))
		if err != nil {
			t.Fatalf("%s: dump: %v", s.Policy, err)
		}
		lines := strings.Split(strings.TrimSpace(string(f)), "\n")
		var r requestResult
		if len(lines) != w.NumRequests() || json.Unmarshal([]byte(lines[len(lines)-1]), &r) != nil || r.Upstream == "" || r.Proxy <= 0 {
			t.Errorf("%s: dump has %d lines (want %d), last %+v: want each request with its upstream and proxy time", s.Policy, len(lines), w.NumRequests(), r)
		}
		// and, for llm, what it had learned of each upstream at the end (its /llm/upstreams).
		name := upstreamsDumpName(run.Regime+"/"+run.Workload+"/seed 3/load 0.50", s.Policy)
		b, err := os.ReadFile(filepath.Join(o.dump, name))
		if !isLLMPolicy(policiesNamed([]string{s.Policy})[0]) {
			if err == nil {
				t.Errorf("%s: %s written for a stock policy", s.Policy, name)
			}
			continue
		}
		var rep struct {
			Upstreams []struct {
				Upstream string          `json:"upstream"`
				Model    json.RawMessage `json:"model"`
				Cache    struct {
					Restarts int `json:"restarts"`
				} `json:"cache"`
			} `json:"upstreams"`
		}
		if err != nil || json.Unmarshal(b, &rep) != nil || len(rep.Upstreams) != 2 || rep.Upstreams[0].Upstream == "" || len(rep.Upstreams[0].Model) == 0 {
			t.Errorf("%s: %s = %.300s (%v); want both upstreams with their learned model", s.Policy, name, b, err)
		}
		// Each llm policy starts cold: what the one before it learned at these addresses was forgotten
		// (forgetUpstreams), so none sees the fresh simulators as the same backends restarted.
		for _, u := range rep.Upstreams {
			if u.Cache.Restarts != 0 {
				t.Errorf("%s: %s seen restarted %d times: it started from an earlier policy's state", s.Policy, u.Upstream, u.Cache.Restarts)
			}
		}
	}
}

// TestEngineFleetsEndToEnd runs the fleets whose engines work otherwise than the policy's model (costs
// growing with context; SGLang's scheduler and /metrics) through Caddy: each backend is built as its
// regime says, and both policies complete every request.
func TestEngineFleetsEndToEnd(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Caddy and simulated backends")
	}
	t.Setenv("XDG_DATA_HOME", t.TempDir())
	t.Setenv("XDG_CONFIG_HOME", t.TempDir())
	o := options{matrix: true, backends: 2, load: 0.5, seed: 5, seeds: 1, out: t.TempDir(), sim: defaultSim, timeScaleSet: true}
	o.sim.TimeScale = 20
	o.policies = policiesNamed([]string{"least_conn", "llm"})
	w := sharedPrefix(rand.New(rand.NewPCG(5, 5)), 4, 5, 1500, 100, 16)
	for _, name := range []string{"long-context", "sglang"} {
		prog := newProgress(os.Stderr, 2*w.NumRequests())
		run := runMatrixJob(context.Background(), o, matrixJob{regime: mustRegime(name), workload: w, seed: 5, load: o.load}, prog)
		prog.finish()
		if len(run.Policies) != 2 {
			t.Fatalf("%s: %d policies run, want 2", name, len(run.Policies))
		}
		for _, s := range run.Policies {
			if s.Skipped != "" || s.Failed != 0 || s.Completed != s.Requests || s.TTFTP50 <= 0 {
				t.Errorf("%s/%s: skipped %q, %d of %d failed (%s), TTFT p50 %v", name, s.Policy, s.Skipped, s.Failed, s.Requests, s.FirstError, s.TTFTP50)
			}
		}
	}
	sims := mustRegime("sglang").build(2, defaultSim)
	if sims[0].Metrics != vllmsim.MetricsSGLang || sims[0].Schedule != vllmsim.ScheduleLPM || !sims[0].SeparatePrefill {
		t.Errorf("sglang backends %+v, want SGLang's metrics and scheduler", sims[0])
	}
}
