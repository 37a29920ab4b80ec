package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"text/tabwriter"
	"time"
)

// The fault workload (-faults): one of the simulated backends cuts streams mid-way and answers some
// requests 500, and every row serves the same streamed requests with the same lb_retries. What
// matters to a client is whether its stream arrives whole, so the figures are completed streams
// (all max_tokens tokens, one [DONE]), goodput (the output tokens of completed streams per simulated
// second) and TTFT p99, against stock least_conn in the same invocation.

// faultDropRate and faultErrorRate are the faulty backend's (backend 0) faults.
const (
	faultDropRate  = 0.10
	faultErrorRate = 0.03
	// faultRetries is every row's lb_retries.
	faultRetries = 2
	// faultLoad and faultTimeScale are -faults' defaults of -load and -timescale (without -quick):
	// with one token per chunk, 0.75 load at 5x was more events than 2 busy cores relay on time (the
	// load generator lagged and every queue grew). At 0.5 the healthy backends still have room when
	// the faulty one is drained.
	faultLoad      = 0.5
	faultTimeScale = 2.5
)

// faultRow is one configuration of the fault comparison.
type faultRow struct {
	Name   string
	Policy policy
	Extras proxyExtras
}

// faultRows are the configurations -faults compares, the baseline first.
//
// Stock Caddy resends a POST body on a retry only from request_buffers (without them, a retry after an
// upstream read the body fails with 502, "ContentLength=N with Body length 0"), so the stock row has
// them; the llm policy keeps the body itself.
var faultRows = []faultRow{
	{"least_conn + lb_retries", policy{Name: "least_conn", JSON: `{"policy":"least_conn"}`}, proxyExtras{Retries: faultRetries, RequestBuffers: 1 << 20}},
	{"llm", policy{Name: "llm", JSON: `{"policy":"llm"}`}, proxyExtras{Retries: faultRetries}},
	{"llm, availability off", policy{Name: "llm-availability-off", JSON: `{"policy":"llm","availability":{"off":true}}`}, proxyExtras{Retries: faultRetries}},
	{"llm + llm_resume", policy{Name: "llm", JSON: `{"policy":"llm"}`}, proxyExtras{Retries: faultRetries, Resume: true}},
	{"llm + llm_resume, availability off", policy{Name: "llm-availability-off", JSON: `{"policy":"llm","availability":{"off":true}}`}, proxyExtras{Retries: faultRetries, Resume: true}},
}

// FaultSummary is one row's figures, over every seed's measured requests.
type FaultSummary struct {
	Config   string      `json:"config"`
	Extras   proxyExtras `json:"extras"`
	Requests int         `json:"requests"`
	// Completed streams have all max_tokens tokens and exactly one [DONE]; Truncated ones were answered
	// 200 but ended short (no [DONE], an error event, missing tokens); Errors got no stream (a status
	// other than 200, or no answer).
	Completed int `json:"completed"`
	Truncated int `json:"truncated"`
	Errors    int `json:"errors"`
	// GoodputTokensPerS is the output tokens of completed streams per simulated second of the runs.
	GoodputTokensPerS float64 `json:"goodput_tokens_per_s"`
	// TTFT is over every request that received content (a truncated stream's first token counted too).
	TTFTP50 float64 `json:"ttft_p50_ms"`
	TTFTP99 float64 `json:"ttft_p99_ms"`
	// FaultyShare is the faulty backend's share of the requests the backends received (retries and
	// continuations included).
	FaultyShare float64 `json:"faulty_backend_share"`
	// BackendRequests is what each backend received, summed over seeds.
	BackendRequests []int   `json:"backend_requests"`
	LagP99          float64 `json:"sched_lag_p99_wall_ms"`
	// CacheHitRate is the backends' prefix-cache hit rate (the last seed's run).
	CacheHitRate float64 `json:"cache_hit_rate"`
	// CPUPercent is the whole benchmark process's CPU time over the runs' wall time, in % of one core.
	CPUPercent  float64 `json:"cpu_percent_of_one_core"`
	WallSeconds float64 `json:"wall_seconds"`
	Skipped     string  `json:"skipped,omitempty"`
}

// FaultResults is the content of faults.json.
type FaultResults struct {
	runHeader
	Workload    string         `json:"workload"`
	Requests    int            `json:"requests_per_seed"`
	RateRPS     float64        `json:"rate_rps"`
	Sim         simSettings    `json:"sim"`
	Faulty      simSettings    `json:"faulty_backend"`
	Rows        []FaultSummary `json:"rows"`
	Notes       []string       `json:"notes,omitempty"`
	WallSeconds float64        `json:"wall_seconds"`
}

