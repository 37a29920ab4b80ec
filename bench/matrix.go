package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"strings"
	"text/tabwriter"
	"time"
)

// Pass thresholds of a matrix cell: llm's median TTFT p99 at most the best stock policy's, its
// p50 at most 5% above.
const (
	passP99Ratio = 1.0
	passP50Ratio = 1.05
)

// MatrixRun is one seed of one matrix cell: every policy's figures.
type MatrixRun struct {
	Regime      string    `json:"regime"`
	Workload    string    `json:"workload"`
	Seed        int64     `json:"seed"`
	Load        float64   `json:"load"`
	TimeScale   float64   `json:"time_scale"`
	Requests    int       `json:"requests"`
	Warmup      int       `json:"warmup_requests"`
	CapacityRPS float64   `json:"capacity_rps"`
	BackendRPS  []float64 `json:"backend_capacity_rps"`
	RateRPS     float64   `json:"rate_rps"`
	Policies    []Summary `json:"policies"`
	Notes       []string  `json:"notes,omitempty"`
}

// PolicyMedian is one policy's figures in a cell, each the median over the cell's seeds.
type PolicyMedian struct {
	Policy  string  `json:"policy"`
	Seeds   int     `json:"seeds"`
	TTFTP50 float64 `json:"ttft_p50_ms"`
	TTFTP99 float64 `json:"ttft_p99_ms"`
	E2EP50  float64 `json:"e2e_p50_ms"`
	// NetTTFTP50 and NetTTFTP99 are the TTFT percentiles with the proxy's own time counted once
	// (Summary.NetTTFTP50), and ProxyP50 that time's median in wall milliseconds; zero when unknown.
	NetTTFTP50 float64 `json:"net_ttft_p50_ms,omitempty"`
	NetTTFTP99 float64 `json:"net_ttft_p99_ms,omitempty"`
	// LateTTFTP50 and LateTTFTP99 are those of the requests sent after each run's first quarter
	// (Summary.LateTTFTP50); zero when unknown (results.json written before they were).
	LateTTFTP50 float64 `json:"late_ttft_p50_ms,omitempty"`
	LateTTFTP99 float64 `json:"late_ttft_p99_ms,omitempty"`
	ProxyP50    float64 `json:"proxy_p50_wall_ms,omitempty"`
	HitRate     float64 `json:"cache_hit_rate"`
	// MaxShare is the busiest backend's requests divided by its fair share, the share its
	// estimated capacity gives it (equal shares on a uniform cluster).
	MaxShare float64 `json:"max_backend_share"`
	// BusiestTTFT is that backend's TTFT median over the run's (Summary.BackendTTFTP50), the median
	// over seeds: below 1 where the requests concentrated there were answered sooner than the run's
	// median request. 0 when unknown (runs recorded before it was).
	BusiestTTFT float64 `json:"busiest_ttft_ratio,omitempty"`
	Failed      int     `json:"failed"`
}

// MatrixCell is the verdict on llm in one regime and workload.
type MatrixCell struct {
	Regime   string `json:"regime"`
	Workload string `json:"workload"`
	// Requests are the measured (non-warm-up) requests of one run of one policy.
	Requests int            `json:"requests_per_run"`
	Seeds    int            `json:"seeds"`
	RateRPS  float64        `json:"rate_rps"`
	Policies []PolicyMedian `json:"policies"`
	// Verdict is llm's standing on the measured TTFTs; its fields are the cell's own in JSON.
	Verdict
	// Net is the same verdict on TTFT with the proxy's own wall time counted once instead of
	// time-scale times (Summary.NetTTFTP50): the decision, without the harness's magnification of
	// the time the policy takes to read and tokenize a request. Nil when the runs do not have it.
	Net *Verdict `json:"net,omitempty"`
	// Late is the same verdict on the requests sent after each run's first quarter
	// (Summary.LateTTFTP50): the start from cold caches and unlearned models left out. Nil when the
	// runs do not have it.
	Late *Verdict `json:"late,omitempty"`
	// Paired is the verdict on the same figures paired by seed: llm's ratios are the medians over the
	// seeds of llm's figure over the same seed's figure of the stock policy whose median is best (its
	// BestP50Policy and BestP99Policy), the two measured on one workload, one arrival sequence and one
	// set of backends. The main verdict divides medians taken apart, and where the seeds' loads differ
	// widely (agentic: a seed's p99 is 4 s or 9 s, whichever the policy) those medians can fall on
	// different seeds: fast-prefill agentic, 24 seeds, llm's p99 below least_conn's on 20 of them, its
	// median 1.23x least_conn's median (docs/bench/paired-verdict). Nil when the cell is not judged.
	Paired *Verdict `json:"paired,omitempty"`
}

// Verdict is llm's standing in a cell on one kind of TTFT figure: the best stock policy's p50 and
// p99 (and which policies those were), llm's ratios to them, the verdict on the medians and on how
// many seeds llm passes.
type Verdict struct {
	// BestP50 and BestP99 are the best stock policy's median TTFT p50 and p99, and which policy
	// that was (they may differ); P50Ratio and P99Ratio are llm's divided by them.
	BestP50       float64 `json:"best_stock_ttft_p50_ms"`
	BestP50Policy string  `json:"best_stock_p50_policy"`
	BestP99       float64 `json:"best_stock_ttft_p99_ms"`
	BestP99Policy string  `json:"best_stock_p99_policy"`
	P50Ratio      float64 `json:"llm_p50_ratio"`
	P99Ratio      float64 `json:"llm_p99_ratio"`
	// Judged is false when llm or every stock policy is missing from the cell.
	Judged bool `json:"judged"`
	Pass   bool `json:"pass"`
	// SeedsPassing is on how many of the cell's seeds llm passes against that seed's best stock
	// figures (the same thresholds): how much the verdict on the medians is worth. Identical runs of
	// the stock policies move a cell's figures by 10-55%, so a median verdict that one seed of three
	// carries is a tie, not a win or a loss.
	SeedsPassing int `json:"seeds_passing"`
	// P50Interval and P99Interval are 95% confidence intervals of the paired ratios' medians (paired
	// verdicts only, from intervalSeeds seeds on; medianInterval), and Settled says what they settle:
	// "pass" where both lie within their thresholds, "fail" where either lies wholly past its own (or llm
	// failed a request), "tie" otherwise (a threshold inside an interval: these seeds cannot tell which
	// side the cell is on).
	P50Interval *Interval `json:"llm_p50_ratio_ci95,omitempty"`
	P99Interval *Interval `json:"llm_p99_ratio_ci95,omitempty"`
	Settled     string    `json:"settled_at_95,omitempty"`
}

// Interval is a confidence interval of a ratio.
type Interval struct {
	Low  float64 `json:"low"`
	High float64 `json:"high"`
}

// String is iv as the report prints it.
func (iv Interval) String() string { return fmt.Sprintf("%.2f-%.2f", iv.Low, iv.High) }

// intervalLevel is the confidence of Verdict's intervals, and intervalSeeds the fewest seeds that give
// one at that level (medianInterval: with 5, the widest interval, the lowest ratio to the highest, holds
// the median with 94% confidence).
const (
	intervalLevel = 0.95
	intervalSeeds = 6
)

