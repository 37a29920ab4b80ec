package main

import (
	"encoding/json"
	"encoding/xml"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"
)

func TestRegimes(t *testing.T) {
	base := defaultSim
	base.TimeScale, base.TokensPerChunk = 7, 3
	tests := []struct {
		name  string
		check func(t *testing.T, b []simSettings)
	}{
		{"small-batch", func(t *testing.T, b []simSettings) {
			for _, s := range b {
				if s.MaxNumSeqs != 8 || s.MaxNumBatchedTokens != -1 || s.PrefillTokensPerSec < 2500 || s.PrefillTokensPerSec > 5000 ||
					s.DecodeStep < 15*time.Millisecond || s.DecodeStep > 20*time.Millisecond {
					t.Errorf("small-batch backend = %+v, want max_num_seqs 8, unchunked, 2.5k-5k tok/s, 15-20 ms steps", s)
				}
			}
		}},
		{"default", func(t *testing.T, b []simSettings) {
			want := defaultSim
			want.TimeScale, want.TokensPerChunk = 7, 3
			for _, s := range b {
				if s != want {
					t.Errorf("default backend = %+v, want defaultSim %+v", s, want)
				}
			}
		}},
		{"large-batch", func(t *testing.T, b []simSettings) {
			for _, s := range b {
				if s.MaxNumSeqs != 256 || s.NumGPUBlocks <= defaultSim.NumGPUBlocks {
					t.Errorf("large-batch backend = %+v, want 256 sequences and a bigger KV cache", s)
				}
			}
		}},
		{"hetero", func(t *testing.T, b []simSettings) {
			slow := b[len(b)-1]
			if math.Abs(slow.PrefillTokensPerSec*3-defaultSim.PrefillTokensPerSec) > 1 || slow.DecodeStep != 3*defaultSim.DecodeStep {
				t.Errorf("hetero slow backend = %+v, want 3x slower prefill and decode", slow)
			}
			for _, s := range b[:len(b)-1] {
				if s.PrefillTokensPerSec != defaultSim.PrefillTokensPerSec {
					t.Errorf("hetero fast backend = %+v, want default speed", s)
				}
			}
		}},
		{"kv-pressure", func(t *testing.T, b []simSettings) {
			if b[0].NumGPUBlocks*b[0].BlockSize > 8192 {
				t.Errorf("kv-pressure KV cache = %d tokens, want at most 8k", b[0].NumGPUBlocks*b[0].BlockSize)
			}
		}},
		{"fast-prefill", func(t *testing.T, b []simSettings) {
			if b[0].PrefillTokensPerSec != 20000 {
				t.Errorf("fast-prefill = %v tok/s, want 20000", b[0].PrefillTokensPerSec)
			}
		}},
		{"slow-prefill", func(t *testing.T, b []simSettings) {
			if b[0].PrefillTokensPerSec != 2000 {
				t.Errorf("slow-prefill = %v tok/s, want 2000", b[0].PrefillTokensPerSec)
			}
		}},
	}
	if len(tests) != len(regimes) {
		t.Errorf("testing %d regimes, the table has %d", len(tests), len(regimes))
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r, err := findRegime(tt.name)
			if err != nil {
				t.Fatal(err)
			}
			b := r.build(4, base)
			if len(b) != 4 {
				t.Fatalf("build(4) returned %d backends", len(b))
			}
			for i, s := range b {
				if s.TimeScale != 7 || s.TokensPerChunk != 3 {
					t.Errorf("backend %d time scale %v, chunk %d; want the run's 7 and 3", i, s.TimeScale, s.TokensPerChunk)
				}
			}
			tt.check(t, b)
		})
	}
	for _, name := range extraRegimeNames() {
		r, err := findRegime(name)
		if err != nil || slices.Contains(regimeNames(), name) {
			t.Errorf("findRegime(%s) = %v; want it found, beyond the matrix's regimes", name, err)
			continue
		}
		b := r.build(4, base)
		if b[0] == b[1] && b[1] == b[2] && b[2] == b[3] && !slices.Contains([]string{"huge-batch", "long-context", "sglang"}, name) {
			t.Errorf("%s: four alike backends, want a mixed pool", name)
		}
	}
	if o, err := parseOptions([]string{"-matrix", "-regimes", "extra"}); err != nil || len(o.regimes) != len(extraRegimes) {
		t.Errorf("-regimes extra: %d regimes, %v; want the %d beyond the matrix", len(o.regimes), err, len(extraRegimes))
	}
	if _, err := findRegime("nope"); err == nil {
		t.Error("findRegime(nope) = nil error, want an error")
	}
}

// TestCapacityPerRegime checks that the capacity estimate follows each regime's settings: a
// heterogeneous cluster adds up its members, and each matrix workload's offered load is neither
// trivial nor absurd (between 0.5 and 200 requests per simulated second).
func TestCapacityPerRegime(t *testing.T) {
	w, _ := generateWorkload("shared-prefix", 1, workloadSize{matrix: true})
	def := estimateCapacity(w, mustRegime("default").build(4, defaultSim))
	het := estimateCapacity(w, mustRegime("hetero").build(4, defaultSim))
	if got, want := het.ClusterRPS, def.ClusterRPS*3/4+het.BackendRPS[3]; math.Abs(got-want) > 1e-9 {
		t.Errorf("hetero capacity = %.3f, want the sum of its backends %.3f", got, want)
	}
	if het.BackendRPS[3] > het.BackendRPS[0]/2 {
		t.Errorf("hetero slow backend capacity %.2f, fast %.2f; want the slow one well below", het.BackendRPS[3], het.BackendRPS[0])
	}
	for _, r := range slices.Concat(regimes, extraRegimes) {
		for _, name := range matrixWorkloads {
			w, _ := generateWorkload(name, 1, workloadSize{matrix: true})
			sims, _ := fitKV(r.build(4, defaultSim), w)
			if e := estimateCapacity(w, sims); e.ClusterRPS < 0.5 || e.ClusterRPS > 200 {
				t.Errorf("%s/%s: capacity %.2f req/s, want 0.5-200", r.Name, name, e.ClusterRPS)
			}
		}
	}
	agentic, _ := generateWorkload("agentic", 1, workloadSize{matrix: true})
	flat, _ := fitKV(mustRegime("default").build(4, defaultSim), agentic)
	long, _ := fitKV(mustRegime("long-context").build(4, defaultSim), agentic)
	if f, l := estimateCapacity(agentic, flat), estimateCapacity(agentic, long); !(l.ClusterRPS < 0.8*f.ClusterRPS) {
		t.Errorf("agentic capacity %.2f req/s with costs growing with context, %.2f without; want well below", l.ClusterRPS, f.ClusterRPS)
	}
	fast := estimateCapacity(w, mustRegime("fast-prefill").build(4, defaultSim))
	slow := estimateCapacity(w, mustRegime("slow-prefill").build(4, defaultSim))
	if !(slow.ClusterRPS < def.ClusterRPS && def.ClusterRPS < fast.ClusterRPS) {
		t.Errorf("capacity slow %.2f, default %.2f, fast %.2f; want increasing with the prefill rate", slow.ClusterRPS, def.ClusterRPS, fast.ClusterRPS)
	}
}