// faultWorkload is shared-prefix sized for the fault run: at the full size (1,280 requests, about
// 90 s simulated at its 0.5 load) long enough for availability's controller to take three 30 s steps
// and for the faulty backend to cut a few dozen streams; -quick is a smoke test of the harness.
func faultWorkload(seed int64, quick bool) Workload {
	rng := rand.New(rand.NewPCG(uint64(seed), 0xfa17))
	groups, perGroup := 64, 20
	if quick {
		groups, perGroup = 16, 6
	}
	w := sharedPrefix(rng, groups, perGroup, 1500, 100, 64)
	w.Name = "shared-prefix (faults)"
	return w
}

// scaleAvailability returns p with the llm policy's availability interval (30 s of wall time by
// default) divided by the time scale, as scaleScrapes does for the scrape interval: the backends run
// timeScale times faster, so the controller steps as often in simulated time as it would in front of
// real ones. Policies with availability off or an interval of their own are returned unchanged.
func scaleAvailability(p policy, timeScale float64) policy {
	var cfg map[string]any
	if timeScale <= 1 || json.Unmarshal([]byte(p.JSON), &cfg) != nil || cfg["policy"] != "llm" {
		return p
	}
	av, _ := cfg["availability"].(map[string]any)
	if av == nil {
		av = map[string]any{}
	}
	if _, set := av["interval"]; set || av["off"] == true {
		return p
	}
	av["interval"] = (time.Duration(float64(30*time.Second) / timeScale)).String()
	cfg["availability"] = av
	return p.withJSON(cfg)
}

// runFaults runs every fault row on every seed and writes faults.json and faults.md to o.out.
func runFaults(ctx context.Context, o options, res Results, started time.Time) error {
	// One token per chunk, as vLLM streams by default: llm_resume counts the tokens a broken stream
	// delivered one per content chunk (or from continuous usage stats, which the simulator lacks), so
	// with the benchmark's usual 8 tokens per chunk a continuation would ask for too many. That is 8
	// times the events to relay, so the full run slows the simulators down (faultTimeScale).
	o.sim.TokensPerChunk = 1
	sims := uniformCluster(o.backends, o.sim)
	faulty := sims[0]
	faulty.DropMidStreamRate, faulty.ErrorRate = faultDropRate, faultErrorRate
	sims[0] = faulty
	fr := FaultResults{runHeader: runHeader{Command: res.Command, Started: res.Started, Machine: res.Machine, Backends: o.backends,
		Load: o.load}, Sim: o.sim, Faulty: faulty}
	var ws []Workload
	total := 0
	for i := range o.seeds {
		seed := o.seed + int64(i)
		fr.Seeds = append(fr.Seeds, seed)
		w := faultWorkload(seed, o.quick)
		ws = append(ws, w)
		total += w.NumRequests() * len(faultRows)
	}
	fr.Workload, fr.Requests = ws[0].Name, ws[0].NumRequests()
	est := estimateCapacity(ws[0], sims)
	fr.RateRPS = round3(o.load * est.ClusterRPS)
	prog := newProgress(os.Stderr, total)
	defer prog.finish()
	for _, row := range faultRows {
		prog.setLabel(row.Name)
		p := scaleAvailability(row.Policy, o.sim.TimeScale)
		var acc faultTally
		sum := FaultSummary{Config: row.Name, Extras: row.Extras}
		var faultyReqs, backendReqs int
		for i, w := range ws {
			so := o
			so.seed = fr.Seeds[i]
			s, results, err := runPolicyResults(ctx, so, sims, w, fr.RateRPS, p, row.Extras, prog)
			if err != nil {
				sum.Skipped = err.Error()
				fr.Notes = append(fr.Notes, fmt.Sprintf("%s skipped: %v", row.Name, err))
				break
			}
			acc.add(&sum, results, o.sim.TimeScale)
			if sum.BackendRequests == nil {
				sum.BackendRequests = make([]int, len(s.BackendRequests))
			}
			for b, n := range s.BackendRequests {
				sum.BackendRequests[b] += n
				backendReqs += n
				if b == 0 {
					faultyReqs += n
				}
			}
			sum.LagP99 = max(sum.LagP99, s.LagP99)
			sum.WallSeconds += s.WallSeconds
			sum.CacheHitRate = s.CacheHitRate
			sum.CPUPercent += s.CPUPercent * s.WallSeconds
		}
		if sum.WallSeconds > 0 {
			sum.CPUPercent = round3(sum.CPUPercent / sum.WallSeconds)
		}
		if sum.Skipped == "" {
			acc.summarize(&sum)
			if backendReqs > 0 {
				sum.FaultyShare = round3(float64(faultyReqs) / float64(backendReqs))
			}
		}
		fr.Rows = append(fr.Rows, sum)
		prog.stepDone(fmt.Sprintf("%s: %d/%d streams complete", row.Name, sum.Completed, sum.Requests))
	}
	var lags []string
	stalled := false
	for _, s := range fr.Rows {
		lags = append(lags, fmt.Sprintf("%s %.0f", s.Config, s.LagP99))
		stalled = stalled || s.LagP99 > lagRerunMS
	}
	if stalled {
		fr.Notes = append(fr.Notes, fmt.Sprintf("the load generator was stalled at times (scheduling lag p99, wall ms: %s): latencies are noisy, and runs are not repeated here",
			strings.Join(lags, ", ")))
	}
	fr.WallSeconds = round3(time.Since(started).Seconds())
	writeFaultTable(os.Stdout, fr)
	if err := os.MkdirAll(o.out, 0o755); err != nil {
		return fmt.Errorf("creating %s: %w", o.out, err)
	}
	b, err := json.MarshalIndent(fr, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(o.out, "faults.json"), append(b, '\n'), 0o644); err != nil {
		return fmt.Errorf("writing faults.json: %w", err)
	}
	var md strings.Builder
	writeFaultReport(&md, fr)
	if err := os.WriteFile(filepath.Join(o.out, "faults.md"), []byte(md.String()), 0o644); err != nil {
		return fmt.Errorf("writing faults.md: %w", err)
	}
	fmt.Printf("\nwall time %.1fs; results in %s\n", fr.WallSeconds, o.out)
	return nil
}