// medianInterval is a distribution-free confidence interval of at least level for the median of the
// population xs is a sample of: the k-th lowest and k-th highest of xs, k the largest for which the
// chance that the median lies outside them, twice a Binomial(n, 1/2) tail, is at most 1-level (the sign
// test's interval; it assumes independent draws, nothing of their shape). With 12 seeds it is the 3rd
// lowest to the 3rd highest (96%), with 24 the 7th (98%). ok is false for too few values (5 or fewer at
// 95%).
func medianInterval(xs []float64, level float64) (iv Interval, ok bool) {
	n := len(xs)
	k, tail, p := 0, 0.0, math.Pow(0.5, float64(n)) // p is P(B = j) for j = k below
	for j := 0; 2*(j+1) <= n; j++ {
		tail += p // P(B <= j): the chance the median lies below the (j+1)-th lowest
		if 1-2*tail < level {
			break
		}
		k = j + 1
		p *= float64(n-j) / float64(j+1)
	}
	if k == 0 {
		return Interval{}, false
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	return Interval{Low: round3(s[k-1]), High: round3(s[n-k])}, true
}

// settle sets what the paired intervals of v settle (Verdict.Settled), of runs in which llm failed
// failed requests (any is a fail, as for the verdict).
func (v *Verdict) settle(failed int) {
	switch {
	case failed > 0:
		v.Settled = "fail"
	case v.P50Interval.High <= passP50Ratio && v.P99Interval.High <= passP99Ratio:
		v.Settled = "pass"
	case v.P50Interval.Low > passP50Ratio || v.P99Interval.Low > passP99Ratio:
		v.Settled = "fail"
	default:
		v.Settled = "tie"
	}
}

// ttftFigures picks the TTFT p50 and p99 a verdict is on, from one run's summary or from a cell's
// medians.
type ttftFigures struct {
	run    func(Summary) (p50, p99 float64)
	median func(PolicyMedian) (p50, p99 float64)
}

var (
	rawTTFT = ttftFigures{
		run:    func(s Summary) (float64, float64) { return s.TTFTP50, s.TTFTP99 },
		median: func(p PolicyMedian) (float64, float64) { return p.TTFTP50, p.TTFTP99 },
	}
	netTTFT = ttftFigures{
		run:    func(s Summary) (float64, float64) { return s.NetTTFTP50, s.NetTTFTP99 },
		median: func(p PolicyMedian) (float64, float64) { return p.NetTTFTP50, p.NetTTFTP99 },
	}
	lateTTFT = ttftFigures{
		run:    func(s Summary) (float64, float64) { return s.LateTTFTP50, s.LateTTFTP99 },
		median: func(p PolicyMedian) (float64, float64) { return p.LateTTFTP50, p.LateTTFTP99 },
	}
)

// RegimeInfo is a regime as results.json records it.
type RegimeInfo struct {
	Name        string        `json:"name"`
	Description string        `json:"description"`
	Backends    []simSettings `json:"backends"`
}

// runHeader is what results.json of -matrix and -goodput, and faults.json of -faults, record about the
// run before its figures.
type runHeader struct {
	Command  string  `json:"command"`
	Started  string  `json:"started"`
	Machine  string  `json:"machine"`
	Seeds    []int64 `json:"seeds"`
	Backends int     `json:"backends"`
	Load     float64 `json:"load"`
}

// MatrixResults is results.json of -matrix and -goodput.
type MatrixResults struct {
	runHeader
	// Length is -length: the sessions of a run, as a multiple of the matrix's own size.
	Length      int            `json:"length"`
	TimeScale   float64        `json:"time_scale"`
	Regimes     []RegimeInfo   `json:"regimes"`
	Runs        []MatrixRun    `json:"runs"`
	Cells       []MatrixCell   `json:"cells,omitempty"`
	Goodput     []GoodputCurve `json:"goodput,omitempty"`
	WallSeconds float64        `json:"wall_seconds"`
	Notes       []string       `json:"notes,omitempty"`
}

// matrixJob is one cell and seed to run.
type matrixJob struct {
	regime   regime
	workload Workload
	seed     int64
	load     float64
}

// runMatrixMode runs -matrix or -goodput and writes their outputs.
func runMatrixMode(ctx context.Context, o options, res Results, started time.Time) error {
	mr := MatrixResults{
		runHeader: runHeader{Command: res.Command, Started: res.Started, Machine: res.Machine, Backends: o.backends, Load: o.load},
		Length:    max(o.length, 1),
	}
	if o.timeScaleSet {
		mr.TimeScale = o.sim.TimeScale
	}
	for i := range o.seeds {
		mr.Seeds = append(mr.Seeds, o.seed+int64(i))
	}
	for _, r := range o.regimes {
		mr.Regimes = append(mr.Regimes, RegimeInfo{Name: r.Name, Description: r.Description, Backends: r.build(o.backends, o.sim)})
	}
	if o.goodput {
		curves, err := runGoodput(ctx, o, &mr)
		if err != nil {
			return err
		}
		mr.Goodput = curves
		for _, c := range curves {
			fmt.Println(c.describe())
		}
	} else {
		if err := runMatrix(ctx, o, &mr); err != nil {
			return err
		}
		mr.Cells = judgeCells(mr.Runs)
		fmt.Println()
		writeMatrixTable(os.Stdout, mr.Cells)
		fmt.Println(matrixVerdict(mr.Cells))
		printSubVerdicts(mr.Cells)
	}
	mr.WallSeconds = round3(time.Since(started).Seconds())
	if err := writeMatrixOutputs(o.out, mr); err != nil {
		return err
	}
	fmt.Printf("\nwall time %.1fs; results in %s\n", mr.WallSeconds, o.out)
	return nil
}

// runMatrix runs every regime x workload x seed with every policy, appending to mr.Runs.
func runMatrix(ctx context.Context, o options, mr *MatrixResults) error {
	var jobs []matrixJob
	total := 0
	for _, r := range o.regimes {
		for _, name := range o.workloads {
			for _, seed := range mr.Seeds {
				w, err := generateWorkload(name, seed, o.size())
				if err != nil {
					return err
				}
				jobs = append(jobs, matrixJob{regime: r, workload: w, seed: seed, load: o.load})
				total += w.NumRequests() * len(o.policies)
			}
		}
	}
	prog := newProgress(os.Stderr, total)
	defer prog.finish()
	for _, j := range jobs {
		if err := ctx.Err(); err != nil {
			return err
		}
		mr.Runs = append(mr.Runs, runMatrixJob(ctx, o, j, prog))
	}
	return nil
}

// matrixTimeScales are the time scales of the matrix workloads (unless -timescale is set): as fast
// as the measurement allows. A wall millisecond of scheduling lag is timeScale simulated
// milliseconds of error, so the workloads with TTFTs near 100 ms run at 5x, agentic (TTFTs of
// seconds, 1 s prefill steps, long runs) at 30x.
var matrixTimeScales = map[string]float64{"shared-prefix": 5, "hot-prefix": 5, "multi-turn-think": 10, "mixed": 10, "agentic": 30}

// runMatrixJob runs one cell and seed with every policy.
func runMatrixJob(ctx context.Context, o options, j matrixJob, prog *progress) MatrixRun {
	oj := o
	oj.seed, oj.load = j.seed, j.load
	if ts, ok := matrixTimeScales[j.workload.Name]; ok && !o.timeScaleSet {
		oj.sim.TimeScale = ts
	}
	sims, notes := fitKV(j.regime.build(o.backends, oj.sim), j.workload)
	w := j.workload
	name := w.Name
	w.Name = fmt.Sprintf("%s/%s/seed %d/load %.2f", j.regime.Name, name, j.seed, j.load)
	wr := runWorkload(ctx, oj, sims, w, prog)
	return MatrixRun{
		Regime:      j.regime.Name,
		Workload:    name,
		Seed:        j.seed,
		Load:        j.load,
		TimeScale:   oj.sim.TimeScale,
		Requests:    wr.Requests,
		Warmup:      wr.Warmup,
		CapacityRPS: round3(wr.CapacityRPS),
		BackendRPS:  roundAll(wr.BackendRPS),
		RateRPS:     round3(wr.RateRPS),
		Policies:    wr.Policies,
		Notes:       append(notes, wr.Notes...),
	}
}

func roundAll(xs []float64) []float64 {
	out := make([]float64, len(xs))
	for i, x := range xs {
		out[i] = round3(x)
	}
	return out
}

// median returns the median of xs (the mean of the middle two for an even count), NaN for none.
func median(xs []float64) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// maxShare returns the busiest backend's requests divided by its fair share (total requests times its
// part of the cluster's capacity: equal parts when capacity is nil or does not match), and its index
// (-1: no requests).
func maxShare(requests []int, capacity []float64) (share float64, busiest int) {
	total, capSum := 0, 0.0
	for _, n := range requests {
		total += n
	}
	if len(capacity) == len(requests) {
		for _, c := range capacity {
			capSum += c
		}
	}
	if total == 0 {
		return 0, -1
	}
	busiest = -1
	for i, n := range requests {
		part := 1 / float64(len(requests))
		if capSum > 0 {
			part = capacity[i] / capSum
		}
		if v := float64(n) / (float64(total) * part); busiest < 0 || v > share {
			share, busiest = v, i
		}
	}
	return share, busiest
}

// judgeCells groups runs by regime and workload (in first-seen order), takes each policy's
// medians over seeds and judges llm against the best stock policy.
func judgeCells(runs []MatrixRun) []MatrixCell {
	type key struct{ regime, workload string }
	var order []key
	byCell := map[key][]MatrixRun{}
	for _, r := range runs {
		k := key{r.Regime, r.Workload}
		if _, ok := byCell[k]; !ok {
			order = append(order, k)
		}
		byCell[k] = append(byCell[k], r)
	}
	cells := make([]MatrixCell, 0, len(order))
	for _, k := range order {
		cells = append(cells, judgeCell(k.regime, k.workload, byCell[k]))
	}
	return cells
}

// judgeCell computes one cell's medians and verdict from its runs (one per seed).
func judgeCell(regime, workload string, runs []MatrixRun) MatrixCell {
	c := MatrixCell{Regime: regime, Workload: workload, Seeds: len(runs)}
	var rates []float64
	var names []string
	samples := map[string][]Summary{}
	shares := map[string][]float64{}
	busiestTTFT := map[string][]float64{} // the busiest backend's TTFT p50 over the run's, per policy
	for _, r := range runs {
		c.Requests = r.Requests - r.Warmup
		rates = append(rates, r.RateRPS)
		for _, s := range r.Policies {
			if s.Skipped != "" {
				continue
			}
			if _, ok := samples[s.Policy]; !ok {
				names = append(names, s.Policy)
			}
			samples[s.Policy] = append(samples[s.Policy], s)
			share, busiest := maxShare(s.BackendRequests, r.BackendRPS)
			shares[s.Policy] = append(shares[s.Policy], share)
			if busiest >= 0 && busiest < len(s.BackendTTFTP50) && s.BackendTTFTP50[busiest] > 0 && s.TTFTP50 > 0 {
				busiestTTFT[s.Policy] = append(busiestTTFT[s.Policy], s.BackendTTFTP50[busiest]/s.TTFTP50)
			}
		}
	}
	c.RateRPS = round3(median(rates))
	for _, name := range names {
		ss := samples[name]
		pick := func(f func(Summary) float64) float64 {
			xs := make([]float64, len(ss))
			for i, s := range ss {
				xs[i] = f(s)
			}
			return round3(median(xs))
		}
		pm := PolicyMedian{
			Policy:      name,
			Seeds:       len(ss),
			TTFTP50:     pick(func(s Summary) float64 { return s.TTFTP50 }),
			TTFTP99:     pick(func(s Summary) float64 { return s.TTFTP99 }),
			E2EP50:      pick(func(s Summary) float64 { return s.E2EP50 }),
			NetTTFTP50:  pick(func(s Summary) float64 { return s.NetTTFTP50 }),
			NetTTFTP99:  pick(func(s Summary) float64 { return s.NetTTFTP99 }),
			LateTTFTP50: pick(func(s Summary) float64 { return s.LateTTFTP50 }),
			LateTTFTP99: pick(func(s Summary) float64 { return s.LateTTFTP99 }),
			ProxyP50:    pick(func(s Summary) float64 { return s.ProxyP50 }),
			HitRate:     pick(func(s Summary) float64 { return s.CacheHitRate }),
			MaxShare:    round3(median(shares[name])),
		}
		if xs := busiestTTFT[name]; len(xs) > 0 {
			pm.BusiestTTFT = round3(median(xs))
		}
		for _, s := range ss {
			pm.Failed += s.Failed
		}
		c.Policies = append(c.Policies, pm)
	}
	c.Verdict = c.judge(runs, rawTTFT)
	if net := c.judge(runs, netTTFT); net.Judged {
		c.Net = &net
	}
	if late := c.judge(runs, lateTTFT); late.Judged {
		c.Late = &late
	}
	if c.Judged {
		paired := c.Verdict.paired(runs, rawTTFT)
		c.Paired = &paired
	}
	return c
}

// paired is v, judged on the medians over runs of llm's figures f over those of v's best stock policies
// in the same run (Verdict.Paired). A run without either figure is left out; with none left, the
// verdict is not judged.
func (v Verdict) paired(runs []MatrixRun, f ttftFigures) Verdict {
	var r50, r99 []float64
	failed := 0
	for _, r := range runs {
		var llm50, llm99, b50, b99 float64
		for _, s := range r.Policies {
			if s.Skipped != "" {
				continue
			}
			p50, p99 := f.run(s)
			switch s.Policy {
			case judgedPolicy:
				llm50, llm99 = p50, p99
				failed += s.Failed
			case v.BestP50Policy:
				b50 = p50
			}
			if s.Policy == v.BestP99Policy {
				b99 = p99
			}
		}
		if llm50 > 0 && llm99 > 0 && b50 > 0 && b99 > 0 {
			r50, r99 = append(r50, llm50/b50), append(r99, llm99/b99)
		}
	}
	if len(r99) == 0 {
		return Verdict{BestP50Policy: v.BestP50Policy, BestP99Policy: v.BestP99Policy}
	}
	p := v
	p.P50Ratio, p.P99Ratio = round3(median(r50)), round3(median(r99))
	p.Pass = passes(p.P50Ratio, p.P99Ratio, failed)
	if i50, ok := medianInterval(r50, intervalLevel); ok {
		i99, _ := medianInterval(r99, intervalLevel) // as many as r50
		p.P50Interval, p.P99Interval = &i50, &i99
		p.settle(failed)
	}
	return p
}

// judge is the verdict on llm in the cell on the figures f of its medians and runs: not judged
// when llm or every stock policy lacks them.
func (c MatrixCell) judge(runs []MatrixRun, f ttftFigures) Verdict {
	var v Verdict
	llm, ok := c.policy(judgedPolicy)
	for _, name := range stockPolicies {
		s, found := c.policy(name)
		p50, p99 := f.median(s)
		if !found || p50 <= 0 || p99 <= 0 { // missing, or without these figures (nothing answered)
			continue
		}
		if v.BestP50Policy == "" || p50 < v.BestP50 {
			v.BestP50, v.BestP50Policy = p50, name
		}
		if v.BestP99Policy == "" || p99 < v.BestP99 {
			v.BestP99, v.BestP99Policy = p99, name
		}
	}
	llm50, llm99 := f.median(llm)
	if !ok || v.BestP50Policy == "" || llm50 <= 0 || llm99 <= 0 {
		return v
	}
	v.Judged = true
	v.P50Ratio = round3(llm50 / v.BestP50)
	v.P99Ratio = round3(llm99 / v.BestP99)
	v.Pass = passes(v.P50Ratio, v.P99Ratio, llm.Failed)
	for _, r := range runs {
		if seedPasses(r.Policies, f) {
			v.SeedsPassing++
		}
	}
	return v
}

// seedPasses reports whether llm passes against the best stock figures f of one seed's run.
func seedPasses(ps []Summary, f ttftFigures) bool {
	var llm *Summary
	best50, best99 := math.Inf(1), math.Inf(1)
	for i := range ps {
		s := &ps[i]
		switch p50, p99 := f.run(*s); {
		case s.Skipped != "":
		case s.Policy == judgedPolicy:
			llm = s
		case slices.Contains(stockPolicies, s.Policy) && p50 > 0 && p99 > 0:
			best50, best99 = min(best50, p50), min(best99, p99)
		}
	}
	if llm == nil || math.IsInf(best99, 1) {
		return false
	}
	p50, p99 := f.run(*llm)
	return p50 > 0 && p99 > 0 && passes(p50/best50, p99/best99, llm.Failed)
}

// passes is the verdict on llm's TTFT ratios to the best stock policy's, with failed requests lost.
func passes(p50Ratio, p99Ratio float64, failed int) bool {
	return p99Ratio <= passP99Ratio && p50Ratio <= passP50Ratio && failed == 0
}

// policy returns the cell's medians of the named policy.
func (c MatrixCell) policy(name string) (PolicyMedian, bool) {
	for _, p := range c.Policies {
		if p.Policy == name {
			return p, true
		}
	}
	return PolicyMedian{}, false
}

// verdictWord is PASS, FAIL or "-" (not judged); a cell's is its main verdict's.
func (v Verdict) verdictWord() string {
	switch {
	case !v.Judged:
		return "-"
	case v.Pass:
		return "PASS"
	}
	return "FAIL"
}

// verdictTally counts the cells' verdicts of one kind: how many were judged and passed, how many pass
// on every seed and on none, and which fail (regime/workload).
type verdictTally struct {
	judged, passed, every, none int
	failed                      []string
}

// tallyVerdicts counts the verdicts of returns for each cell (nil: the cell has none of that kind).
func tallyVerdicts(cells []MatrixCell, of func(MatrixCell) *Verdict) verdictTally {
	var t verdictTally
	for _, c := range cells {
		v := of(c)
		if v == nil {
			continue
		}
		t.judged++
		switch v.SeedsPassing {
		case c.Seeds:
			t.every++
		case 0:
			t.none++
		}
		if v.Pass {
			t.passed++
		} else {
			t.failed = append(t.failed, c.Regime+"/"+c.Workload)
		}
	}
	return t
}

// matrixVerdict is the one-line summary: how many judged cells pass.
func matrixVerdict(cells []MatrixCell) string {
	t := tallyVerdicts(cells, func(c MatrixCell) *Verdict {
		if !c.Judged {
			return nil
		}
		return &c.Verdict
	})
	v := fmt.Sprintf("verdict: %s passes %d of %d cells (TTFT p99 <= %.2fx and p50 <= %.2fx the best of %s)",
		judgedPolicy, t.passed, t.judged, passP99Ratio, passP50Ratio, strings.Join(stockPolicies, "/"))
	if len(t.failed) > 0 {
		v += "; fails " + strings.Join(t.failed, ", ")
	}
	if t.judged > 0 {
		v += fmt.Sprintf(". Seed by seed: passes on every seed in %d cells, on none in %d, the seeds disagree in %d", t.every, t.none, t.judged-t.every-t.none)
	}
	return v
}

// netVerdict is the one-line summary of the verdicts on TTFT net of the proxy's own time (empty when
// no cell has them).
func netVerdict(cells []MatrixCell) string {
	return subVerdict(cells, func(c MatrixCell) *Verdict { return c.Net }, "net of the proxy's own time (counted once, not time-scale times)")
}

// lateVerdict is the one-line summary of the verdicts on the requests sent after each run's first
// quarter (empty when no cell has them).
func lateVerdict(cells []MatrixCell) string {
	return subVerdict(cells, func(c MatrixCell) *Verdict { return c.Late }, fmt.Sprintf("after the first %.0f%% of each run", 100*lateFraction))
}

// pairedVerdict is the one-line summary of the verdicts paired by seed (empty when no cell has them).
// It ends with what the cells' 95% intervals settle (Verdict.Settled), where the seeds give them.
func pairedVerdict(cells []MatrixCell) string {
	v := subVerdict(cells, func(c MatrixCell) *Verdict { return c.Paired }, "paired by seed (medians of the per-seed ratios to the best stock policy)")
	settled := map[string][]string{}
	n := 0
	for _, c := range cells {
		if c.Paired != nil && c.Paired.Settled != "" {
			settled[c.Paired.Settled] = append(settled[c.Paired.Settled], c.Regime+"/"+c.Workload)
			n++
		}
	}
	if v == "" || n == 0 {
		return v
	}
	v += fmt.Sprintf(". At %.0f%% confidence (%d cells): %d pass, %d ties, %d fail", 100*intervalLevel, n,
		len(settled["pass"]), len(settled["tie"]), len(settled["fail"]))
	if f := settled["fail"]; len(f) > 0 {
		v += " (" + strings.Join(f, ", ") + ")"
	}
	return v
}

// subVerdict is the one-line summary of the cells' verdicts of one kind, of, said to be on what
// label names (empty when no cell has one).
func subVerdict(cells []MatrixCell, of func(MatrixCell) *Verdict, label string) string {
	t := tallyVerdicts(cells, of)
	if t.judged == 0 {
		return ""
	}
	v := fmt.Sprintf("%s: %s passes %d of %d cells", label, judgedPolicy, t.passed, t.judged)
	if len(t.failed) > 0 {
		v += "; fails " + strings.Join(t.failed, ", ")
	}
	return v + fmt.Sprintf(". Seed by seed: every seed in %d cells, none in %d, the seeds disagree in %d", t.every, t.none, t.judged-t.every-t.none)
}

// The workload targets the regime matrix was built to show, each against least_conn in the same
// regime: a shared prefix is kept where it is cached (TTFT p50 at most 0.30x), a hot one is replicated
// and balanced (TTFT p99 at most 0.80x), and no backend serves more than 1.5x its fair share.
const (
	sharedPrefixP50Target = 0.30
	hotPrefixP99Target    = 0.80
	maxShareTarget        = 1.5
)

// targetRow is one regime's standing on the workload targets; a ratio is 0 when its cell or one of
// its two policies is missing.
type targetRow struct {
	regime                        string
	sharedP50, hotP99             float64 // llm over least_conn
	oracleSharedP50, oracleHotP99 float64 // the oracle's over least_conn: what reading the true caches and queues gives
	maxShare                      float64 // llm's busiest backend over its fair share, the largest over the regime's cells
	maxShareCell                  string  // the workload of that cell
	busiestTTFT                   float64 // that cell's PolicyMedian.BusiestTTFT (0: unknown)
	sharedPass, hotPass           bool
}

// sharePasses reports whether the busiest backend's share meets its target: at most maxShareTarget, or
// above it with the requests it took answered no later than its run's median request.
func (r targetRow) sharePasses() bool {
	return r.maxShare <= maxShareTarget || r.busiestTTFT > 0 && r.busiestTTFT <= 1
}

// targetRows computes the workload targets per regime, in the cells' order.
func targetRows(cells []MatrixCell) []targetRow {
	var rows []targetRow
	row := func(regime string) *targetRow {
		for i := range rows {
			if rows[i].regime == regime {
				return &rows[i]
			}
		}
		rows = append(rows, targetRow{regime: regime})
		return &rows[len(rows)-1]
	}
	for _, c := range cells {
		llm, okL := c.policy(judgedPolicy)
		if !okL {
			continue
		}
		r := row(c.Regime)
		if llm.MaxShare > r.maxShare {
			r.maxShare, r.maxShareCell, r.busiestTTFT = llm.MaxShare, c.Workload, llm.BusiestTTFT
		}
		lc, okC := c.policy("least_conn")
		if !okC {
			continue
		}
		oracle, okO := c.policy("oracle")
		// versus returns llm's and the oracle's figure over least_conn's (the oracle's 0 when it did not
		// run), and whether llm's meets target; all zero when least_conn's figure is.
		versus := func(figure func(PolicyMedian) float64, target float64) (ratio, oracleRatio float64, pass bool) {
			base := figure(lc)
			if base <= 0 {
				return 0, 0, false
			}
			ratio = figure(llm) / base
			if okO {
				oracleRatio = figure(oracle) / base
			}
			return ratio, oracleRatio, ratio <= target
		}
		switch c.Workload {
		case "shared-prefix":
			r.sharedP50, r.oracleSharedP50, r.sharedPass = versus(func(p PolicyMedian) float64 { return p.TTFTP50 }, sharedPrefixP50Target)
		case "hot-prefix":
			r.hotP99, r.oracleHotP99, r.hotPass = versus(func(p PolicyMedian) float64 { return p.TTFTP99 }, hotPrefixP99Target)
		}
	}
	return rows
}

// writeTargetsMarkdown writes the section on the workload targets.
func writeTargetsMarkdown(out io.Writer, cells []MatrixCell) {
	rows := targetRows(cells)
	if len(rows) == 0 {
		return
	}
	fmt.Fprintf(out, "\n## Workload targets against least_conn\n\n"+
		"Shared-prefix TTFT p50 at most %.2fx `least_conn`'s (a group's prefix stays where it is cached), hot-prefix TTFT p99 at most %.2fx "+
		"(the hot prefix is replicated and balanced), and no backend over %.1fx its fair share (the largest over the regime's cells) "+
		"unless it is faster for the requests it takes: after the cell, the busiest backend's TTFT p50 over its run's (the median over seeds; "+
		"at most 1, its requests were answered sooner than the run's median request, and the share passes). Medians over seeds; "+
		"in brackets the oracle's ratio (it routes on the true caches and queues; no bound on what a router can do, but where it misses a target too, knowing where every prefix is cached did not meet it).\n\n",
		sharedPrefixP50Target, hotPrefixP99Target, maxShareTarget)
	fmt.Fprintf(out, "| regime | shared-prefix p50 ratio (oracle) | hot-prefix p99 ratio (oracle) | llm max share |\n|---|---|---|---|\n")
	mark := func(v, oracle float64, pass bool) string {
		if v == 0 {
			return "-"
		}
		s := fmt.Sprintf("%.2f", v)
		if !pass {
			s = "**" + s + "**"
		}
		if oracle > 0 {
			s += fmt.Sprintf(" (%.2f)", oracle)
		}
		return s
	}
	for _, r := range rows {
		share := "-"
		if r.maxShareCell != "" {
			share = fmt.Sprintf("%.2f (%s)", r.maxShare, r.maxShareCell)
			if r.busiestTTFT > 0 {
				share = fmt.Sprintf("%.2f (%s; its p50 %.2fx the run's)", r.maxShare, r.maxShareCell, r.busiestTTFT)
			}
		}
		if !r.sharePasses() {
			share = "**" + share + "**"
		}
		fmt.Fprintf(out, "| %s | %s | %s | %s |\n", r.regime, mark(r.sharedP50, r.oracleSharedP50, r.sharedPass), mark(r.hotP99, r.oracleHotP99, r.hotPass), share)
	}
}

// printSubVerdicts prints the one-line summaries paired by seed, net of the proxy's time and after each
// run's first quarter, those the cells have.
func printSubVerdicts(cells []MatrixCell) {
	for _, v := range []string{pairedVerdict(cells), netVerdict(cells), lateVerdict(cells)} {
		if v != "" {
			fmt.Println(v)
		}
	}
}

// subSection starts the report's section on one kind of sub-verdict: its title, its one-line summary v,
// what it judges (intro) and its table's header row. It writes nothing and reports false when v is
// empty (no cell has that verdict).
func subSection(out io.Writer, title, v, intro string, columns ...string) bool {
	if v == "" {
		return false
	}
	fmt.Fprintf(out, "\n## %s\n\n**%s**\n\n%s\n\n", title, v, intro)
	writeTableHeader(out, columns)
	return true
}

// writeLateMarkdown writes the section on the requests sent after each run's first quarter: the
// verdicts without the start from cold caches and unlearned models.
func writeLateMarkdown(out io.Writer, mr MatrixResults) {
	if !subSection(out, fmt.Sprintf("After the first %.0f%% of each run", 100*lateFraction), lateVerdict(mr.Cells),
		fmt.Sprintf("Every run starts from cold: empty caches on the backends, and a bare `llm` policy that has learned nothing of them (their slot counts "+
			"from its scrapes, their speeds from requests that end). Here each run's TTFTs are those of the requests sent after its first %.0f%% (in send order): "+
			"how the policies compare once each has seen traffic. A run of the matrix's own length spends much of that quarter with queues still forming; "+
			"`-length` makes the later part longer.", 100*lateFraction),
		"regime", "workload", "llm p50", "best stock p50", "p50 ratio", "llm p99", "best stock p99", "p99 ratio", "p99 / least_conn", "seeds passing", "verdict") {
		return
	}
	for _, c := range mr.Cells {
		if c.Late == nil {
			continue
		}
		llm, _ := c.policy(judgedPolicy)
		lc := "-"
		if p, ok := c.policy("least_conn"); ok && p.LateTTFTP99 > 0 {
			lc = fmt.Sprintf("%.2f", llm.LateTTFTP99/p.LateTTFTP99)
		}
		fmt.Fprintf(out, "| %s | %s | %s | %s (%s) | %.2f | %s | %s (%s) | %.2f | %s | %d/%d | %s |\n", c.Regime, c.Workload,
			f0(llm.LateTTFTP50), f0(c.Late.BestP50), c.Late.BestP50Policy, c.Late.P50Ratio,
			f0(llm.LateTTFTP99), f0(c.Late.BestP99), c.Late.BestP99Policy, c.Late.P99Ratio, lc, c.Late.SeedsPassing, c.Seeds, c.Late.verdictWord())
	}
}

// writePairedMarkdown writes the section on the verdicts paired by seed.
func writePairedMarkdown(out io.Writer, mr MatrixResults) {
	if !subSection(out, "Paired by seed", pairedVerdict(mr.Cells),
		"The table above divides `llm`'s median over the seeds by the best stock policy's median, each taken on its own. "+
			"Here each seed's figure of `llm` is divided by the same seed's figure of that stock policy (the same workload, arrivals and backends), "+
			"and the verdict is on the medians of those ratios, with the same thresholds. Where the seeds' loads differ widely, the two medians of the table above "+
			"can fall on different seeds and disagree with most seeds; where the two verdicts differ, read both. "+
			fmt.Sprintf("With %d seeds or more, each paired median has a %.0f%% confidence interval (the sign test's: the k-th lowest to the k-th highest ratio, "+
				"assuming only that the seeds are independent draws), and the last column says what they settle: "+
				"`pass` where both intervals lie within the thresholds, `fail` where either lies wholly past its own, "+
				"`tie` where a threshold lies inside an interval (these seeds cannot tell the cell's side; more seeds narrow it).", intervalSeeds, 100*intervalLevel),
		"regime", "workload", "paired with (p50 / p99)", "paired p50 ratio", "paired p99 ratio", "p99 ratio of medians", "seeds passing", "verdict",
		fmt.Sprintf("p50 %.0f%% interval", 100*intervalLevel), fmt.Sprintf("p99 %.0f%% interval", 100*intervalLevel), fmt.Sprintf("at %.0f%%", 100*intervalLevel)) {
		return
	}
	for _, c := range mr.Cells {
		if c.Paired == nil {
			continue
		}
		i50, i99, settled := "-", "-", "-"
		if p := c.Paired; p.P50Interval != nil && p.P99Interval != nil {
			i50, i99, settled = p.P50Interval.String(), p.P99Interval.String(), p.Settled
		}
		fmt.Fprintf(out, "| %s | %s | %s / %s | %.2f | %.2f | %.2f | %d/%d | %s | %s | %s | %s |\n", c.Regime, c.Workload, c.Paired.BestP50Policy, c.Paired.BestP99Policy,
			c.Paired.P50Ratio, c.Paired.P99Ratio, c.P99Ratio, c.Paired.SeedsPassing, c.Seeds, c.Paired.verdictWord(), i50, i99, settled)
	}
}

// writeNetMarkdown writes the section on the harness's time compression: each policy's proxy time and
// the verdicts on TTFT with that time counted once.
func writeNetMarkdown(out io.Writer, mr MatrixResults) {
	if !subSection(out, "Net of the proxy's own time", netVerdict(mr.Cells),
		fmt.Sprintf("The simulated backends run faster than real time (the time scale), the proxy does not: each wall millisecond from a request's sending to its arrival at the backend "+
			"(Caddy, and the policy reading and tokenizing the body) counts as time-scale simulated milliseconds in the figures above, where a deployment counts it once. "+
			"Here each request's TTFT counts that time once; the proxy columns are its median per request in wall milliseconds (the stock policies' lowest). "+
			"What this does not remove: the policy's CPU is taken from the simulators on the same %s.", mr.Machine),
		"regime", "workload", "llm proxy ms", "stock proxy ms", "net p50 ratio", "net p99 ratio", "seeds passing", "verdict") {
		return
	}
	for _, c := range mr.Cells {
		if c.Net == nil {
			continue
		}
		llm, _ := c.policy(judgedPolicy)
		stock := math.Inf(1)
		for _, name := range stockPolicies {
			if p, ok := c.policy(name); ok && p.ProxyP50 > 0 {
				stock = min(stock, p.ProxyP50)
			}
		}
		fmt.Fprintf(out, "| %s | %s | %.2f | %.2f | %.2f | %.2f | %d/%d | %s |\n", c.Regime, c.Workload, llm.ProxyP50, stock,
			c.Net.P50Ratio, c.Net.P99Ratio, c.Net.SeedsPassing, c.Seeds, c.Net.verdictWord())
	}
}

// matrixHeader names the columns of the pass/fail table.
var matrixHeader = []string{"regime", "workload", "req/run", "llm p50", "best stock p50", "p50 ratio",
	"llm p99", "best stock p99", "p99 ratio", "llm hit", "llm max share", "oracle p99 ratio", "seeds passing", "verdict"}

// matrixRows returns the pass/fail table, one row per cell; times in simulated ms.
func matrixRows(cells []MatrixCell) [][]string {
	var rows [][]string
	for _, c := range cells {
		llm, _ := c.policy(judgedPolicy)
		row := []string{c.Regime, c.Workload, fmt.Sprint(c.Requests)}
		if !c.Judged {
			for len(row) < len(matrixHeader) {
				row = append(row, "-")
			}
			rows = append(rows, row)
			continue
		}
		oracle := "-"
		if o, ok := c.policy("oracle"); ok && c.BestP99 > 0 {
			oracle = fmt.Sprintf("%.2f", o.TTFTP99/c.BestP99)
		}
		rows = append(rows, append(row,
			f0(llm.TTFTP50), fmt.Sprintf("%s (%s)", f0(c.BestP50), c.BestP50Policy), fmt.Sprintf("%.2f", c.P50Ratio),
			f0(llm.TTFTP99), fmt.Sprintf("%s (%s)", f0(c.BestP99), c.BestP99Policy), fmt.Sprintf("%.2f", c.P99Ratio),
			fmt.Sprintf("%.0f%%", 100*llm.HitRate), fmt.Sprintf("%.2f", llm.MaxShare), oracle,
			fmt.Sprintf("%d/%d", c.SeedsPassing, c.Seeds), c.verdictWord()))
	}
	return rows
}

// writeMatrixTable prints the pass/fail table as aligned text.
func writeMatrixTable(out io.Writer, cells []MatrixCell) {
	fmt.Fprintf(out, "llm vs the best stock policy per cell (TTFT medians over seeds, simulated ms; PASS: p99 ratio <= %.2f and p50 ratio <= %.2f)\n", passP99Ratio, passP50Ratio)
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, strings.Join(matrixHeader, "\t"))
	for _, r := range matrixRows(cells) {
		fmt.Fprintln(tw, strings.Join(r, "\t"))
	}
	_ = tw.Flush()
}