func TestFitKV(t *testing.T) {
	w, _ := generateWorkload("agentic", 1, workloadSize{matrix: true})
	largest := 0
	for _, r := range w.Requests() {
		largest = max(largest, templatedTokens(r.Messages)+r.MaxTokens)
	}
	for _, r := range slices.Concat(regimes, extraRegimes) {
		sims, _ := fitKV(r.build(4, defaultSim), w)
		for i, s := range sims {
			// the simulator's 400: prompt + output over the cache, or prompt over cache - 1% watermark
			if blocks := (largest + s.BlockSize - 1) / s.BlockSize; blocks > s.NumGPUBlocks-s.NumGPUBlocks/100 {
				t.Errorf("%s backend %d: %d blocks cannot hold the largest agentic request (%d blocks)", r.Name, i, s.NumGPUBlocks, blocks)
			}
		}
	}
	big := mustRegime("large-batch").build(2, defaultSim)
	if got, notes := fitKV(big, w); got[0] != big[0] || len(notes) != 0 {
		t.Errorf("fitKV changed a cache that was big enough: %+v, %v", got[0], notes)
	}
}

// summaryOf is a policy's figures with the fields the verdict reads.
func summaryOf(policy string, p50, p99 float64, backends ...int) Summary {
	return Summary{Policy: policy, TTFTP50: p50, TTFTP99: p99, BackendRequests: backends}
}

func TestJudgeCell(t *testing.T) {
	stock := []Summary{summaryOf("round_robin", 200, 1000, 10, 10), summaryOf("least_conn", 150, 900, 10, 10), summaryOf("header", 100, 1200, 15, 5)}
	tests := []struct {
		name                string
		runs                [][]Summary // per seed
		wantPass, wantJudge bool
		wantP50, wantP99    float64
		wantSeeds           int // seeds on which llm passes against that seed's best stock figures
	}{
		{"better on both", [][]Summary{append(slices.Clone(stock), summaryOf("llm", 90, 800, 10, 10))}, true, true, 0.9, 0.889, 1},
		{"p50 within 5%", [][]Summary{append(slices.Clone(stock), summaryOf("llm", 105, 900, 10, 10))}, true, true, 1.05, 1, 1},
		{"p50 over 5%", [][]Summary{append(slices.Clone(stock), summaryOf("llm", 106, 800, 10, 10))}, false, true, 1.06, 0.889, 0},
		{"p99 worse", [][]Summary{append(slices.Clone(stock), summaryOf("llm", 50, 901, 10, 10))}, false, true, 0.5, 1.001, 0},
		{"no llm", [][]Summary{stock}, false, false, 0, 0, 0},
		{"no stock", [][]Summary{{summaryOf("llm", 50, 500), summaryOf("oracle", 40, 400)}}, false, false, 0, 0, 0},
		// The medians pass, yet seed by seed llm loses twice: once on p99 (2000 against 1000), once on
		// p50 (400 against 200).
		{"median of three seeds", [][]Summary{
			{summaryOf("least_conn", 100, 1000), summaryOf("llm", 50, 2000)},
			{summaryOf("least_conn", 300, 3000), summaryOf("llm", 90, 900)},
			{summaryOf("least_conn", 200, 2000), summaryOf("llm", 400, 1000)},
		}, true, true, 0.45, 0.5, 1},
		{"a failed request fails the seed", [][]Summary{
			{summaryOf("least_conn", 100, 1000), {Policy: "llm", TTFTP50: 50, TTFTP99: 500, Failed: 1}},
			{summaryOf("least_conn", 100, 1000), summaryOf("llm", 50, 500)},
		}, false, true, 0.5, 0.5, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var runs []MatrixRun
			for i, ps := range tt.runs {
				runs = append(runs, MatrixRun{Regime: "r", Workload: "w", Seed: int64(i), Requests: 110, Warmup: 10, Policies: ps})
			}
			c := judgeCell("r", "w", runs)
			if c.Judged != tt.wantJudge || c.Pass != tt.wantPass {
				t.Errorf("judged %v pass %v, want %v %v (cell %+v)", c.Judged, c.Pass, tt.wantJudge, tt.wantPass, c)
			}
			if c.P50Ratio != tt.wantP50 || c.P99Ratio != tt.wantP99 {
				t.Errorf("ratios p50 %v p99 %v, want %v %v", c.P50Ratio, c.P99Ratio, tt.wantP50, tt.wantP99)
			}
			if c.SeedsPassing != tt.wantSeeds {
				t.Errorf("seeds passing %d, want %d", c.SeedsPassing, tt.wantSeeds)
			}
			if c.Requests != 100 || c.Seeds != len(tt.runs) {
				t.Errorf("requests %d seeds %d, want 100 and %d", c.Requests, c.Seeds, len(tt.runs))
			}
		})
	}
	c := judgeCell("r", "w", []MatrixRun{{Policies: append(slices.Clone(stock), summaryOf("llm", 90, 800, 10, 10))}})
	if c.BestP50Policy != "header" || c.BestP99Policy != "least_conn" {
		t.Errorf("best stock p50 %s, p99 %s; want header and least_conn", c.BestP50Policy, c.BestP99Policy)
	}
	if h, _ := c.policy("header"); h.MaxShare != 1.5 {
		t.Errorf("header max share = %v, want 1.5 (15 of 20 requests on one of 2 backends)", h.MaxShare)
	}
	// The busiest backend's TTFT median over the run's, where the runs name each backend's: the median
	// over seeds of 40/80 and 60/80 (the busiest is the second backend, 3 of 4 requests).
	busy := func(p50, busiest float64) MatrixRun {
		s := summaryOf("llm", p50, 800)
		s.BackendRequests, s.BackendTTFTP50 = []int{1, 3}, []float64{200, busiest}
		return MatrixRun{Policies: []Summary{summaryOf("least_conn", 100, 1000), s}}
	}
	c = judgeCell("r", "w", []MatrixRun{busy(80, 40), busy(80, 60)})
	if l, _ := c.policy("llm"); l.BusiestTTFT != 0.625 {
		t.Errorf("llm busiest TTFT ratio = %v, want 0.625 (the median of 0.5 and 0.75)", l.BusiestTTFT)
	}
	if lc, _ := c.policy("least_conn"); lc.BusiestTTFT != 0 {
		t.Errorf("least_conn busiest TTFT ratio = %v without backend figures, want 0", lc.BusiestTTFT)
	}
}