// streamComplete reports whether r is a whole stream: answered, all MaxTokens tokens of content
// (the simulator's tokens are 4 bytes), one [DONE] and nothing after it.
func streamComplete(r requestResult) bool {
	return !r.Failed && r.ContentBytes == simBytesPerToken*r.MaxTokens && r.ExtraEvents == 0
}

// faultTally accumulates a row's runs, one per seed.
type faultTally struct {
	ttft   []float64 // simulated ms
	tokens int       // output tokens of complete streams
	span   float64   // simulated seconds from the first measured request sent to the last one's end, summed over runs
}

// add counts the measured (non-warm-up) requests of one run into s and t; scale converts wall
// durations to simulated ones.
func (t *faultTally) add(s *FaultSummary, results []requestResult, scale float64) {
	var first, last time.Time
	for _, r := range results {
		if r.Warmup {
			continue
		}
		if first.IsZero() || r.Sent.Before(first) {
			first = r.Sent
		}
		if r.End.After(last) {
			last = r.End
		}
		s.Requests++
		switch {
		case streamComplete(r):
			s.Completed++
			t.tokens += r.MaxTokens
		case r.Status == 200:
			s.Truncated++
		default:
			s.Errors++
		}
		if r.TTFT > 0 {
			t.ttft = append(t.ttft, ms(r.TTFT)*scale)
		}
	}
	if !first.IsZero() {
		t.span += last.Sub(first).Seconds() * scale
	}
}

// summarize sets s's goodput and TTFT from the runs counted.
func (t *faultTally) summarize(s *FaultSummary) {
	if t.span > 0 {
		s.GoodputTokensPerS = round3(float64(t.tokens) / t.span)
	}
	d := newDistribution(t.ttft)
	s.TTFTP50, s.TTFTP99 = round3(finite(d.P50)), round3(finite(d.P99))
	s.WallSeconds = round3(s.WallSeconds)
}