// writeMatrixMarkdown writes report.md of -matrix or -goodput.
func writeMatrixMarkdown(out io.Writer, mr MatrixResults) {
	fmt.Fprintf(out, "# caddy-llm benchmark: backend-regime matrix\n\n`%s`  \n%s, %s; wall time %.0f s  \n", mr.Command, mr.Started, mr.Machine, mr.WallSeconds)
	fmt.Fprintf(out, "%d simulated vLLM backends per cluster, load %.2f of each cell's estimated capacity, seeds %v, time scale %.0fx (0: per workload). "+
		"Latencies are simulated milliseconds, each the median over seeds of a run's percentile; the first %.0f%% of each run's requests are warm-up.\n\n",
		mr.Backends, mr.Load, mr.Seeds, mr.TimeScale, 100*warmupFraction)
	if mr.Length > 1 {
		fmt.Fprintf(out, "Each run sends %d times the matrix's sessions at the same offered load (-length %d).\n\n", mr.Length, mr.Length)
	}
	if mr.TimeScale == 0 {
		fmt.Fprintf(out, "Time scales per workload: %s.\n\n", describeTimeScales())
	}
	if len(mr.Cells) > 0 {
		fmt.Fprintf(out, "**%s**\n\n", matrixVerdict(mr.Cells))
		fmt.Fprintf(out, "![llm TTFT p99 / best stock policy](matrix.svg)\n\n")
		fmt.Fprintf(out, "A cell passes when `llm`'s TTFT p99 is at most the best stock policy's (the lowest of %s in that cell) and its p50 at most %.2fx the best stock p50 (possibly another policy's). "+
			"Max share is the busiest backend's requests over its fair share (by estimated capacity: equal on uniform clusters). "+
			"The oracle column is the oracle's p99 over the best stock p99: what reading the true caches and queues could do. "+
			"Seeds passing: on how many seeds llm passes against that seed's best stock figures; where the seeds disagree, the verdict on the medians is a tie "+
			"(identical runs of the stock policies move a cell's figures by 10-55%%).\n\n",
			strings.Join(stockPolicies, ", "), passP50Ratio)
		writeMarkdownTable(out, append([][]string{matrixHeader}, matrixRows(mr.Cells)...))
		writePairedMarkdown(out, mr)
		writeNetMarkdown(out, mr)
		writeLateMarkdown(out, mr)
		writeTargetsMarkdown(out, mr.Cells)
		fmt.Fprintf(out, "\n## Every policy, medians over seeds (TTFT p50 / p99 ms, hit rate)\n\n")
		var pols []string
		for _, c := range mr.Cells {
			for _, p := range c.Policies {
				if !slices.Contains(pols, p.Policy) {
					pols = append(pols, p.Policy)
				}
			}
		}
		fmt.Fprintf(out, "| regime | workload | offered req/s | %s |\n|---|---|---|%s\n", strings.Join(pols, " | "), strings.Repeat("---|", len(pols)))
		for _, c := range mr.Cells {
			row := []string{c.Regime, c.Workload, f1(c.RateRPS)}
			for _, name := range pols {
				p, ok := c.policy(name)
				if !ok {
					row = append(row, "-")
					continue
				}
				cell := fmt.Sprintf("%s / %s, %.0f%%", f0(p.TTFTP50), f0(p.TTFTP99), 100*p.HitRate)
				if p.Failed > 0 {
					cell += fmt.Sprintf(", %d failed", p.Failed)
				}
				row = append(row, cell)
			}
			fmt.Fprintf(out, "| %s |\n", strings.Join(row, " | "))
		}
		fmt.Fprintln(out)
	}
	for _, g := range mr.Goodput {
		writeGoodputMarkdown(out, g)
	}
	fmt.Fprintf(out, "## Regimes\n\n")
	for _, r := range mr.Regimes {
		fmt.Fprintf(out, "- `%s`: %s\n", r.Name, r.Description)
	}
	var notes []string
	for _, r := range mr.Runs {
		for _, n := range r.Notes {
			if strings.Contains(n, "KV cache raised") || strings.Contains(n, "scheduling lag") || strings.Contains(n, "skipped") {
				notes = append(notes, fmt.Sprintf("%s/%s seed %d load %.2f: %s", r.Regime, r.Workload, r.Seed, r.Load, n))
			}
		}
		for _, s := range r.Policies {
			if s.Skipped == "" && s.LagP99 > lagRerunMS {
				notes = append(notes, fmt.Sprintf("%s/%s seed %d load %.2f: %s had scheduling lag p99 %.1f ms (wall) even after re-runs: the machine was busy", r.Regime, r.Workload, r.Seed, r.Load, s.Policy, s.LagP99))
			}
		}
	}
	if len(notes) > 0 {
		fmt.Fprintf(out, "\n## Notes\n\n")
		for _, n := range notes {
			fmt.Fprintf(out, "- %s\n", n)
		}
	}
	for _, n := range mr.Notes {
		fmt.Fprintf(out, "- %s\n", n)
	}
}