// The verdicts net of the proxy's time and after each run's first quarter are judged like the main one,
// each on its own figures: here llm loses on TTFT as measured and passes on the other figures; without
// them on a stock policy the verdict is on the others, and without llm's there is none.
func TestJudgeCellSubVerdicts(t *testing.T) {
	for _, tc := range []struct {
		name    string
		set     func(s *Summary, p50, p99 float64)
		of      func(MatrixCell) *Verdict
		summary func([]MatrixCell) string
		says    string
	}{
		{"net", func(s *Summary, p50, p99 float64) { s.NetTTFTP50, s.NetTTFTP99 = p50, p99 },
			func(c MatrixCell) *Verdict { return c.Net }, netVerdict, "net of the proxy's own time (counted once, not time-scale times): llm passes 1 of 1"},
		{"late", func(s *Summary, p50, p99 float64) { s.LateTTFTP50, s.LateTTFTP99 = p50, p99 },
			func(c MatrixCell) *Verdict { return c.Late }, lateVerdict, "after the first 25% of each run: llm passes 1 of 1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			runs := []MatrixRun{{Policies: []Summary{summaryOf("least_conn", 100, 1000), summaryOf("header", 90, 1100), summaryOf("llm", 120, 990)}}}
			for i, f := range [][2]float64{{99, 990}, {89, 1090}, {91, 960}} {
				tc.set(&runs[0].Policies[i], f[0], f[1])
			}
			c := judgeCell("r", "w", runs)
			v := tc.of(c)
			if c.Pass || v == nil {
				t.Fatalf("pass %v, %s verdict %+v: want a loss as measured and a %s verdict", c.Pass, tc.name, v, tc.name)
			}
			if !v.Pass || v.SeedsPassing != 1 || v.BestP50Policy != "header" || v.BestP99Policy != "least_conn" || v.P50Ratio != 1.022 || v.P99Ratio != 0.97 {
				t.Errorf("%s verdict %+v, want a pass on header's p50 89 (1.022x) and least_conn's p99 990 (0.97x)", tc.name, *v)
			}
			if got := tc.summary([]MatrixCell{c}); !strings.Contains(got, tc.says) {
				t.Errorf("summary %q, want %q", got, tc.says)
			}
			tc.set(&runs[0].Policies[1], 0, 0) // header's runs do not have these figures
			if v := tc.of(judgeCell("r", "w", runs)); v == nil || v.BestP50Policy != "least_conn" {
				t.Errorf("%s verdict %+v, want it on least_conn alone", tc.name, v)
			}
			tc.set(&runs[0].Policies[2], 0, 0)
			if c := judgeCell("r", "w", runs); tc.of(c) != nil || tc.summary([]MatrixCell{c}) != "" {
				t.Errorf("%s verdict %+v without llm's figures, want none", tc.name, tc.of(c))
			}
		})
	}
}

// The late section's row: llm's figures, the best stock ones, and llm's p99 over least_conn's, the
// hot-prefix target's baseline, even where least_conn is not the best.
func TestLateMarkdown(t *testing.T) {
	runs := []MatrixRun{{Policies: []Summary{summaryOf("least_conn", 100, 1000), summaryOf("round_robin", 110, 900), summaryOf("llm", 100, 1200)}}}
	for i, f := range [][2]float64{{60, 500}, {70, 450}, {61, 300}} {
		runs[0].Policies[i].LateTTFTP50, runs[0].Policies[i].LateTTFTP99 = f[0], f[1]
	}
	var md strings.Builder
	writeLateMarkdown(&md, MatrixResults{Cells: []MatrixCell{judgeCell("r", "w", runs)}})
	if !strings.Contains(md.String(), "| r | w | 61 | 60 (least_conn) | 1.02 | 300 | 450 (round_robin) | 0.67 | 0.60 | 1/1 | PASS |") {
		t.Errorf("late section:\n%s\nwant llm's row with its p99 over least_conn's (0.60)", md.String())
	}
}

func TestMaxShare(t *testing.T) {
	tests := []struct {
		name     string
		requests []int
		capacity []float64
		want     float64
		busiest  int
	}{
		{"even", []int{25, 25, 25, 25}, nil, 1, 0},
		{"one hot", []int{10, 70, 10, 10}, nil, 2.8, 1},
		{"weighted by capacity", []int{30, 30, 30, 10}, []float64{3, 3, 3, 1}, 1, 0},
		{"slow backend overloaded", []int{25, 25, 25, 25}, []float64{3, 3, 3, 1}, 2.5, 3},
		{"capacity of another length ignored", []int{50, 50}, []float64{1}, 1, 0},
		{"nothing sent", []int{0, 0}, nil, 0, -1},
	}
	for _, tt := range tests {
		if got, i := maxShare(tt.requests, tt.capacity); math.Abs(got-tt.want) > 1e-9 || i != tt.busiest {
			t.Errorf("%s: maxShare(%v, %v) = %v, %d; want %v, %d", tt.name, tt.requests, tt.capacity, got, i, tt.want, tt.busiest)
		}
	}
}

func TestMatrixVerdict(t *testing.T) {
	cells := []MatrixCell{
		{Regime: "a", Workload: "x", Seeds: 3, Verdict: Verdict{Judged: true, Pass: true, SeedsPassing: 3}},
		{Regime: "a", Workload: "y", Seeds: 3, Verdict: Verdict{Judged: true, SeedsPassing: 1}},
		{Regime: "a", Workload: "z", Seeds: 3, Verdict: Verdict{Judged: true, Pass: true, SeedsPassing: 2}},
		{Regime: "b", Workload: "x"},
	}
	got := matrixVerdict(cells)
	if !strings.Contains(got, "passes 2 of 3 cells") || !strings.Contains(got, "fails a/y") {
		t.Errorf("matrixVerdict = %q, want 2 of 3 passing and a/y named", got)
	}
	if !strings.Contains(got, "every seed in 1 cells, on none in 0, the seeds disagree in 2") {
		t.Errorf("matrixVerdict = %q, want the seed-by-seed counts 1, 0, 2", got)
	}
}

func TestRatioColor(t *testing.T) {
	tests := []struct {
		ratio float64
		want  string
	}{
		{1, "#ffffbf"}, {0.5, "#1a9850"}, {0.1, "#1a9850"}, {2, "#d73027"}, {50, "#d73027"}, {0, "#dddddd"}, {math.NaN(), "#dddddd"},
	}
	for _, tt := range tests {
		if got := ratioColor(tt.ratio); got != tt.want {
			t.Errorf("ratioColor(%v) = %s, want %s", tt.ratio, got, tt.want)
		}
	}
}

// TestHeatMap renders two regimes x two workloads (one cell missing) and checks that the SVG is
// well-formed, has a rectangle per cell, prints each judged cell's p99 ratio and has axis titles.
func TestHeatMap(t *testing.T) {
	cells := []MatrixCell{
		{Regime: "small-batch", Workload: "shared-prefix", Verdict: Verdict{Judged: true, Pass: true, P50Ratio: 0.4, P99Ratio: 0.83}},
		{Regime: "small-batch", Workload: "hot-prefix", Verdict: Verdict{Judged: true, P50Ratio: 1.1, P99Ratio: 2.4}},
		{Regime: "default", Workload: "shared-prefix", Verdict: Verdict{Judged: true, Pass: true, P50Ratio: 0.2, P99Ratio: 0.5}},
	}
	var b strings.Builder
	writeHeatMap(&b, cells, 3)
	svg := b.String()
	rects, texts := 0, []string{}
	dec := xml.NewDecoder(strings.NewReader(svg))
	for {
		tok, err := dec.Token()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("matrix.svg is not well-formed XML: %v", err)
		}
		switch e := tok.(type) {
		case xml.StartElement:
			for _, a := range e.Attr {
				if e.Name.Local == "rect" && a.Name.Local == "class" && a.Value == "cell" {
					rects++
				}
			}
		case xml.CharData:
			texts = append(texts, string(e))
		}
	}
	if rects != 4 {
		t.Errorf("%d cell rectangles, want 4 (2 regimes x 2 workloads)", rects)
	}
	all := strings.Join(texts, "|")
	for _, want := range []string{"0.83x", "2.40x", "0.50x", "n/a", "p50 1.10x FAIL", "workload", "backend regime", "small-batch", "hot-prefix"} {
		if !strings.Contains(all, want) {
			t.Errorf("matrix.svg lacks the text %q", want)
		}
	}
	if !strings.Contains(svg, ratioColor(2.4)) || !strings.Contains(svg, ratioColor(0.83)) {
		t.Error("matrix.svg does not colour the cells by their p99 ratio")
	}
}