// faultTableRows returns the table of the fault rows with ratios against the first (the baseline).
func faultTableRows(fr FaultResults) [][]string {
	rows := [][]string{{"configuration", "complete streams", "truncated", "errors", "goodput tok/s", "TTFT p50", "TTFT p99",
		"faulty backend share", "hit rate", "| vs " + fr.Rows[0].Config + ": complete", "goodput", "TTFT p99"}}
	base := fr.Rows[0]
	for _, s := range fr.Rows {
		if s.Skipped != "" {
			rows = append(rows, []string{s.Config, "skipped: " + s.Skipped})
			continue
		}
		rows = append(rows, []string{s.Config,
			fmt.Sprintf("%d/%d (%.1f%%)", s.Completed, s.Requests, 100*float64(s.Completed)/float64(max(s.Requests, 1))),
			fmt.Sprint(s.Truncated), fmt.Sprint(s.Errors), f0(s.GoodputTokensPerS), f0(s.TTFTP50), f0(s.TTFTP99),
			fmt.Sprintf("%.1f%%", 100*s.FaultyShare), fmt.Sprintf("%.0f%%", 100*s.CacheHitRate),
			"| " + ratio(float64(s.Completed), float64(base.Completed)), ratio(s.GoodputTokensPerS, base.GoodputTokensPerS),
			ratio(s.TTFTP99, base.TTFTP99)})
	}
	return rows
}

// writeFaultTable prints the fault table for a terminal.
func writeFaultTable(out io.Writer, fr FaultResults) {
	fmt.Fprintf(out, "\n%s, %d requests x %d seeds at %.2f req/s; backend 0 of %d drops %.0f%% of streams mid-way and answers %.0f%% with 500 (TTFT in simulated ms)\n",
		fr.Workload, fr.Requests, len(fr.Seeds), fr.RateRPS, fr.Backends, 100*fr.Faulty.DropMidStreamRate, 100*fr.Faulty.ErrorRate)
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	for _, row := range faultTableRows(fr) {
		fmt.Fprintln(tw, strings.Join(row, "\t"))
	}
	tw.Flush()
	for _, n := range fr.Notes {
		fmt.Fprintln(out, "note:", n)
	}
}

// writeFaultReport writes faults.md.
func writeFaultReport(out io.Writer, fr FaultResults) {
	fmt.Fprintf(out, "# Fault workload: streams through a failing backend\n\n")
	fmt.Fprintf(out, "`%s` (started %s, %s, wall time %.0f s)\n\n", fr.Command, fr.Started, fr.Machine, fr.WallSeconds)
	fmt.Fprintf(out, "%d simulated backends (%s); backend 0 drops %.0f%% of its streams mid-way (at a random token) "+
		"and answers %.0f%% of its requests 500. Workload: %s, %d streamed requests (64 output tokens, `ignore_eos`) per seed, seeds %v, "+
		"at %.2f req/s (simulated; %.2f of the estimated capacity). Every row has `lb_retries %d` with `lb_retry_match` "+
		"for POSTs and 429/5xx answers, so the rows differ only in the policy and `llm_resume` (and the stock row's "+
		"`request_buffers 1MiB`, without which stock Caddy cannot resend a POST body an upstream has read). `llm`'s availability interval "+
		"is 30 s simulated (%s wall at time scale %g), as its scrape interval is scaled.\n\n",
		fr.Backends, fr.Sim.describe(), 100*fr.Faulty.DropMidStreamRate, 100*fr.Faulty.ErrorRate, fr.Workload, fr.Requests, fr.Seeds,
		fr.RateRPS, fr.Load, faultRetries, time.Duration(float64(30*time.Second)/fr.Sim.TimeScale), fr.Sim.TimeScale)
	fmt.Fprintf(out, "A stream is **complete** when it has all `max_tokens` tokens of content and exactly one `[DONE]`; "+
		"**truncated** when it was answered 200 but ended short (no `[DONE]`, or an error event); an **error** got no stream. "+
		"Goodput is the output tokens of complete streams per simulated second; TTFT (simulated ms) is over every request that "+
		"received content. The faulty backend's share counts every request it received, retries and continuations included. "+
		"The first %.0f%% of each run's requests are warm-up and not counted.\n\n", 100*warmupFraction)
	rows := faultTableRows(fr)
	for i, row := range rows {
		if len(row) == 2 {
			row = append(row, make([]string, len(rows[0])-2)...)
		}
		for j := range row {
			row[j] = strings.TrimPrefix(row[j], "| ")
		}
		fmt.Fprintf(out, "| %s |\n", strings.Join(row, " | "))
		if i == 0 {
			fmt.Fprintf(out, "|%s\n", strings.Repeat("---|", len(row)))
		}
	}
	for _, n := range fr.Notes {
		fmt.Fprintf(out, "\n- %s", n)
	}
	fmt.Fprintln(out)
}