// rejudgeMatrix reads an earlier -matrix results.json, judges its runs again (the verdict's rules may
// have changed since, e.g. seeds passing) and writes the outputs into dir; nothing is run. With replace
// (files, comma-separated; may be empty), their policies take the place of the same policies in those
// runs first (replaceRuns). command is recorded in the notes; the original command, start time and
// machine stay the run's.
func rejudgeMatrix(paths, replace, dir, command string) error {
	mr, err := readMatrices(strings.Split(paths, ","))
	if err != nil {
		return err
	}
	if replace != "" {
		with, err := readMatrices(strings.Split(replace, ","))
		if err != nil {
			return err
		}
		if err := replaceRuns(&mr, with, replace); err != nil {
			return err
		}
	}
	mr.Cells = judgeCells(mr.Runs)
	note := fmt.Sprintf("judged again by `%s` on %s", command, time.Now().UTC().Format(time.RFC3339))
	if i := slices.IndexFunc(mr.Notes, func(n string) bool { return strings.HasPrefix(n, "judged again by ") }); i >= 0 {
		mr.Notes[i] = note
	} else {
		mr.Notes = append(mr.Notes, note)
	}
	writeMatrixTable(os.Stdout, mr.Cells)
	fmt.Println(matrixVerdict(mr.Cells))
	printSubVerdicts(mr.Cells)
	return writeMatrixOutputs(dir, mr)
}