func TestParseMatrixOptions(t *testing.T) {
	o, err := parseOptions([]string{"-matrix"})
	if err != nil {
		t.Fatal(err)
	}
	var pols []string
	for _, p := range o.policies {
		pols = append(pols, p.Name)
	}
	if len(o.regimes) != len(regimes) || !slices.Equal(o.workloads, matrixWorkloads) || o.seeds != 3 ||
		!slices.Equal(pols, matrixPolicies) {
		t.Errorf("-matrix: %d regimes, workloads %v, %d seeds, policies %v; want all regimes, the matrix workloads, 3 seeds, %v",
			len(o.regimes), o.workloads, o.seeds, pols, matrixPolicies)
	}
	o, err = parseOptions([]string{"-quick", "-matrix"})
	if err != nil {
		t.Fatal(err)
	}
	if len(o.regimes) != 2 || o.regimes[0].Name != "small-batch" || o.regimes[1].Name != "default" || o.seeds != 1 || len(o.workloads) != 5 {
		t.Errorf("-quick -matrix: regimes %v, %d seeds, %d workloads; want small-batch,default, 1 seed, 5 workloads", o.regimes, o.seeds, len(o.workloads))
	}
	o, err = parseOptions([]string{"-matrix", "-regimes", "hetero,kv-pressure", "-workloads", "agentic", "-seeds", "2"})
	if err != nil {
		t.Fatal(err)
	}
	if len(o.regimes) != 2 || o.regimes[0].Name != "hetero" || !slices.Equal(o.workloads, []string{"agentic"}) || o.seeds != 2 {
		t.Errorf("filtered -matrix: regimes %v, workloads %v, seeds %d", o.regimes, o.workloads, o.seeds)
	}
	o, err = parseOptions([]string{"-goodput"})
	if err != nil {
		t.Fatal(err)
	}
	if len(o.regimes) != 1 || o.regimes[0].Name != "default" || !slices.Equal(o.workloads, []string{"shared-prefix"}) || len(o.policies) != 2 {
		t.Errorf("-goodput: regimes %v, workloads %v, policies %v", o.regimes, o.workloads, o.policies)
	}
	o, err = parseOptions([]string{"-matrix", "-regimes", "hetero", "-metrics", "llamacpp"})
	if err != nil {
		t.Fatal(err)
	}
	for i, s := range o.regimes[0].build(4, o.sim) {
		if s.Metrics != "llamacpp" {
			t.Errorf("-metrics llamacpp: backend %d of hetero serves %q metrics", i, s.Metrics)
		}
	}
	// A pool larger than 4 runs as long as a 4-backend one unless -length says otherwise.
	for _, c := range []struct {
		args   []string
		length int
	}{
		{[]string{"-matrix"}, 1},
		{[]string{"-matrix", "-backends", "2"}, 1},
		{[]string{"-matrix", "-backends", "5"}, 2},
		{[]string{"-matrix", "-backends", "16"}, 4},
		{[]string{"-matrix", "-backends", "16", "-length", "1"}, 1},
		{[]string{"-matrix", "-backends", "8", "-length", "3"}, 3},
		{[]string{"-matrix", "-backends", "200"}, 20},
		{[]string{"-goodput", "-backends", "16"}, 1},
	} {
		if o, err := parseOptions(c.args); err != nil || o.length != c.length {
			t.Errorf("parseOptions(%q): length %d, err %v; want %d", c.args, o.length, err, c.length)
		}
	}
	for _, bad := range [][]string{{"-matrix", "-regimes", "nope"}, {"-matrix", "-seeds", "0"}, {"-matrix", "-goodput"}, {"-metrics", "ollama"}} {
		if _, err := parseOptions(bad); err == nil {
			t.Errorf("parseOptions(%q) = nil error, want an error", bad)
		}
	}
}

func TestGoodputStep(t *testing.T) {
	run := func(p99 float64, failed int) MatrixRun {
		return MatrixRun{RateRPS: 10, Policies: []Summary{{Policy: "llm", TTFTP99: p99, Failed: failed}}}
	}
	tests := []struct {
		name string
		runs []MatrixRun
		ok   bool
	}{
		{"under the SLO", []MatrixRun{run(1500, 0)}, true},
		{"over the SLO", []MatrixRun{run(2500, 0)}, false},
		{"median under", []MatrixRun{run(1000, 0), run(5000, 0), run(1900, 0)}, true},
		{"failures", []MatrixRun{run(1000, 1)}, false},
		{"skipped", []MatrixRun{{Policies: []Summary{{Policy: "llm", Skipped: "x"}}}}, false},
	}
	for _, tt := range tests {
		if got := goodputStep(1, tt.runs); got.OK != tt.ok {
			t.Errorf("%s: goodputStep = %+v, want ok %v", tt.name, got, tt.ok)
		}
	}
	c := GoodputCurve{Goodput: map[string]float64{"llm": 30, "least_conn": 20}, Order: []string{"least_conn", "llm"}}
	if got := c.ratio("llm", "least_conn"); got != 1.5 {
		t.Errorf("ratio = %v, want 1.5", got)
	}
	if d := c.describe(); !strings.Contains(d, "llm/least_conn = 1.50x") {
		t.Errorf("describe = %q, want the ratio", d)
	}
}

func TestWorkloadVerdict(t *testing.T) {
	w := WorkloadResult{Workload: "hot-prefix", Requests: 64, Warmup: 6, Policies: []Summary{
		summaryOf("least_conn", 100, 1000, 16, 16, 16, 16), summaryOf("llm", 50, 800, 16, 16, 16, 16)}}
	got := w.verdict()
	for _, want := range []string{"hot-prefix: 58 measured requests per policy", "p50 0.50x", "p99 0.80x", "PASS"} {
		if !strings.Contains(got, want) {
			t.Errorf("verdict = %q, lacks %q", got, want)
		}
	}
	w.Policies = w.Policies[:1]
	if got := w.verdict(); !strings.Contains(got, "not judged") {
		t.Errorf("verdict without llm = %q, want not judged", got)
	}
}

// TestScaleScrapes: the bare llm policy scrapes every 1s/timeScale of wall time (1 s simulated), an
// explicit interval or metrics off is kept, and other policies are untouched.
func TestScaleScrapes(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{`{"policy":"llm"}`, `{"metrics":{"interval":"200ms"},"policy":"llm"}`},
		{`{"policy":"llm","metrics":{"interval":"1s"}}`, `{"policy":"llm","metrics":{"interval":"1s"}}`},
		{`{"policy":"llm","metrics":{"off":true}}`, `{"policy":"llm","metrics":{"off":true}}`},
		{`{"policy":"least_conn"}`, `{"policy":"least_conn"}`},
	} {
		if got := scaleScrapes(policy{Name: "p", JSON: tc.in}, 5).JSON; got != tc.want {
			t.Errorf("scaleScrapes(%s) = %s, want %s", tc.in, got, tc.want)
		}
	}
}