// runKey names one run of a matrix: a cell, a seed and a load. Two files pooled, or a run and its
// replacement, are matched by it.
type runKey struct {
	regime, workload string
	seed             int64
	load             float64
}

func runKeyOf(r MatrixRun) runKey { return runKey{r.Regime, r.Workload, r.Seed, r.Load} }

// replaceRuns sets the policies of with's runs into mr's runs of the same regime, workload, seed and load,
// in place of mr's policies of the same name (or beside them): a policy run alone (llm, A/B runs of a
// change) judged against the stock policies of runs made on the same seeds and ports. Every run of mr
// must have its match in with and every run of with one in mr, so a judgement never mixes replaced and
// original figures unnoticed. A note names the policies replaced and source, the files they came from.
func replaceRuns(mr *MatrixResults, with MatrixResults, source string) error {
	from := make(map[runKey]MatrixRun, len(with.Runs))
	for _, r := range with.Runs {
		from[runKeyOf(r)] = r
	}
	var names []string
	for i := range mr.Runs {
		dst := &mr.Runs[i]
		k := runKeyOf(*dst)
		r, ok := from[k]
		if !ok {
			return fmt.Errorf("-replace holds no run of %s/%s seed %d load %g", k.regime, k.workload, k.seed, k.load)
		}
		delete(from, k)
		dst.Policies = slices.Clone(dst.Policies)
		for _, p := range r.Policies {
			if j := slices.IndexFunc(dst.Policies, func(q Summary) bool { return q.Policy == p.Policy }); j >= 0 {
				dst.Policies[j] = p
			} else {
				dst.Policies = append(dst.Policies, p)
			}
			if !slices.Contains(names, p.Policy) {
				names = append(names, p.Policy)
			}
		}
	}
	for k := range from {
		return fmt.Errorf("-replace holds %s/%s seed %d load %g, which the judged runs do not", k.regime, k.workload, k.seed, k.load)
	}
	mr.Notes = append(mr.Notes, fmt.Sprintf("%s from %s, in place of the runs' own", strings.Join(names, ", "), source))
	return nil
}

// readMatrices reads one or more -matrix results.json and pools their runs, as if one run had made
// them all: more seeds per cell from runs made apart (`-seed 4 -seeds 3` after the default 1-3). The
// header (command, machine) is the first file's, the seeds and regimes are all of them, and a note names
// every file; a run that two files both hold (the same regime, workload, seed and load) is an error,
// not a seed counted twice. One file alone is judged as it stands, as before pooling.
func readMatrices(paths []string) (MatrixResults, error) {
	var mr MatrixResults
	from := map[runKey]int{} // the file (index in paths) that holds each run
	for i, path := range paths {
		m, err := readMatrix(path)
		if err != nil {
			return mr, err
		}
		for _, r := range m.Runs { // against the files before it: one file is judged as it stands
			k := runKeyOf(r)
			if other, ok := from[k]; ok && other != i {
				return mr, fmt.Errorf("%s and %s both hold %s/%s seed %d load %g: pool runs of different seeds", paths[other], path, r.Regime, r.Workload, r.Seed, r.Load)
			}
			from[k] = i
		}
		if i == 0 {
			mr = m
			continue
		}
		mr.Runs = append(mr.Runs, m.Runs...)
		for _, r := range m.Regimes { // a later file may have run regimes the first did not
			if !slices.ContainsFunc(mr.Regimes, func(x RegimeInfo) bool { return x.Name == r.Name }) {
				mr.Regimes = append(mr.Regimes, r)
			}
		}
		for _, seed := range m.Seeds {
			if !slices.Contains(mr.Seeds, seed) {
				mr.Seeds = append(mr.Seeds, seed)
			}
		}
		mr.WallSeconds += m.WallSeconds
	}
	if len(paths) > 1 {
		slices.Sort(mr.Seeds)
		mr.Notes = append(mr.Notes, fmt.Sprintf("runs pooled from %s", strings.Join(paths, ", ")))
	}
	return mr, nil
}