// TestScalePrior: the llm policy starts from its prior in simulated time (capacity = time scale) unless it
// sets capacities; other policies are untouched.
func TestScalePrior(t *testing.T) {
	dials := []string{"127.0.0.1:1", "127.0.0.1:2"}
	for _, tc := range []struct{ in, want string }{
		{`{"policy":"llm"}`, `{"capacities":{"127.0.0.1:1":10,"127.0.0.1:2":10},"policy":"llm"}`},
		{`{"policy":"llm","capacities":{"127.0.0.1:1":2}}`, `{"policy":"llm","capacities":{"127.0.0.1:1":2}}`},
		{`{"policy":"least_conn"}`, `{"policy":"least_conn"}`},
	} {
		if got := scalePrior(policy{Name: "p", JSON: tc.in}, 10, dials, nil).JSON; got != tc.want {
			t.Errorf("scalePrior(%s) = %s, want %s", tc.in, got, tc.want)
		}
	}
}

// TestRejudge: -rejudge reads an earlier results.json, judges its runs with today's rules and writes the
// report, without running anything; a file without runs is an error.
func TestRejudge(t *testing.T) {
	dir := t.TempDir()
	mr := MatrixResults{runHeader: runHeader{Command: "go run ./bench -matrix", Seeds: []int64{1, 2}}, Runs: []MatrixRun{
		{Regime: "r", Workload: "w", Seed: 1, Requests: 110, Warmup: 10, Policies: []Summary{summaryOf("least_conn", 100, 1000), summaryOf("llm", 50, 500)}},
		{Regime: "r", Workload: "w", Seed: 2, Requests: 110, Warmup: 10, Policies: []Summary{summaryOf("least_conn", 100, 1000), summaryOf("llm", 50, 2000)}},
	}}
	in := writeMatrixFile(t, filepath.Join(dir, "in.json"), mr)
	out := filepath.Join(dir, "out")
	if err := run([]string{"-rejudge", in, "-out", out}); err != nil {
		t.Fatal(err)
	}
	var got MatrixResults
	if b, err := os.ReadFile(filepath.Join(out, "results.json")); err != nil || json.Unmarshal(b, &got) != nil {
		t.Fatalf("results.json: %v", err)
	}
	if len(got.Cells) != 1 || got.Cells[0].SeedsPassing != 1 || got.Cells[0].Seeds != 2 || got.Command != mr.Command {
		t.Errorf("rejudged %+v, want one cell passing on 1 of 2 seeds and the run's own command", got)
	}
	report, err := os.ReadFile(filepath.Join(out, "report.md"))
	if err != nil || !strings.Contains(string(report), "| 1/2 |") || !strings.Contains(string(report), "judged again by") {
		t.Errorf("report.md (%v) lacks the seeds-passing column or the re-judge note:\n%s", err, report)
	}
	empty := filepath.Join(dir, "empty.json")
	if err := os.WriteFile(empty, []byte(`{"runs":[]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := run([]string{"-rejudge", empty, "-out", out}); err == nil {
		t.Error("re-judging a file without runs: no error")
	}
	if _, err := parseOptions([]string{"-rejudge", in, "-matrix"}); err == nil {
		t.Error("-rejudge with -matrix: no error")
	}

	// Two runs of other seeds pool into one judgement of all four; the same seed twice is an error.
	more := mr
	more.Seeds = []int64{3, 4}
	more.Runs = []MatrixRun{mr.Runs[0], mr.Runs[0]}
	more.Runs[0].Seed, more.Runs[1].Seed = 3, 4
	in2 := writeMatrixFile(t, filepath.Join(dir, "in2.json"), more)
	if err := run([]string{"-rejudge", in + "," + in2, "-out", out}); err != nil {
		t.Fatal(err)
	}
	got = MatrixResults{}
	if b, err := os.ReadFile(filepath.Join(out, "results.json")); err != nil || json.Unmarshal(b, &got) != nil {
		t.Fatalf("results.json: %v", err)
	}
	if len(got.Cells) != 1 || got.Cells[0].Seeds != 4 || got.Cells[0].SeedsPassing != 3 || !slices.Equal(got.Seeds, []int64{1, 2, 3, 4}) {
		t.Errorf("pooled %+v, want one cell passing on 3 of 4 seeds 1-4", got)
	}
	if err := run([]string{"-rejudge", in + "," + in, "-out", out}); err == nil || !strings.Contains(err.Error(), "both hold") {
		t.Errorf("pooling a file with itself: %v, want an error naming the run both hold", err)
	}
	// One file is judged as it stands, whatever it holds: the check is between files.
	twice := mr
	twice.Runs = []MatrixRun{mr.Runs[0], mr.Runs[0]}
	in3 := writeMatrixFile(t, filepath.Join(dir, "in3.json"), twice)
	if err := run([]string{"-rejudge", in3, "-out", out}); err != nil {
		t.Errorf("re-judging one file that holds a run twice: %v, want it judged as before pooling", err)
	}
}

// TestRejudgeReplace: -replace sets llm's figures from a run of llm alone into another run's cells in
// place of its own, and the verdict follows them; a run on either side without its match is an error.
func TestRejudgeReplace(t *testing.T) {
	dir := t.TempDir()
	stock := MatrixResults{runHeader: runHeader{Command: "go run ./bench -matrix", Seeds: []int64{1, 2}}, Runs: []MatrixRun{
		{Regime: "r", Workload: "w", Seed: 1, Policies: []Summary{summaryOf("least_conn", 100, 1000), summaryOf("llm", 50, 2000)}},
		{Regime: "r", Workload: "w", Seed: 2, Policies: []Summary{summaryOf("least_conn", 100, 1000), summaryOf("llm", 50, 2000)}},
	}}
	alone := MatrixResults{runHeader: runHeader{Command: "go run ./bench -matrix -policies llm", Seeds: []int64{1, 2}}, Runs: []MatrixRun{
		{Regime: "r", Workload: "w", Seed: 1, Policies: []Summary{summaryOf("llm", 50, 500)}},
		{Regime: "r", Workload: "w", Seed: 2, Policies: []Summary{summaryOf("llm", 60, 900)}},
	}}
	in := writeMatrixFile(t, filepath.Join(dir, "stock.json"), stock)
	with := writeMatrixFile(t, filepath.Join(dir, "alone.json"), alone)
	out := filepath.Join(dir, "out")
	judged := func(args ...string) MatrixResults {
		t.Helper()
		if err := run(append(args, "-out", out)); err != nil {
			t.Fatal(err)
		}
		var got MatrixResults
		if b, err := os.ReadFile(filepath.Join(out, "results.json")); err != nil || json.Unmarshal(b, &got) != nil {
			t.Fatalf("results.json: %v", err)
		}
		return got
	}
	if got := judged("-rejudge", in); got.Cells[0].Pass {
		t.Fatalf("the stock run's own llm (p99 2x least_conn's) passes: %+v", got.Cells[0])
	}
	got := judged("-rejudge", in, "-replace", with)
	c := got.Cells[0]
	if !c.Pass || c.SeedsPassing != 2 || len(got.Runs[0].Policies) != 2 || got.Runs[1].Policies[1].TTFTP99 != 900 {
		t.Errorf("judged with llm replaced: %+v, runs %+v; want a pass on 2 of 2 seeds, llm's p99s 500 and 900", c, got.Runs)
	}
	if !slices.ContainsFunc(got.Notes, func(n string) bool { return strings.Contains(n, "llm from "+with) }) {
		t.Errorf("notes %q do not say where llm came from", got.Notes)
	}

	short := alone
	short.Runs = alone.Runs[:1]
	if err := run([]string{"-rejudge", in, "-replace", writeMatrixFile(t, filepath.Join(dir, "short.json"), short), "-out", out}); err == nil || !strings.Contains(err.Error(), "seed 2") {
		t.Errorf("-replace missing seed 2: %v, want an error naming it", err)
	}
	extra := alone
	extra.Runs = append(slices.Clone(alone.Runs), MatrixRun{Regime: "r", Workload: "w", Seed: 3, Policies: []Summary{summaryOf("llm", 1, 1)}})
	if err := run([]string{"-rejudge", in, "-replace", writeMatrixFile(t, filepath.Join(dir, "extra.json"), extra), "-out", out}); err == nil || !strings.Contains(err.Error(), "seed 3") {
		t.Errorf("-replace with a run the judged ones lack: %v, want an error naming it", err)
	}
	if _, err := parseOptions([]string{"-replace", with}); err == nil {
		t.Error("-replace without -rejudge: no error")
	}
}

// writeMatrixFile writes mr as a -matrix results.json at path and returns path.
func writeMatrixFile(t *testing.T, path string, mr MatrixResults) string {
	t.Helper()
	raw, err := json.Marshal(mr)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, raw, 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// TestCompare: -compare prints each common cell's ratios, new over base, and each policy's geometric
// means; cells only one file holds are skipped, and files with nothing in common are an error.
func TestCompare(t *testing.T) {
	dir := t.TempDir()
	write := func(name string, runs ...MatrixRun) string {
		return writeMatrixFile(t, filepath.Join(dir, name), MatrixResults{Runs: runs})
	}
	cell := func(regime string, llm50, llm99 float64) MatrixRun {
		return MatrixRun{Regime: regime, Workload: "w", Seed: 1, Policies: []Summary{summaryOf("least_conn", 100, 1000), summaryOf("llm", llm50, llm99)}}
	}
	base := write("base.json", cell("a", 50, 500), cell("b", 80, 800), cell("only-base", 1, 1))
	changed := write("new.json", cell("a", 100, 250), cell("b", 80, 1600))
	var out strings.Builder
	if err := compareMatrices(&out, base, changed); err != nil {
		t.Fatal(err)
	}
	got := strings.Join(strings.Fields(out.String()), " ") // the table's spacing aside
	for _, want := range []string{
		"a w llm 50 100 2.00 500 250 0.50",              // p50 50 -> 100, p99 500 -> 250
		"b w llm 80 80 1.00 800 1600 2.00",              // p99 800 -> 1600
		"llm p50 1.414x p99 1.000x over 2 cells",        // sqrt(2 x 1), sqrt(0.5 x 2)
		"least_conn p50 1.000x p99 1.000x over 2 cells", // the stock policy did not move
	} {
		if !strings.Contains(got, want) {
			t.Errorf("output lacks %q:\n%s", want, got)
		}
	}
	// Seed by seed: cell a ran one seed, worse on p50, better on p99.
	if !strings.Contains(got, "2.00 (1/1 worse) 0.50 (0/1 worse)") {
		t.Errorf("paired figures of cell a missing:\n%s", got)
	}
	// Two seeds, one twice as slow and one twice as fast: the paired mean is 1, worse on one of two,
	// whatever the medians say.
	seeded := func(seed int64, llm50 float64) MatrixRun {
		r := cell("s", llm50, 500)
		r.Seed = seed
		return r
	}
	out.Reset()
	if err := compareMatrices(&out, write("base-seeds.json", seeded(1, 50), seeded(2, 100)), write("new-seeds.json", seeded(1, 100), seeded(2, 50))); err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(strings.Fields(out.String()), " "); !strings.Contains(got, "1.00 (1/2 worse) 1.00 (0/2 worse)") {
		t.Errorf("paired figures over two seeds missing:\n%s", got)
	}
	// ... and over the runs pooled, the geometric mean with its 95% interval: logs +-ln 2, mean 0, standard
	// error ln 2, t at one degree of freedom 12.706 (p99 did not move: an interval of nothing).
	if got := strings.Join(strings.Fields(out.String()), " "); !strings.Contains(got, fmt.Sprintf("paired by seed: p50 1.000x (95%% %.3f-%.3f) p99 1.000x (95%% 1.000-1.000) over 2 runs", math.Exp(-12.706*math.Ln2), math.Exp(12.706*math.Ln2))) {
		t.Errorf("paired means over the runs missing:\n%s", got)
	}
	if strings.Contains(got, "only-base") {
		t.Errorf("a cell only the base holds was compared:\n%s", got)
	}
	// Where both runs recorded the proxy's time, the net figures get their own means.
	withNet := func(r MatrixRun, net50, net99 float64) MatrixRun {
		r.Policies[1].NetTTFTP50, r.Policies[1].NetTTFTP99 = net50, net99
		return r
	}
	out.Reset()
	if err := compareMatrices(&out, write("base2.json", withNet(cell("a", 50, 500), 40, 400)), write("new2.json", withNet(cell("a", 100, 250), 20, 800))); err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(strings.Fields(out.String()), " "); !strings.Contains(got, "llm p50 2.000x p99 0.500x over 1 cells; net of the proxy's time p50 0.500x p99 2.000x over 1") ||
		strings.Contains(got, "least_conn p50 1.000x p99 1.000x over 1 cells;") {
		t.Errorf("net means missing, or printed for a policy without net figures:\n%s", got)
	}
	other := write("other.json", cell("c", 1, 1))
	if err := compareMatrices(&out, base, other); err == nil {
		t.Error("files without a common cell: no error")
	}
	if err := run([]string{"-compare", base}); err == nil {
		t.Error("-compare with one file: no error")
	}
	if _, err := parseOptions([]string{"-compare", base + "," + changed, "-rejudge", base}); err == nil {
		t.Error("-compare with -rejudge: no error")
	}
}

func TestTargetRows(t *testing.T) {
	cell := func(regime, workload string, llm, lc PolicyMedian) MatrixCell {
		llm.Policy, lc.Policy = judgedPolicy, "least_conn"
		return MatrixCell{Regime: regime, Workload: workload, Policies: []PolicyMedian{lc, llm}}
	}
	cells := []MatrixCell{
		cell("a", "shared-prefix", PolicyMedian{TTFTP50: 30, MaxShare: 1.2}, PolicyMedian{TTFTP50: 100}),
		cell("a", "mixed", PolicyMedian{MaxShare: 1.1}, PolicyMedian{}),
		cell("b", "shared-prefix", PolicyMedian{TTFTP50: 31}, PolicyMedian{TTFTP50: 100}),
		{Regime: "c", Workload: "hot-prefix", Policies: []PolicyMedian{{Policy: judgedPolicy, TTFTP99: 50, MaxShare: 1}}},
		// over the share, but the busiest backend answered its requests sooner than the run's median, and
		// later: a pass, then a miss
		{Regime: "d", Workload: "hot-prefix", Policies: []PolicyMedian{{Policy: judgedPolicy, MaxShare: 1.7, BusiestTTFT: 0.8}}},
		{Regime: "e", Workload: "mixed", Policies: []PolicyMedian{{Policy: judgedPolicy, MaxShare: 2, BusiestTTFT: 1.3}}},
	}
	hot := cell("a", "hot-prefix", PolicyMedian{TTFTP99: 90, MaxShare: 1.6}, PolicyMedian{TTFTP99: 100})
	hot.Policies = append(hot.Policies, PolicyMedian{Policy: "oracle", TTFTP99: 85})
	cells = slices.Insert(cells, 1, hot)
	got := targetRows(cells)
	want := []targetRow{
		{regime: "a", sharedP50: 0.30, hotP99: 0.90, oracleHotP99: 0.85, maxShare: 1.6, maxShareCell: "hot-prefix", sharedPass: true},
		{regime: "b", sharedP50: 0.31},
		{regime: "c", maxShare: 1, maxShareCell: "hot-prefix"}, // no least_conn: no ratio
		{regime: "d", maxShare: 1.7, maxShareCell: "hot-prefix", busiestTTFT: 0.8},
		{regime: "e", maxShare: 2, maxShareCell: "mixed", busiestTTFT: 1.3},
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("targetRows() =\n%+v\nwant\n%+v", got, want)
	}
	var b strings.Builder
	writeTargetsMarkdown(&b, cells)
	for _, s := range []string{"| a | 0.30 | **0.90** (0.85) | **1.60 (hot-prefix)** |", "| b | **0.31** | - | - |", "| c | - | - | 1.00 (hot-prefix) |",
		"| d | - | - | 1.70 (hot-prefix; its p50 0.80x the run's) |", "| e | - | - | **2.00 (mixed; its p50 1.30x the run's)** |"} {
		if !strings.Contains(b.String(), s) {
			t.Errorf("targets section lacks %q:\n%s", s, b.String())
		}
	}
}

// TestMatrixLength: -length N runs N times as many requests per matrix run, with the same shape.
func TestMatrixLength(t *testing.T) {
	for _, name := range matrixWorkloads {
		one, _ := generateWorkload(name, 1, workloadSize{matrix: true})
		two, _ := generateWorkload(name, 1, workloadSize{matrix: true, length: 2})
		if r := float64(two.NumRequests()) / float64(one.NumRequests()); r < 1.8 || r > 2.2 {
			t.Errorf("%s: length 2 has %d requests, length 1 %d; want about twice", name, two.NumRequests(), one.NumRequests())
		}
	}
	if _, err := parseOptions([]string{"-length", "2"}); err == nil {
		t.Error("-length without -matrix was accepted")
	}
}

// The verdict paired by seed divides each seed's figures by the same seed's figures of the stock policy
// with the best median. Here the seeds' loads differ (a light and a heavy mode) and llm's median falls on
// a heavy seed while least_conn's falls on a light one: the medians' ratio fails (1.59x), while llm is
// faster on four seeds of five and the median of the per-seed ratios is 0.89x.
func TestJudgeCellPaired(t *testing.T) {
	lc := [][2]float64{{1000, 4000}, {1000, 4200}, {1000, 4400}, {2000, 9000}, {2000, 9400}}
	llm := [][2]float64{{800, 3000}, {800, 3200}, {1500, 7000}, {1600, 8000}, {1600, 8500}}
	var runs []MatrixRun
	for i := range lc {
		runs = append(runs, MatrixRun{Seed: int64(i), Policies: []Summary{
			summaryOf("round_robin", 3000, 20000), summaryOf("least_conn", lc[i][0], lc[i][1]), summaryOf("llm", llm[i][0], llm[i][1])}})
	}
	c := judgeCell("r", "w", runs)
	if c.Pass || c.P99Ratio != 1.591 {
		t.Errorf("main verdict pass %v p99 ratio %v, want a loss at 7000/4400 = 1.591x", c.Pass, c.P99Ratio)
	}
	p := c.Paired
	if p == nil {
		t.Fatal("no paired verdict")
	}
	if !p.Pass || p.P99Ratio != 0.889 || p.P50Ratio != 0.8 || p.BestP99Policy != "least_conn" || p.SeedsPassing != 4 {
		t.Errorf("paired verdict %+v, want a pass: p99 0.889x (the median of 0.75, 0.76, 1.59, 0.89, 0.90), p50 0.8x, against least_conn, 4 seeds", *p)
	}
	if got := pairedVerdict([]MatrixCell{c}); !strings.Contains(got, "paired by seed (medians of the per-seed ratios to the best stock policy): llm passes 1 of 1") {
		t.Errorf("summary %q", got)
	}
	var md strings.Builder
	writePairedMarkdown(&md, MatrixResults{Cells: []MatrixCell{c}})
	if !strings.Contains(md.String(), "| r | w | least_conn / least_conn | 0.80 | 0.89 | 1.59 | 4/5 | PASS |") {
		t.Errorf("paired section:\n%s", md.String())
	}

	// A failed request of llm fails the paired verdict as it fails the main one.
	runs[0].Policies[2].Failed = 1
	if p := judgeCell("r", "w", runs).Paired; p == nil || p.Pass {
		t.Errorf("paired verdict %+v with a failed request, want a loss", p)
	}
	// A seed without llm's figures is left out of the pairing; a cell without llm is not judged.
	runs[0].Policies[2] = Summary{Policy: "llm", Skipped: "not run"}
	if p := judgeCell("r", "w", runs).Paired; p == nil || p.P99Ratio != 0.897 {
		t.Errorf("paired verdict %+v with seed 0 skipped, want the median of the other four ((0.889 + 0.904) / 2)", p)
	}
	for i := range runs {
		runs[i].Policies = runs[i].Policies[:2]
	}
	if c := judgeCell("r", "w", runs); c.Paired != nil || pairedVerdict([]MatrixCell{c}) != "" {
		t.Errorf("paired verdict %+v without llm, want none", c.Paired)
	}
}

// medianInterval is the sign test's interval: the k-th lowest to the k-th highest value, k the largest
// that leaves at least the level's confidence (twice a Binomial(n, 1/2) tail at most 1-level), none below
// 6 values at 95%.
func TestMedianInterval(t *testing.T) {
	seq := func(n int) []float64 { // n, n-1, ..., 1: unsorted on purpose
		xs := make([]float64, n)
		for i := range xs {
			xs[i] = float64(n - i)
		}
		return xs
	}
	for _, tc := range []struct {
		n        int
		level    float64
		ok       bool
		low, top float64
	}{
		{n: 3, level: 0.95},                             // 75% at most
		{n: 5, level: 0.95},                             // 93.75% at most
		{n: 5, level: 0.9, ok: true, low: 1, top: 5},    // the extremes: 93.75%
		{n: 6, level: 0.95, ok: true, low: 1, top: 6},   // 96.9%
		{n: 8, level: 0.95, ok: true, low: 1, top: 8},   // 99.2%; the 2nd: 1 - 2 x 9/256 = 93.0%
		{n: 12, level: 0.95, ok: true, low: 3, top: 10}, // 1 - 2 x 79/4096 = 96.1%; the 4th: 85.4%
		{n: 24, level: 0.95, ok: true, low: 7, top: 18}, // 97.7%; the 8th: 93.6%
	} {
		iv, ok := medianInterval(seq(tc.n), tc.level)
		if ok != tc.ok || (ok && (iv.Low != tc.low || iv.High != tc.top)) {
			t.Errorf("n %d level %v: %+v %v, want %v-%v %v", tc.n, tc.level, iv, ok, tc.low, tc.top, tc.ok)
		}
	}
}

// With enough seeds, the paired verdict carries 95% intervals of its medians and says what they settle:
// a cell whose ratios scatter around its threshold is a tie, one wholly past it a fail, one wholly within
// a pass, whatever its median says.
func TestJudgeCellPairedInterval(t *testing.T) {
	cell := func(p99 []float64) MatrixCell {
		var runs []MatrixRun
		for i, r := range p99 {
			runs = append(runs, MatrixRun{Seed: int64(i), Policies: []Summary{
				summaryOf("least_conn", 100, 1000), summaryOf("llm", 100, 1000*r)}})
		}
		return judgeCell("r", "w", runs)
	}
	for _, tc := range []struct {
		name    string
		p99     []float64
		pass    bool
		settled string
	}{
		// Median 1.01: a loss on the median, but the interval (0.98-1.06) holds 1.
		{"tie", []float64{0.94, 0.96, 0.98, 0.99, 1.0, 1.01, 1.01, 1.02, 1.04, 1.06, 1.08, 1.2}, false, "tie"},
		{"fail", []float64{1.02, 1.04, 1.05, 1.06, 1.08, 1.1, 1.1, 1.12, 1.15, 1.2, 1.3, 0.9}, false, "fail"},
		{"pass", []float64{0.7, 0.75, 0.8, 0.82, 0.85, 0.88, 0.9, 0.92, 0.95, 0.98, 1.1, 1.3}, true, "pass"},
		{"too few seeds", []float64{0.9, 0.95, 1.1}, true, ""},
	} {
		c := cell(tc.p99)
		p := c.Paired
		if p == nil || p.Pass != tc.pass || p.Settled != tc.settled {
			t.Errorf("%s: paired verdict %+v, want pass %v, settled %q", tc.name, p, tc.pass, tc.settled)
			continue
		}
		if tc.settled == "" {
			if p.P99Interval != nil || strings.Contains(pairedVerdict([]MatrixCell{c}), "confidence") {
				t.Errorf("%s: an interval from %d seeds: %+v", tc.name, len(tc.p99), p.P99Interval)
			}
			continue
		}
		if want := fmt.Sprintf("At 95%% confidence (1 cells): %d pass, %d ties, %d fail", btoi(tc.settled == "pass"), btoi(tc.settled == "tie"), btoi(tc.settled == "fail")); !strings.Contains(pairedVerdict([]MatrixCell{c}), want) {
			t.Errorf("%s: summary %q lacks %q", tc.name, pairedVerdict([]MatrixCell{c}), want)
		}
		var md strings.Builder
		writePairedMarkdown(&md, MatrixResults{Cells: []MatrixCell{c}})
		if row := fmt.Sprintf("| %s | %s | %s |", p.P50Interval, p.P99Interval, tc.settled); !strings.Contains(md.String(), row) {
			t.Errorf("%s: paired section lacks %q:\n%s", tc.name, row, md.String())
		}
	}
	if c := cell([]float64{0.94, 0.96, 0.98, 0.99, 1.0, 1.01, 1.01, 1.02, 1.04, 1.06, 1.08, 1.2}); c.Paired.P99Interval.Low != 0.98 || c.Paired.P99Interval.High != 1.06 {
		t.Errorf("p99 interval %+v, want the 3rd lowest to the 3rd highest of 12: 0.98-1.06", c.Paired.P99Interval)
	}
}

// tQuantile975 is Student's t at 97.5%: the table's values within 0.2%, the normal's far out.
func TestTQuantile975(t *testing.T) {
	for df, want := range map[int]float64{1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 10: 2.228, 30: 2.042, 104: 1.983, 100000: 1.960} {
		if got := tQuantile975(df); math.Abs(got-want) > 0.002*want {
			t.Errorf("t(0.975, %d) = %.4f, want %.3f", df, got, want)
		}
	}
}

// meanInterval is the geometric mean of the ratios with a t interval on their logs; none from one run.
func TestMeanInterval(t *testing.T) {
	logs := []float64{math.Log(0.9), math.Log(1.0), math.Log(1.1), math.Log(1.2)}
	g, ok := meanInterval(logs)
	mean, sd := 0.0, 0.0
	for _, x := range logs {
		mean += x / 4
	}
	for _, x := range logs {
		sd += (x - mean) * (x - mean) / 3
	}
	half := 3.182 * math.Sqrt(sd/4)
	if !ok || math.Abs(g.mean-math.Exp(mean)) > 1e-9 || math.Abs(g.low-math.Exp(mean-half)) > 0.002 || math.Abs(g.high-math.Exp(mean+half)) > 0.002 {
		t.Errorf("meanInterval = %+v %v, want %.4f (%.4f-%.4f)", g, ok, math.Exp(mean), math.Exp(mean-half), math.Exp(mean+half))
	}
	if _, ok := meanInterval(logs[:1]); ok {
		t.Error("an interval from one run")
	}
}

// TestTellSpeeds: llm-told's capacities are each backend's prefill speed over the prior's, times the
// time scale; a policy that does not ask gets the time scale alone whatever the speeds, and the told
// one keeps asking through scaleScrapes.
func TestTellSpeeds(t *testing.T) {
	told := policiesNamed([]string{"llm-told"})[0]
	dials := []string{"a:1", "b:2"}
	speeds := []float64{8000, 3300}
	capacities := func(p policy) map[string]float64 {
		var cfg struct {
			Capacities map[string]float64 `json:"capacities"`
		}
		if err := json.Unmarshal([]byte(p.JSON), &cfg); err != nil {
			t.Fatalf("%s: %v", p.JSON, err)
		}
		return cfg.Capacities
	}
	got := capacities(scalePrior(scaleScrapes(told, 5), 5, dials, speeds))
	if math.Abs(got["a:1"]-5) > 1e-9 || math.Abs(got["b:2"]-5*3300.0/8000) > 1e-9 {
		t.Errorf("llm-told capacities %v, want 5 and %v", got, 5*3300.0/8000)
	}
	if got := capacities(scalePrior(policiesNamed([]string{"llm"})[0], 5, dials, speeds)); got["a:1"] != 5 || got["b:2"] != 5 {
		t.Errorf("llm capacities %v with speeds given, want the time scale for both", got)
	}
}