// readMatrix reads a -matrix results.json that holds runs.
func readMatrix(path string) (MatrixResults, error) {
	var mr MatrixResults
	raw, err := os.ReadFile(path)
	if err != nil {
		return mr, err
	}
	if err := json.Unmarshal(raw, &mr); err != nil {
		return mr, fmt.Errorf("%s: %w", path, err)
	}
	if len(mr.Runs) == 0 {
		return mr, fmt.Errorf("%s: no matrix runs", path)
	}
	return mr, nil
}

// compareMatrices writes, for every cell and policy the -matrix results.json at base and changed both
// hold, the changed run's median TTFT p50 and p99 over base's and both hit rates, then each policy's
// geometric means of those ratios: how a change moved llm, beside how far the stock policies moved
// between the same two runs (their spread). Both runs are judged again, so files of any age compare.
func compareMatrices(w io.Writer, base, changed string) error {
	a, err := readMatrix(base)
	if err != nil {
		return err
	}
	b, err := readMatrix(changed)
	if err != nil {
		return err
	}
	before := map[cellKey]PolicyMedian{}
	for _, c := range judgeCells(a.Runs) {
		for _, p := range c.Policies {
			before[cellKey{c.Regime, c.Workload, p.Policy}] = p
		}
	}
	paired, runs := pairSeeds(a.Runs, b.Runs)
	type sums struct {
		p50, p99, netP50, netP99 float64
		n, netN                  int
	}
	means := map[string]*sums{}
	var order []string
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "regime\tworkload\tpolicy\tp50 base\tp50 new\tratio\tp99 base\tp99 new\tratio\thit base\thit new\tp50 paired\tp99 paired\n")
	for _, c := range judgeCells(b.Runs) {
		for _, p := range c.Policies {
			q, ok := before[cellKey{c.Regime, c.Workload, p.Policy}]
			if !ok || !(q.TTFTP50 > 0 && q.TTFTP99 > 0 && p.TTFTP50 > 0 && p.TTFTP99 > 0) {
				continue
			}
			r50, r99 := p.TTFTP50/q.TTFTP50, p.TTFTP99/q.TTFTP99
			pr := paired[cellKey{c.Regime, c.Workload, p.Policy}]
			fmt.Fprintf(tw, "%s\t%s\t%s\t%.0f\t%.0f\t%.2f\t%.0f\t%.0f\t%.2f\t%.0f%%\t%.0f%%\t%s\t%s\n", c.Regime, c.Workload, p.Policy,
				q.TTFTP50, p.TTFTP50, r50, q.TTFTP99, p.TTFTP99, r99, 100*q.HitRate, 100*p.HitRate, pr.p50, pr.p99)
			m := means[p.Policy]
			if m == nil {
				m = &sums{}
				means[p.Policy] = m
				order = append(order, p.Policy)
			}
			m.p50 += math.Log(r50)
			m.p99 += math.Log(r99)
			m.n++
			if q.NetTTFTP50 > 0 && q.NetTTFTP99 > 0 && p.NetTTFTP50 > 0 && p.NetTTFTP99 > 0 {
				m.netP50 += math.Log(p.NetTTFTP50 / q.NetTTFTP50)
				m.netP99 += math.Log(p.NetTTFTP99 / q.NetTTFTP99)
				m.netN++
			}
		}
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(order) == 0 {
		return fmt.Errorf("%s and %s have no cell and policy in common", base, changed)
	}
	fmt.Fprintf(w, "\ngeometric means of new over base (%s over %s):\n", changed, base)
	for _, p := range order {
		m := means[p]
		fmt.Fprintf(w, "  %-24s p50 %.3fx  p99 %.3fx  over %d cells", p, math.Exp(m.p50/float64(m.n)), math.Exp(m.p99/float64(m.n)), m.n)
		if m.netN > 0 { // both runs recorded the proxy's time
			fmt.Fprintf(w, "; net of the proxy's time p50 %.3fx  p99 %.3fx  over %d", math.Exp(m.netP50/float64(m.netN)), math.Exp(m.netP99/float64(m.netN)), m.netN)
		}
		fmt.Fprintln(w)
		if r := runs[p]; r != nil {
			if g50, ok := meanInterval(r.p50); ok {
				g99, _ := meanInterval(r.p99) // as many as r.p50
				fmt.Fprintf(w, "  %-24s paired by seed: p50 %s  p99 %s  over %d runs\n", "", g50, g99, len(r.p50))
			}
		}
	}
	return nil
}

// geoMean is a geometric mean of ratios with its 95% confidence interval.
type geoMean struct{ mean, low, high float64 }

func (g geoMean) String() string { return fmt.Sprintf("%.3fx (95%% %.3f-%.3f)", g.mean, g.low, g.high) }

// meanInterval is the geometric mean of the ratios whose logs are logs, with a 95% confidence interval
// from Student's t on those logs: runs paired by seed, every cell pooled, as independent draws of how a
// change moves a run. ok is false for fewer than two. An interval that holds 1 says these runs cannot
// tell the change from none; one that barely excludes it may still be the VM: two runs of one decision
// over the seven regimes' 105 runs, an hour apart, gave p99 1.053x (0.999-1.111; docs/bench/intervals),
// runs of one time sharing that time's noise, which the interval does not see.
func meanInterval(logs []float64) (g geoMean, ok bool) {
	n := len(logs)
	if n < 2 {
		return g, false
	}
	m, sq := mean(logs), 0.0
	for _, x := range logs {
		sq += (x - m) * (x - m)
	}
	half := tQuantile975(n-1) * math.Sqrt(sq/float64(n-1)/float64(n))
	return geoMean{mean: math.Exp(m), low: math.Exp(m - half), high: math.Exp(m + half)}, true
}

// tQuantile975 is Student's t distribution's 97.5th percentile at df degrees of freedom (df >= 1): the
// table's for 1-4, else the Cornish-Fisher expansion around the normal's 1.96 (within 0.2% from 5 on).
func tQuantile975(df int) float64 {
	if df >= 1 && df <= 4 {
		return [...]float64{12.706, 4.303, 3.182, 2.776}[df-1]
	}
	const z = 1.959964
	v := float64(df)
	z3, z5 := z*z*z, z*z*z*z*z
	return z + (z3+z)/(4*v) + (5*z5+16*z3+3*z)/(96*v*v) + (3*z5*z*z+19*z5+17*z3-15*z)/(384*v*v*v)
}

// cellKey names one policy's figures in one cell.
type cellKey struct{ regime, workload, policy string }

// pairedRatio is one cell's and policy's figures of a new run over a base run, seed by seed: the
// geometric mean of the per-seed ratios and on how many of the seeds both ran the new one was worse,
// formatted "0.97 (3/9 worse)". Paired, a cell's verdict does not hang on whichever seed its median
// falls on: two runs of one decision move single seeds by tens of percent.
type pairedRatio struct{ p50, p99 string }

// runLogs are the logs of one policy's per-run ratios of a new run over a base run, paired by seed, every
// cell pooled.
type runLogs struct{ p50, p99 []float64 }

// pairSeeds pairs the runs of changed with those of base on the same regime, workload, policy and seed:
// each cell's and policy's paired ratios, and each policy's per-run logs.
func pairSeeds(base, changed []MatrixRun) (map[cellKey]pairedRatio, map[string]*runLogs) {
	type seedKey struct {
		cellKey
		seed int64
	}
	before := map[seedKey]Summary{}
	for _, r := range base {
		for _, p := range r.Policies {
			before[seedKey{cellKey{r.Regime, r.Workload, p.Policy}, r.Seed}] = p
		}
	}
	type acc struct {
		log50, log99     float64
		worse50, worse99 int
		n                int
	}
	sums := map[cellKey]*acc{}
	runs := map[string]*runLogs{}
	for _, r := range changed {
		for _, p := range r.Policies {
			k := cellKey{r.Regime, r.Workload, p.Policy}
			q, ok := before[seedKey{k, r.Seed}]
			if !ok || !(q.TTFTP50 > 0 && q.TTFTP99 > 0 && p.TTFTP50 > 0 && p.TTFTP99 > 0) {
				continue
			}
			a := sums[k]
			if a == nil {
				a = &acc{}
				sums[k] = a
			}
			l50, l99 := math.Log(p.TTFTP50/q.TTFTP50), math.Log(p.TTFTP99/q.TTFTP99)
			a.log50 += l50
			a.log99 += l99
			rl := runs[p.Policy]
			if rl == nil {
				rl = &runLogs{}
				runs[p.Policy] = rl
			}
			rl.p50, rl.p99 = append(rl.p50, l50), append(rl.p99, l99)
			a.worse50 += btoi(p.TTFTP50 > q.TTFTP50)
			a.worse99 += btoi(p.TTFTP99 > q.TTFTP99)
			a.n++
		}
	}
	out := make(map[cellKey]pairedRatio, len(sums))
	for k, a := range sums {
		n := float64(a.n)
		out[k] = pairedRatio{
			p50: fmt.Sprintf("%.2f (%d/%d worse)", math.Exp(a.log50/n), a.worse50, a.n),
			p99: fmt.Sprintf("%.2f (%d/%d worse)", math.Exp(a.log99/n), a.worse99, a.n),
		}
	}
	return out, runs
}

// writeMatrixOutputs writes results.json, report.md and (for -matrix) matrix.svg into dir.
func writeMatrixOutputs(dir string, mr MatrixResults) error {
	var heatMap func(*strings.Builder)
	if len(mr.Cells) > 0 {
		heatMap = func(svg *strings.Builder) { writeHeatMap(svg, mr.Cells, len(mr.Seeds)) }
	}
	return writeResultFiles(dir, mr, func(md *strings.Builder) { writeMatrixMarkdown(md, mr) }, "matrix.svg", heatMap)
}

// describeTimeScales lists matrixTimeScales in matrix order.
func describeTimeScales() string {
	var parts []string
	for _, w := range matrixWorkloads {
		parts = append(parts, fmt.Sprintf("%s %.0fx", w, matrixTimeScales[w]))
	}
	return strings.Join(parts, ", ")
}
